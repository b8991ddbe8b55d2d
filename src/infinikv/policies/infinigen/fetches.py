"""What a layer of InfiniGen reads in a decode step, and an own-query layer's corrected prefetch.

A :class:`Fetch` is a layer's copy in flight with the slots it takes. With ``own_query_prefetch`` an
own-query layer copies ahead the slots it chose at the step before; once its own query has chosen,
:func:`corrected` copies only what that prefetch missed, and :class:`Corrected` puts the rows of both copies
in the order of the layer's own choice, so the layer attends to what it would attend to without the
prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...copiers import Transfer
from ..base import first_slots

Tensor = torch.Tensor


@dataclass(frozen=True)
class Fetch:
    """What a layer reads this step: its copy in flight, the slots it takes (None: every slot), their token
    positions, and which of them each row attends to (None: all)."""

    transfer: Transfer | Corrected
    index: Tensor | None
    positions: Tensor
    valid: Tensor | None


class Corrected:
    """An own-query layer's rows (``own_query_prefetch``): those its prefetch copied and the correction
    copied once its own query chose, put in the order of its own choice. ``wait()`` returns (keys, values)
    with a spare last slot, as a fetch with ``extra=1`` does."""

    def __init__(self, prefetched: Transfer, correction: Transfer | None, source: Tensor) -> None:
        self.prefetched, self.correction = prefetched, correction
        self.source = source  # [batch, kv_heads, m + 1]: each row's place in [prefetched + spare; correction]

    def wait(self) -> tuple[Tensor, Tensor]:
        keys, values = self.prefetched.wait()
        if self.correction is not None:
            more_keys, more_values = self.correction.wait()
            keys, values = torch.cat([keys, more_keys], dim=2), torch.cat([values, more_values], dim=2)
        batch, heads, rows, dim = keys.shape
        # whole rows by one index_select over [batch * heads * rows, dim] (a per-element gather is slower)
        starts = torch.arange(batch * heads, device=keys.device).view(batch, heads, 1) * rows
        flat = (self.source + starts).view(-1)
        shape = (batch, heads, self.source.shape[2], dim)
        keys, values = (
            rows_of.reshape(-1, dim).index_select(0, flat).view(shape) for rows_of in (keys, values)
        )
        return keys, values


def corrected(
    index: Tensor, prefetched: Fetch, n_slots: int, fetch: Callable[[Tensor], Transfer]
) -> tuple[Corrected, Tensor]:
    """``index``'s rows [batch, kv_heads, m] from those ``prefetched`` copied ahead (of a layer whose pool
    uses ``n_slots`` slots), and the correction: the slots it missed, copied now by ``fetch``. Returns the
    rows and the slots copied now (a row with fewer misses padded with its first)."""
    ahead = prefetched.index
    batch, heads, width = ahead.shape
    # where each slot sits among the prefetched rows (-1: not there); a repeated slot holds the same row
    where = torch.full((batch, heads, n_slots), -1, device=ahead.device)
    where.scatter_(2, ahead, torch.arange(width, device=ahead.device).expand_as(ahead))
    at = where.gather(2, index)
    missed = at < 0
    misses = missed.sum(dim=-1, keepdim=True)
    count = int(misses.max())
    correction = index.gather(2, first_slots(missed, count))  # each row's misses, padded with its first
    # each row's place in [prefetched rows, their spare slot, correction rows], then the spare for the new
    # token (decode writes it)
    source = torch.where(missed, width + missed.long().cumsum(dim=-1), at)
    source = torch.cat([source, source.new_full((batch, heads, 1), width)], dim=2)
    rest = fetch(correction) if count else None
    return Corrected(prefetched.transfer, rest, source), correction
