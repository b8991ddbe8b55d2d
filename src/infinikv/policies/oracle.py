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

Same rules as ``infinigen`` so the two compare at matched bytes, all of them the shared ones of
``base.ScoredPolicy``: per KV head, each query head's real logits are taken relative to that head's best
and the group's heads are combined by max (a token counts if any head of the group wants it); k =
``resolve_budget(budget, real past tokens)`` per sequence, at least ``min_tokens`` (all of them within it);
every layer selects, as InfiniGen's do by default
(its first layers with their own query; ``dense_layers`` loads the first layers whole, as InfiniGen's
``--first-layers dense``); sliding-window layers attend to their window.
``n_sink``/``window`` reserve part of the budget for the first and the most recent tokens (StreamingLLM's
sinks and window, which later selectors keep): the ceiling of a selector that keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoredPolicy
from .config import PolicyConfig, knob, min_tokens_knob
from .registry import register

Tensor = torch.Tensor


@dataclass(frozen=True)
class OracleConfig(PolicyConfig):
    budget: float = knob(
        0.2,
        "past tokens attended per managed layer and step, as InfiniGen's cap (<= 1: fraction of the real "
        "past tokens; a count above them attends to all)",
        low=0,
        open_low=True,
    )
    min_tokens: int = min_tokens_knob()
    dense_layers: int = knob(
        0, "the first layers, which load their full KV (InfiniGen's select too, with their own query)", low=0
    )
    n_sink: int = knob(
        0,
        "first real tokens always among the budget's tokens (more than there are: all, the budget still "
        "caps)",
        low=0,
    )
    window: int = knob(
        0,
        "most recent past tokens always among the budget's tokens (more than there are: all, the budget "
        "still caps)",
        low=0,
    )


@register("oracle")
class OraclePolicy(ScoredPolicy):
    config_class = OracleConfig
    query_aware = True

    def score(self, layer: int, n_past: int, batch: int) -> Tensor:
        """The layer's real logits of every past slot, per query head: [batch, heads, n_past], read from the
        whole key cache in the host pool."""
        keys = self.host_pool.keys(layer)  # [batch, kv_heads, n_past, d]
        self.selector_read(keys)  # the whole key cache: the oracle's price
        query = self.query(layer)
        group = self.spec.group_size
        grouped = query.to(keys.device, keys.dtype).reshape(*keys.shape[:2], group, -1)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * self.spec.scaling(layer)
        return scores.flatten(1, 2)
