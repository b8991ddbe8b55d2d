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
head of the group wants it); k = ``resolve_budget(budget, real past tokens)`` per sequence (the largest of
the batch when they differ: a shorter row's extra entries are its next-best tokens or masked padding); the
first ``dense_layers`` layers load their full KV; sliding-window layers attend to their window.
``n_sink``/``window`` reserve part of the budget for the first and the most recent tokens (StreamingLLM's
sinks and window, which later selectors keep): the ceiling of a selector that keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import PolicyError
from .base import ModelSpec, PolicyConfig, resolve_budget
from .selective import SelectivePolicy

Tensor = torch.Tensor


def group_relative_max(scores: Tensor, group: int) -> Tensor:
    """[batch, heads, n] logits -> [batch, kv_heads, n]: each query head's logits minus its own best (so
    <= 0), then the max over the ``group`` query heads that share a KV head. -inf stays -inf."""
    batch, heads, n = scores.shape
    grouped = scores.reshape(batch, heads // group, group, n)
    best = grouped.amax(dim=-1, keepdim=True)
    return (grouped - best.masked_fill(best == -math.inf, 0)).amax(dim=2)


@dataclass(frozen=True)
class OracleConfig(PolicyConfig):
    """budget: past tokens attended per managed layer and step (fraction of the real past tokens if <= 1,
    else a count), as InfiniGen's cap; dense_layers: the first layers that load their full KV; n_sink /
    window: the first real tokens / the most recent past tokens always among the budget's tokens (0: pure
    top-k)."""

    budget: float = 0.2
    dense_layers: int = 2
    n_sink: int = 0
    window: int = 0

    def __post_init__(self):
        if not 0 < self.budget < math.inf:
            raise PolicyError(f"budget must be positive and finite, got {self.budget}")
        if (
            not isinstance(self.dense_layers, int)
            or isinstance(self.dense_layers, bool)
            or self.dense_layers < 0
        ):
            raise PolicyError(f"dense_layers must be a non-negative integer, got {self.dense_layers}")
        for name in ("n_sink", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PolicyError(f"{name} must be a non-negative integer, got {value}")


class OraclePolicy(SelectivePolicy):
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
        scaling = getattr(self.spec.attention[layer], "scaling", self.spec.head_dim**-0.5)
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
        take = max(resolve_budget(self.config.budget, max(int(n), 1)) for n in real_past)
        scores = self.real_scores(layer, query, n_past)
        if self.config.n_sink or self.config.window:
            scores = scores.masked_fill(self._reserved(n_past, batch).to(scores.device)[:, None], math.inf)
        return scores.topk(min(take, n_past), dim=-1).indices.sort(dim=-1).values.to(self.device)

    def _reserved(self, n_past: int, batch: int) -> Tensor:
        """bool [batch, n_past]: the first ``n_sink`` real tokens and the last ``window`` past tokens."""
        valid = self.past_valid(n_past, batch)
        rank = valid.long().cumsum(dim=1)  # 1 for the first real token
        slot = torch.arange(n_past, device=valid.device)
        return valid & ((rank <= self.config.n_sink) | (slot >= n_past - self.config.window))
