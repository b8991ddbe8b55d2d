"""What each slot of InfiniGen's host pool holds, per layer.

With a capacity below the tokens seen, the pool overwrites slots in place (eviction), so a slot is not a
position: the table keeps, per (sequence, KV head) and slot, the token position (mask column) it holds,
how often and when it was last fetched (for the ``counter`` and ``lru`` eviction rules, where a full pool
evicts by them: ``tracks_use``), and, for layers the
policy rehearses, the token's partial skewed key (4-bit ones packed two columns to a byte: readers take
them through :meth:`SlotTable.unpacked`) and, under block speculation, the bounds of their blocks
(``policies.bounds.BlockBounds``, bfloat16 rounded outward), which the table keeps up to date as slots are
stored, overwritten and moved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kvpool import with_headroom
from ..bounds import BlockBounds, SlotsTo
from .blocks import BOUND_DTYPE, partial_values
from .rehearsal import dequantized

Tensor = torch.Tensor
RealAt = Callable[[Tensor], Tensor]  # slots [batch, kv_heads, m] -> bool: each holds a real token


def pack_nibbles(integers: Tensor) -> Tensor:
    """4-bit integers ``integers`` [..., k] (int8 within -8..7, as ``rehearsal.quantize`` gives them) two to
    a byte: int8 [..., ⌈k/2⌉], byte i holding column i in its low nibble and column ⌈k/2⌉ + i in its high
    one, both two's complement (an odd k is padded with a zero column). Halves rather than neighbours, so
    that :func:`unpack_nibbles` is two shifts and a concatenation."""
    if integers.shape[-1] % 2:
        integers = torch.nn.functional.pad(integers, (0, 1))
    half = integers.shape[-1] // 2
    return (integers[..., :half] & 15) | (integers[..., half:] << 4)


def unpack_nibbles(packed: Tensor, columns: int) -> Tensor:
    """The int8 integers [..., columns, slots] of a store of :func:`pack_nibbles`' bytes kept slots last,
    ``packed`` [..., ⌈columns/2⌉, slots] (arithmetic shifts restore each nibble's sign)."""
    return torch.cat(((packed << 4) >> 4, packed >> 4), dim=-2)[..., :columns, :]


class SlotTable:
    """Per layer: what each pool slot holds (position; fetch count and last use where a full pool evicts by
    them, ``tracks_use``) and its partial key."""

    def __init__(self, packed: bool = False, tracks_use: bool = True):
        self.n = 0
        # keep fetch counts and last uses (False where nothing evicts by them: they stay None)
        self.tracks_use = tracks_use
        # 4-bit partial keys: stored packed (``partial`` then holds ⌈columns/2⌉ rows), ``columns`` of them
        self.packed = packed
        self.columns = 0
        self.pos: Tensor | None = None  # [batch, kv_heads, cap] mask column of the token in each slot
        self.fetches: Tensor | None = None  # [batch, kv_heads, cap] times the slot was fetched
        self.last: Tensor | None = None  # [batch, kv_heads, cap] step of the last fetch or store
        # [batch, kv_heads, k, cap] partial skewed keys of managed layers, slots last: the rehearsal's
        # q̂ · K̃ᵀ is then a plain matmul over a strided view, with no copy of the slots in use (on a CPU,
        # faster than the same product over keys stored a token's columns together)
        self.partial: Tensor | None = None
        self.scale: Tensor | None = None  # [batch, kv_heads, 1, cap] per-token scales of quantized keys
        self.bounds: BlockBounds | None = None  # of managed layers under block speculation
        self.expected = 0  # slots a row is expected to reach (``reserve``): the tables' first size

    def reserve(self, tokens: int) -> None:
        """Expect about ``tokens`` tokens per row: the tables are first made for them and as many again as
        a quarter of them (at least 256) for the decode steps, so a prompt's last chunk or the first decode
        step does not copy them into larger ones (a hint, as ``KVPool.reserve``)."""
        self.expected = with_headroom(tokens)

    def view(self, name: str) -> Tensor:
        return getattr(self, name)[..., : self.n]

    def append(self, pos: Tensor, partial: Tensor | None, step: int, scale: Tensor | None = None) -> None:
        """Add tokens at ``pos`` [batch, kv_heads, q] with their partial keys [batch, kv_heads, q, k] (and
        scales [batch, kv_heads, q, 1] when quantized)."""
        partial = self._packed(partial)
        q = pos.shape[2]
        if self.pos is None or self.pos.shape[2] < self.n + q:
            self._grow(pos, partial, scale, max(self.n + q, 2 * self.n, 256, self.expected))
        end = self.n + q
        self.pos[:, :, self.n : end] = pos
        self._put(slice(self.n, end), partial, step, scale)
        self.n = end

    def store(self, pos: int, partial: Tensor | None, step: int, scale: Tensor | None = None) -> None:
        """Add a decode step's token at position ``pos`` to every (sequence, KV head), as :meth:`append`
        would (in fewer operations: a step stores one in every layer), and its block's bounds widen to
        it."""
        stored = self._packed(partial)
        if self.pos.shape[2] <= self.n:
            self._grow(self.pos, stored, scale, max(self.n + 1, 2 * self.n, 256, self.expected))
        self.pos[:, :, self.n].fill_(pos)
        self._put(self.n, stored, step, scale)
        self.n += 1
        if self.bounds is not None and self.bounds.size > 1:
            self.bounds.extend(self.n - 1, dequantized(partial, scale))

    def _put(self, at: int | slice, partial: Tensor | None, step: int, scale: Tensor | None) -> None:
        """The use counts, partial keys ([batch, kv_heads, q, k], as stored) and scales of new tokens, in
        slots ``at`` (one slot: its q is 1)."""
        one = isinstance(at, int)
        if self.tracks_use:
            self.fetches[:, :, at] = 0
            self.last[:, :, at] = step
        if partial is not None:
            self.partial[..., at] = partial[:, :, 0] if one else partial.transpose(2, 3)
        if scale is not None:
            self.scale[..., at] = scale[:, :, 0] if one else scale.transpose(2, 3)

    def write(
        self,
        slots: Tensor,
        pos: int,
        partial: Tensor | None,
        step: int,
        scale: Tensor | None = None,
        real_at: RealAt | None = None,
    ) -> None:
        """Overwrite slot ``slots[b, h]`` of every (sequence, KV head) with a new token; the bounds of the
        blocks written to are taken again (``real_at``: which slots hold a real token)."""
        partial = self._packed(partial)
        index = slots[..., None]
        self.pos.scatter_(2, index, torch.full_like(index, pos))
        if self.tracks_use:
            self.fetches.scatter_(2, index, torch.zeros_like(index))
            self.last.scatter_(2, index, torch.full_like(index, step))
        if partial is not None:
            columns = index[:, :, None].expand(-1, -1, partial.shape[-1], 1)
            self.partial.scatter_(3, columns, partial.transpose(2, 3))
        if scale is not None:
            self.scale.scatter_(3, index[:, :, None], scale.transpose(2, 3))
        if self.bounds is not None and self.bounds.size > 1:
            self.bounds.refresh(self.bounds.block_of(index), self.n, self._values(), real_at)

    def bound_chunk(
        self, start: int, count: int, block_size: int, padding: list[int], real_at: RealAt
    ) -> None:
        """Block speculation: the bounds of the blocks a prompt chunk's slots ``start``.. fall in, taken as
        the chunk arrives (so the first decode step does not pay for the whole prompt's); ``padding``: each
        row's left padding so far, where its blocks start."""
        if self.bounds is None:
            self.bounds = self._new_bounds(block_size, padding)
        self.bounds.align(padding)
        ends = self.bounds.block_of(torch.tensor([start, start + count - 1], device=self.pos.device))
        touched = torch.arange(int(ends.min()), int(ends.max()) + 1, device=self.pos.device)
        touched = touched.expand(*self.pos.shape[:2], -1)
        self.bounds.refresh(touched, self.n, self._values(), real_at)

    def block_bounds(self, block_size: int, padding: list[int], real_at: RealAt) -> BlockBounds:
        """The bounds of the slots' blocks, taken from the partial keys on first use (and after
        :meth:`keep` moved the slots)."""
        if self.bounds is None:
            self.bounds = self._new_bounds(block_size, padding)
            if block_size > 1:
                self.bounds.build(self.n, self._values(), real_at, *self.pos.shape[:2])
        return self.bounds

    def keep(self, index: Tensor) -> None:
        for name in ("pos", "fetches", "last") if self.tracks_use else ("pos",):
            setattr(self, name, torch.gather(self.view(name), 2, index))
        for name in ("partial", "scale"):
            table = getattr(self, name)
            if table is not None:
                columns = index[:, :, None].expand(-1, -1, table.shape[2], -1)
                setattr(self, name, torch.gather(self.view(name), 3, columns))
        self.n = index.shape[2]
        self.bounds = None  # slots moved: the bounds are taken again
        self.expected = 0  # the prompt is cut: its reservation no longer sizes the tables

    def count_use(self, index: Tensor | None, step: int) -> None:
        """For eviction, each slot read at decode step ``step`` (``index``; None: every slot): its fetch
        count and last use. A narrower row's padding repeats a slot it reads. Nothing to count where the
        pool never evicts by them (``tracks_use``)."""
        if not self.tracks_use:
            return
        if index is None:
            self.view("fetches").add_(1)
            self.view("last").fill_(step)
            return
        self.fetches.scatter_add_(2, index, torch.ones_like(index))
        self.last.scatter_(2, index, torch.full_like(index, step))

    def form(self) -> tuple:
        """How the partial keys are stored (their columns, 4-bit packing, dtype, scales): tables of one form
        are scored in one product (``selector.choose_together``)."""
        columns = self.columns if self.packed else self.partial.shape[2]
        return columns, self.packed, self.partial.dtype, self.scale is None

    def unpacked(self, keys: Tensor) -> Tensor:
        """``keys`` (the partial key table, a view of it or slots gathered from it) with one integer per
        column: 4-bit ones unpacked, the others as they are."""
        return unpack_nibbles(keys, self.columns) if self.packed else keys

    def keep_columns(self, kept: Tensor) -> None:
        """Keep only the partial key columns ``kept`` [kv_heads, k'] (positions among the stored ones)."""
        table = self.unpacked(self.partial)
        table = torch.gather(table, 2, kept[None, :, :, None].expand(table.shape[0], -1, -1, table.shape[3]))
        self.columns = kept.shape[1]
        if self.packed:
            table = pack_nibbles(table.transpose(2, 3)).transpose(2, 3).contiguous()
        self.partial = table
        if self.bounds is not None and self.bounds.bounds is not None:
            self.bounds.keep(kept)

    def nbytes(self) -> int:
        """Device bytes of the partial keys (and their scales) in use, and of their block bounds."""
        tables = [self.view(name) for name in ("partial", "scale") if getattr(self, name) is not None]
        held = sum(table.numel() * table.element_size() for table in tables)
        return held + (0 if self.bounds is None else self.bounds.nbytes())

    def _new_bounds(self, block_size: int, padding: list[int]) -> BlockBounds:
        """InfiniGen's block bounds: bfloat16, rounded outward (a ranking on low-precision bounds)."""
        return BlockBounds(block_size, padding, self.pos.device, dtype=BOUND_DTYPE, outward=True)

    def _values(self) -> SlotsTo:
        """What the bounds read of the slots: their partial keys as values (``blocks.partial_values``)."""
        return partial_values(self.partial, self.scale, self.unpacked)

    def _packed(self, partial: Tensor | None) -> Tensor | None:
        """New tokens' partial keys [batch, kv_heads, q, k] as the table stores them."""
        if partial is None or not self.packed:
            return partial
        self.columns = partial.shape[-1]
        return pack_nibbles(partial)

    def _grow(self, pos: Tensor, partial: Tensor | None, scale: Tensor | None, cap: int) -> None:
        batch, heads = pos.shape[:2]

        def grown(old: Tensor | None, like: Tensor, *rows: int) -> Tensor:
            new = like.new_zeros(batch, heads, *rows, cap)
            if old is not None:
                new[..., : self.n] = old[..., : self.n]
            return new

        self.pos = grown(self.pos, pos)
        if self.tracks_use:
            self.fetches = grown(self.fetches, pos)
            self.last = grown(self.last, pos)
        if partial is not None:
            self.partial = grown(self.partial, partial, partial.shape[-1])
        if scale is not None:
            self.scale = grown(self.scale, scale, 1)
