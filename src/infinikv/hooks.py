"""How infinikv joins a transformers model: two pieces installed once per model by :func:`install`.

1. a forward pre-hook on each attention module: it hands the layer's normalised input to the cache
   (``PolicyCache.before_attention``, where the policy sees it and the look-ahead runs) and passes the
   cache on to the attention function;
2. the attention function registered as ``"infinikv"``: with a :class:`PolicyCache` it calls
   ``PolicyCache.attend``, which fits the model's mask to the policy's selection; with any other cache it
   is plain SDPA, so the model still works without us.

The cache itself (``cache.InfinikvCache``) subclasses :class:`PolicyCache`, so this module needs nothing
from it. A policy's work is Python over tensors whose shapes and state change from step to step, so in a
compiled decode step each call into it (these two, and ``cache.PolicyLayer.update``, through
:func:`store`) runs eagerly:

* on the CPU, as an opaque operator of the step's one graph (``infinikv::before_attention``, ``::store``
  and ``::attend``), which the graph calls with its tensors and the step's cache (:func:`stepping`, set
  by ``forward.decode_call``) and of which it sees only outputs whose shapes follow from its inputs':
  the pre-attention operator hands the layer's input back (a copy, on which the projections depend, so
  the graph keeps the operator and orders it), the store hands back the new K/V (the cache keeps its
  selection for attend), and the cache gets copies of what it may keep, as the graph reuses its tensors'
  memory; a model compiled by its user, outside a step, breaks its graph there instead;
* on CUDA, as a graph break (``torch.compiler.disable``), between the graphs of the model's own work: a
  CUDA graph would replay a capture of an operator's host work instead of running it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .compat import accept_cache_kwarg
from .errors import ModelError
from .spec import model_spec

Tensor = torch.Tensor
ATTN_IMPLEMENTATION = "infinikv"
ONE_USE = "make a new InfinikvCache for each generate call"
UNSUPPORTED = (
    "InfinikvCache supports greedy decoding and sampling only (no beam search, contrastive search, "
    "assisted decoding or cache cropping); use num_beams=1"
)


class PolicyCache(Cache):
    """What the hook and the attention function call on a cache that routes attention to a policy (and,
    through ``cache.PolicyLayer``, what its layers call: ``store_and_select`` and ``seq_length``)."""

    def store_and_select(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def seq_length(self, layer: int) -> int:
        raise NotImplementedError

    def before_attention(self, layer: int, x: Tensor, mask: Tensor | None, position_ids: Tensor) -> None:
        raise NotImplementedError

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        raise NotImplementedError


def _infinikv_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    infinikv_cache: PolicyCache | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    if infinikv_cache is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            softcap=softcap,
            **kwargs,
        )
    if softcap is not None:
        raise ModelError("attention logit soft-capping is not supported by infinikv policies")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _attend(infinikv_cache, module.layer_idx, query, key, value, attention_mask, scaling), None


def _attend(
    cache: PolicyCache, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
) -> Tensor:
    if _opaque(q):
        return torch.ops.infinikv.attend(q, k, v, mask, layer, scaling)
    return _call(cache.attend, layer, q, k, v, mask, scaling)


def store(cache: PolicyCache, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``cache.store_and_select`` of a layer's new K/V (``Cache.update``, from ``cache.PolicyLayer``)."""
    if _opaque(k):
        return torch.ops.infinikv.store(k, v, layer)
    return _call(cache.store_and_select, layer, k, v)


def _pre_attention_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PolicyCache):
        return None
    named = "hidden_states" in kwargs
    hidden = kwargs["hidden_states"] if named else args[0]
    mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if _opaque(hidden):
        # the layer's input as the operator hands it back: the projections that follow depend on it, so
        # the graph keeps the operator and runs it first
        hidden = torch.ops.infinikv.before_attention(hidden, mask, position_ids, module.layer_idx)
        if named:
            kwargs["hidden_states"] = hidden
        else:
            args = (hidden, *args[1:])
    else:
        _call(cache.before_attention, module.layer_idx, hidden, mask, position_ids)
    kwargs["infinikv_cache"] = cache
    return args, kwargs


# -- a compiled decode step ----------------------------------------------------------------------------------
# On the CPU the policy's three calls per layer are opaque operators of the step's one graph: the graph
# calls them with its tensors and the cache of the step (stepping) and sees only their outputs, whose shapes
# follow from their inputs'. On CUDA they are graph breaks instead (_call), as a CUDA graph would replay a
# capture of their host work instead of running it.
_stepping = threading.local()


