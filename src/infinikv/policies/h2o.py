"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023, https://arxiv.org/abs/2306.14048).

Each layer keeps, per KV head, a bounded set of tokens: the "heavy hitters" with the largest accumulated
attention, plus a window of the most recent tokens. Everything else is evicted for real: dropped from the
host pool, never to return. Each decode step copies the kept set to the compute device, attends to it and
the new token with explicit softmax weights, adds those weights to the tokens' accumulated scores, and then
evicts the lowest-scoring token outside the recent window to make room for the new one.

* Budget: ``budget`` tokens are attended per layer and step, the new token included (so the pool keeps
  ``budget - 1`` between steps); ``budget`` <= 1 is a fraction of the prompt length at the end of prefill
  (each row's own real length, so a row's result does not depend on its batchmates; a narrower row's
  extra slots are dead and hidden with ``Selection.valid``), so the kept set never grows while generating
  (budget 1 holds the cache at the prompt's size; a token count above the final length is dense). It is
  at least ``min_tokens`` + 1 (the floor counts past tokens): a prompt and answer within the floor keep
  everything.
  ``heavy_ratio`` of it goes to heavy hitters, the rest (at least the new token) to the recent window.
* Prefill scores: prefill attention stays SDPA, and the policy also computes the softmax weights of the
  prompt's queries over its keys, in blocks of query rows, and accumulates them (the sum of attention each
  key receives). The prompt is cut down to the kept set at the first decode step.
