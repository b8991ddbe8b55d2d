"""``oracle``: exact top-k attention, the ceiling of any token-selection policy.

Each decode step, every managed layer attends to the top-k past tokens by its *real* attention scores (the
query of this very step against every cached key), plus the new token. It is what InfiniGen (Lee et al.,
OSDI 2024, https://arxiv.org/abs/2406.19707) tries to predict one layer ahead, and what query-aware
selection papers (Quest, ShadowKV) report against: at a given budget no policy that picks tokens can keep
more of the attention than this one. The gap between a selector and the oracle at the same budget is what
its prediction misses; the gap between the oracle and dense is what token selection itself costs on the
model.

It is a measurement, not a deployable policy: choosing needs the layer's real query and every cached key,
so nothing can be prefetched (the rows are gathered after the query is known) and scoring reads the whole
key cache in the host pool. Bytes are counted as if only the chosen rows crossed from the host pool, which
is the traffic a perfect predictor would cause.

Same rules as ``infinigen`` so the two compare at matched bytes: per KV head, each query head's real logits
are taken relative to that head's best and the group's heads are combined by max (a token counts if any
head of the group wants it); k = ``resolve_budget(budget, real past tokens)`` per sequence (the gather is as
wide as the largest; a shorter row's extra entries are its own masked padding, so each sequence attends
to what it would alone); every layer selects, as InfiniGen's do by default (its first layers with their own
query; ``dense_layers`` loads the first layers whole, as InfiniGen's ``--first-layers dense``);
sliding-window layers attend to their window.
``n_sink``/``window`` reserve part of the budget for the first and the most recent tokens (StreamingLLM's
sinks and window, which later selectors keep): the ceiling of a selector that keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .base import PolicyConfig, group_relative_max, knob, resolve_budget
from .gather import GatherPolicy

Tensor = torch.Tensor


@dataclass(frozen=True)
class OracleConfig(PolicyConfig):
    budget: float = knob(
        0.2,
        "past tokens attended per managed layer and step (<= 1: fraction of the real past tokens), as "
        "InfiniGen's cap",
        low=0,
        open_low=True,
    )
    dense_layers: int = knob(
        0, "the first layers, which load their full KV (InfiniGen's select too, with their own query)", low=0
    )
    n_sink: int = knob(0, "first real tokens always among the budget's tokens", low=0)
    window: int = knob(0, "most recent past tokens always among the budget's tokens", low=0)


class OraclePolicy(GatherPolicy):
    name = "oracle"
    config_class = OracleConfig

    def __init__(self, config: OracleConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self._query: dict[int, Tensor] = {}

    def managed(self, layer: int) -> bool:
        return layer >= self.config.dense_layers and not self.spec.is_sliding(layer)

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        if self.managed(layer):
            self._query[layer] = self.spec.query(layer, x, position_ids)[:, :, -1]  # [batch, heads, d]

    def real_scores(self, layer: int, query: Tensor, n_past: int) -> Tensor:
        """The layer's real logits of every past slot, combined per KV group: [batch, kv_heads, n_past]
        (-inf on left padding)."""
        keys = self.host_pool.keys(layer)  # [batch, kv_heads, n_past, d], in the host pool
        group = self.spec.group_size
        scaling = self.spec.scaling(layer)
        grouped = query.to(keys.device, keys.dtype).reshape(*keys.shape[:2], group, -1)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # [batch, kv, group, n]
        valid = self.past_valid(n_past, keys.shape[0]).to(keys.device)
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        return group_relative_max(scores.flatten(1, 2), group)

    def select(self, layer: int, n_past: int, batch: int) -> Tensor:
        query = self._query.pop(layer, None)
        if query is None:  # a dense layer
            return torch.arange(n_past, device=self.device).expand(batch, self.spec.num_kv_heads, -1)
        real_past = self.past_valid(n_past, batch).sum(dim=1).tolist()
        takes = [min(resolve_budget(self.config.budget, max(int(n), 1)), n_past) for n in real_past]
        scores = self.real_scores(layer, query, n_past)
        if self.config.n_sink or self.config.window:
            reserved = self._reserved(n_past, batch).to(scores.device)[:, None].expand_as(scores)
            finite = scores > -math.inf
            lift = scores.masked_fill(~finite, 0).amax(-1, keepdim=True) - scores.masked_fill(
                ~finite, 0
            ).amin(-1, keepdim=True)
            scores = torch.where(reserved & finite, scores + lift + 1, scores)  # first, in their own order
        take = max(takes)
        if min(takes) < take:
            # A row with left padding takes fewer: its extra entries are padding slots (masked), never tokens
            # it would not attend alone. It has at least as many padding slots as extra entries.
            own = torch.zeros_like(scores, dtype=torch.bool)
            for row, count in enumerate(takes):
                own[row].scatter_(-1, scores[row].topk(count, dim=-1).indices, True)
            padding = torch.finfo(scores.dtype).min
            scores = torch.where(own, scores, torch.where(scores == -math.inf, padding, -math.inf))
        return scores.topk(take, dim=-1).indices.sort(dim=-1).values.to(self.device)

    def _reserved(self, n_past: int, batch: int) -> Tensor:
        """bool [batch, n_past]: the first ``n_sink`` real tokens and the last ``window`` past tokens."""
        valid = self.past_valid(n_past, batch)
        rank = valid.long().cumsum(dim=1)  # 1 for the first real token
        slot = torch.arange(n_past, device=valid.device)
        return valid & ((rank <= self.config.n_sink) | (slot >= n_past - self.config.window))
