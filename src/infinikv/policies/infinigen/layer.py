"""What InfiniGen keeps per layer: one :class:`LayerState` per layer instead of parallel per-layer lists."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .fetches import Fetch
from .slots import SlotTable

Tensor = torch.Tensor


@dataclass
class LayerState:
    """One layer's pool slots, partial-key columns, and what its reads at one step leave for the next."""

    managed: bool  # selectively fetched (else it loads its full KV, or its window)
    slots: SlotTable = field(default_factory=SlotTable)
    seen: int = 0  # positions (mask columns) seen
    # [kv_heads, d, k] onto the widest calibrated columns (managed layers, from the first prompt chunk)
    projection: Tensor | None = None
    # from the first decode step: which of the widest columns the store keeps ([kv_heads, k'], None: all)
    stored: Tensor | None = None
    # the same columns as host integers, set with ``stored``: rows of an engine step compare them without a
    # device read (``together.rehearsal_queries_together``)
    stored_key: tuple[int, ...] | None = None
    # n' averaged over the batch per decode step, left on the device until stats() (no sync per step)
    selected: list[Tensor] = field(default_factory=list)
    # an own-query layer's prefetch this step (own_query_prefetch): the slots it prefetched and their copy,
    # until the layer's own choice takes what it needs of them
    prefetched: Fetch | None = None
    # what the layer read at the step before ([batch, kv_heads, m] slots, and which of them each row
    # attends to: None = all), kept under own_query_prefetch (what an own-query layer prefetches) and
    # select_every > 1 (what the steps between choices read again)
    chosen: Tensor | None = None
    chosen_valid: Tensor | None = None
    newest: Tensor | None = None  # [batch, kv_heads, 1]: the slot its last token was stored in (select_every)
    # select_every: the slots whose next token the steps between read ([batch, kv_heads, f] and which of
    # them hold one: None = all), the best read at the last choice, one further at each step
    followed: tuple[Tensor, Tensor | None] | None = None

    def positions(self, index: Tensor | None = None) -> Tensor:
        """The token positions (mask columns) held by the slots ``index`` [batch, kv_heads, m] (None: every
        slot in use). Where nothing was evicted that is ``index`` itself, or the table's own view: read
        them, do not write to them."""
        if index is None:
            return self.slots.view("pos")
        if self.slots.n == self.seen:  # nothing evicted: slot i holds position i
            return index
        return torch.gather(self.slots.view("pos"), 2, index)

    def in_store(self, wide: Tensor) -> Tensor:
        """``wide`` [..., kv_heads, rows, k]: values in the widest columns, cut to the store's."""
        if self.stored is None:
            return wide
        return torch.gather(wide, -1, self.stored[:, None, :].expand(*wide.shape[:-1], -1))
