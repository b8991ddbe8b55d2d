"""Compatibility with the range of transformers versions infinikv runs on (5.17 to 5.24).

transformers renamed the forward argument that carries the KV cache from ``past_key_values`` to ``cache``
(5.24 still accepts the old name). infinikv passes ``cache=``; on a version whose model forward has no
``cache`` argument the keyword would land in ``**kwargs`` and be ignored, and the model would silently build
its own ``DynamicCache``. :func:`accept_cache_kwarg` renames it on the way in.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def _rename_cache(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    if "cache" in kwargs:
        kwargs["past_key_values"] = kwargs.pop("cache")
    return args, kwargs


def accept_cache_kwarg(model: torch.nn.Module) -> None:
    """Make ``model(..., cache=c)`` mean ``past_key_values=c`` where the model does not know ``cache``
    (idempotent; nothing to do on transformers versions that already take ``cache``)."""
    if getattr(model, "_infinikv_cache_kwarg", False):
        return
    parameters = inspect.signature(model.forward).parameters
    if "cache" not in parameters and "past_key_values" in parameters:
        model.register_forward_pre_hook(_rename_cache, with_kwargs=True)
    model._infinikv_cache_kwarg = True
