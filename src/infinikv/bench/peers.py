"""transformers' own caches, run beside the infinikv policies in the same benchmark.

* ``hf-dynamic``: ``DynamicCache``, everything on the compute device (dense).
* ``hf-offloaded``: ``DynamicCache(offloading=True)``, layer-wise offload to host with a CUDA prefetch
  stream. Its update path calls ``torch.cuda.default_stream``, so it needs CUDA; elsewhere it is skipped
  with that reason.
* ``hf-quanto``: ``QuantizedCache("quanto", nbits=4)`` (needs optimum-quanto: the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel, QuantizedCache
from transformers.cache_utils import Cache

PEERS = ("hf-dynamic", "hf-offloaded", "hf-quanto")


def peer_unavailable(name: str, device: torch.device) -> str | None:
    """Why a peer cannot run here, or None."""
    if name == "hf-offloaded" and device.type != "cuda":
        return (
            "DynamicCache(offloading=True) calls torch.cuda.default_stream in update: it needs a CUDA device"
        )
    if name == "hf-quanto":
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            return "optimum-quanto is not installed (pip install 'infinikv[bench]')"
    return None


def peer_factory(name: str, model: PreTrainedModel) -> Callable[[], Cache]:
    config = model.config
    if name == "hf-dynamic":
        return lambda: DynamicCache(config=config)
    if name == "hf-offloaded":
        return lambda: DynamicCache(config=config, offloading=True)
    if name == "hf-quanto":
        return lambda: QuantizedCache("quanto", config=config, nbits=4)
    raise ValueError(f"unknown peer {name!r}")


def peer_kv_bytes(cache: Cache) -> int | None:
    """Bytes of K/V a plain DynamicCache holds (None for caches whose storage is opaque)."""
    if type(cache) is not DynamicCache:
        return None
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
