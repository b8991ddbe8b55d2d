"""Coarse-to-fine speculation: per block of ``block_size`` tokens, bounds of the partial keys.

A rehearsal that scores every past token spends most of its time on the count and the top-k over all of
them, not on the few columns it multiplies. With blocks, it first
scores blocks by an upper bound of what any of their tokens can score (:func:`block_scores`), keeps the
best blocks as candidates, and only then scores, counts and picks tokens, among the candidates alone
(``policy.py``). The bounds are Quest's (Tang et al., ICML 2024, https://arxiv.org/abs/2406.10774), taken
on InfiniGen's skewed partial keys instead of the full keys: per block and column, the largest and the
smallest value, so that q · k ≤ Σ_c max(q_c · max_c, q_c · min_c) for every key k of the block.

Blocks follow each sequence's own tokens, not the batch's slots: the block of slot s in row r is
⌊(s − o_r) / block_size⌋ + 1, with o_r the row's left padding modulo the block size, so a row's first
real token starts a block whether it is batched or alone, and its candidates are those it gets alone.
Block 0 holds only padding. When the pool evicts (``capacity`` below 1), a slot keeps its block and the
bounds of the block it is written to are taken again from its tokens.

Bounds are stored as bfloat16, rounded outward (the max up, the min down), so they stay bounds; as
[max; −min] over the columns, so that the bound of a query q is one product, [relu(q); relu(−q)] · bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .rehearsal import dequantized

Tensor = torch.Tensor
BOUND_DTYPE = torch.bfloat16
BOUND_BYTES = 2  # per bound value: each block holds a max and a min per column


def bound_bytes_per_token(columns: int, block_size: int) -> float:
    """Device bytes of the bounds, per token and KV head (0 without blocks)."""
    return 0.0 if block_size <= 1 else 2 * columns * BOUND_BYTES / block_size


def _round_outward(value: Tensor, up: bool) -> Tensor:
    """``value`` (float32) as bfloat16, rounded up (``up``) or down: still a bound of what it bounded."""
    rounded = value.to(BOUND_DTYPE)
    off = rounded.float() < value if up else rounded.float() > value
    toward = torch.tensor(math.inf if up else -math.inf, dtype=BOUND_DTYPE, device=value.device)
    return torch.where(off, torch.nextafter(rounded, toward), rounded)  # no read: a decode step extends


class BlockBounds:
    """One layer's block bounds [batch, kv_heads, blocks, 2·k] (as [max; −min] per column) and which blocks
    hold a real token."""

    def __init__(self, block_size: int, padding: list[int], device: torch.device):
        self.size = block_size
        self.offsets = torch.zeros(len(padding), 1, 1, dtype=torch.long, device=device)
        self.align(padding)
        self.bounds: Tensor | None = None
        self.filled: Tensor | None = None  # [batch, kv_heads, blocks]: a block with a real token

    def align(self, padding: list[int]) -> None:
        """Start each row's blocks at its first real token, after ``padding`` slots. A prompt's chunks may
        show more of a row's padding as they come; its blocks hold no real token until its first one."""
        self.row_offsets = [p % self.size for p in padding]  # on the host, so a block's number needs no read
        self.offsets = torch.tensor(self.row_offsets, device=self.offsets.device)[:, None, None]

    def block_of(self, slots: Tensor) -> Tensor:
        """The block of each slot of ``slots`` [batch, kv_heads, m]."""
        return torch.div(slots - self.offsets + self.size, self.size, rounding_mode="floor")

    def slots_of(self, blocks: Tensor) -> Tensor:
        """[batch, kv_heads, m · block_size]: the slots of ``blocks`` [batch, kv_heads, m], ascending within
        each block (may fall outside the slots in use: the caller masks them)."""
        first = (blocks - 1) * self.size + self.offsets
        within = torch.arange(self.size, device=blocks.device)
        return (first[..., None] + within).flatten(2)

    def count(self, slots: int) -> int:
        """Blocks needed to cover ``slots`` slots in every row."""
        return (slots + self.size - 1) // self.size + 1

    def build(
        self,
        keys: Tensor,
        scale: Tensor | None,
        n: int,
        real_at: Callable[[Tensor], Tensor],
        unpack: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """All bounds, from the first ``n`` slots (those in use) of the partial key store ``keys`` [batch,
        kv_heads, k, slots] (``scale`` [..., 1, slots]). ``real_at(slots)``: bool, whether each slot of
        ``slots`` [batch, kv_heads, m] holds a real token. ``unpack``: a packed store's slots as one integer
        per column (``SlotTable.unpacked``), applied to the slots read only (None: one to a column)."""
        batch, heads = keys.shape[:2]
        every = torch.arange(self.count(n), device=keys.device).expand(batch, heads, -1)
        self.refresh(every, keys, scale, n, real_at, unpack)

    def refresh(
        self,
        blocks: Tensor,
        keys: Tensor,
        scale: Tensor | None,
        n: int,
        real_at: Callable[[Tensor], Tensor],
        unpack: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """Take the bounds of ``blocks`` [batch, kv_heads, m] again from their tokens (after a store or an
        overwrite; arguments as :meth:`build`), growing the table when a block is new."""
        slots = self.slots_of(blocks)
        inside = (slots >= 0) & (slots < n)
        slots = slots.clamp(0, max(n - 1, 0))
        present = inside & real_at(slots)
        integers, scales = gather_slots(keys, scale, slots)
        if unpack is not None:
            integers = unpack(integers)
        values = dequantized(integers, scales).transpose(2, 3)  # [batch, heads, m·size, k]
        batch, heads, _, k = values.shape
        self._grow(int(blocks.max()) + 1, batch, heads, k, keys.device)
        present = present.view(batch, heads, -1, self.size, 1)
        values = values.reshape(batch, heads, -1, self.size, k)
        high = values.masked_fill(~present, -math.inf).amax(dim=3)
        low = values.masked_fill(~present, math.inf).amin(dim=3)
        filled = present.any(dim=3)  # [batch, kv_heads, m, 1]
        high, low = high.masked_fill(~filled, 0), low.masked_fill(~filled, 0)
        bounds = torch.cat([_round_outward(high, up=True), -_round_outward(low, up=False)], dim=-1)
        rows = self._rows(blocks)  # by flat row: a scatter over bfloat16 would copy the whole table
        self.bounds.view(-1, 2 * k).index_copy_(0, rows, bounds.reshape(-1, 2 * k))
        self.filled.view(-1).index_copy_(0, rows, filled.flatten())

    def extend(self, slot: int, keys: Tensor) -> None:
        """Add a real token, stored in ``slot`` of every row, whose partial keys (as values) are ``keys``
        [batch, kv_heads, 1, k]: its block's bounds widen to it (a new block starts with it alone)."""
        batch, heads, _, k = keys.shape
        blocks = self.block_of(torch.full((batch, heads, 1), slot, device=keys.device))
        self._grow(
            max((slot - offset + self.size) // self.size for offset in self.row_offsets) + 1,
            batch,
            heads,
            k,
            keys.device,
        )
        rows = self._rows(blocks)
        token = torch.cat([_round_outward(keys, up=True), -_round_outward(keys, up=False)], dim=-1)
        table, filled = self.bounds.view(-1, 2 * k), self.filled.view(-1)
        token = token.reshape(-1, 2 * k)
        old = table.index_select(0, rows)
        merged = torch.where(filled.index_select(0, rows)[:, None], torch.maximum(old, token), token)
        table.index_copy_(0, rows, merged)
        filled.index_fill_(0, rows, True)

    def _grow(self, needed: int, batch: int, heads: int, k: int, device: torch.device) -> None:
        """Room for ``needed`` blocks (doubling)."""
        if self.bounds is None:
            self.bounds = torch.zeros(batch, heads, needed, 2 * k, dtype=BOUND_DTYPE, device=device)
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

    def keep(self, columns: Tensor) -> None:
        """Keep only the partial key columns ``columns`` [kv_heads, k'] (of the k the bounds hold)."""
        k = self.bounds.shape[-1] // 2
        both = torch.cat([columns, columns + k], dim=-1)[None, :, None, :]
        self.bounds = torch.gather(self.bounds, 3, both.expand(*self.bounds.shape[:3], -1))

    def nbytes(self) -> int:
        """Device bytes of the bounds in use: those of the blocks that hold a real token."""
        if self.bounds is None:
            return 0
        return int(self.filled.sum()) * self.bounds.shape[3] * self.bounds.element_size()


def gather_slots(keys: Tensor, scale: Tensor | None, slots: Tensor) -> tuple[Tensor, Tensor | None]:
    """The partial keys [batch, kv_heads, k, m] (and scales [..., 1, m]) of ``slots`` [batch, kv_heads, m]
    from the store ``keys`` [batch, kv_heads, k, capacity] (``scale`` [..., 1, capacity]), slots last as
    the store keeps them."""
    picked = torch.gather(keys, 3, slots[:, :, None].expand(-1, -1, keys.shape[2], -1))
    return picked, None if scale is None else torch.gather(scale, 3, slots[:, :, None])


def block_scores(
    partial_query: Tensor,
    bounds: BlockBounds,
    blocks: int,
    row_columns: tuple[tuple[Tensor, Tensor], ...] = (),
) -> Tensor:
    """Per query head, the upper bound of the first ``blocks`` blocks [batch, kv_heads, group, blocks]
    (-inf: no real token): ``partial_query`` [batch, kv_heads, group, k] (scaled) against the bounds, in
    bfloat16 (a ranking of blocks, on low-precision scores). ``row_columns`` as in
    ``rehearsal.speculative_scores``: those rows bound their scores over their own columns, as alone."""
    k = partial_query.shape[-1]
    table = bounds.bounds[:, :, :blocks]
    signed = torch.cat([partial_query.clamp(min=0), (-partial_query).clamp(min=0)], dim=-1)
    signed = signed.to(BOUND_DTYPE)
    # the table on the left, as it is stored: no transposed copy of it
    scores = torch.matmul(table, signed.transpose(2, 3))  # [batch, kv_heads, blocks, group]
    for rows, own in row_columns:
        both = torch.cat([own, own + k], dim=-1)[None, :, None, :]
        q_rows = torch.gather(signed[rows], 3, both.expand(len(rows), -1, signed.shape[2], -1))
        t_rows = torch.gather(table[rows], 3, both.expand(len(rows), -1, table.shape[2], -1))
        scores[rows] = torch.matmul(t_rows, q_rows.transpose(2, 3))
    scores = scores.transpose(2, 3).float()
    return scores.masked_fill(~bounds.filled[:, :, None, :blocks], -math.inf)
