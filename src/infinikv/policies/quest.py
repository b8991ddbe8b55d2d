"""``quest``: query-aware page selection (Tang et al., 2024, https://arxiv.org/abs/2406.10774).

The cache is cut into pages of ``page_size`` consecutive tokens. For every full page the policy keeps, on
the compute device, the per-channel minimum and maximum of its keys (post-RoPE), in the block bounds it
shares with InfiniGen's coarse-to-fine speculation (``bounds.BlockBounds``: a page is a block), in the
model's dtype with no rounding, so they are the keys' own values. In a decode step, with the
layer's real query q, each page gets the upper bound of any of its tokens' logits,
sum_c max(q_c * max_c, q_c * min_c); the pages with the highest bounds are gathered from the host pool,
and the newest (partial) page is always attended.

GQA: pages are chosen per KV head, which serves a group of query heads; a page's bound for the KV head is the
max of its query heads' bounds (a page goes in if any head of the group might need it). ``budget`` counts
tokens (the partial page and the new token included); a fraction (<= 1) refers to each row's current context
(its real tokens, not the batch's padded length), so 1 attends to everything. As in the paper, the first
``dense_layers`` layers attend to everything; having nothing to choose, they are copied a layer ahead
(``prefetches``), while a scored layer's pages are gathered once its query exists.

Batches: a row's pages start at its own first real token (left padding is never paged), so they hold the
tokens they hold when the row runs alone; rows with fewer pages, or a shorter budget, than their batchmates
hide the extra slots of the gather (``Selection.valid``), so a row's selection does not depend on its batch.
A unit of the seam is a row's page, numbered from its first one (page j of row r is the block after its
first page's by j), so ties and a shorter row's missing pages fall as they do when it runs alone.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .base import ScoredPolicy, resolve_budget
from .bounds import BlockBounds
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
    prefetches = True  # the layers it does not score; those it scores, on demand
    scores_slots = False

    def __init__(self, config: QuestConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        layers = spec.num_layers
        # Per layer, each row's pages start at its own first real token (its left padding is never paged),
        # so a row's pages are the ones it has alone. pages: the bounds of the full pages (a block per
        # page, blocks aligned on each row's first real token); partial [batch, kv_heads, page_size,
        # head_dim] holds the keys of each row's unfinished page. Per row, on the host (so a step reads
        # nothing back): its full pages (n_pages), the keys of its unfinished page (n_partial) and the slot
        # of its first real token (first_real, -1: none yet).
        self.pages: list[BlockBounds | None] = [None] * layers
        self.partial: list[Tensor | None] = [None] * layers
        self.n_pages: list[list[int]] = [[] for _ in range(layers)]
        self.n_partial: list[list[int]] = [[] for _ in range(layers)]
        self.first_real: list[list[int]] = [[] for _ in range(layers)]

    # -- page metadata -------------------------------------------------------------------------------------
    def _add_keys(self, layer: int, k: Tensor) -> None:
        """Append a chunk's real keys to each row's partial page and close the pages that fill up."""
        if self.spec.is_sliding(layer):
            return
        batch, heads, count, dim = k.shape
        size, device = self.config.page_size, k.device
        start = self.host_pool.length(layer) - count  # called after the append
        # Left padding: a row's real tokens are the chunk's last n_real (in a decode step, its one token).
        padding = self.row_padding(batch)
        n_real = [count - min(max(pad - start, 0), count) for pad in padding]
        if self.partial[layer] is None:
            self.pages[layer] = BlockBounds(size, [0] * batch, device, dtype=k.dtype, outward=False)
            self.partial[layer] = k.new_zeros(batch, heads, size, dim)
            self.n_pages[layer], self.n_partial[layer] = [0] * batch, [0] * batch
            self.first_real[layer] = [-1] * batch
        first = [
            start + count - real if first < 0 and real > 0 else first
            for first, real in zip(self.first_real[layer], n_real, strict=True)
        ]
        if first != self.first_real[layer]:  # a row's first real token: its blocks start there
            self.first_real[layer] = first
            self.pages[layer].align([max(slot, 0) for slot in first])
        held, width = self.n_partial[layer], size + count
        if n_real == [1] * batch and max(held) + 1 < size:  # a decode step that closes no page
            if min(held) == max(held):  # every row's next slot is the same: one write
                self.partial[layer][:, :, held[0]] = k[:, :, 0]
            else:
                rows = torch.arange(batch, device=device)
                self.partial[layer][rows, :, torch.tensor(held, device=device)] = k[:, :, 0]
            self.n_partial[layer] = [have + 1 for have in held]
            return
        # Row r's unfinished content: its partial keys, then its real chunk keys, gathered to the front.
        at = torch.arange(width)
        held_rows, real_rows = torch.tensor(held)[:, None], torch.tensor(n_real)[:, None]
        source = torch.where(at < held_rows, at, size + count - real_rows + at - held_rows)
        source = source.clamp(0, width - 1).to(device)
        joined = torch.cat([self.partial[layer], k], dim=2)
        joined = joined.gather(2, source[:, None, :, None].expand(batch, heads, width, dim))
        total = [have + real for have, real in zip(held, n_real, strict=True)]
        closed = [n // size for n in total]  # pages each row completes now
        if max(closed) > 0:
            self._close_pages(layer, joined, closed)
        # What is left after the closed pages goes to the front of the partial buffer.
        rest = (torch.tensor(closed)[:, None] * size + torch.arange(size)).clamp(max=width - 1).to(device)
        self.partial[layer] = joined.gather(2, rest[:, None, :, None].expand(batch, heads, size, dim))
        self.n_partial[layer] = [n - pages * size for n, pages in zip(total, closed, strict=True)]

    def _close_pages(self, layer: int, joined: Tensor, closed: list[int]) -> None:
        """Bound row r's first ``closed[r]`` pages of ``joined`` [batch, kv_heads, width, head_dim] (its
        unfinished keys, gathered to the front) as its pages after its ``n_pages[r]``."""
        pages, size = self.pages[layer], self.config.page_size
        batch, heads = joined.shape[:2]
        most, device = max(closed), joined.device
        after = [
            block + have for block, have in zip(self._first_blocks(layer), self.n_pages[layer], strict=True)
        ]
        blocks = (torch.tensor(after)[:, None] + torch.arange(most)).to(device)[:, None].expand(-1, heads, -1)
        # a row closing fewer than the most writes its next blocks as empty: they hold nothing yet
        present = torch.arange(most * size) < torch.tensor(closed)[:, None] * size
        present = present.to(device)[:, None].expand(-1, heads, -1)
        pages.write(blocks, joined[:, :, : most * size], present, needed=max(after) + most)
        self.n_pages[layer] = [have + new for have, new in zip(self.n_pages[layer], closed, strict=True)]

    def _first_blocks(self, layer: int) -> list[int]:
        """Per row, the block of its first page (on the host)."""
        pages = self.pages[layer]
        return [pages.block_at(row, max(first, 0)) for row, first in enumerate(self.first_real[layer])]

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
        size, pages = self.config.page_size, self.n_pages[layer]
        return [full * size + held for full, held in zip(pages, self.n_partial[layer], strict=True)]

    def units(self, layer: int, real: list[int]) -> list[int]:
        return self.n_pages[layer]

    def takes(self, layer: int, real: list[int]) -> list[int]:
        """Full pages per row: its budget (of its context, the new token included) less its unfinished
        page and the new token, in whole pages."""
        size, held = self.config.page_size, self.n_partial[layer]
        floor = self.config.min_tokens + 1  # the floor counts past tokens; this budget, the new one too
        budgets = [resolve_budget(self.config.budget, n + 1, capped=False, floor=floor) for n in real]
        return [max(0, (b - h - 1) // size) for b, h in zip(budgets, held, strict=True)]

    def score(self, layer: int, n_past: int, batch: int) -> Tensor:
        """Each page's upper bound on the logit of any of its tokens, per KV head: [batch, kv_heads, pages]
        (the max over the group's query heads, as the paper's; -inf on the pages a row does not have)."""
        query, n_pages = self.query(layer), self.n_pages[layer]
        first = self._first_blocks(layer)
        low, most = min(first), max(n_pages)
        high = max(block + have for block, have in zip(first, n_pages, strict=True))
        table = self.pages[layer].bounds[:, :, low:high]
        self.selector_read(table)
        bound = page_bounds(query, table)
        kv_heads = table.shape[1]
        at = torch.arange(most)
        if min(first) != max(first):  # rows' pages start at different blocks: each row's from its first
            start = (torch.tensor(first) - low)[:, None] + at
            pick = start.clamp(max=table.shape[2] - 1).to(bound.device)[:, None].expand(-1, kv_heads, -1)
            bound = bound.gather(2, pick)
        if min(n_pages) == most:  # every row has every page
            return bound
        real = (at < torch.tensor(n_pages)[:, None]).to(bound.device)[:, None]  # a shorter row's: -inf
        return torch.where(real, bound, float("-inf"))

    def together_key(self, layer: int) -> Hashable | None:
        """One unpadded sequence that leaves pages out: sequences of one page size pick their pages together
        (:meth:`score_rows`), whatever their lengths and budgets."""
        if self.padded or self.host_pool.rows != 1 or not self.scored(layer) or not self.n_pages[layer]:
            return None
        take = self.takes(layer, self.real_past(layer, self.host_pool.length(layer), 1))[0]
        return self.config.page_size if 0 < take < self.n_pages[layer][0] else None

    def expand(self, layer: int, index: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The tokens of the chosen pages, then each row's unfinished page (as wide as the widest one, a
        shorter one's extra slots hidden)."""
        size, device, heads = self.config.page_size, self.device, self.spec.num_kv_heads
        first, n_pages, held = self.first_real[layer], self.n_pages[layer], self.n_partial[layer]
        n_past, widest = self.host_pool.length(layer), max(held)
        if min(first) == max(first) and min(n_pages) == max(n_pages):  # rows alike: the slots from ints
            offsets = torch.arange(first[0], first[0] + size, device=device)
            tokens = (index[..., None] * size + offsets).flatten(2)
            start = first[0] + n_pages[0] * size
            partial = torch.arange(start, start + widest, device=device).expand(index.shape[0], -1)
        else:
            offsets = torch.arange(size, device=device)
            first = torch.tensor(first)
            tokens = (first.to(device)[:, None, None, None] + index[..., None] * size + offsets).flatten(2)
            partial = (first[:, None] + torch.tensor(n_pages)[:, None] * size + torch.arange(widest)).to(
                device
            )
        slots = torch.cat([tokens, partial[:, None].expand(-1, heads, -1)], dim=2).clamp(max=n_past - 1)
        if valid is None and min(held) == widest:
            return slots, None
        at = torch.arange(widest)
        page_valid = index.new_ones(index.shape, dtype=torch.bool) if valid is None else valid
        partial_valid = (at < torch.tensor(held)[:, None]).to(device)[:, None].expand(-1, heads, -1)
        return slots, torch.cat([page_valid.repeat_interleave(size, dim=2), partial_valid], dim=2)

    def device_bytes(self) -> int:
        """The bounds of the full pages (``BlockBounds.nbytes``) and the unfinished pages' keys."""
        held = sum(pages.nbytes() for pages in self.pages if pages is not None)
        return held + sum(keys.numel() * keys.element_size() for keys in self.partial if keys is not None)


def page_bounds(query: Tensor, table: Tensor) -> Tensor:
    """Each page's upper bound on the logit of any of its tokens, per KV head: [batch, kv_heads, pages], from
    the query [batch, heads, head_dim] and the pages' bounds ``table`` [batch, kv_heads, pages, 2 * head_dim]
    (each channel's max, then its negated min): the max over the group's query heads of
    sum_c max(q_c * max_c, q_c * min_c)."""
    batch, kv_heads, dim = table.shape[0], table.shape[1], table.shape[3] // 2
    page_max, page_neg_min = table[:, :, None, :, :dim], table[:, :, None, :, dim:]
    q = query.reshape(batch, kv_heads, query.shape[1] // kv_heads, 1, -1)
    # q·min as (-q)·(-min): the same product to the last bit (rounding is symmetric in sign)
    return torch.maximum(q * page_max, -q * page_neg_min).sum(dim=-1).amax(dim=2)
