"""Block bounds: per block of consecutive tokens, the largest and the smallest value of each key column.

They bound what any token of a block can score against a query q: q · k ≤ Σ_c max(q_c · max_c, q_c · min_c)
for every key k of the block (Quest, Tang et al., ICML 2024, https://arxiv.org/abs/2406.10774). Quest keeps
them on its pages of full keys (``quest.py``), InfiniGen's coarse-to-fine speculation on blocks of its
partial skewed keys (``infinigen/blocks.py``); both keep them in one :class:`BlockBounds`, which numbers the
blocks, stores, widens, takes again and trims the bounds and counts their bytes. Each policy scores them its
own way.

Blocks follow each sequence's own tokens, not the batch's slots: the block of slot s in row r is
⌊(s − o_r) / block_size⌋ + 1, with o_r the row's left padding modulo the block size, so a row's first
real token starts a block whether it is batched or alone. Block 0 holds only padding.

Bounds are stored as [max; −min] over the columns, [batch, kv_heads, blocks, 2·k], so that both halves are
exact slices and a bound is also one product, [relu(q); relu(−q)] · bounds. The dtype and the rounding are
the owner's: InfiniGen keeps bfloat16 rounded outward (the max up, the min down, so they stay bounds), Quest
its model's dtype as is (its bounds are values of its keys).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor
SlotsTo = Callable[[Tensor], Tensor]  # slots [batch, kv_heads, m] -> what they hold, per slot


def round_outward(value: Tensor, dtype: torch.dtype, up: bool) -> Tensor:
    """``value`` as ``dtype``, rounded up (``up``) or down: still a bound of what it bounded."""
    rounded = value.to(dtype)
    off = rounded.float() < value if up else rounded.float() > value
    toward = torch.tensor(math.inf if up else -math.inf, dtype=dtype, device=value.device)
    return torch.where(off, torch.nextafter(rounded, toward), rounded)  # no read: a decode step extends


class BlockBounds:
    """One layer's block bounds [batch, kv_heads, blocks, 2·k] (as [max; −min] per column) and which blocks
    hold a real token (``filled``). ``dtype``: how the bounds are stored; ``outward``: values of another
    dtype are rounded outward into it (else as ``Tensor.to`` rounds them)."""

    def __init__(
        self,
        block_size: int,
        padding: list[int],
        device: torch.device,
        *,
        dtype: torch.dtype,
        outward: bool,
    ):
        self.size = block_size
        self.dtype = dtype
        self.outward = outward
        self.offsets = torch.zeros(len(padding), 1, 1, dtype=torch.long, device=device)
        self.align(padding)
        self.bounds: Tensor | None = None
        self.filled: Tensor | None = None  # [batch, kv_heads, blocks]: a block with a real token

    # -- numbering -----------------------------------------------------------------------------------------
    def align(self, padding: list[int]) -> None:
        """Start each row's blocks at its first real token, after ``padding`` slots. A prompt's chunks may
        show more of a row's padding as they come; its blocks hold no real token until its first one."""
        self.row_offsets = [p % self.size for p in padding]  # on the host, so a block's number needs no read
        self.offsets = torch.tensor(self.row_offsets, device=self.offsets.device)[:, None, None]

    def block_of(self, slots: Tensor) -> Tensor:
        """The block of each slot of ``slots`` [batch, kv_heads, m]."""
        return torch.div(slots - self.offsets + self.size, self.size, rounding_mode="floor")

    def block_at(self, row: int, slot: int) -> int:
        """The block of ``slot`` in ``row``, on the host."""
        return (slot - self.row_offsets[row] + self.size) // self.size

    def slots_of(self, blocks: Tensor) -> Tensor:
        """[batch, kv_heads, m · block_size]: the slots of ``blocks`` [batch, kv_heads, m], ascending within
        each block (may fall outside the slots in use: the caller masks them)."""
        first = (blocks - 1) * self.size + self.offsets
        within = torch.arange(self.size, device=blocks.device)
        return (first[..., None] + within).flatten(2)

    def count(self, slots: int) -> int:
        """Blocks needed to cover ``slots`` slots in every row."""
        return (slots + self.size - 1) // self.size + 1

    # -- the bounds ----------------------------------------------------------------------------------------
    def write(self, blocks: Tensor, values: Tensor, present: Tensor, needed: int | None = None) -> None:
        """Set the bounds of ``blocks`` [batch, kv_heads, m] to those of their tokens' ``values`` [batch,
        kv_heads, m · block_size, k] (each block's tokens in a row), over the tokens ``present`` (bool
        [batch, kv_heads, m · block_size]); a block with none holds no real token. ``needed``: the blocks
        the table must hold, where the host knows it (None: read from ``blocks``)."""
        batch, heads, _, k = values.shape
        self._grow(int(blocks.max()) + 1 if needed is None else needed, batch, heads, k, values.device)
        present = present.view(batch, heads, -1, self.size, 1)
        values = values.reshape(batch, heads, -1, self.size, k)
        high = values.masked_fill(~present, -math.inf).amax(dim=3)
        low = values.masked_fill(~present, math.inf).amin(dim=3)
        filled = present.any(dim=3)  # [batch, kv_heads, m, 1]
        high, low = high.masked_fill(~filled, 0), low.masked_fill(~filled, 0)
        bounds = torch.cat([self._stored(high, up=True), -self._stored(low, up=False)], dim=-1)
        rows = self._rows(blocks)  # by flat row: a scatter over bfloat16 would copy the whole table
        self.bounds.view(-1, 2 * k).index_copy_(0, rows, bounds.reshape(-1, 2 * k))
        self.filled.view(-1).index_copy_(0, rows, filled.flatten())

    def refresh(self, blocks: Tensor, n: int, read: SlotsTo, real_at: SlotsTo) -> None:
        """Take the bounds of ``blocks`` [batch, kv_heads, m] again from their tokens (after a store or an
        overwrite), growing the table when a block is new: ``n`` slots are in use, ``read(slots)`` gives the
        values [batch, kv_heads, m', k] of ``slots`` [batch, kv_heads, m'] and ``real_at(slots)`` whether
        each holds a real token."""
        slots = self.slots_of(blocks)
        inside = (slots >= 0) & (slots < n)
        slots = slots.clamp(0, max(n - 1, 0))
        self.write(blocks, read(slots), inside & real_at(slots))

    def build(self, n: int, read: SlotsTo, real_at: SlotsTo, batch: int, heads: int) -> None:
        """All bounds of ``batch`` rows and ``heads`` KV heads, from the first ``n`` slots (those in use);
        the other arguments as :meth:`refresh`."""
        every = torch.arange(self.count(n), device=self.offsets.device).expand(batch, heads, -1)
        self.refresh(every, n, read, real_at)

    def extend(self, slot: int, values: Tensor) -> None:
        """Add a real token, stored in ``slot`` of every row, whose values are ``values`` [batch, kv_heads,
        1, k]: its block's bounds widen to it (a new block starts with it alone)."""
        batch, heads, _, k = values.shape
        blocks = self.block_of(torch.full((batch, heads, 1), slot, device=values.device))
        most = max(self.block_at(row, slot) for row in range(batch))
        self._grow(most + 1, batch, heads, k, values.device)
        rows = self._rows(blocks)
        token = torch.cat([self._stored(values, up=True), -self._stored(values, up=False)], dim=-1)
        table, filled = self.bounds.view(-1, 2 * k), self.filled.view(-1)
        token = token.reshape(-1, 2 * k)
        old = table.index_select(0, rows)
        merged = torch.where(filled.index_select(0, rows)[:, None], torch.maximum(old, token), token)
        table.index_copy_(0, rows, merged)
        filled.index_fill_(0, rows, True)

    def keep(self, columns: Tensor) -> None:
        """Keep only the columns ``columns`` [kv_heads, k'] (of the k the bounds hold)."""
        k = self.bounds.shape[-1] // 2
        both = torch.cat([columns, columns + k], dim=-1)[None, :, None, :]
        self.bounds = torch.gather(self.bounds, 3, both.expand(*self.bounds.shape[:3], -1))

    def nbytes(self) -> int:
        """Device bytes of the bounds in use: those of the blocks that hold a real token."""
        if self.bounds is None:
            return 0
        return int(self.filled.sum()) * self.bounds.shape[3] * self.bounds.element_size()

    def _stored(self, value: Tensor, up: bool) -> Tensor:
        """``value`` as the table stores it: rounded outward (``up``: the max) where ``outward``."""
        return round_outward(value, self.dtype, up) if self.outward else value.to(self.dtype)

    def _grow(self, needed: int, batch: int, heads: int, k: int, device: torch.device) -> None:
        """Room for ``needed`` blocks (doubling)."""
        if self.bounds is None:
            self.bounds = torch.zeros(batch, heads, needed, 2 * k, dtype=self.dtype, device=device)
            self.filled = torch.zeros(batch, heads, needed, dtype=torch.bool, device=device)
        have = self.bounds.shape[2]
        if needed > have:
            grow = max(needed, 2 * have) - have
            self.bounds = torch.cat([self.bounds, self.bounds.new_zeros(batch, heads, grow, 2 * k)], dim=2)
            self.filled = torch.cat([self.filled, self.filled.new_zeros(batch, heads, grow)], dim=2)

    def _rows(self, blocks: Tensor) -> Tensor:
        """Flat row indices of ``blocks`` [batch, kv_heads, m] in the table viewed as [rows, 2·k]."""
        batch, heads = blocks.shape[:2]
        start = torch.arange(batch * heads, device=blocks.device).view(batch, heads, 1) * self.bounds.shape[2]
        return (blocks + start).flatten()
