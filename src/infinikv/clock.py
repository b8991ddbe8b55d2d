"""The clock every timing in infinikv reads: ``time.perf_counter()`` once the device's queued work has
finished (CUDA runs asynchronously, so reading it earlier would time the launches, not the work)."""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds on the monotonic clock, read after synchronising ``device`` when it is a CUDA device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
