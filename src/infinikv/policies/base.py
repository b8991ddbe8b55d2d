"""The policy seam: what every KV policy implements, and the pieces they share.

A policy owns the KV cache of one generation run. The cache (``infinikv.cache``) calls it, per layer:

* ``prefill(layer, k, v)`` with each prompt chunk's K/V; it stores them and returns the K/V the chunk
  attends to (prefill attention is always dense, over everything stored so far);
* ``before_attention(layer, x, position_ids)`` with layer ``layer``'s normalised input, before its q/k/v
  projections (a look-ahead point: InfiniGen rehearses layer ``layer + 1`` here and starts its prefetch);
* ``decode(layer, k_new, v_new)`` with the new token's K/V; it stores them and returns a :class:`Selection`,
  the K/V the layer attends to this step;
* ``attend(layer, q, k, v, mask, scaling)``, the attention itself (SDPA unless the policy needs the
  attention weights, as H2O does).

``stats()`` reports what the policy did. Policies never touch the engine, the tokenizer or the sampler.
A new policy is one file in this package, a frozen dataclass config, and one line in ``registry.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import PolicyError
from ..kvpool import KVPool

Tensor = torch.Tensor


@dataclass(frozen=True)
class ModelSpec:
    """What a policy needs to know about the model, independent of the transformers class."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: tuple[int | None, ...]  # per layer: window size for sliding-window layers, else None
    attention: tuple[torch.nn.Module, ...] = field(repr=False, default=())  # per layer: the attention module
    # rope(layer, x, position_ids) -> (cos, sin) for that layer's rotary embedding
    rope: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = field(repr=False, default=None)
    name: str = "model"
    weights_id: str = ""  # LoadedModel.weights_id; keys per-model files such as InfiniGen's skew

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window[layer] is not None

    def query(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """Post-RoPE query of ``layer`` [batch, heads, q, d] for normalised input x [batch, q, hidden]."""
        attn = self.attention[layer]
        q = attn.q_proj(x).view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Gemma-3 normalises queries per head before RoPE
            q = attn.q_norm(q)
        cos, sin = self.rope(layer, x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


@dataclass
class Selection:
    """What a layer attends to in a decode step.

    ``keys``/``values``: [batch, kv_heads, n, head_dim] on the compute device. ``positions``: None when they
    are all cached tokens in position order (then the model's mask applies as is); otherwise the token
    positions [batch, kv_heads, n] of each row, used to pick the matching mask entries.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor | None = None


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every policy's config. Subclasses add knobs with the shared names
    (budget, alpha, partial_ratio, capacity, eviction, bits, group_size, n_sink, window, page_size)."""

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def prepare(self, loaded: Any) -> None:
        """Model-level work before a policy first runs on ``loaded`` (a LoadedModel), e.g. InfiniGen's
        calibration. The Generator calls it; most policies need nothing."""


def resolve_budget(budget: float, context: int) -> int:
    """``budget`` <= 1 is a fraction of ``context`` (1 = all of it); otherwise a token count. At least one
    token."""
    if budget <= 0:
        raise PolicyError(f"budget must be positive, got {budget}")
    tokens = math.ceil(budget * context) if budget <= 1 else int(budget)
    return max(1, min(tokens, context))


class Policy:
    """Base class. The default behaviour is dense attention over KV kept on the compute device."""

    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig]]
    # Policies of one family build the same state from a prompt whatever their knobs, so a prefill recorded
    # under one can be replayed into another (InfinikvCache.replay_prefill) instead of running the model
    # over the prompt again. "dense": prompt attention is plain dense attention over the full-precision
    # K/V and the policy keeps what it is handed. None: never shared.
    prefill_family: ClassVar[str | None] = None
    # True when before_attention starts the copy of a later layer's K/V (the link model overlaps it).
    prefetches: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device):
        self.config = config
        self.spec = spec
        self.device = torch.device(device)
        # Which cached positions are real tokens (not left padding): [batch, tokens], kept by the cache.
        self.key_valid: Tensor | None = None
        self.decode_steps = 0
        self._attended_tokens = 0.0  # summed over layers and steps, averaged over batch and heads
        self._attended_calls = 0

    # -- the seam ------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def prefill_state(self) -> Any:
        """What prefill left in the policy besides the K/V it was handed (replayed along with them)."""
        return None

    def restore_prefill_state(self, state: Any) -> None:
        """Take the ``prefill_state`` of a policy of the same family, after a replayed prefill."""

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        """Look-ahead hook; most policies need none."""

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        raise NotImplementedError

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        return attention(q, k, v, mask, scaling)

    def seq_length(self, layer: int) -> int:
        """Tokens seen by ``layer`` so far (including evicted ones): positions are 0..seq_length-1."""
        raise NotImplementedError

    def kv_bytes(self) -> dict[str, int]:
        """Bytes of K/V held in the host pool and on the compute device."""
        raise NotImplementedError

    def pool(self) -> KVPool | None:
        return None

    def stats(self) -> dict[str, Any]:
        """What this policy did, for the per-request statistics."""
        out: dict[str, Any] = {"policy": self.name, **self.config.knobs()}
        out.update({f"kv_bytes_{where}": n for where, n in self.kv_bytes().items()})
        pool = self.pool()
        counters = pool.counters if pool is not None else None
        out["bytes_h2d"] = counters.bytes_h2d if counters else 0
        out["bytes_d2h"] = counters.bytes_d2h if counters else 0
        out["prefetch_wait_s"] = round(counters.wait_s, 6) if counters else 0.0
        out["mean_tokens_attended"] = (
            self._attended_tokens / self._attended_calls if self._attended_calls else 0.0
        )
        return out

    def close(self) -> None:
        pool = self.pool()
        if pool is not None:
            pool.close()

    # -- helpers for subclasses ----------------------------------------------------------------------------
    def record_attended(self, layer: int, n_tokens: float) -> None:
        """Count how many tokens a layer attended to in a decode step (mean over batch and heads). A
        sliding-window layer sees at most its window, whatever it was handed (the mask hides the rest)."""
        window = self.spec.sliding_window[layer]
        self._attended_tokens += float(n_tokens if window is None else min(n_tokens, window))
        self._attended_calls += 1


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q: [batch, heads, q_len, d]; k, v: [batch, kv_heads, n, d]; mask: bool, True = attend, broadcastable to
    [batch, kv_heads or 1, q_len, n], or None for plain causal attention (q_len == n) or no mask (q_len == 1).
    Returns [batch, q_len, heads, d] (the layout transformers' attention modules expect).
    """
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if q_len == 1:
        # One query per head: fold each group's heads into the query axis so every KV head is read once.
        grouped = q.reshape(batch, kv_heads, group, dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2)
    is_causal = mask is None and q_len > 1
    if mask is not None and mask.shape[1] not in (1, heads):
        mask = mask.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=group > 1
    )
    return out.transpose(1, 2)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """Softmax attention probabilities [batch, heads, q_len, n] (explicit, for policies that need them)."""
    group = q.shape[1] // k.shape[1]
    scores = torch.matmul(q, k.repeat_interleave(group, dim=1).transpose(-1, -2)) * scaling
    if mask is None and q.shape[2] > 1:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(
            k.shape[2] - q.shape[2]
        )
    if mask is not None:
        if mask.dim() == 4 and mask.shape[1] not in (1, q.shape[1]):
            mask = mask.repeat_interleave(group, dim=1)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).nan_to_num(0.0)
