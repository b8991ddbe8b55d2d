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
# not needed by the check; reported when present (numba: the host kernel of the policies' pick)
OPTIONAL = ("gguf", "rdata", "matplotlib", "pytest", "numba")


# Subpackages that need an extra a GPU box may lack, and the module that extra provides: the check measures
# without them, so they are not imported where it is absent.
EXTRAS = {"infinikv.serve": "fastapi", "infinikv.serve.replicas": "ray", "infinikv.lm_eval": "lm_eval"}


def _needs_absent_extra(name: str) -> bool:
    return any(
        (name == package or name.startswith(package + ".")) and importlib.util.find_spec(extra) is None
        for package, extra in EXTRAS.items()
    )


def importable_modules(path: list[str], prefix: str) -> list[str]:
    """Every module under ``path`` (``__main__`` left out: importing it would run a command line), those of
    a package whose extra is absent skipped without importing the package."""
    names = []
    for info in pkgutil.iter_modules(path, prefix):
        if info.name.endswith("__main__") or _needs_absent_extra(info.name):
            continue
        names.append(info.name)
        if info.ispkg:
            package = importlib.util.find_spec(info.name)
            names += importable_modules(list(package.submodule_search_locations or []), info.name + ".")
    return names


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
    for name in importable_modules(infinikv.__path__, "infinikv."):
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import error is a finding; report them all at once
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
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
    """Give cached pinned blocks back (the pinned allocator keeps freed blocks, rounded up to 2^k bytes).
    A closed cache's pool is freed by the garbage collector (the cache and its layers refer to each other),
    so that runs first: else the next policy's fit check counts the last one's pool as still held."""
    import gc

    import torch

    gc.collect()

    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
