"""``quest``: query-aware page selection (Tang et al., 2024, https://arxiv.org/abs/2406.10774).

The cache is cut into pages of ``page_size`` consecutive tokens. For every full page the policy keeps, on
the compute device, the per-channel minimum and maximum of its keys (post-RoPE). In a decode step, with the
layer's real query q, each page gets the upper bound of any of its tokens' logits,
sum_c max(q_c * max_c, q_c * min_c); the pages with the highest bounds are gathered from the host pool,
and the newest (partial) page is always attended.

GQA: pages are chosen per KV head, which serves a group of query heads; a page's bound for the KV head is the
max of its query heads' bounds (a page goes in if any head of the group might need it). ``budget`` counts
tokens (the partial page and the new token included); a fraction (<= 1) refers to the current context, so 1
attends to everything. As in the paper, the first ``dense_layers`` layers attend to everything. Pages that
hold only left padding are never chosen; padding inside a chosen page is masked by the model's mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .base import PolicyConfig, knob, resolve_budget
from .gather import GatherPolicy

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuestConfig(PolicyConfig):
    budget: float = knob(
        0.2,
        "tokens attended per layer and step (<= 1: fraction of the current context)",
        low=0,
        open_low=True,
    )
    page_size: int = knob(16, "tokens per page", low=1)
    dense_layers: int = knob(2, "leading layers that attend to everything (the paper keeps two)", low=0)


class QuestPolicy(GatherPolicy):
    name = "quest"
    config_class = QuestConfig

    def __init__(self, config: QuestConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        layers = spec.num_layers
        # Per layer: [batch, kv_heads, pages, head_dim] key max / min of the full pages (padding excluded:
        # -inf / +inf), and the keys of the partial page prepared for max / min.
        self.page_max: list[Tensor | None] = [None] * layers
        self.page_min: list[Tensor | None] = [None] * layers
        self._partial_max: list[Tensor | None] = [None] * layers
        self._partial_min: list[Tensor | None] = [None] * layers
        self._query: dict[int, Tensor] = {}

    # -- page metadata -------------------------------------------------------------------------------------
    def _add_keys(self, layer: int, k: Tensor) -> None:
        if self.spec.is_sliding(layer):
            return
        n_past = self.host_pool.length(layer) - k.shape[2]  # called after the append
        valid = self.key_valid
        if valid is not None:
            valid = valid[:, n_past : n_past + k.shape[2]].to(k.device)[:, None, :, None]
        inf = torch.tensor(float("inf"), dtype=k.dtype, device=k.device)
        for_max = k if valid is None else torch.where(valid, k, -inf)
        for_min = k if valid is None else torch.where(valid, k, inf)
        if self._partial_max[layer] is not None:
            for_max = torch.cat([self._partial_max[layer], for_max], dim=2)
            for_min = torch.cat([self._partial_min[layer], for_min], dim=2)
        size = self.config.page_size
        full = for_max.shape[2] // size * size
        batch, heads, _, dim = k.shape
        if full:
            new_max = for_max[:, :, :full].reshape(batch, heads, -1, size, dim).amax(dim=3)
            new_min = for_min[:, :, :full].reshape(batch, heads, -1, size, dim).amin(dim=3)
            if self.page_max[layer] is not None:
                new_max = torch.cat([self.page_max[layer], new_max], dim=2)
                new_min = torch.cat([self.page_min[layer], new_min], dim=2)
            self.page_max[layer], self.page_min[layer] = new_max, new_min
        self._partial_max[layer] = for_max[:, :, full:]
        self._partial_min[layer] = for_min[:, :, full:]

    # -- the seam ------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = super().prefill(layer, k, v)
        self._add_keys(layer, k)
        return out

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        if layer >= self.config.dense_layers and not self.spec.is_sliding(layer):
            self._query[layer] = self.spec.query(layer, x, position_ids)[:, :, -1]  # [batch, heads, d]

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor):
        selection = super().decode(layer, k_new, v_new)
        self._add_keys(layer, k_new)
        return selection

    def select(self, layer: int, n_past: int, batch: int) -> Tensor:
        size = self.config.page_size
        n_pages = n_past // size
        partial = torch.arange(n_pages * size, n_past, device=self.device)
        query = self._query.pop(layer, None)
        budget = resolve_budget(self.config.budget, n_past + 1, capped=False)
        take = min(n_pages, max(0, (budget - partial.numel() - 1) // size))
        if query is None or take == n_pages:  # a dense layer, or every page fits
            return torch.arange(n_past, device=self.device).expand(batch, self.spec.num_kv_heads, -1)
        pages = self.top_pages(
            query, self.page_max[layer][:, :, :n_pages], self.page_min[layer][:, :, :n_pages], take
        )
        tokens = (pages[..., None] * size + torch.arange(size, device=self.device)).flatten(2)
        return torch.cat([tokens, partial.expand(*tokens.shape[:2], -1)], dim=2)

    def top_pages(self, query: Tensor, page_max: Tensor, page_min: Tensor, take: int) -> Tensor:
        """The ``take`` pages with the highest logit upper bound per KV head, sorted: [batch, kv_heads, take].

        query [batch, heads, d]; page_max / page_min [batch, kv_heads, pages, d]."""
        batch, kv_heads, n_pages, _ = page_max.shape
        group = query.shape[1] // kv_heads
        q = query.reshape(batch, kv_heads, group, 1, -1)
        bound = torch.maximum(q * page_max[:, :, None], q * page_min[:, :, None]).sum(dim=-1).amax(dim=2)
        real = page_max[..., 0] > float("-inf")  # pages with at least one real token
        bound = torch.where(real, bound, float("-inf"))
        return bound.topk(take, dim=-1).indices.sort(dim=-1).values

    def device_bytes(self) -> int:
        metadata = (*self.page_max, *self.page_min, *self._partial_max, *self._partial_min)
        return sum(meta.numel() * meta.element_size() for meta in metadata if meta is not None)
