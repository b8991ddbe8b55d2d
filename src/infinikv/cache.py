"""The transformers ``Cache`` that hands every attention layer to an infinikv policy.

Three pieces join a transformers model to a policy, all installed once per model by :func:`install`:

1. a forward pre-hook on each attention module: in a decode step it gives the policy the layer's own
   normalised input x (``policy.before_attention``; first, so a copy the layer starts for itself is not
   queued behind the look-ahead's), then, for a policy that declares ``prefetches``, runs the look-ahead
   here, once for all such policies — ``policy.plan(i + 1, x, position_ids)`` (layer 0 also plans
   itself) — and passes the cache on to the attention function;
2. ``InfinikvCache.update`` (called by the attention module after q/k/v and RoPE): prefill chunks go to
   ``policy.prefill``, decode tokens to ``policy.decode``, which returns the K/V the layer attends to;
3. the attention function registered as ``"infinikv"``: it fits the model's mask to the policy's selection
   and calls ``policy.attend``. With any other cache it is plain SDPA, so the model still works without us.

A forward pass is a prefill when it carries more than one token or the cache is empty; a decode step
feeds exactly one token per sequence.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .compat import accept_cache_kwarg
from .errors import ModelError
from .policies import Policy, PolicyConfig, Selection, make_policy
from .spec import model_spec

Tensor = torch.Tensor
ATTN_IMPLEMENTATION = "infinikv"
_ONE_USE = "make a new InfinikvCache for each generate call"
_UNSUPPORTED = (
    "InfinikvCache supports greedy decoding and sampling only (no beam search, contrastive search, "
    "assisted decoding or cache cropping); use num_beams=1"
)


def chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    """(begin, end) of each prefill chunk of at most ``chunk`` tokens, never a one-token last chunk: it
    would look like a decode step."""
    bounds = list(range(0, total, chunk)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 2:
        bounds.pop(-2)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class _PolicyLayer(CacheLayerMixin):
    """One layer's view of the policy, in the shape transformers' ``Cache`` expects."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: InfinikvCache, layer: int, sliding: bool):
        super().__init__()
        self.cache = cache
        self.layer = layer
        self.is_sliding = sliding

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.cache.store_and_select(self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.policy.seq_length(self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Masks always span every position seen; the attention function picks the selected columns.
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class InfinikvCache(Cache):
    """A transformers ``Cache`` whose storage and selection belong to an infinikv policy.

    Works with infinikv's engine and as a drop-in for ``model.generate(past_key_values=cache)``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy | PolicyConfig | str = "dense",
        device: torch.device | str | None = None,
        **knobs,
    ):
        install(model)
        spec = model_spec(model)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, spec, device, **knobs)
        self._selections: dict[int, Selection] = {}
        # When a list: every prefill call (layer, K, V, key_valid) is appended, for driver.PrefillMemo.
        self.prefill_log: list[tuple[int, Tensor, Tensor, Tensor | None]] | None = None
        layers = [_PolicyLayer(self, i, spec.is_sliding(i)) for i in range(spec.num_layers)]
        super().__init__(layers=layers)

    # -- called by the pre-attention hook ------------------------------------------------------------------
    def before_attention(self, layer: int, x: Tensor, mask: Tensor | None, position_ids: Tensor) -> None:
        policy = self.policy
        if not policy.spec.is_sliding(layer):
            # Last query row of a full-attention mask = which cached positions are real tokens.
            policy.key_valid = None if mask is None else mask[:, 0, -1, :]
        if not self._is_decode(layer, x.shape[1]):
            return
        # First: a copy the layer starts for itself must not queue behind the next layer's.
        policy.before_attention(layer, x, position_ids)
        if policy.prefetches:
            # Look one layer ahead, so the copy for layer i+1 overlaps layer i's compute.
            for target in (0, 1) if layer == 0 else (layer + 1,):
                if target < policy.spec.num_layers:
                    policy.plan(target, x, position_ids)

    # -- called from the attention module via Cache.update -------------------------------------------------
    def store_and_select(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._is_decode(layer, k.shape[2]):
            selection = self.policy.decode(layer, k, v)
            self._selections[layer] = selection
            return selection.keys, selection.values
        self._selections.pop(layer, None)
        if self.prefill_log is not None:
            self.prefill_log.append((layer, k, v, self.policy.key_valid))
        return self.policy.prefill(layer, k, v)

    def _is_decode(self, layer: int, q_len: int) -> bool:
        return q_len == 1 and self.policy.seq_length(layer) > 0

    # -- called by the registered attention function -------------------------------------------------------
    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        selection = self._selections.pop(layer, None)
        if q.shape[2] == 1 and selection is not None:
            if mask is not None:
                mask = mask[:, :, -1:, :]
                if selection.positions is not None:
                    # Pick the mask entries of the selected positions, per KV head: [batch, kv_heads, 1, n].
                    columns = mask.expand(-1, selection.positions.shape[1], -1, -1)
                    mask = torch.gather(columns, 3, selection.positions[:, :, None, :])
            if selection.valid is not None:  # entries the policy hides (a narrower row's extras)
                hidden = selection.valid[:, :, None, :]
                mask = hidden if mask is None else mask & hidden
        elif mask is not None and q.shape[2] == 1:
            mask = mask[:, :, -1:, :]
        return self.policy.attend(layer, q, k, v, mask, scaling)

    def stats(self) -> dict:
        return self.policy.stats()

    # -- what a policy's storage cannot do ----------------------------------------------------------------
    # Beam search, contrastive search and assisted decoding reorder, repeat or crop the cached rows; the
    # policies keep per-row side state (scores, pages, pools) that cannot follow, so these are refused.
    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise ModelError(_UNSUPPORTED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ModelError(_UNSUPPORTED)

    def batch_select_indices(self, indices: Tensor) -> None:
        raise ModelError(_UNSUPPORTED)

    def crop(self, tokens_to_remove: int) -> None:
        raise ModelError(_UNSUPPORTED)

    def reset(self) -> None:
        raise ModelError(f"an InfinikvCache cannot be reset; {_ONE_USE}")

    def close(self) -> None:
        self.policy.close()


def _infinikv_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    infinikv_cache: InfinikvCache | None = None,
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
    return infinikv_cache.attend(module.layer_idx, query, key, value, attention_mask, scaling), None


def _pre_attention_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, InfinikvCache):
        return None
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cache.before_attention(module.layer_idx, hidden, kwargs.get("attention_mask"), kwargs.get("position_ids"))
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
        if isinstance(cache, InfinikvCache):
            config = kwargs.get("generation_config") or generate.__self__.generation_config
            beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
            if beams > 1:
                raise ModelError(_UNSUPPORTED)
            if cache.get_seq_length() > 0:
                raise ModelError(
                    f"this InfinikvCache already holds {cache.get_seq_length()} tokens of an earlier "
                    f"generation; {_ONE_USE}"
                )
        return generate(*args, **kwargs)

    return checked
