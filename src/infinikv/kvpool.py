"""The host KV pool and the copies from it to the compute device.

The pool holds, per layer, named parts in host memory (pinned when the compute device is CUDA), each seen as
[batch, kv_heads, slots, width]: ``keys`` and ``values``, and whatever a policy stores beside them on its
own slot axis (quantized KV's scales and minimums). Each part is paged: its slots live in fixed-size blocks
of a :class:`~infinikv.paged.BlockStore`, listed per row (sequence) in a block table, so a part grows a
block at a time and is never regrown by copying. The store is the pool's own (growing) unless the pool
draws from a shared one (``draw_from``: the engine's, bounded by its memory budget), to which every block
goes back when the pool closes (the pool's own store goes with the pool). Policies read from the pool in
one of two ways:

* ``fetch(layer)`` copies the whole layer (full offload),
* ``fetch(layer, index)`` gathers the rows named by ``index`` ([batch, kv_heads, n] token slots) and copies
  only those (selective policies); ``parts`` names other parts and their rows, fetched in the same copy.

Both return a :class:`~infinikv.copiers.Transfer` at once; ``Transfer.wait()`` hands back the device
tensors. A slot's row in its block is found through the block table, on the device that holds the index,
so a gather needs no read back. The pool's :class:`~infinikv.copiers.Copier` decides where the copy runs (a
CUDA side stream, a CPU worker thread, or the calling thread). Every byte that crosses is counted, and so
are the bytes of copies started on demand (``on_demand``: by the layer that reads them, so nothing
overlaps them), apart.

``ahead(work, ...)`` hands a policy's look-ahead (choosing what the next layer reads, then starting its copy)
to the copier: on a CPU worker it overlaps the current layer's compute as the copy does; elsewhere it runs
at once.

On CUDA a row gather runs on the device: with unified addressing every pinned host page is mapped into the
device's address space, so an ``index_select`` kernel on the copy stream reads the chosen rows across the link
itself (zero-copy). The host neither gathers rows nor waits for the index. Where the pinned store cannot be
seen from the device, rows are gathered on the host into pinned memory and copied as one block.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .copiers import Copier, Transfer, TransferCounters, make_copier
from .paged import BlockArena, BlockStore, Segment

Tensor = torch.Tensor
KV = ("keys", "values")


def with_headroom(tokens: int) -> int:
    """Slots for ``tokens`` expected tokens and the decode steps after them: a quarter more, at least 256
    (what a pool's first segment, InfiniGen's slot tables and dense's store are first sized for)."""
    return tokens + max(tokens // 4, 256)


class _DeviceArray:
    """Hands a device pointer to ``torch.as_tensor`` through the CUDA array interface."""

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


class _Part:
    """One (layer, part) of a pool: its arena, each row's block table and the slots in use."""

    def __init__(self, arena: BlockArena, rows: int):
        self.arena = arena
        self.rows = rows
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.length = 0
        self.adopted = 0  # slots taken over in shared blocks (``KVPool.adopt``): already written
        self.may_share = False  # a block may be held elsewhere too: copy it before overwriting a slot
        # the block table as each slot's row, per device (rebuilt when the table changes)
        self._on: dict[torch.device, Tensor] = {}

    def slot_rows(self, device: torch.device) -> Tensor:
        """[rows, heads, blocks · block_tokens] on ``device``: each slot's row in the arena seen as rows of
        ``width`` values (the block table, spelt out). Immutable, so a queued copy may keep it."""
        slot_rows = self._on.get(device)
        if slot_rows is None:
            heads, size = self.arena.heads, self.arena.block_tokens
            table = torch.tensor(self.tables, dtype=torch.long, device=device).view(self.rows, -1)
            runs = table[:, None, :] * heads + torch.arange(heads, device=device).view(1, heads, 1)
            slot_rows = runs[..., None] * size + torch.arange(size, device=device)
            slot_rows = self._on[device] = slot_rows.view(self.rows, heads, -1)
        return slot_rows

    def cover(self, slots: int, reserve_tokens: int) -> None:
        """Blocks for ``slots`` slots in every row (a growing arena adds a segment for ``reserve_tokens``
        slots of every row if it must grow)."""
        size = self.arena.block_tokens
        need = -(-slots // size) - len(self.tables[0])
        if need <= 0:
            return
        reserve = self.rows * -(-max(reserve_tokens, slots) // size)
        taken = self.arena.take(need * self.rows, reserve)  # one run per row, ascending when new
        for row, table in enumerate(self.tables):
            table.extend(taken[row * need : (row + 1) * need])
        self._on = {}

    def privatize(self) -> None:
        """Give each row its own copy of every block held elsewhere too (before a slot is overwritten)."""
        for table in self.tables:
            for at, block in enumerate(table):
                if self.arena.shared(block):
                    (own,) = self.arena.take(1)
                    self.arena.block(own).copy_(self.arena.block(block))
                    self.arena.give_back([block])
                    table[at] = own
        self.may_share = False
        self._on = {}

    def adopt(self, block: int) -> None:
        """``block``, held elsewhere, as the next block of the (one) row: see ``KVPool.adopt``."""
        (table,) = self.tables
        size = self.arena.block_tokens
        if max(self.length, self.adopted) != len(table) * size:
            raise RuntimeError("a pool adopts a block only after whole blocks")
        self.arena.share(block)
        table.append(block)
        self.adopted, self.may_share, self._on = len(table) * size, True, {}

    def release(self) -> None:
        """Give every block back (``length`` stays: what was held, for the statistics); nothing adopted or
        shared is left."""
        for table in self.tables:
            self.arena.give_back(table)
        self.tables = [[] for _ in range(self.rows)]
        self.adopted, self.may_share, self._on = 0, False, {}

    def slot_bytes(self) -> int:
        """Bytes of one slot of one (row, head)."""
        return self.arena.width * self.arena.dtype.itemsize

    def nbytes(self, slots: int | None = None) -> int:
        """Bytes of ``slots`` (default: those in use) slots of every (row, head)."""
        slots = self.length if slots is None else slots
        return self.rows * self.arena.heads * slots * self.slot_bytes()


@dataclass(frozen=True)
class _Source:
    """What a copy reads of a part, as the part stood when the copy was started."""

    part: _Part
    segments: tuple[Segment, ...]  # the arena's, then
    slot_rows: Tensor  # ``_Part.slot_rows`` on the device the rows are numbered on
    length: int

    @property
    def rows(self) -> int:
        return self.part.rows

    @property
    def heads(self) -> int:
        return self.part.arena.heads

    def nbytes(self, slots: int | None = None) -> int:
        return self.part.nbytes(self.length if slots is None else slots)


def _row_numbers(source: _Source, index: Tensor, extra: int) -> Tensor:
    """Row numbers, over the arena's blocks seen as rows of ``width`` values, of the slots in ``index``
    [rows, heads, n], plus ``extra`` spare rows per (row, head) that point at slot 0 (the caller overwrites
    them). A slot past the table's blocks (a hidden entry) reads the last one's row."""
    slot_rows = source.slot_rows
    numbers = slot_rows.gather(2, index.to(slot_rows.device).clamp(max=slot_rows.shape[2] - 1))
    return _with_spares(numbers, slot_rows, extra)


def _numbered(numbered: dict, source: _Source, index: Tensor, extra: int) -> Tensor:
    """``_row_numbers``, kept in ``numbered`` per (index, slot map): K and V that share their slot map
    (``KVPool._sources``) share their row numbers."""
    key = (id(index), id(source.slot_rows))
    if key not in numbered:
        numbered[key] = _row_numbers(source, index, extra)
    return numbered[key]


def _with_spares(numbers: Tensor, slot_rows: Tensor, extra: int) -> Tensor:
    """``numbers`` [rows, heads, n] and ``extra`` more per (row, head) pointing at slot 0, flattened."""
    if extra:
        numbers = torch.cat([numbers, slot_rows[:, :, :1].expand(-1, -1, extra)], dim=2)
    return numbers.reshape(-1)


def _index_select(rows: Tensor, numbers: Tensor) -> Tensor:
    """Rows ``numbers`` of ``rows``, in host memory."""
    return rows.index_select(0, numbers)


def _read(source: _Source, numbers: Tensor, gather: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Rows ``numbers`` of the arena, [len(numbers), width], read from each segment by ``gather(segment as
    rows, numbers within it)`` and merged where they spread over several."""
    if len(source.segments) == 1:  # the first segment: numbers are within it
        return gather(source.segments[0].rows, numbers)
    out = None
    for segment in source.segments:
        flat = segment.rows
        local = numbers - source.part.arena.first_row(segment)
        got = gather(flat, local.clamp(0, flat.shape[0] - 1))
        if out is None:
            out = got
        else:
            inside = ((local >= 0) & (local < flat.shape[0])).to(got.device)
            out = torch.where(inside[:, None], got, out)
    return out


def _scatter(arena: BlockArena, rows: Tensor, new: Tensor) -> None:
    """Write ``new`` [len(rows), width] to the arena's rows ``rows`` (host numbers); where the arena has
    several segments, each segment's copy sends the rows of the others to its spare block."""
    if new.device != arena.device:
        new = new.to(arena.device)
    if len(arena.segments) == 1:  # the first segment: the numbers are its own
        arena.segments[0].rows.index_copy_(0, rows, new)
        return
    for segment in arena.segments:
        flat = segment.rows
        local = rows - arena.first_row(segment)
        local = torch.where((local >= 0) & (local < flat.shape[0]), local, flat.shape[0] - 1)
        flat.index_copy_(0, local, new)


def _whole(
    source: _Source, extra: int, gather: Callable[[Tensor, Tensor], Tensor], device: torch.device
) -> Tensor:
    """Every slot in use of every (row, head), plus ``extra`` spare slots after them: [rows, heads, length +
    extra, width], in one gather of rows (one copy, as contiguous as attention wants it)."""
    shape = (source.rows, source.heads, source.length + extra, source.part.arena.width)
    slot_rows = source.slot_rows
    if slot_rows.shape[2] == 0:
        return torch.empty(shape, dtype=source.part.arena.dtype, device=device)
    return _read(source, _with_spares(slot_rows[:, :, : source.length], slot_rows, extra), gather).view(shape)


class KVPool:
    """Per-layer named parts of one batch in host memory (``keys``, ``values`` and any side tensors a
    policy stores on its own slot axis), paged in blocks, with counted copies to the compute device.

    Slots are token positions unless a policy rewrites slots in place (eviction), in which case it keeps its
    own map.
    """

    def __init__(
        self, num_layers: int, compute_device: torch.device, overlap: str = "thread", block_tokens: int = 128
    ):
        self.num_layers = num_layers
        self.compute_device = torch.device(compute_device)
        self.on_cuda = self.compute_device.type == "cuda"
        # the pool's own store, until it draws from a shared one
        self.blocks = BlockStore(block_tokens, pin=self.on_cuda)
        self._parts: list[dict[str, _Part]] = [{} for _ in range(num_layers)]
        self._reserve_tokens = 0
        self.rows = 0  # sequences in the batch (known at the first append)
        self.counters = TransferCounters()
        self._copied_when_sized = 0  # counters.bytes_h2d at the last size_step
        self.copier: Copier = make_copier(self.compute_device, self.counters, overlap)
        self.device_gather = self.on_cuda  # cleared if the pinned store is not device-visible
        self._demand = threading.local()  # .active: fetches now are on demand (``on_demand``)
        self._counting = threading.Lock()

    # -- storage ------------------------------------------------------------------------------------------
    def draw_from(self, blocks: BlockStore) -> None:
        """Take blocks from ``blocks`` (a store shared with other pools) instead of the pool's own; before
        anything is stored."""
        if any(self._parts):
            raise RuntimeError("a pool draws from another block store only before it stores anything")
        self.blocks = blocks

    def reserve(self, tokens: int) -> None:
        """Expect about ``tokens`` slots per row: a growing store's first segment holds them and a quarter
        more, so that one run's blocks lie in one segment (a hint; nothing is allocated now)."""
        self._reserve_tokens = with_headroom(tokens)

    def length(self, layer: int, name: str = "keys") -> int:
        """Slots ``layer``'s part ``name`` holds."""
        part = self._parts[layer].get(name)
        return 0 if part is None else part.length

    def slot_bytes(self, layer: int, name: str = "keys") -> int:
        """Bytes of one slot of one (row, KV head) of ``layer``'s part ``name``."""
        return self._parts[layer][name].slot_bytes()

    def stored(self, layer: int, name: str) -> Tensor:
        """A copy of the live slots of ``layer``'s part ``name``, in host memory: [batch, kv_heads, length,
        width]."""
        return _whole(self._source(layer, name, torch.device("cpu")), 0, _index_select, torch.device("cpu"))

    def keys(self, layer: int) -> Tensor:
        return self.stored(layer, "keys")

    def values(self, layer: int) -> Tensor:
        return self.stored(layer, "values")

    def _part(self, layer: int, name: str, like: Tensor) -> _Part:
        part = self._parts[layer].get(name)
        if part is None:
            rows, heads, _, width = like.shape
            self.rows = rows
            arena = self.blocks.arena(layer, name, heads, width, like.dtype)
            part = self._parts[layer][name] = _Part(arena, rows)
        return part

    def append(self, layer: int, k: Tensor, v: Tensor, **side: Tensor) -> None:
        """Write new tokens' K/V ([batch, kv_heads, q, head_dim], on the compute device) into the pool, and
        any ``side`` tensors ([batch, kv_heads, q', width]) beside them, each on its own slot axis."""
        for name, new in {"keys": k, "values": v, **side}.items():
            part = self._part(layer, name, new)
            n, q = part.length, new.shape[2]
            part.cover(n + q, self._reserve_tokens)
            written = max(part.adopted - n, 0)  # slots of adopted blocks hold these tokens already
            if written < q:
                unwritten = new[:, :, written:] if written else new
                self._write(part, n + written, unwritten)
                self.counters.bytes_d2h += unwritten.numel() * unwritten.element_size()
            part.length = n + q

    @staticmethod
    def append_rows(pools: list[KVPool], layer: int, k: list[Tensor], v: list[Tensor]) -> None:
        """``pools[r].append(layer, k[r], v[r])``, one new token each ([rows, kv_heads, 1, head_dim]): the
        tokens of pools that share an arena (those of an engine step, which draw from one store) in one copy
        per part."""
        for name, new in (("keys", k), ("values", v)):
            by_arena: dict[int, list[tuple[KVPool, _Part, Tensor]]] = {}
            for pool, token in zip(pools, new, strict=True):
                part = pool._part(layer, name, token)
                part.cover(part.length + 1, pool._reserve_tokens)
                if part.adopted > part.length:  # an adopted block holds it already
                    part.length += 1
                    continue
                by_arena.setdefault(id(part.arena), []).append((pool, part, token))
            for writes in by_arena.values():
                arena = writes[0][1].arena
                rows = torch.cat(
                    [part.slot_rows(arena.device)[:, :, part.length].reshape(-1) for _, part, _ in writes]
                )
                tokens = torch.cat([token for _, _, token in writes])
                _scatter(arena, rows, tokens.reshape(rows.shape[0], -1))
                for pool, part, token in writes:
                    part.length += 1
                    pool.counters.bytes_d2h += token.numel() * token.element_size()

    @staticmethod
    def _write(part: _Part, start: int, new: Tensor) -> None:
        """``new`` [rows, heads, q, width] into slots start..start+q-1 of every row: a decode step's one
        token in one copy of every row's, a prompt chunk in a copy per block."""
        size, q = part.arena.block_tokens, new.shape[2]
        if q == 1:
            rows = part.slot_rows(part.arena.device)[:, :, start].reshape(-1)
            _scatter(part.arena, rows, new.reshape(rows.shape[0], -1))
            return
        for row, table in enumerate(part.tables):  # a prompt chunk: a copy per block
            at = start
            while at < start + q:
                block, offset = table[at // size], at % size
                count = min(size - offset, start + q - at)
                target = part.arena.block(block)[:, offset : offset + count]
                target.copy_(new[row, :, at - start : at - start + count])
                at += count

    def share(self, layer: int, name: str, index: int) -> int:
        """Block ``index`` of ``layer``'s part ``name`` (one row), held once more by the caller (the engine's
        prefix cache), which gives it back to the store when done; returns its number."""
        part = self._parts[layer][name]
        (table,) = part.tables
        part.arena.share(table[index])
        part.may_share = True
        return table[index]

    def arena(self, layer: int, name: str) -> BlockArena:
        """Where ``layer``'s part ``name`` keeps its blocks."""
        return self._parts[layer][name].arena

    def adopt(self, layer: int, name: str, arena: BlockArena, block: int) -> None:
        """Take block ``block`` of ``arena`` (held elsewhere, in this pool's store) as the next block of
        ``layer``'s part ``name`` (one row, whole blocks so far), without copying: the tokens it holds are
        stored already, and appending them (the prefill's calls, replayed) writes nothing."""
        part = self._part(layer, name, arena.block(block)[None])
        if part.arena is not arena:
            raise RuntimeError(f"layer {layer}'s {name} are kept in another arena than the block's")
        part.adopt(block)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append a prompt chunk and return the layer's whole K/V on the device (prefill attention is dense:
        the chunk attends to everything stored before it, which is fetched, and to itself). A chunk that
        adopted blocks hold already is a prefix-cache hit replayed (``adopt``), whose attention is not
        computed: it gets itself alone, and nothing is fetched."""
        keys = self._parts[layer].get("keys")
        if self.length(layer) == 0 or (keys is not None and keys.length + k.shape[2] <= keys.adopted):
            self.append(layer, k, v)
            return k, v
        before = self.counters.bytes_h2d
        past_k, past_v = self.fetch(layer).wait()
        self._copied_when_sized += self.counters.bytes_h2d - before  # a prompt's copy does not size a step
        self.append(layer, k, v)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def write_slots(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Overwrite one slot per (batch, head) with a new token's K/V (eviction). slots: [batch, heads]."""
        for name in KV:
            if self._parts[layer][name].may_share:
                self._parts[layer][name].privatize()
        index, numbered = slots.to("cpu")[:, :, None], {}
        for source, new in zip(self._sources(layer, KV, torch.device("cpu")).values(), (k, v), strict=True):
            rows = _numbered(numbered, source, index, 0)
            _scatter(source.part.arena, rows, new.reshape(rows.shape[0], -1))
        self.counters.bytes_d2h += 2 * k.numel() * k.element_size()

    def keep(self, layer: int, index: Tensor) -> None:
        """Evict every slot of a layer's K/V but those in ``index`` ([batch, heads, m]), which become slots
        0..m-1, in fresh blocks. Done in host memory: nothing crosses to the compute device."""
        kept, index, numbered = {}, index.to("cpu"), {}
        for name, source in self._sources(layer, KV, torch.device("cpu")).items():
            rows = _numbered(numbered, source, index, 0)
            kept[name] = _read(source, rows, _index_select).view(*index.shape, source.part.arena.width)
        self.copier.drain()  # no queued copy may read a block once it is handed out again
        self.copier.settle()
        for name, tensor in kept.items():
            part = self._parts[layer][name]
            part.release()
            part.cover(tensor.shape[2], 0)
            self._write(part, 0, tensor)
            part.length = tensor.shape[2]

    def nbytes(self) -> int:
        """Bytes held (live slots of every part only, not the rest of their blocks)."""
        return sum(part.nbytes() for parts in self._parts for part in parts.values())

    def _sources(self, layer: int, names: Iterable[str], device: torch.device) -> dict[str, _Source]:
        """``_source`` of each part named; parts stored in step (K and V) have equal tables and share one
        slot map, so their row numbers are computed once (``_numbered``)."""
        sources: dict[str, _Source] = {}
        for name in names:
            source = self._source(layer, name, device)
            twin = next((s for s in sources.values() if s.part.tables == source.part.tables), None)
            if twin is not None:  # share the twin's slot map
                source = _Source(
                    part=source.part, segments=source.segments, slot_rows=twin.slot_rows, length=source.length
                )
            sources[name] = source
        return sources

    def _source(self, layer: int, name: str, device: torch.device) -> _Source:
        part = self._parts[layer][name]
        return _Source(part, part.arena.segments, part.slot_rows(device), part.length)

    # -- copies to the compute device ----------------------------------------------------------------------
    @staticmethod
    def size_step(pools: list[KVPool]) -> None:
        """Tell the copier of each of a decode step's ``pools`` (its rows', one or an engine step's) what
        they copied together per layer since the step before was sized, prompt chunks' copies left out
        (``Copier.size_step``: where the step's copies and look-aheads run; a first step: at once)."""
        totals = [pool.counters.bytes_h2d for pool in pools]  # read once: a worker may still be counting
        copied = sum(total - pool._copied_when_sized for pool, total in zip(pools, totals, strict=True))
        for pool, total in zip(pools, totals, strict=True):
            pool.copier.size_step(copied // pool.num_layers)
            pool._copied_when_sized = total

    def ahead(self, work: Callable[..., object], *args: object) -> Transfer:
        """Hand ``work(*args)``, a look-ahead that chooses what the next layer reads and starts its copy, to
        the copier (``Copier.ahead``). ``wait()`` returns its result."""
        return self.copier.ahead(work, *args)

    def drain(self) -> None:
        """Wait until every copy and look-ahead started so far has run (their counters are then complete: a
        prefetch for the next step may still be queued when a step ends)."""
        self.copier.drain()

    @contextmanager
    def on_demand(self) -> Iterator[None]:
        """Count the fetches started inside as on demand: the layer that reads them waits for them, nothing
        runs beside them (``counters.bytes_on_demand``). Per thread."""
        self._demand.active = True
        try:
            yield
        finally:
            self._demand.active = False

    def fetch(
        self,
        layer: int,
        index: Tensor | None = None,
        extra: int = 0,
        now: bool = False,
        parts: Mapping[str, Tensor | None] | None = None,
    ) -> Transfer:
        """Start copying a layer's K/V (all of it, or the slots in ``index`` [batch, heads, n]) to the device.

        ``parts`` instead names the parts to copy, each with its own slots (None: all of them); ``wait()``
        returns them in that order (by default keys, then values). ``extra`` > 0 leaves that many
        uninitialised slots after the copied ones, for the caller to fill with the new token's K/V: one copy
        into a buffer of the final size instead of copy + concatenate. ``now``: the calling thread makes the
        copy (a look-ahead on a worker that reads the copy itself would otherwise wait for a copy queued
        behind it).
        """
        parts = dict.fromkeys(KV, index) if parts is None else dict(parts)
        if not self.device_gather:  # one host copy per distinct index (K and V share theirs)
            on_host = {id(rows): rows.to("cpu") for rows in parts.values() if rows is not None}
            parts = {name: None if rows is None else on_host[id(rows)] for name, rows in parts.items()}
        numbering = self.compute_device if self.device_gather else torch.device("cpu")
        sources = self._sources(layer, parts, numbering)
        on_demand = getattr(self._demand, "active", False)
        if on_demand:
            self.counters.bytes_on_demand += self._parts_bytes(sources, parts)
        job = functools.partial(self._copy, sources, parts, extra)
        # A copy on demand is waited for at once: handing it to a worker would only add the hand-off. The
        # index and the slot map stay alive until the copy that reads them is waited for.
        return self.copier.copy(job, queue=not (on_demand or now), keep=(parts, sources))

    @staticmethod
    def _parts_bytes(
        sources: Mapping[str, _Source],
        parts: Mapping[str, Tensor | None],
        names: tuple[str, ...] | None = None,
    ) -> int:
        """Bytes copied for ``parts`` (those in ``names``, if given)."""
        return sum(
            sources[name].nbytes(None if rows is None else rows.shape[2])
            for name, rows in parts.items()
            if names is None or name in names
        )

    def _copy(
        self, sources: Mapping[str, _Source], parts: Mapping[str, Tensor | None], extra: int
    ) -> tuple[Tensor, ...]:
        out, numbered = [], {}
        for name, rows in parts.items():
            source = sources[name]
            if rows is None:
                out.append(_whole(source, extra, self._gather_segment, self.compute_device))
                continue
            shape = (source.rows, source.heads, rows.shape[2] + extra, source.part.arena.width)
            out.append(
                _read(source, _numbered(numbered, source, rows, extra), self._gather_segment).view(shape)
            )
        copied = self._parts_bytes(sources, parts)
        with self._counting:  # the worker and a thread that took a queued copy over may both count
            self.counters.bytes_h2d += copied
            self.counters.peak_bytes = max(self.counters.peak_bytes, self._parts_bytes(sources, parts, KV))
            self.counters.copies += 1
        return tuple(out)

    def _gather_segment(self, flat: Tensor, rows: Tensor) -> Tensor:
        """Whole rows of ``flat`` (one segment) on the compute device, copied by index_select (a per-element
        gather is an order of magnitude slower); on CUDA by a kernel reading the pinned store (module
        docstring), else into pinned memory on the host, then one asynchronous copy to the device."""
        if not self.on_cuda:
            return flat.index_select(0, rows)
        if self.device_gather:
            mapped = self._device_view(flat)
            if mapped is not None:
                if not rows.is_cuda:  # a pinned source keeps the copy asynchronous
                    rows = rows.pin_memory().to(self.compute_device, non_blocking=True)
                return mapped.index_select(0, rows).view(flat.dtype)
        rows = rows.to("cpu")
        staged = torch.empty((rows.numel(), flat.shape[1]), dtype=flat.dtype, pin_memory=True)
        torch.index_select(flat, 0, rows, out=staged)
        return staged.to(self.compute_device, non_blocking=True)

    def _device_view(self, flat: Tensor) -> Tensor | None:
        """``flat`` (a pinned host tensor) as a CUDA tensor over the same memory, as integers of its element
        size (bfloat16 has no array-interface type code); None, and host gathers from then on, if the device
        cannot address it."""
        size = flat.element_size()
        as_int = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
        interface = {
            "shape": tuple(as_int.shape),
            "typestr": f"<i{size}",
            "data": (as_int.data_ptr(), False),
            "version": 3,
            "strides": None,
        }
        try:
            mapped = torch.as_tensor(_DeviceArray(interface), device=self.compute_device)
        except (RuntimeError, TypeError, ValueError) as error:
            self.device_gather = False
            warnings.warn(
                f"pinned K/V pool not addressable from the device ({error}); gathering on the host",
                stacklevel=2,
            )
            return None
        return mapped

    def close(self) -> None:
        """Stop the copier (no copy may still read a block once it is handed out again) and give every
        block back to a shared store. The pool's own store goes with the pool, so until then what it holds
        can still be read (statistics and inspection after a run)."""
        self.copier.close()
        if self.blocks.bounded:
            for parts in self._parts:
                for part in parts.values():
                    part.release()
