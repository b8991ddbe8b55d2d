"""``infinigen``: speculative KV selection and prefetch (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707).

The full K/V of every layer live in the host pool. Each layer that InfiniGen manages keeps, on the compute
device, a *partial key cache*: its post-RoPE keys times the skewing matrix A (``infinikv.skew``), restricted
to a few columns. In a decode step, inside layer i's pre-attention hook, the policy rehearses layer i+1:

1. speculative query q̂ = (RoPE(x W_q,i+1) A)[cols] from layer i's normalised input x;
2. scores s = q̂ · K̃_i+1[:, cols]ᵀ · scale per query head, taken relative to that head's best score, then
   combined over the heads of a KV group by max (a token counts if any head of the group wants it);
3. per KV head the count of tokens with s > max(s) − alpha, averaged over KV heads: n' (per sequence,
   capped by ``budget``); the rows fetched are each head's top-n' scores;
4. the gather + copy of those rows from the pool starts at once (worker thread or CUDA copy stream) and
   overlaps the rest of layer i; layer i+1 attends with its real query over [selected; newest token].

Layers below ``dense_layers`` load their full KV (nothing rehearses layer 0). Sliding-window layers
(Gemma-3) attend to their window, fetched from the pool; the policy rehearses the global layers, each in
the hook of the layer before it whatever that layer's type.

Where this differs from the paper's artifact: one skewing matrix per KV head (grouped-query attention);
scores use the layer's own attention scale (1/√d for Llama); with grouped-query attention each query head's
scores are taken relative to its own best before the group's heads are combined by max (the KV head is
fetched once for the whole group, so it needs the union of what its query heads want; combining raw
logits would let a head with large logits, e.g. on an attention sink, hide what the others need); the
threshold count is averaged over the KV heads of each sequence; when the sequences of a batch get
different n', all get the largest and a shorter row's extra entries are its next-best tokens (or, past its
real tokens, left-padding slots that the mask hides).

Host pool capacity (``capacity``): at most 1 is a fraction, above 1 a token count. After t tokens have been
seen, a layer's pool holds at most ⌈capacity·t⌉ (or ``capacity``) tokens per sequence and KV head, counted
in slots of the left-padded batch — at the end of a run that is that fraction of prompt + generated tokens.
The prompt is stored whole during prefill (its attention is dense) and the pool is cut to capacity when
decoding starts; from then on, when full, one slot per (sequence, KV head) is overwritten per new token.
Victims: left-padding slots first; never the newest half of the pool; among the rest ``fifo`` takes the
oldest token, ``lru`` the least recently fetched (storing counts as a use), ``counter`` the one fetched
the fewest times (paper's default), ties to the oldest. Evicted tokens leave the partial key cache with
them (the two share slot numbers). Sliding-window layers keep at most their window, evicting by FIFO.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PolicyError
from ..kvpool import KVPool, Transfer
from .base import ModelSpec, Policy, PolicyConfig, Selection, resolve_budget

Tensor = torch.Tensor
EVICTIONS = ("fifo", "lru", "counter")
_SHIFT = 1 << 21  # eviction keys pack (tier, rule value, position), each below 2**21


@dataclass(frozen=True)
class InfiniGenConfig(PolicyConfig):
    """alpha: threshold in logit units (tokens within alpha of a head's best speculative score are counted;
    inf = all); partial_ratio: share of head_dim columns used for speculation; budget: cap on tokens fetched
    per layer (fraction of context if <= 1, else tokens); capacity: host pool size (fraction of the tokens
    seen if <= 1, else tokens; 1 = no eviction); eviction: fifo | lru | counter; dense_layers: the first
    layers that always load their full KV; skew: False uses the identity instead of the skewing matrices
    (partial columns still chosen by the same rule)."""

    alpha: float = 5.0
    partial_ratio: float = 0.2
    budget: float = 0.2
    capacity: float = 1.0
    eviction: str = "counter"
    dense_layers: int = 2
    skew: bool = True

    def __post_init__(self):
        if math.isnan(self.alpha) or self.alpha <= 0:
            raise PolicyError(f"alpha must be positive (inf allowed), got {self.alpha}")
        if not 0 < self.partial_ratio <= 1:
            raise PolicyError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        if not 0 < self.budget < math.inf:
            raise PolicyError(f"budget must be positive and finite, got {self.budget}")
        if not 0 < self.capacity < math.inf:
            raise PolicyError(f"capacity must be positive and finite, got {self.capacity}")
        if self.eviction not in EVICTIONS:
            raise PolicyError(f"eviction must be one of {', '.join(EVICTIONS)}, got '{self.eviction}'")
        if (
            not isinstance(self.dense_layers, int)
            or isinstance(self.dense_layers, bool)
            or self.dense_layers < 0
        ):
            raise PolicyError(f"dense_layers must be a non-negative integer, got {self.dense_layers}")
        if not isinstance(self.skew, bool):
            raise PolicyError(f"skew must be true or false, got {self.skew!r}")

    def prepare(self, loaded: Any) -> None:
        from ..skew import ensure

        ensure(loaded)


class _SlotPool(KVPool):
    """The host pool plus compaction: keep only some slots of a layer (capacity cut when decoding starts)."""

    def keep(self, layer: int, index: Tensor) -> None:
        """Keep the slots ``index`` [batch, kv_heads, m] of ``layer``, in that order, as slots 0..m-1."""
        index = index.to("cpu")[..., None].expand(-1, -1, -1, self._keys[layer].shape[-1])
        for store in (self._keys, self._values):
            kept = torch.gather(store[layer][:, :, : self._length[layer]], 2, index)
            store[layer] = self._alloc(tuple(kept.shape), kept.dtype)
            store[layer].copy_(kept)
        self._length[layer] = index.shape[2]


class _Slots:
    """Per layer: what each pool slot holds (position, fetch count, last use) and its partial key."""

    def __init__(self):
        self.n = 0
        self.pos: Tensor | None = None  # [batch, kv_heads, cap] mask column of the token in each slot
        self.fetches: Tensor | None = None  # [batch, kv_heads, cap] times the slot was fetched
        self.last: Tensor | None = None  # [batch, kv_heads, cap] step of the last fetch or store
        # [batch, kv_heads, k, cap] partial skewed keys of managed layers, slots last: the rehearsal's
        # q̂ · K̃ᵀ is then a plain matmul over a strided view, with no copy of the slots in use
        self.partial: Tensor | None = None

    def view(self, name: str) -> Tensor:
        return getattr(self, name)[..., : self.n]

    def append(self, pos: Tensor, partial: Tensor | None, step: int) -> None:
        """Add tokens at ``pos`` [batch, kv_heads, q] with their partial keys [batch, kv_heads, q, k]."""
        q = pos.shape[2]
        if self.pos is None or self.pos.shape[2] < self.n + q:
            self._grow(pos, partial, max(self.n + q, 2 * self.n, 256))
        end = self.n + q
        self.pos[:, :, self.n : end] = pos
        self.fetches[:, :, self.n : end] = 0
        self.last[:, :, self.n : end] = step
        if partial is not None:
            self.partial[..., self.n : end] = partial.transpose(2, 3)
        self.n = end

    def write(self, slots: Tensor, pos: int, partial: Tensor | None, step: int) -> None:
        """Overwrite slot ``slots[b, h]`` of every (sequence, KV head) with a new token."""
        index = slots[..., None]
        self.pos.scatter_(2, index, torch.full_like(index, pos))
        self.fetches.scatter_(2, index, torch.zeros_like(index))
        self.last.scatter_(2, index, torch.full_like(index, step))
        if partial is not None:
            columns = index[:, :, None].expand(-1, -1, partial.shape[-1], 1)
            self.partial.scatter_(3, columns, partial.transpose(2, 3))

    def keep(self, index: Tensor) -> None:
        for name in ("pos", "fetches", "last"):
            setattr(self, name, torch.gather(self.view(name), 2, index))
        if self.partial is not None:
            columns = index[:, :, None].expand(-1, -1, self.partial.shape[2], -1)
            self.partial = torch.gather(self.view("partial"), 3, columns)
        self.n = index.shape[2]

    def _grow(self, pos: Tensor, partial: Tensor | None, cap: int) -> None:
        batch, heads = pos.shape[:2]

        def grown(old: Tensor | None, like: Tensor, *rows: int) -> Tensor:
            new = like.new_zeros(batch, heads, *rows, cap)
            if old is not None:
                new[..., : self.n] = old[..., : self.n]
            return new

        self.pos = grown(self.pos, pos)
        self.fetches = grown(self.fetches, pos)
        self.last = grown(self.last, pos)
        if partial is not None:
            self.partial = grown(self.partial, partial, partial.shape[-1])


class InfiniGenPolicy(Policy):
    name = "infinigen"
    config_class = InfiniGenConfig
    prefill_family = "dense"
    prefetches = True

    def __init__(self, config: InfiniGenConfig, spec: ModelSpec, device: torch.device, skew: Any = None):
        """``skew``: an ``infinikv.skew.Skew``; by default the cached calibration for ``spec.weights_id`` is
        loaded when the first prompt arrives."""
        super().__init__(config, spec, device)
        if skew is not None:
            skew.check(spec)
        self._skew = skew
        self.host_pool = _SlotPool(spec.num_layers, device, host=True)
        layers = range(spec.num_layers)
        self._slots = [_Slots() for _ in layers]
        self._proj: list[Tensor | None] = [None] * spec.num_layers  # [kv_heads, d, k] for managed layers
        self._seen = [0] * spec.num_layers  # positions (mask columns) seen per layer
        self._real: Tensor | None = None  # [batch, prompt tokens]: True = real token, False = left padding
        self._padding: list[int] = []  # left-padding tokens per sequence, kept on the host (no sync per step)
        self._pending: dict[int, tuple[Transfer, Tensor]] = {}
        self._step = 0
        # statistics
        # mean over the batch per decode step, left on the device until stats() (no host sync per step)
        self._selected: list[list[Tensor]] = [[] for _ in layers]
        self._decode_h2d = 0
        self._offload_h2d = 0  # what full offload would have moved in the same decode steps
        self._rehearsal_s = 0.0
        self._evicted = 0

    # -- which layer does what -------------------------------------------------------------------------------
    def managed(self, layer: int) -> bool:
        """Rehearsed and selectively fetched (the others load their full KV or their window)."""
        return layer >= self.config.dense_layers and not self.spec.is_sliding(layer)

    def limit(self, layer: int, seen: int) -> int:
        """Most tokens the pool may hold for ``layer`` after ``seen`` tokens."""
        capacity = self.config.capacity
        tokens = math.ceil(capacity * seen) if capacity <= 1 else min(int(capacity), seen)
        window = self.spec.sliding_window[layer]
        return max(1, tokens if window is None else min(tokens, window))

    # -- prefill ---------------------------------------------------------------------------------------------
    def seq_length(self, layer: int) -> int:
        return self._seen[layer]

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._step:
            raise PolicyError("infinigen: a prompt chunk after decoding started is not supported")
        if not self.spec.is_sliding(layer) and self.key_valid is not None:
            self._real = self.key_valid.clone()
            self._padding = (~self._real).sum(dim=1).tolist()
        start, count = self._seen[layer], k.shape[2]
        pos = torch.arange(start, start + count, device=k.device).expand(k.shape[0], k.shape[1], -1)
        self._slots[layer].append(pos, self._partial_keys(layer, k), 0)
        self._seen[layer] = start + count
        return self.host_pool.extend(layer, k, v)

    def _partial_keys(self, layer: int, k: Tensor) -> Tensor | None:
        if not self.managed(layer):
            return None
        if self._proj[layer] is None:
            self._proj[layer] = self._skew_data().projection(
                layer, self.config.partial_ratio, self.config.skew
            )
            self._proj[layer] = self._proj[layer].to(k.device, k.dtype)
        return torch.matmul(k, self._proj[layer])  # [batch, kv_heads, tokens, k]

    def _skew_data(self):
        if self._skew is None:
            from ..skew import cached

            self._skew = cached(self.spec)
            if self._skew is None:
                raise PolicyError(
                    f"no InfiniGen calibration for these weights ({self.spec.weights_id[:12] or 'unknown'}); "
                    "run `infinikv calibrate --model …` or infinikv.skew.calibrate(loaded), "
                    "or pass skew= to InfiniGenPolicy"
                )
        return self._skew

    # -- decode: rehearsal and prefetch ----------------------------------------------------------------------
    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        if layer == 0:
            self._step += 1
            self._plan(0, x, position_ids)
        if layer + 1 < self.spec.num_layers:
            self._plan(layer + 1, x, position_ids)

    def _plan(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        """Decide what ``layer`` reads this step and start copying it from the pool."""
        slots = self._slots[layer]
        cap = self.limit(layer, self._seen[layer] + 1)
        if slots.n > cap:  # first decode step with a prompt larger than the capacity: cut the pool
            keep = self._eviction_keys(layer).topk(cap, dim=-1).indices.sort(dim=-1).values
            self._evicted += (slots.n - cap) * keep.shape[0] * keep.shape[1]
            self.host_pool.keep(layer, keep)
            slots.keep(keep)
        window = self.spec.sliding_window[layer]
        if self.managed(layer):
            index = self._select(layer, x, position_ids)
        elif window is not None:
            index = slots.view("pos").topk(min(window - 1, slots.n), dim=-1).indices
        else:
            index = None
        if index is None:
            positions = slots.view("pos").clone()
            slots.view("fetches").add_(1)
            slots.view("last").fill_(self._step)
        else:
            positions = torch.gather(slots.view("pos"), 2, index)
            slots.fetches.scatter_add_(2, index, torch.ones_like(index))
            slots.last.scatter_(2, index, torch.full_like(index, self._step))
        k = self.host_pool.keys(layer)
        row_bytes = 2 * k.shape[-1] * k.element_size()
        self._decode_h2d += positions.numel() * row_bytes
        self._offload_h2d += k.shape[0] * k.shape[1] * self._seen[layer] * row_bytes
        self._pending[layer] = (self.host_pool.fetch(layer, index, extra=1), positions)

    def _select(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """Rehearse ``layer`` from input x: slot indices [batch, kv_heads, n'] to fetch."""
        start = time.perf_counter()
        scores = self.speculate(layer, x, position_ids)
        index, per_row = self.choose(scores, self._real_tokens(layer))
        self._selected[layer].append(per_row.float().mean())
        self._rehearsal_s += time.perf_counter() - start
        return index

    def speculate(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """Speculative attention logits [batch, kv_heads, slots] of ``layer``, each query head's relative to
        its own best (so <= 0), then the max over the query heads of each KV group; -inf on left padding."""
        spec, slots = self.spec, self._slots[layer]
        query = spec.query(layer, x, position_ids)  # [batch, heads, 1, d]
        grouped = query.reshape(query.shape[0], spec.num_kv_heads, spec.group_size, spec.head_dim)
        scaling = getattr(spec.attention[layer], "scaling", spec.head_dim**-0.5)
        partial_q = torch.matmul(grouped, self._proj[layer]) * scaling  # [batch, kv_heads, group, k]
        scores = torch.matmul(partial_q, slots.view("partial"))  # [batch, kv_heads, group, slots]
        if self._has_padding():
            scores = scores.masked_fill(~self._slot_real(layer)[:, :, None], -math.inf)
        # The heads of a group differ in logit scale (one may put everything on a sink token): compare each
        # with its own best, and keep a token if any head of the group wants it.
        best = scores.amax(dim=-1, keepdim=True)
        return (scores - best.masked_fill(best == -math.inf, 0)).amax(dim=2)

    def choose(self, scores: Tensor, real_tokens: list[int]) -> tuple[Tensor, Tensor]:
        """Slots to fetch from speculative ``scores`` [batch, kv_heads, slots] (-inf = never): the top-n' per
        head, n' the mean over heads of each row's count within alpha of its best, capped by the budget (of
        the row's ``real_tokens``) and its real slots. Returns (index [batch, kv_heads, max n'], n' per
        row)."""
        best = scores.amax(dim=-1, keepdim=True)
        within = (scores > best - self.config.alpha).sum(dim=-1).float().mean(dim=-1).ceil().long()
        available = (scores > -math.inf).sum(dim=-1).amin(dim=-1)
        budget = torch.tensor([resolve_budget(self.config.budget, max(n, 1)) for n in real_tokens])
        per_row = torch.minimum(torch.minimum(within, available), budget.to(within.device)).clamp(min=0)
        top = int(per_row.max()) if per_row.numel() else 0  # the gather's size: one host sync per layer
        return scores.topk(top, dim=-1, sorted=False).indices, per_row

    def _has_padding(self) -> bool:
        return any(self._padding)

    def _slot_real(self, layer: int) -> Tensor:
        """[batch, kv_heads, slots]: True where the slot holds a real token (not left padding)."""
        pos = self._slots[layer].view("pos")
        if self._real is None:
            return torch.ones_like(pos, dtype=torch.bool)
        prompt = self._real.shape[1]
        real = self._real[:, None, :].expand(-1, pos.shape[1], -1)
        in_prompt = torch.gather(real, 2, pos.clamp(max=prompt - 1))
        return torch.where(pos < prompt, in_prompt, True)

    def _real_tokens(self, layer: int) -> list[int]:
        """Real (non-padding) tokens seen per sequence: the context the budget is a fraction of."""
        seen = self._seen[layer]
        if self._real is None:
            return [seen] * self._slots[layer].pos.shape[0]
        return [seen - padding for padding in self._padding]

    # -- decode: attend and store ----------------------------------------------------------------------------
    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        if layer not in self._pending:  # no hook ran for this layer (not expected): fetch everything
            self._plan_full(layer)
        transfer, positions = self._pending.pop(layer)
        keys, values = transfer.wait()  # the selected rows plus a spare last slot for the new token
        keys[:, :, -1:], values[:, :, -1:] = k_new, v_new
        position = self._seen[layer]
        self._store(layer, k_new, v_new, position)
        self._seen[layer] = position + 1
        self.record_attended(layer, positions.shape[2] + 1)
        newest = torch.full_like(positions[:, :, :1], position)
        return Selection(keys, values, torch.cat([positions, newest], dim=2))

    def _plan_full(self, layer: int) -> None:
        slots = self._slots[layer]
        self._pending[layer] = (self.host_pool.fetch(layer, extra=1), slots.view("pos").clone())

    def _store(self, layer: int, k: Tensor, v: Tensor, position: int) -> None:
        slots = self._slots[layer]
        partial = self._partial_keys(layer, k)
        if slots.n < self.limit(layer, position + 1):
            self.host_pool.append(layer, k, v)
            slots.append(torch.full_like(k[:, :, :, 0], position, dtype=torch.long), partial, self._step)
            return
        victims = self._eviction_keys(layer).argmin(dim=-1)  # [batch, kv_heads]
        self.host_pool.write_slots(layer, victims, k, v)
        slots.write(victims, position, partial, self._step)
        self._evicted += victims.numel()

    def _eviction_keys(self, layer: int) -> Tensor:
        """[batch, kv_heads, slots]: lower = evicted first. Tier (padding < older half < newest half), then
        the rule's value, then the position (older first)."""
        slots = self._slots[layer]
        pos = slots.view("pos")
        order = pos.argsort(dim=-1)
        rank = torch.empty_like(pos).scatter_(
            2, order, torch.arange(slots.n, device=pos.device).expand_as(pos)
        )
        tier = torch.where(rank >= slots.n - slots.n // 2, 2, 1)
        tier = torch.where(self._slot_real(layer), tier, 0)
        rule = "fifo" if self.spec.is_sliding(layer) else self.config.eviction
        value = {"fifo": pos, "lru": slots.view("last"), "counter": slots.view("fetches")}[rule]
        return (tier * _SHIFT + value.clamp(max=_SHIFT - 1)) * _SHIFT + pos

    # -- reporting -------------------------------------------------------------------------------------------
    def kv_bytes(self) -> dict[str, int]:
        device = sum(
            s.view("partial").numel() * s.partial.element_size() for s in self._slots if s.partial is not None
        )
        return {"host": self.host_pool.nbytes(), "device": device}

    def pool(self) -> KVPool:
        return self.host_pool

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        selected = [torch.stack(s).tolist() if s else [] for s in self._selected]
        steps = [n for s in selected for n in s]
        out.update(
            selected_tokens_mean=sum(steps) / len(steps) if steps else 0.0,
            selected_tokens_max=max(steps) if steps else 0.0,
            # managed layers only (None for layers that load their full KV or their window)
            selected_tokens_per_layer=[
                {"mean": sum(s) / len(s), "max": max(s)} if s else None for s in selected
            ],
            decode_bytes_h2d=self._decode_h2d,
            offload_equivalent_bytes_h2d=self._offload_h2d,
            kv_fetch_fraction=self._decode_h2d / self._offload_h2d if self._offload_h2d else 0.0,
            rehearsal_s=round(self._rehearsal_s, 6),
            evicted_tokens=self._evicted,
            skew_source=None if self._skew is None else f"{self._skew.source} ({self._skew.tokens} tokens)",
        )
        return out
