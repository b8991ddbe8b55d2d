"""How infinikv joins a transformers model: two pieces installed once per model by :func:`install`.

1. a forward pre-hook on each attention module: it hands the layer's normalised input to the cache
   (``PolicyCache.before_attention``, where the policy sees it and the look-ahead runs) and passes the
   cache on to the attention function;
2. the attention function registered as ``"infinikv"``: with a :class:`PolicyCache` it calls
   ``PolicyCache.attend``, which fits the model's mask to the policy's selection; with any other cache it
   is plain SDPA, so the model still works without us.

The cache itself (``cache.InfinikvCache``) subclasses :class:`PolicyCache`, so this module needs nothing
from it. Every call into a policy (these two, and ``cache.PolicyLayer.update``) is left out of a compiled
decode step's graph (``torch.compiler.disable``): a policy's work is Python over tensors whose shapes and
state change from step to step, and it runs eagerly between the graphs of the model's own work.
"""

from __future__ import annotations

import functools

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


@torch.compiler.disable
def _attend(
    cache: PolicyCache, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
) -> Tensor:
    return cache.attend(layer, q, k, v, mask, scaling)


@torch.compiler.disable
def _before_attention(
    cache: PolicyCache, layer: int, x: Tensor, mask: Tensor | None, position_ids: Tensor
) -> None:
    cache.before_attention(layer, x, mask, position_ids)


def _pre_attention_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PolicyCache):
        return None
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    _before_attention(cache, module.layer_idx, hidden, mask, position_ids)
    kwargs["infinikv_cache"] = cache
    return args, kwargs


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
