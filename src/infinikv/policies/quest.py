"""``quest``: query-aware page selection (Tang et al., 2024, https://arxiv.org/abs/2406.10774).

The cache is cut into pages of ``page_size`` consecutive tokens. For every full page the policy keeps, on
the compute device, the per-channel minimum and maximum of its keys (post-RoPE). In a decode step, with the
layer's real query q, each page gets the upper bound of any of its tokens' logits,
sum_c max(q_c * max_c, q_c * min_c); the pages with the highest bounds are gathered from the host pool,
and the newest (partial) page is always attended.

GQA: pages are chosen per KV head, which serves a group of query heads; a page's bound for the KV head is the
max of its query heads' bounds (a page goes in if any head of the group might need it). ``budget`` counts
tokens (the partial page and the new token included); a fraction (<= 1) refers to each row's current context
(its real tokens, not the batch's padded length), so 1 attends to everything. As in the paper, the first
``dense_layers`` layers attend to everything.

Batches: a row's pages start at its own first real token (left padding is never paged), so they hold the
tokens they hold when the row runs alone; rows with fewer pages, or a shorter budget, than their batchmates
hide the extra slots of the gather (``Selection.valid``), so a row's selection does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .base import ScoredPolicy, resolve_budget
from .config import PolicyConfig, knob, min_tokens_knob
from .registry import register

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuestConfig(PolicyConfig):
    budget: float = knob(
        0.2,
        "tokens attended per layer and step (<= 1: fraction of the current context; a count above it "
        "attends to everything)",
        low=0,
        open_low=True,
    )
    min_tokens: int = min_tokens_knob()
    page_size: int = knob(
        16,
        "tokens per page, at most 4096 (larger is refused: each row's unfinished page of keys stays on the "
        "compute device); a page longer than the context never fills, so every token is attended",
        low=1,
        high=4096,
    )
    dense_layers: int = knob(2, "leading layers that attend to everything (the paper keeps two)", low=0)


@register("quest")
class QuestPolicy(ScoredPolicy):
    """Scores pages, not tokens: a unit of the shared seam is one of a row's full pages (:meth:`expand`
    turns the chosen pages into their tokens and adds the row's unfinished page)."""

    config_class = QuestConfig
    query_aware = True
    scores_slots = False

    def __init__(self, config: QuestConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        layers = spec.num_layers
        # Per layer, each row's pages start at its own first real token (its left padding is never paged),
        # so a row's pages are the ones it has alone. Rows differ in how many pages they have:
        # page_max / page_min [batch, kv_heads, most pages, head_dim], a row's missing pages at -inf / +inf;
        # n_pages [batch]; partial [batch, kv_heads, page_size, head_dim] holds the keys of each row's
        # unfinished page, n_partial [batch] of them; first_real [batch] the slot of each row's first real
        # token (-1: none yet).
        self.page_max: list[Tensor | None] = [None] * layers
        self.page_min: list[Tensor | None] = [None] * layers
        self.n_pages: list[Tensor | None] = [None] * layers
        self.partial: list[Tensor | None] = [None] * layers
        self.n_partial: list[Tensor | None] = [None] * layers
        self.first_real: list[Tensor | None] = [None] * layers

    # -- page metadata -------------------------------------------------------------------------------------
    def _add_keys(self, layer: int, k: Tensor) -> None:
        """Append a chunk's real keys to each row's partial page and close the pages that fill up."""
        if self.spec.is_sliding(layer):
            return
        batch, heads, count, dim = k.shape
        size, device = self.config.page_size, k.device
        start = self.host_pool.length(layer) - count  # called after the append
        # Left padding: a row's real tokens are the chunk's last n_real. The counts live on the host, so a
        # decode step (every row's token is real) never waits for the device.
        if count == 1:
            n_real = torch.ones(batch, dtype=torch.long)
        else:
            n_real = self.past_valid(start + count, batch)[:, start:].sum(dim=1).cpu()
        if self.partial[layer] is None:
            self.page_max[layer] = k.new_empty(batch, heads, 0, dim)
            self.page_min[layer] = k.new_empty(batch, heads, 0, dim)
            self.partial[layer] = k.new_zeros(batch, heads, size, dim)
            self.n_pages[layer] = torch.zeros(batch, dtype=torch.long)
            self.n_partial[layer] = torch.zeros(batch, dtype=torch.long)
            self.first_real[layer] = torch.full((batch,), -1, dtype=torch.long)
        first = self.first_real[layer]
        self.first_real[layer] = torch.where((first < 0) & (n_real > 0), start + count - n_real, first)
        # Row r's unfinished content: its partial keys, then its real chunk keys, gathered to the front.
        held, width = self.n_partial[layer], size + count
        at = torch.arange(width)
        source = torch.where(at < held[:, None], at, size + count - n_real[:, None] + at - held[:, None])
        source = source.clamp(0, width - 1).to(device)
        joined = torch.cat([self.partial[layer], k], dim=2)
        joined = joined.gather(2, source[:, None, :, None].expand(batch, heads, width, dim))
        total = held + n_real
        closed = total // size  # pages each row completes now
        if int(closed.max()) > 0:
            blocks = joined[:, :, : width // size * size].unflatten(2, (-1, size))
            self._append_pages(layer, blocks.amax(dim=3), blocks.amin(dim=3), closed)
        # What is left after the closed pages goes to the front of the partial buffer.
        rest = (closed[:, None] * size + torch.arange(size)).clamp(max=width - 1).to(device)
        self.partial[layer] = joined.gather(2, rest[:, None, :, None].expand(batch, heads, size, dim))
        self.n_partial[layer] = total - closed * size

    def _append_pages(self, layer: int, new_max: Tensor, new_min: Tensor, closed: Tensor) -> None:
        """Put row r's first ``closed[r]`` of ``new_max``/``new_min`` after its ``n_pages[r]`` pages."""
        old_max, old_min, have = self.page_max[layer], self.page_min[layer], self.n_pages[layer]
        batch, heads, _, dim = new_max.shape
        most = int((have + closed).max())
        at = torch.arange(most)
        source = torch.where(at >= have[:, None], old_max.shape[2] + at - have[:, None], at)
        source = source.clamp(0, old_max.shape[2] + new_max.shape[2] - 1).to(new_max.device)
        pick = source[:, None, :, None].expand(batch, heads, most, dim)
        inf = torch.tensor(float("inf"), dtype=new_max.dtype, device=new_max.device)
        keep = (at < (have + closed)[:, None]).to(new_max.device)[:, None, :, None]
        self.page_max[layer] = torch.where(keep, torch.cat([old_max, new_max], dim=2).gather(2, pick), -inf)
        self.page_min[layer] = torch.where(keep, torch.cat([old_min, new_min], dim=2).gather(2, pick), inf)
        self.n_pages[layer] = have + closed

    # -- the seam ------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = super().prefill(layer, k, v)
        self._add_keys(layer, k)
        return out

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor):
        selection = super().decode(layer, k_new, v_new)
        self._add_keys(layer, k_new)
        return selection

    def real_past(self, layer: int, n_past: int, batch: int) -> list[int]:
        # host tensors: no device sync
        return (self.n_pages[layer] * self.config.page_size + self.n_partial[layer]).tolist()

    def units(self, layer: int, real: list[int]) -> list[int]:
        return self.n_pages[layer].tolist()

    def takes(self, layer: int, real: list[int]) -> list[int]:
        """Full pages per row: its budget (of its context, the new token included) less its unfinished
        page and the new token, in whole pages."""
        size, held = self.config.page_size, self.n_partial[layer].tolist()
        floor = self.config.min_tokens + 1  # the floor counts past tokens; this budget, the new one too
        budgets = [resolve_budget(self.config.budget, n + 1, capped=False, floor=floor) for n in real]
        return [max(0, (b - h - 1) // size) for b, h in zip(budgets, held, strict=True)]

    def score(self, layer: int, n_past: int, batch: int) -> Tensor:
        """Each page's upper bound on the logit of any of its tokens, per KV head: [batch, kv_heads, pages]
        (the max over the group's query heads, as the paper's; -inf on the pages a row does not have)."""
        query, page_max, page_min = self.query(layer), self.page_max[layer], self.page_min[layer]
        self.selector_read(page_max, page_min)
        batch, kv_heads, n_pages, _ = page_max.shape
        q = query.reshape(batch, kv_heads, query.shape[1] // kv_heads, 1, -1)
        bound = torch.maximum(q * page_max[:, :, None], q * page_min[:, :, None]).sum(dim=-1).amax(dim=2)
        real = page_max[..., 0] > float("-inf")  # pages the row has (a shorter row's others are -inf)
        return torch.where(real, bound, float("-inf"))

    def expand(self, layer: int, index: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The tokens of the chosen pages, then each row's unfinished page (as wide as the widest one, a
        shorter one's extra slots hidden)."""
        size, device, heads = self.config.page_size, self.device, self.spec.num_kv_heads
        first, n_pages, held = self.first_real[layer], self.n_pages[layer], self.n_partial[layer]
        n_past, widest = self.host_pool.length(layer), int(held.max())
        offsets = torch.arange(size, device=device)
        tokens = (first.to(device)[:, None, None, None] + index[..., None] * size + offsets).flatten(2)
        at = torch.arange(widest)
        partial = (first[:, None] + n_pages[:, None] * size + at).to(device)
        slots = torch.cat([tokens, partial[:, None].expand(-1, heads, -1)], dim=2).clamp(max=n_past - 1)
        if valid is None and not bool((held < widest).any()):
            return slots, None
        page_valid = index.new_ones(index.shape, dtype=torch.bool) if valid is None else valid
        partial_valid = (at < held[:, None]).to(device)[:, None].expand(-1, heads, -1)
        return slots, torch.cat([page_valid.repeat_interleave(size, dim=2), partial_valid], dim=2)

    def device_bytes(self) -> int:
        metadata = (*self.page_max, *self.page_min, *self.partial)
        return sum(meta.numel() * meta.element_size() for meta in metadata if meta is not None)
