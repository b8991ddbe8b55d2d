"""The policy seam: what every KV policy implements, and the pieces they share.

A policy owns the KV cache of one generation run. The cache (``infinikv.cache``) calls it, per layer:

* ``prefill(layer, k, v)`` with each prompt chunk's K/V; it stores them and returns the K/V the chunk
  attends to (prefill attention is dense, over everything stored so far);
* ``plan(layer, x, position_ids)``, only for policies that declare ``prefetches = True``: once per decode
  step, from the previous layer's pre-attention hook (layer 0: its own), decide what ``layer`` will read and
  start copying it from the host pool, so the copy overlaps the previous layer's compute. ``x`` is the
  normalised input of the layer whose hook runs (InfiniGen rehearses ``layer``'s attention from it);
* ``before_attention(layer, x, position_ids)`` with ``layer``'s own normalised input, before its q/k/v
  projections and before the look-ahead's ``plan`` of the next layer (a policy that needs the layer's real
  query computes it here, as Quest does);
* ``decode(layer, k_new, v_new)`` with the new token's K/V; it stores them and returns a :class:`Selection`,
  the K/V the layer attends to this step;
* ``attend(layer, q, k, v, mask, scaling)``, the attention itself (SDPA unless the policy needs the
  attention weights, as H2O does).

:class:`HostPoolPolicy` is the base of every policy whose KV lives in the host pool: it owns the pool, the
prompt storage and the prefetch bookkeeping, so a policy only says what to copy (``start_fetch``) and what
to attend to. Configs are frozen dataclasses whose fields are declared with :func:`knob`: a docstring per
knob and its valid range, checked once in :class:`PolicyConfig` for every policy. A new policy is one file
in this package and one line in ``registry.py``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import PolicyError
from ..kvpool import KVPool
from ..spec import ModelSpec

Tensor = torch.Tensor


@dataclass
class Selection:
    """What a layer attends to in a decode step.

    ``keys``/``values``: [batch, kv_heads, n, head_dim] on the compute device. ``positions``: None when they
    are all cached tokens in position order (then the model's mask applies as is); otherwise the token
    positions [batch, kv_heads, n] of each row, used to pick the matching mask entries. ``valid``: None, or
    bool [batch, kv_heads, n] where False hides an entry (a batch's gather is as wide as its widest row; a
    narrower row's extra entries are hidden, so its result does not depend on its batchmates).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor | None = None
    valid: Tensor | None = None


# -- configs -------------------------------------------------------------------------------------------------
def knob(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    allow_inf: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A policy knob: its default, what it means (shown by ``infinikv policies``) and its valid values.

    ``low``/``high`` bound numbers (``open_low``: strictly above ``low``); numbers must be finite unless
    ``allow_inf``; ``choices`` lists a string knob's values."""
    meta = {"doc": doc, "low": low, "high": high, "open_low": open_low, "allow_inf": allow_inf}
    return field(default=default, metadata={**meta, "choices": choices})


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every policy's config. Knobs share names across policies (budget, alpha, partial_ratio,
    capacity, eviction, bits, group_size, n_sink, window, page_size, dense_layers, …) and are checked here,
    from their :func:`knob` declarations, before any model work."""

    def __post_init__(self):
        for f in fields(self):
            try:
                _check_knob(f.name, f.type, getattr(self, f.name), f.metadata)
            except PolicyError as exc:
                exc.knob = f.name
                raise

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def knob_docs(cls) -> dict[str, str]:
        """Each knob's meaning, as declared."""
        return {f.name: f.metadata.get("doc", "") for f in fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: None if f.default is MISSING else f.default for f in fields(cls)}

    def prepare(self, loaded: Any) -> None:
        """Model-level work before a policy first runs on ``loaded`` (a LoadedModel), e.g. InfiniGen's
        calibration. The drivers call it; most policies need nothing."""

    def padding_grid(self) -> int:
        """A row of a left-padded batch gets what it gets alone only when its padding is a multiple of this
        (1: any padding). A policy that groups token slots on the batch's shared grid (KIVI's key groups)
        says how wide; ``Generator.generate`` then batches only rows whose lengths agree modulo it. Not
        covered: a prompt longer than one prefill chunk, whose chunks are cut on the batch's grid too, with
        a policy whose later chunks attend to a lossy copy of the earlier ones (quant)."""
        return 1

    def rehearsal_share(self, spec: Any, tokens: int | None = None) -> float:
        """Share of the cached keys (all layers, all columns) the policy reads on the compute device per
        decode step to choose what to fetch (InfiniGen's partial keys on its managed layers; ``spec``: the
        ModelSpec; ``tokens``: the prompt length, when the share depends on it); 0: none."""
        return 0.0


def _check_knob(name: str, kind: Any, value: Any, meta: Any) -> None:
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    if kind == "bool":
        if not isinstance(value, bool):
            raise PolicyError(f"{name} must be true or false, got {value!r}")
        return
    if kind == "str":
        choices = meta.get("choices")
        if not isinstance(value, str) or (choices and value not in choices):
            allowed = f"one of {', '.join(choices)}" if choices else "a string"
            raise PolicyError(f"{name} must be {allowed}, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{name} must be a number, got {value!r}")
    if kind == "int" and (isinstance(value, float) and not value.is_integer()):
        raise PolicyError(f"{name} must be a whole number, got {value}")
    if math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf")):
        raise PolicyError(f"{name} must be a finite number, got {value}")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (value <= low if meta.get("open_low") else value < low):
        raise PolicyError(f"{name} must be {'>' if meta.get('open_low') else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise PolicyError(f"{name} must be <= {high}, got {value}")


def group_relative_max(scores: Tensor, group: int) -> Tensor:
    """[batch, heads, n] logits -> [batch, kv_heads, n]: each query head's logits minus its own best (so
    <= 0), then the max over the ``group`` query heads that share a KV head. -inf stays -inf."""
    batch, heads, n = scores.shape
    grouped = scores.reshape(batch, heads // group, group, n)
    best = grouped.amax(dim=-1, keepdim=True)
    return (grouped - best.masked_fill(best == -math.inf, 0)).amax(dim=2)


def resolve_budget(budget: float, context: int, capped: bool = True) -> int:
    """Tokens a ``budget`` stands for: <= 1 is a fraction of ``context`` (1 = all of it, at least one token),
    above 1 a token count. ``capped``: never more than ``context`` (False keeps a token count's meaning while
    the context grows)."""
    if not budget > 0:
        raise PolicyError(f"budget must be positive, got {budget}")
    tokens = math.ceil(budget * context) if budget <= 1 else int(budget)
    return max(1, min(tokens, context) if capped or budget <= 1 else tokens)


# -- policies ------------------------------------------------------------------------------------------------
class Policy:
    """Base class: the seam, statistics, and no KV storage of its own."""

    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig]]
    # Policies of one family build the same state from a prompt whatever their knobs, so a prefill recorded
    # under one can be replayed into another (driver.PrefillMemo) instead of running the model
    # over the prompt again. "dense": prompt attention is plain dense attention over the full-precision
    # K/V and the policy keeps what it is handed. None: never shared.
    prefill_family: ClassVar[str | None] = None
    # True when plan() starts a copy of a layer's KV before that layer runs (overlapping the previous
    # layer's compute); the cache calls plan() only then, and the bench's link model trusts it.
    prefetches: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device):
        self.config = config
        self.spec = spec
        self.device = torch.device(device)
        # Which cached positions are real tokens (not left padding): [batch, tokens], kept by the cache.
        self.key_valid: Tensor | None = None
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

    def plan(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        """Look-ahead for ``layer`` (prefetching policies only): decide what it reads and start the copy."""

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        """``layer``'s own input, before its attention; most policies need nothing here."""

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
        """The pool whose counters hold this policy's copies (None: it moves nothing)."""
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
            float(self._attended_tokens) / self._attended_calls if self._attended_calls else 0.0
        )
        return out

    def close(self) -> None:
        pool = self.pool()
        if pool is not None:
            pool.close()

    # -- helpers for subclasses ----------------------------------------------------------------------------
    def record_attended(self, layer: int, n_tokens: float | Tensor) -> None:
        """Count how many tokens a layer attended to in a decode step (mean over batch and heads). A
        sliding-window layer sees at most its window, whatever it was handed (the mask hides the rest)."""
        window = self.spec.sliding_window[layer]
        if isinstance(n_tokens, Tensor):  # kept on the device until stats(): no host sync per step
            tokens = n_tokens.float() if window is None else n_tokens.float().clamp(max=window)
        else:
            tokens = float(n_tokens if window is None else min(n_tokens, window))
        self._attended_tokens = self._attended_tokens + tokens
        self._attended_calls += 1

    def past_valid(self, n_past: int, batch: int) -> Tensor:
        """bool [batch, n_past]: which past positions hold real tokens (False = left padding)."""
        if self.key_valid is None:
            return torch.ones(batch, n_past, dtype=torch.bool, device=self.device)
        return self.key_valid[:, :n_past].to(self.device)


class HostPoolPolicy(Policy):
    """KV in the host pool, copied to the compute device as each layer needs it.

    Owns the pool and what every such policy repeats: prompt chunks are appended to the pool (and attend
    densely to everything stored so far); ``plan`` (called by the cache for prefetching policies) starts a
    subclass's ``start_fetch`` one layer ahead; ``take_fetch`` in ``decode`` picks it up, or starts it then.
    """

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device, overlap: str = "thread"):
        super().__init__(config, spec, device)
        self.host_pool = KVPool(spec.num_layers, device, host=True, overlap=overlap)
        self._in_flight: dict[int, Any] = {}

    def start_fetch(self, layer: int, x: Tensor | None = None, position_ids: Tensor | None = None) -> Any:
        """Begin copying what ``layer`` reads this step; returns what ``decode`` needs to finish it. ``x``
        is the look-ahead input when called from ``plan``, None when called late from ``decode``."""
        raise NotImplementedError

    def plan(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        self._in_flight[layer] = self.start_fetch(layer, x, position_ids)

    def take_fetch(self, layer: int) -> Any:
        """The copy ``plan`` started for ``layer``, or one started now."""
        started = self._in_flight.pop(layer, None)
        return started if started is not None else self.start_fetch(layer)

    def seq_length(self, layer: int) -> int:
        return self.host_pool.length(layer)

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.host_pool.extend(layer, k, v)

    def device_bytes(self) -> int:
        """Bytes a subclass keeps on the compute device besides what it copies each step (metadata)."""
        return 0

    def kv_bytes(self) -> dict[str, int]:
        return {"host": self.host_pool.nbytes(), "device": self.device_bytes()}

    def pool(self) -> KVPool:
        return self.host_pool


# -- attention -----------------------------------------------------------------------------------------------
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