# whether any thread is in a step (read while tracing, so a guard of the graph: a model compiled by its
# user, outside decode_call, traces the graph breaks instead)
_stepping_anywhere = False
_steps = 0
_counting_steps = threading.Lock()


@contextlib.contextmanager
def stepping(cache: PolicyCache) -> Iterator[None]:
    """The cache a compiled decode step's operators call on this thread, for the step."""
    global _stepping_anywhere, _steps
    before = getattr(_stepping, "cache", None)
    _stepping.cache = cache
    with _counting_steps:
        _steps += 1
        _stepping_anywhere = True
    try:
        yield
    finally:
        _stepping.cache = before
        with _counting_steps:
            _steps -= 1
            _stepping_anywhere = _steps > 0


def _step_cache() -> PolicyCache:
    cache = getattr(_stepping, "cache", None)
    if cache is None:
        raise ModelError("a compiled infinikv decode step runs through forward.decode_call (hooks.stepping)")
    return cache


def _opaque(tensor: Tensor) -> bool:
    """Whether the policy's call on ``tensor`` is an opaque operator of a graph being compiled: on the CPU,
    inside :func:`stepping` (elsewhere, as a model compiled by its user, a graph break)."""
    return torch.compiler.is_compiling() and tensor.device.type == "cpu" and _stepping_anywhere


def _call(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, in a compiled step (on CUDA) as a graph break."""
    return _apart(call, *args) if torch.compiler.is_compiling() else call(*args)


@torch.compiler.disable
def _apart(call: Callable[..., Any], *args: Any) -> Any:
    return call(*args)


# The graph owns its intermediate tensors and reuses their memory after their last use in it, so the cache,
# which may keep what it is handed past the call (a look-ahead queued on a pool's worker, a layer's new K/V
# waiting for its query, the mask's real positions), gets copies of its own.
@torch.library.custom_op("infinikv::before_attention", mutates_args=())
def _before_attention_op(x: Tensor, mask: Tensor | None, position_ids: Tensor | None, layer: int) -> Tensor:
    _step_cache().before_attention(layer, x.clone(), None if mask is None else mask.clone(), position_ids)
    return x.clone()


@_before_attention_op.register_fake
def _(x: Tensor, mask: Tensor | None, position_ids: Tensor | None, layer: int) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("infinikv::store", mutates_args=())
def _store_op(k: Tensor, v: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    # the cache keeps the selection for attend (which takes the layer's new K/V, not it)
    _step_cache().store_and_select(layer, k.clone(), v.clone())
    return k.clone(), v.clone()


@_store_op.register_fake
def _(k: Tensor, v: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("infinikv::attend", mutates_args=())
def _attend_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, scaling: float) -> Tensor:
    return _step_cache().attend(layer, q, k, v, mask, scaling)


@_attend_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, scaling: float) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # [batch, tokens, heads, head_dim]


def install(model: PreTrainedModel) -> None:
    """Route ``model``'s attention through infinikv (idempotent). Other caches keep plain SDPA."""
    if getattr(model, "_infinikv_installed", False):
        return
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None:
        raise ModelError("this model soft-caps attention logits, which infinikv policies do not support")
    AttentionInterface.register(ATTN_IMPLEMENTATION, _infinikv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    accept_cache_kwarg(model)
    for attention in model_spec(model).attention:
        attention.register_forward_pre_hook(_pre_attention_hook, with_kwargs=True)
    model.generate = _checked_generate(model.generate)
    model._infinikv_installed = True


def _checked_generate(generate):
    """``model.generate`` that refuses, before any work, what an InfinikvCache cannot do: beam search
    and a cache already used by an earlier call (its policy state belongs to that call's sequences)."""

    @functools.wraps(generate)
    def checked(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PolicyCache):
            config = kwargs.get("generation_config") or generate.__self__.generation_config
            beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
            if beams > 1:
                raise ModelError(UNSUPPORTED)
            if cache.get_seq_length() > 0:
                raise ModelError(
                    f"this InfinikvCache already holds {cache.get_seq_length()} tokens of an earlier "
                    f"generation; {ONE_USE}"
                )
        return generate(*args, **kwargs)

    return checked