* GQA: one kept set per KV head; its score sums the weights of the query heads of its group.
* Left padding has score -inf and is evicted first; Gemma-3 sliding-window layers keep just their window.
* An engine step's rows whose kept sets are as wide attend and evict together (``attend_rows``): one
  stacked product and softmax, and the bookkeeping in one pass, each row's result bit for bit its own
  (where ``stacks_rows_exactly`` holds: float32 and bfloat16 on the CPU; elsewhere each row alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..copiers import Transfer
from ..spec import ModelSpec
from .base import (
    HostPoolPolicy,
    Policy,
    QueryOf,
    RowAttention,
    Selection,
    attention,
    attention_weights,
    per_kv_head,
    resolve_budget,
    stacks_rows_exactly,
)
from .config import PolicyConfig, knob, min_tokens_knob
from .registry import register

Tensor = torch.Tensor
SCORE_ROWS = 256  # prefill query rows scored at once (bounds the [rows, tokens] weight block)


@dataclass(frozen=True)
class H2OConfig(PolicyConfig):
    budget: float = knob(
        0.2,
        "tokens attended per layer and step (<= 1: fraction of the prompt; a count above the context keeps "
        "everything)",
        low=0,
        open_low=True,
    )
    min_tokens: int = min_tokens_knob()
    heavy_ratio: float = knob(
        0.5, "share of the budget held by heavy hitters; the rest is the recent window", low=0, high=1
    )


@dataclass(frozen=True)
class _Limits:
    """A layer's limits per row, as a decode step compares them: the live slots kept between steps (its
    budget less the new token) [batch, 1], and the recent window's tokens before the new one [batch, 1,
    1]."""

    kept: Tensor
    recent: Tensor


@dataclass(frozen=True)
class _NewToken:
    """A decode step's token between ``decode`` and ``_store_new``: its K/V, the slots' positions and
    liveness with it appended, and each (row, KV head)'s live count."""

    keys: Tensor
    values: Tensor
    positions: Tensor  # [batch, kv_heads, m + 1]
    valid: Tensor  # [batch, kv_heads, m + 1]
    alive_count: Tensor  # [batch, kv_heads]


@register("h2o")
class H2OPolicy(HostPoolPolicy):
    config_class = H2OConfig
    prefill_family = "h2o"  # the prompt's attention scores do not depend on the knobs
    prefetches = True

    def __init__(self, config: H2OConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        layers = spec.num_layers
        self.seen = [0] * layers  # tokens seen per layer (kept or evicted)
        self.score: list[Tensor | None] = [
            None
        ] * layers  # accumulated attention per slot [batch, kv_heads, m]
        self.slot_pos: list[Tensor | None] = [None] * layers  # token position of each slot, after the prompt
        # per row, from its budget and recent window (a fraction refers to each row's own prompt)
        self.limits: list[_Limits | None] = [None] * layers
        self.alive: list[Tensor | None] = [None] * layers  # bool per slot; False: a dead slot, hidden
        self.capacity = [0] * layers  # slots kept between steps: the widest row's budget - 1
        self._new: dict[int, _NewToken] = {}

    def seq_length(self, layer: int) -> int:
        return self.seen[layer]

    def prefill_state(self) -> list[Tensor | None]:
        return list(self.score)

    def restore_prefill_state(self, state: list[Tensor | None]) -> None:
        self.score = list(state)

    # -- prefill -------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._new.pop(layer, None)  # a prompt chunk: whatever attend() sees next is not a decode
        self.seen[layer] += k.shape[2]
        return self.host_pool.extend(layer, k, v)

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        if layer in self._new:  # this step's decode() handed the new token (a one-token prompt is a prefill)
            return self._attend_decode(layer, q, k, v, mask, scaling)
        if not self.spec.is_sliding(layer):
            self._score_prompt(layer, q, k, mask, scaling)
        return attention(q, k, v, mask, scaling)

    def _score_prompt(self, layer: int, q: Tensor, k: Tensor, mask: Tensor | None, scaling: float) -> None:
        """Add the softmax weight each key receives from the chunk's queries to the layer's scores."""
        batch, heads, q_len, dim = q.shape
        kv_heads, n = k.shape[1], k.shape[2]
        group = heads // kv_heads
        grouped_q = q.view(batch, kv_heads, group, q_len, dim)  # query head h reads KV head h // group
        received = torch.zeros(batch, kv_heads, n, dtype=torch.float32, device=q.device)
        for begin in range(0, q_len, SCORE_ROWS):
            end = min(begin + SCORE_ROWS, q_len)
            visible = n - q_len + end  # later keys are in every row's future: skip them
            rows = grouped_q[:, :, :, begin:end].reshape(batch, kv_heads, group * (end - begin), dim)
            scores = torch.matmul(rows, k[:, :, :visible].transpose(-1, -2)).float()
            scores = scores.mul_(scaling).view(batch, kv_heads, group, end - begin, visible)
            if mask is None:  # plain causal: query row r sits at position n - q_len + r
                at = torch.arange(n - q_len + begin, n - q_len + end, device=q.device)
                allowed = at[:, None] >= torch.arange(visible, device=q.device)
            else:  # [batch, 1 or kv_heads, 1, rows, visible]
                allowed = mask[:, :, begin:end, :visible].unsqueeze(2)
            weights = scores.masked_fill_(~allowed, float("-inf")).softmax(dim=-1).nan_to_num_(0.0)
            received[..., :visible] += weights.sum(dim=(2, 3))
        old = self.score[layer]
        if old is not None:
            received[..., : old.shape[-1]] += old
        self.score[layer] = received

    # -- decode --------------------------------------------------------------------------------------------
    def _compact(self, layer: int, batch: int) -> None:
        """End of prefill for this layer: set each row's limits and evict the prompt down to the kept set.

        Each row's budget refers to its own prompt (its real tokens, not the batch's padded length). The
        pool is as wide as the widest row's kept set; a narrower row's extra slots are dead (``alive``
        False): hidden from attention, never evicted, and reused for new tokens first, so a row keeps and
        attends to what it would alone."""
        n = self.host_pool.length(layer)
        window = self.spec.sliding_window[layer]
        if window is not None:  # sliding layers: exactly their window, no heavy hitters
            rows = [window] * batch
            budget = torch.full((batch,), window, device=self.device)
            recent = budget
        else:
            lengths = self.real_tokens(n, batch)
            floor = self.config.min_tokens + 1  # the floor counts past tokens; this budget, the new one too
            rows = [
                resolve_budget(self.config.budget, max(1, real), capped=False, floor=floor)
                for real in lengths
            ]
            budget = torch.tensor(rows, device=self.device)
            heavy = torch.tensor(
                [min(round(self.config.heavy_ratio * b), b - 1) for b in rows], device=self.device
            )
            recent = budget - heavy
        limits = self.limits[layer] = _Limits((budget - 1)[:, None], (recent - 1)[:, None, None])
        capacity = self.capacity[layer] = max(rows) - 1  # slots the pool keeps between steps
        heads = self.spec.num_kv_heads
        positions = torch.arange(n, device=self.device).expand(batch, heads, n)
        score = self.score[layer]
        if score is None:
            score = torch.zeros(batch, heads, n, device=self.device)
        valid = None if window is not None else self.real_at(positions)
        priority = _priority(score, positions, n - limits.recent, valid)
        if n > capacity:
            keep = priority.topk(capacity, dim=-1).indices.sort(dim=-1).values
            self.host_pool.keep(layer, keep)
            positions, score, priority = keep, score.gather(2, keep), priority.gather(2, keep)
        # A row keeps its budget - 1 best slots; padding (priority -inf) is never alive.
        rank = priority.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        alive = (rank < limits.kept[:, :, None]) & (priority > float("-inf"))
        self.slot_pos[layer], self.score[layer], self.alive[layer] = positions, score, alive

    def device_bytes(self) -> int:
        """The per-slot bookkeeping the selector keeps on the device: accumulated scores, positions, alive."""
        tables = [
            t for per_layer in (self.score, self.slot_pos, self.alive) for t in per_layer if t is not None
        ]
        return sum(t.numel() * t.element_size() for t in tables)

    def plan(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None) -> None:
        if self.slot_pos[layer] is not None:  # from the second step on: the prompt is cut at the first
            super().plan(layer, x, position_ids, queries)

    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> Transfer:
        return self.host_pool.fetch(layer, extra=1)  # a spare slot: decode writes the new token there

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        if self.slot_pos[layer] is None:
            self._compact(layer, k_new.shape[0])
        keys, values = self.take_fetch(layer).wait()  # the kept slots, then the spare one
        keys[:, :, -1:], values[:, :, -1:] = k_new, v_new
        slots = self.slot_pos[layer]
        positions = torch.cat([slots, slots.new_full((*slots.shape[:2], 1), self.seen[layer])], dim=2)
        alive = self.alive[layer]
        valid = torch.cat([alive, alive.new_ones(*alive.shape[:2], 1)], dim=2)
        self.seen[layer] += 1
        attended = valid.sum(dim=-1)
        self.record_attended(layer, attended.float().mean())  # what each row really sees
        # the candidates for the next step's slots, as _store_new reads them
        self._new[layer] = _NewToken(k_new, v_new, positions, valid, attended)
        return Selection(keys, values, positions, valid)

    def _attend_decode(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        return self.decode_together([self], layer, [RowAttention(q, k, v, mask)], scaling)[0]

    @classmethod
    def attend_rows(
        cls, policies: list[Policy], layer: int, rows: list[RowAttention], scaling: float
    ) -> list[Tensor]:
        """The decode attention of rows whose kept sets are as wide, with the same capacity, runs as one
        (:meth:`decode_together`) where stacked rows compute as alone (``stacks_rows_exactly``); any other
        row (a prompt chunk, another width) alone."""
        outputs: list[Tensor | None] = [None] * len(rows)
        alike: dict[tuple, list[int]] = {}
        for i, (policy, row) in enumerate(zip(policies, rows, strict=True)):
            if layer in policy._new and stacks_rows_exactly(row.q):
                mask = None if row.mask is None else row.mask.shape
                alike.setdefault((row.k.shape, mask, policy.capacity[layer]), []).append(i)
            else:
                outputs[i] = policy.attend(layer, *row, scaling)
        for members in alike.values():
            together = cls.decode_together(
                [policies[i] for i in members], layer, [rows[i] for i in members], scaling
            )
            for i, out in zip(members, together, strict=True):
                outputs[i] = out
        return outputs

    @classmethod
    def decode_together(
        cls, policies: list[H2OPolicy], layer: int, rows: list[RowAttention], scaling: float
    ) -> list[Tensor]:
        """A decode step's attention for ``rows`` of one width, each a policy's (in an engine step one row
        each; a left-padded batch's one policy: its batch): explicit weights, which then add to each row's
        accumulated scores and evict (:meth:`_store_new`). Stacked rows compute each row's weights and
        output as the row alone does, bit for bit (a batched product and a softmax per row); the
        bookkeeping is elementwise per row."""
        q, k, v = (_stacked([getattr(row, part) for row in rows]) for part in ("q", "k", "v"))
        mask = None if rows[0].mask is None else _stacked([row.mask for row in rows])
        weights = attention_weights(q, k, mask, scaling)  # [rows, heads, 1, m + 1]
        group = q.shape[1] // k.shape[1]
        out = per_kv_head(weights.to(v.dtype), v).transpose(1, 2)
        batch, kv_heads = k.shape[:2]
        received = weights[:, :, 0].view(batch, kv_heads, group, -1).sum(dim=2)
        start = time.perf_counter()  # the accumulated scores choose which token is dropped
        for policy in policies:
            policy.selector_read(policy.score[layer])
        past = _stacked([policy.score[layer] for policy in policies])
        score = torch.cat([past, received.new_zeros(batch, kv_heads, 1)], dim=2) + received
        H2OPolicy._store_new(policies, layer, score, k, v)
        share = (time.perf_counter() - start) / len(policies)
        for policy in policies:
            policy.count_selector_time(share)
        return _split(out, [row.q.shape[0] for row in rows])

    @staticmethod
    def _store_new(policies: list[H2OPolicy], layer: int, score: Tensor, k: Tensor, v: Tensor) -> None:
        """Keep each row's new token: a row over its budget marks its lowest-priority live slot dead; the new
        token takes a new slot while the pool has room, else a dead one (it may be itself: then nothing
        moves). ``score``, ``k`` and ``v`` hold the rows stacked, one per policy; the rows share the layer's
        capacity and width."""
        new = [policy._new.pop(layer) for policy in policies]
        first = policies[0]
        capacity = first.capacity[layer]
        if capacity == 0:  # nothing is kept between steps: the new token goes at once
            return
        candidates = _stacked([token.positions for token in new])
        alive = _stacked([token.valid for token in new])
        kept = _stacked([policy.limits[layer].kept for policy in policies])
        over = _stacked([token.alive_count for token in new]) > kept  # [rows, kv_heads]
        window = _stacked([policy.seen[layer] - policy.limits[layer].recent for policy in policies])
        priority = _priority(score, candidates, window, None)
        victim = torch.where(alive, priority, float("inf")).argmin(dim=-1, keepdim=True)
        alive = alive.scatter(2, victim, alive.gather(2, victim) & ~over[..., None])  # a row over: dead
        sizes = [token.positions.shape[0] for token in new]  # each policy's rows (one in an engine step)
        if first.slot_pos[layer].shape[2] < capacity:
            rows = zip(policies, new, *(_split(t, sizes) for t in (candidates, score, alive)), strict=True)
            for policy, token, *state in rows:
                policy.host_pool.append(layer, token.keys, token.values)
                policy.slot_pos[layer], policy.score[layer], policy.alive[layer] = state
            return
        slots = _stacked([policy.slot_pos[layer] for policy in policies])
        newest = candidates.shape[2] - 1
        dead = (~alive).float().argmax(dim=-1)  # every row has one: it keeps at most capacity live slots
        # A dead slot that is the new token itself: rewrite slot 0 with its own content (a no-op).
        evict_new = dead == newest
        slot = torch.where(evict_new, 0, dead)[..., None]
        source = torch.where(evict_new, 0, newest)[..., None]
        pick = source[..., None].expand(-1, -1, 1, k.shape[-1])
        written = (slot[..., 0], k.gather(2, pick), v.gather(2, pick))
        state = (
            slots.scatter(2, slot, candidates.gather(2, source)),
            score[..., :newest].scatter(2, slot, score.gather(2, source)),
            alive[..., :newest].scatter(2, slot, alive.gather(2, source)),
        )
        rows = zip(policies, *(_split(t, sizes) for t in (*written, *state)), strict=True)
        for policy, slot_of, keys, values, *kept_state in rows:
            policy.host_pool.write_slots(layer, slot_of, keys, values)
            policy.slot_pos[layer], policy.score[layer], policy.alive[layer] = kept_state


def _stacked(tensors: list[Tensor]) -> Tensor:
    """Rows' tensors one above the other (a single row's as it is)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _split(tensor: Tensor, sizes: list[int]) -> list[Tensor]:
    """:func:`_stacked` undone: each policy's ``sizes`` rows (a single policy's tensor as it is)."""
    return [tensor] if len(sizes) == 1 else list(tensor.split(sizes))


def _priority(score: Tensor, positions: Tensor, window_start: Tensor, valid: Tensor | None) -> Tensor:
    """Eviction order: the recent window (positions from ``window_start``, per row) last (+inf), padding
    (-inf) first, the rest by score. Between steps the window holds recent - 1 tokens (``window_start`` is
    the tokens seen less that): the next step's token completes it."""
    priority = torch.where(positions >= window_start, float("inf"), score)
    return priority if valid is None else torch.where(valid, priority, float("-inf"))
