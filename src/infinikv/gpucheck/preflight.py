"""Step 1, preflight: Python and package versions, every infinikv module imported, the CUDA device, host
memory and the measured pinned host -> device bandwidth; anything missing stops the check with one line."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pkgutil
import platform
from typing import Any

from .plan import GIB

REQUIRED = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "tqdm", "psutil")
OPTIONAL = ("gguf", "rdata", "matplotlib", "pytest")  # not needed by the check; reported when present


def preflight(need_cuda: bool) -> dict[str, Any]:
    """Versions, imports and the device; raises SystemExit with one clear line when something is missing."""
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    missing = []
    for name in REQUIRED + OPTIONAL:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
            if name in REQUIRED:
                missing.append(name)
    if missing:
        raise SystemExit(
            f"gpu-check: missing packages: {', '.join(missing)} (nothing is installed from a network)"
        )
    import torch

    if need_cuda and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device visible to torch (use --tiny for the CPU smoke run)")
    import infinikv

    failed = []
    for module in pkgutil.walk_packages(infinikv.__path__, "infinikv."):
        if module.name.endswith("__main__"):  # importing it would run the command line
            continue
        if module.name.startswith("infinikv.serve") and importlib.util.find_spec("fastapi") is None:
            continue  # the server's extras are not needed to measure, and a GPU box may lack them
        if module.name == "infinikv.serve.replicas" and importlib.util.find_spec("ray") is None:
            continue  # serving on Ray needs the [ray] extra
        try:
            importlib.import_module(module.name)
        except Exception as exc:  # any import error is a finding; report them all at once
            failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
    if failed:
        raise SystemExit("gpu-check: infinikv modules fail to import:\n  " + "\n  ".join(failed))
    out: dict[str, Any] = {
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "infinikv": infinikv.__file__,
    }
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out["device"] = props.name
        out["device_memory_bytes"] = props.total_memory
        out["h2d_pinned_bytes_per_s"] = measure_h2d()
    import psutil

    memory = psutil.virtual_memory()
    out["host_memory_bytes"], out["host_available_bytes"] = memory.total, memory.available
    out["cpu_count"] = os.cpu_count()
    return out


def measure_h2d(size: int = GIB, repeats: int = 3) -> float:
    """Best of a few pinned host -> device copies of ``size`` bytes, in bytes/s."""
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del host, device
    release_pinned()
    return size / best


def release_pinned() -> None:
    """Give cached pinned blocks back (the pinned allocator keeps freed blocks, rounded up to 2^k bytes)."""
    import torch

    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
