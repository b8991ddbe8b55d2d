"""Host memory in fixed-size blocks: where the KV pool (``kvpool.KVPool``) keeps what it stores.

A :class:`BlockStore` holds one :class:`BlockArena` for each (layer, part) a pool stores: its keys, its
values, and what a policy keeps beside them on their own slot axis (quantized KV's scales and minimums).
An arena is blocks of ``block_tokens`` slots of every KV head, [blocks, kv_heads, block_tokens, width],
handed out by number. A pool lists each row's blocks in a block table, so a sequence grows one block at a
time, nothing is ever regrown by copying, and its blocks go back to the store when it ends (or evicts: the
kept tokens are written to fresh blocks).

Two kinds of store:

* **bounded** (``blocks`` given): the engine's, shared by every sequence it runs. ``blocks`` comes from the
  engine's memory budget, which the arena never exceeds: the engine admits and preempts by the same count
  (``engine.blocks.BlockPool``), so a bounded arena never runs out; if it did, ``take`` raises
  :class:`OutOfBlocks` rather than allocate past the budget. Its first segment holds at least 256 blocks
  where the budget allows, so a server whose requests hold fewer keeps to one.
* **growing** (``blocks`` None): one run's own (the eval, the bench, a left-padded batch through a
  ``Driver``). Its first segment is sized by the pool's reservation (a prompt and a quarter more).

Either way an arena grows by whole segments, each as large as all before it (within the budget), allocated
as needed, never copied. A row's blocks may lie in several segments, and a gather then reads each
(``KVPool``); in the common run everything lies in the first one, and a gather is one ``index_select``.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
MIN_SEGMENT_BLOCKS = 4  # an arena's smallest segment
FIRST_BOUNDED_BLOCKS = 256  # a bounded arena's first segment, at most (its budget permitting)


class OutOfBlocks(RuntimeError):
    """A bounded arena has no free block left (the engine's count of blocks should have prevented it)."""


@dataclass(frozen=True)
class Segment:
    """One allocation of an arena: blocks ``first`` on, as [count, heads, block_tokens, width]."""

    first: int
    tensor: Tensor

    @property
    def count(self) -> int:
        return self.tensor.shape[0]

    @functools.cached_property
    def rows(self) -> Tensor:
        """The segment as rows of ``width`` values: row (b·heads + h)·block_tokens + s is slot s of head h in
        its block b, counted from the segment's first block (one view, made once)."""
        return self.tensor.view(-1, self.tensor.shape[-1])


class BlockArena:
    """The blocks of one (layer, part): segments of storage, and a free list of block numbers."""

    def __init__(
        self,
        heads: int,
        width: int,
        dtype: torch.dtype,
        block_tokens: int,
        device: torch.device,
        pin: bool,
        limit: int | None,
    ):
        self.heads, self.width, self.dtype = heads, width, dtype
        self.block_tokens = block_tokens
        self.device, self.pin, self.limit = device, pin, limit
        self.segments: tuple[Segment, ...] = ()  # replaced, never changed in place: readers keep a snapshot
        self._free: list[int] = []  # a stack: freed blocks are reused first, new ones in ascending order
        self._holders: dict[int, int] = {}  # a block held more than once (shared): how many hold it
        self.in_use = 0  # blocks handed out and not given back
        self._lock = threading.Lock()  # sequences of one engine share an arena

    @property
    def size(self) -> int:
        """Block numbers allocated in all segments (spare blocks included)."""
        return sum(segment.count for segment in self.segments)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int, reserve: int = 0) -> list[int]:
        """``count`` free block numbers, in ascending order when new. A growing arena out of blocks adds a
        segment of at least ``reserve`` blocks."""
        if count <= 0:
            return []
        with self._lock:
            if len(self._free) < count:
                self._grow(count - len(self._free), reserve)
            taken = self._free[-count:][::-1]
            del self._free[-count:]
            self.in_use += count
            return taken

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a prefix cache entry, or a sequence that starts with it): it goes
        back to the free list only when every holder has given it back."""
        with self._lock:
            self._holders[block] = self._holders.get(block, 1) + 1

    def shared(self, block: int) -> bool:
        return block in self._holders

    def give_back(self, blocks: list[int]) -> None:
        with self._lock:
            for block in reversed(blocks):
                holders = self._holders.pop(block, 1) - 1
                if holders > 1:
                    self._holders[block] = holders
                elif not holders:
                    self._free.append(block)
                    self.in_use -= 1

    def first_row(self, segment: Segment) -> int:
        """The number, over the whole arena seen as rows (``Segment.rows``), of ``segment``'s first row."""
        return segment.first * self.heads * self.block_tokens

    def block(self, number: int) -> Tensor:
        """Block ``number`` itself (a view): [heads, block_tokens, width]."""
        segment = next(s for s in reversed(self.segments) if s.first <= number)
        return segment.tensor[number - segment.first]

    def _grow(self, needed: int, reserve: int) -> None:
        size, usable = self.size, self.size - len(self.segments)  # each segment has one spare block
        blocks = max(needed, reserve, usable, MIN_SEGMENT_BLOCKS)
        if self.limit is not None:
            if needed > self.limit - usable:
                raise OutOfBlocks(f"the KV pool's {self.limit} blocks are all in use")
            blocks = min(max(blocks, FIRST_BOUNDED_BLOCKS), self.limit - usable)
        # A segment ends with a spare block it never hands out: a write that spans segments sends each
        # segment's rows that lie elsewhere there (``KVPool``), so no read is needed to split them.
        shape = (blocks + 1, self.heads, self.block_tokens, self.width)
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device, pin_memory=self.pin)
        self.segments = (*self.segments, Segment(size, tensor))
        # new blocks below the freed ones: blocks given back are reused first
        self._free[:0] = range(size + blocks - 1, size - 1, -1)


class BlockStore:
    """The arenas of one pool (growing), or of every pool of an engine (bounded by ``blocks``), by (layer,
    part, heads, width, dtype): two policies storing different things never share an arena."""

    def __init__(
        self,
        block_tokens: int = 128,
        blocks: int | None = None,
        device: torch.device | str = "cpu",
        pin: bool = False,
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        if blocks is not None and blocks < 1:
            raise ValueError(f"a bounded store needs at least one block, got {blocks}")
        self.block_tokens = block_tokens
        self.blocks = blocks
        self.device = torch.device(device)
        self.pin = pin
        self._arenas: dict[tuple, BlockArena] = {}
        self._lock = threading.Lock()

    @property
    def bounded(self) -> bool:
        return self.blocks is not None

    def arena(self, layer: int, part: str, heads: int, width: int, dtype: torch.dtype) -> BlockArena:
        key = (layer, part, heads, width, dtype)
        with self._lock:
            arena = self._arenas.get(key)
            if arena is None:
                arena = BlockArena(heads, width, dtype, self.block_tokens, self.device, self.pin, self.blocks)
                self._arenas[key] = arena
            return arena

    def blocks_in_use(self) -> int:
        """The most blocks any one arena has handed out and not had back: a sequence holds blocks in every
        arena it stores into, so this counts positions in use, in blocks."""
        return max((arena.in_use for arena in self._arenas.values()), default=0)
