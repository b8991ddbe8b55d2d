"""The host KV pool and the copies from it to the compute device.

The pool holds, per layer, named tensors in host memory (pinned when the compute device is CUDA), each
shaped [batch, kv_heads, slots, width]: ``keys`` and ``values``, and whatever a policy stores beside them on
its own slot axis (quantized KV's scales and minimums). Policies read from it in one of two ways:

* ``fetch(layer)`` copies the whole layer (full offload),
* ``fetch(layer, index)`` gathers the rows named by ``index`` ([batch, kv_heads, n] token slots) and copies
  only those (selective policies); ``parts`` names other tensors and their rows, fetched in the same copy.

Both return a :class:`~infinikv.copiers.Transfer` at once; ``Transfer.wait()`` hands back the device
tensors. The pool's :class:`~infinikv.copiers.Copier` decides where the copy runs (a CUDA side stream, a CPU
worker thread, or the calling thread). Every byte that crosses is counted, and so are the bytes of copies
started on demand (``on_demand``: by the layer that reads them, so nothing overlaps them), apart.

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from .copiers import Copier, Transfer, TransferCounters, make_copier

Tensor = torch.Tensor
KV = ("keys", "values")


class _DeviceArray:
    """Hands a device pointer to ``torch.as_tensor`` through the CUDA array interface."""

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


def _copy_bytes(store: Tensor, tokens: int) -> int:
    """Bytes copied for ``tokens`` slots of every (sequence, head) of ``store``."""
    batch, heads, _, width = store.shape
    return batch * heads * tokens * width * store.element_size()


class KVPool:
    """Per-layer named tensors of one batch in host memory (``keys``, ``values`` and any side tensors a
    policy stores on its own slot axis), with counted copies to the compute device.

    Each tensor grows by a quarter, so appending one token per step is amortised O(1). Slots are token
    positions unless a policy rewrites slots in place (eviction), in which case it keeps its own map.
    """

    def __init__(
        self, num_layers: int, compute_device: torch.device, host: bool = True, overlap: str = "thread"
    ):
        self.num_layers = num_layers
        self.compute_device = torch.device(compute_device)
        self.on_cuda = self.compute_device.type == "cuda"
        # host=False keeps the store on the compute device (dense): nothing crosses, nothing is counted.
        self.host = host
        self.storage = torch.device("cpu") if host else self.compute_device
        self._stores: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
        self._lengths: list[dict[str, int]] = [{} for _ in range(num_layers)]
        self.counters = TransferCounters()
        self.copier: Copier = make_copier(
            self.compute_device if host else torch.device("cpu"), self.counters, overlap if host else "none"
        )
        self.device_gather = self.on_cuda and self.host  # cleared if the pinned store is not device-visible
        self._demand = threading.local()  # .active: fetches now are on demand (``on_demand``)
        self._counting = threading.Lock()

    # -- storage ------------------------------------------------------------------------------------------
    def length(self, layer: int, name: str = "keys") -> int:
        """Slots ``layer``'s tensor ``name`` holds."""
        return self._lengths[layer].get(name, 0)

    def capacity(self, layer: int) -> int:
        """Slots ``layer``'s keys hold before they grow (0 before its first append)."""
        stored = self._stores[layer].get("keys")
        return 0 if stored is None else stored.shape[2]

    def stored(self, layer: int, name: str) -> Tensor:
        """The live slots of ``layer``'s tensor ``name``: [batch, kv_heads, length, width]."""
        return self._stores[layer][name][:, :, : self.length(layer, name)]

    def keys(self, layer: int) -> Tensor:
        return self.stored(layer, "keys")

    def values(self, layer: int) -> Tensor:
        return self.stored(layer, "values")

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        pin = self.host and self.on_cuda
        return torch.empty(shape, dtype=dtype, device=self.storage, pin_memory=pin)

    def _reserve(self, layer: int, name: str, like: Tensor, needed: int) -> None:
        stored = self._stores[layer].get(name)
        if stored is not None and stored.shape[2] >= needed:
            return
        # Grow by a quarter: amortised O(1) appends without doubling a long prompt's memory.
        current = stored.shape[2] if stored is not None else 0
        capacity = max(needed, current + max(current // 4, 256))
        batch, heads, _, width = like.shape
        if self.host and self.on_cuda:  # pinned blocks come in powers of two bytes: use the whole block
            row = batch * heads * width * like.element_size()
            capacity = (1 << (capacity * row - 1).bit_length()) // row
        grown = self._alloc((batch, heads, capacity, width), like.dtype)
        self.copier.settle()
        if stored is not None:
            n = self.length(layer, name)
            grown[:, :, :n].copy_(stored[:, :, :n])
        self._stores[layer][name] = grown

    def append(self, layer: int, k: Tensor, v: Tensor, **side: Tensor) -> None:
        """Write new tokens' K/V ([batch, kv_heads, q, head_dim], on the compute device) into the pool, and
        any ``side`` tensors ([batch, kv_heads, q', width]) beside them, each on its own slot axis."""
        for name, new in {"keys": k, "values": v, **side}.items():
            n, q = self.length(layer, name), new.shape[2]
            self._reserve(layer, name, new, n + q)
            self._stores[layer][name][:, :, n : n + q].copy_(new)
            self._lengths[layer][name] = n + q
            if self.host:
                self.counters.bytes_d2h += new.numel() * new.element_size()

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append a prompt chunk and return the layer's whole K/V on the device (prefill attention is dense:
        the chunk attends to everything stored before it, which is fetched, and to itself)."""
        if self.length(layer) == 0:
            self.append(layer, k, v)
            return k, v
        past_k, past_v = self.fetch(layer).wait()
        self.append(layer, k, v)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def write_slots(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Overwrite one slot per (batch, head) with a new token's K/V (eviction). slots: [batch, heads]."""
        index = slots.to("cpu")[:, :, None, None].expand(-1, -1, 1, k.shape[-1])
        for name, new in zip(KV, (k, v), strict=True):
            self._stores[layer][name].scatter_(2, index, new.to("cpu"))
        self.counters.bytes_d2h += 2 * k.numel() * k.element_size()

    def keep(self, layer: int, index: Tensor) -> None:
        """Evict every slot of a layer's K/V but those in ``index`` ([batch, heads, m]), which become slots
        0..m-1. Done in host memory: nothing crosses to the compute device."""
        kept = index.shape[2]
        for name in KV:
            live = self.stored(layer, name)
            expanded = index.to(self.storage)[..., None].expand(-1, -1, -1, live.shape[-1])
            compact = self._alloc((*live.shape[:2], max(kept, 1), live.shape[-1]), live.dtype)
            torch.gather(live, 2, expanded, out=compact[:, :, :kept])
            self.copier.settle()
            self._stores[layer][name], self._lengths[layer][name] = compact, kept

    def nbytes(self) -> int:
        """Bytes held (live slots of every tensor only, not spare capacity)."""
        total = 0
        for layer in range(self.num_layers):
            for name in self._stores[layer]:
                live = self.stored(layer, name)
                total += live.numel() * live.element_size()
        return total

    # -- copies to the compute device ----------------------------------------------------------------------
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

        ``parts`` instead names the tensors to copy, each with its own slots (None: all of them); ``wait()``
        returns them in that order (by default keys, then values). ``extra`` > 0 leaves that many
        uninitialised slots after the copied ones, for the caller to fill with the new token's K/V: one copy
        into a buffer of the final size instead of copy + concatenate. ``now``: the calling thread makes the
        copy (a look-ahead on a worker that reads the copy itself would otherwise wait for a copy queued
        behind it).
        """
        parts = dict.fromkeys(KV, index) if parts is None else dict(parts)
        sources = {name: (self._stores[layer][name], self.length(layer, name)) for name in parts}
        on_demand = getattr(self._demand, "active", False)
        if on_demand:
            self.counters.bytes_on_demand += self._parts_bytes(sources, parts)
        if not self.device_gather:  # one host copy per distinct index (K and V share theirs)
            on_host = {id(rows): rows.to("cpu") for rows in parts.values() if rows is not None}
            parts = {name: None if rows is None else on_host[id(rows)] for name, rows in parts.items()}
        job = functools.partial(self._copy, sources, parts, extra)
        # A copy on demand is waited for at once: handing it to a worker would only add the hand-off.
        return self.copier.copy(job, queue=not (on_demand or now), keep=parts)

    @staticmethod
    def _parts_bytes(
        sources: Mapping[str, tuple[Tensor, int]],
        parts: Mapping[str, Tensor | None],
        names: tuple[str, ...] | None = None,
    ) -> int:
        """Bytes copied for ``parts`` (those in ``names``, if given)."""
        return sum(
            _copy_bytes(sources[name][0], sources[name][1] if rows is None else rows.shape[2])
            for name, rows in parts.items()
            if names is None or name in names
        )

    def _copy(
        self, sources: Mapping[str, tuple[Tensor, int]], parts: Mapping[str, Tensor | None], extra: int
    ) -> tuple[Tensor, ...]:
        out, numbered = [], {}  # row numbers per (index, store shape): K and V share theirs
        for name, rows in parts.items():
            store, length = sources[name]
            if rows is None:
                out.append(self._into(store[:, :, :length], extra))
                continue
            batch, heads, _, width = store.shape
            key = (id(rows), store.shape[:3])
            if key not in numbered:
                numbered[key] = self._row_numbers(store.shape, rows, extra)
            shape = (batch, heads, rows.shape[2] + extra, width)
            out.append(self._gather_rows(store, numbered[key], shape))
        copied = self._parts_bytes(sources, parts)
        with self._counting:  # the worker and a thread that took a queued copy over may both count
            self.counters.bytes_h2d += copied
            self.counters.peak_bytes = max(self.counters.peak_bytes, self._parts_bytes(sources, parts, KV))
            self.counters.copies += 1
        return tuple(out)

    @staticmethod
    def _row_numbers(store_shape: torch.Size, index: Tensor, extra: int) -> Tensor:
        """Row numbers in the store seen as [batch * heads * capacity, head_dim] of the slots in ``index``,
        plus ``extra`` spare rows per (sequence, head) that point at slot 0 (the caller overwrites them)."""
        batch, heads, capacity, _ = store_shape
        if extra:
            index = torch.cat([index, index.new_zeros(batch, heads, extra)], dim=2)
        offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * capacity
        return (index + offsets).view(-1)

    def _gather_rows(self, store: Tensor, rows: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Whole head_dim rows copied in one index_select (a per-element gather is an order of magnitude
        slower); on CUDA by a kernel reading the pinned store (module docstring), else into pinned memory on
        the host, then one asynchronous copy to the device."""
        flat = store.view(-1, store.shape[-1])
        if not self.on_cuda:
            return flat.index_select(0, rows).view(shape)
        if self.device_gather:
            mapped = self._device_view(flat)
            if mapped is not None:
                if not rows.is_cuda:  # a pinned source keeps the copy asynchronous
                    rows = rows.pin_memory().to(self.compute_device, non_blocking=True)
                return mapped.index_select(0, rows).view(store.dtype).view(shape)
        rows = rows.to("cpu")
        staged = torch.empty((rows.numel(), flat.shape[1]), dtype=store.dtype, pin_memory=True)
        torch.index_select(flat, 0, rows, out=staged)
        return staged.view(shape).to(self.compute_device, non_blocking=True)

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

    def _into(self, source: Tensor, extra: int) -> Tensor:
        """``source`` copied to the compute device, into a buffer with ``extra`` spare token slots."""
        batch, heads, n, dim = source.shape
        out = torch.empty((batch, heads, n + extra, dim), dtype=source.dtype, device=self.compute_device)
        if self.on_cuda and not source.is_contiguous():
            # The live tokens of a store with spare capacity are strided. torch stages a strided host source
            # through pageable memory, which blocks the caller; each (sequence, head) run is contiguous in
            # pinned memory, so one copy per run stays asynchronous.
            for row, run in enumerate(source.flatten(0, 1)):
                out[row // heads, row % heads, :n].copy_(run, non_blocking=True)
            return out
        out[:, :, :n].copy_(source, non_blocking=self.on_cuda)
        return out

    def close(self) -> None:
        self.copier.close()  # no copy may still read the stores once they are dropped
