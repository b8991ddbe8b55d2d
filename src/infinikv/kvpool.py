"""The host KV pool and the copies from it to the compute device.

The pool holds, per layer, the keys and values of a batch in host memory (pinned when the compute device is
CUDA), shaped [batch, kv_heads, tokens, head_dim]. Policies read from it in one of two ways:

* ``fetch(layer)`` copies the whole layer (full offload),
* ``fetch(layer, index)`` gathers the rows named by ``index`` ([batch, kv_heads, n] token slots) and copies
  only those (selective policies).

Both return a :class:`Transfer` at once; ``Transfer.wait()`` hands back the device tensors. On CUDA the copy
runs on a side stream and ``wait`` makes the compute stream wait on its event; on CPU the copy is done on a
worker thread (``overlap="thread"``) or right away (``overlap="none"``). Every byte that crosses is counted,
and so are the bytes of copies started on demand (``on_demand``: by the layer that reads them, so nothing
overlaps them), apart.

``ahead(work, ...)`` queues a policy's look-ahead (choosing what the next layer reads, then starting its
copy) on the same worker, so on a CPU the choosing overlaps the current layer's compute as the copy does;
on CUDA, or without a worker, it runs at once.

On CUDA a row gather runs on the device: with unified addressing every pinned host page is mapped into the
device's address space, so an ``index_select`` kernel on the copy stream reads the chosen rows across the link
itself (zero-copy). The host neither gathers rows nor waits for the index. Where the pinned store cannot be
seen from the device, rows are gathered on the host into pinned memory and copied as one block.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


@dataclass
class TransferCounters:
    bytes_h2d: int = 0  # pool -> compute device
    bytes_d2h: int = 0  # new tokens' KV written into the pool
    bytes_on_demand: int = 0  # of bytes_h2d: copies started by the layer that reads them (not prefetched)
    wait_s: float = 0.0  # time the compute stream spent blocked on a copy
    copies: int = 0
    peak_bytes: int = 0  # the largest single fetch (K and V of one layer): the device buffer it lands in
    timings: list[CopyTiming] = field(default_factory=list)  # CUDA: one per fetch, in order


@dataclass
class CopyTiming:
    """CUDA events of one fetch: its copy on the copy stream, and the compute stream's wait for it; and the
    host time spent inside fetch (the row gather into pinned memory, the launch)."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    issue_s: float = 0.0
    wait_start: torch.cuda.Event | None = None
    wait_end: torch.cuda.Event | None = None

    def seconds(self) -> tuple[float, float]:
        """(copy time, time the compute stream stalled on it); call once the device is synchronised."""
        stalled = self.wait_start.elapsed_time(self.wait_end) if self.wait_end is not None else 0.0
        return self.start.elapsed_time(self.end) / 1e3, stalled / 1e3


class Transfer:
    """A copy from the pool in flight, or look-ahead work that starts one (``KVPool.ahead``). ``wait()``
    returns its result, (keys, values) on the compute device for a copy; the time it blocks is counted.
    ``take_over``: for a queued copy, called first; it returns the copy's result when it made the copy on the
    waiting thread itself (``KVPool.take_over``), else None."""

    def __init__(
        self,
        result: tuple[Tensor, Tensor] | Future,
        counters: TransferCounters,
        event: torch.cuda.Event | None = None,
        timing: CopyTiming | None = None,
        keep: Tensor | None = None,
        take_over: Callable[[], tuple[Tensor, Tensor] | None] | None = None,
    ):
        self._result = result
        self._take_over = take_over
        self._keep = keep  # an input the copy reads, held until the compute stream waits for the copy
        self._event = event
        self._counters = counters
        self._timing = timing

    def done(self) -> bool:
        """Whether the copy has finished (without waiting for it)."""
        if isinstance(self._result, Future):
            return self._result.done()
        return self._event is None or self._event.query()

    def wait(self) -> tuple[Tensor, Tensor]:
        if isinstance(self._result, Future) and self._take_over is not None:
            made = self._take_over()  # work of this thread, not a wait
            self._result = self._result if made is None else made
        start = time.perf_counter()
        if isinstance(self._result, Future):
            self._result = self._result.result()
        if self._event is not None:
            stream = torch.cuda.current_stream()
            self._timing.wait_start, self._timing.wait_end = _timed_event(), _timed_event()
            self._timing.wait_start.record(stream)
            stream.wait_event(self._event)
            self._timing.wait_end.record(stream)
            for tensor in self._result:  # made on the copy stream, used on this one
                tensor.record_stream(stream)
            self._event = self._keep = None
        self._counters.wait_s += time.perf_counter() - start
        return self._result


class _DeviceArray:
    """Hands a device pointer to ``torch.as_tensor`` through the CUDA array interface."""

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _copy_bytes(store: Tensor, tokens: int) -> int:
    """Bytes of K and V copied for ``tokens`` slots of every (sequence, head) of ``store``'s layer."""
    batch, heads, _, dim = store.shape
    return 2 * batch * heads * tokens * dim * store.element_size()


_worker = threading.local()  # .active: this thread is a pool's worker


def _mark_worker() -> None:
    _worker.active = True


def on_worker() -> bool:
    """Whether the caller runs on a pool's worker thread (look-ahead work, beside the decode thread)."""
    return getattr(_worker, "active", False)


class KVPool:
    """Per-layer K/V of one batch in host memory, with counted copies to the compute device.

    Storage grows by doubling, so appending one token per step is amortised O(1). Slots are token
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
        self._keys: list[Tensor | None] = [None] * num_layers
        self._values: list[Tensor | None] = [None] * num_layers
        self._length = [0] * num_layers
        self.counters = TransferCounters()
        self._stream = torch.cuda.Stream(self.compute_device) if self.on_cuda else None
        threaded = not self.on_cuda and overlap == "thread"
        self._executor = ThreadPoolExecutor(1, initializer=_mark_worker) if threaded else None
        self.device_gather = self.on_cuda and self.host  # cleared if the pinned store is not device-visible
        self._demand = threading.local()  # .active: fetches now are on demand (``on_demand``)
        self._counting = threading.Lock()
        self._choosing = False  # the worker runs a look-ahead (``ahead``) now

    @property
    def threaded(self) -> bool:
        """Whether look-aheads (``ahead``) and copies run on a worker thread, beside the decode thread."""
        return self._executor is not None

    # -- storage ------------------------------------------------------------------------------------------
    def length(self, layer: int) -> int:
        return self._length[layer]

    def capacity(self, layer: int) -> int:
        """Tokens ``layer``'s store holds before it grows (0 before its first append)."""
        stored = self._keys[layer]
        return 0 if stored is None else stored.shape[2]

    def keys(self, layer: int) -> Tensor:
        return self._keys[layer][:, :, : self._length[layer]]

    def values(self, layer: int) -> Tensor:
        return self._values[layer][:, :, : self._length[layer]]

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        pin = self.host and self.on_cuda
        return torch.empty(shape, dtype=dtype, device=self.storage, pin_memory=pin)

    def _reserve(self, layer: int, like: Tensor, needed: int) -> None:
        stored = self._keys[layer]
        if stored is not None and stored.shape[2] >= needed:
            return
        # Grow by a quarter: amortised O(1) appends without doubling a long prompt's memory.
        current = stored.shape[2] if stored is not None else 0
        capacity = max(needed, current + max(current // 4, 256))
        batch, heads, _, dim = like.shape
        if self.host and self.on_cuda:  # pinned blocks come in powers of two bytes: use the whole block
            row = batch * heads * dim * like.element_size()
            capacity = (1 << (capacity * row - 1).bit_length()) // row
        new_k = self._alloc((batch, heads, capacity, dim), like.dtype)
        new_v = self._alloc((batch, heads, capacity, dim), like.dtype)
        self._release_store()
        if stored is not None:
            n = self._length[layer]
            new_k[:, :, :n].copy_(self._keys[layer][:, :, :n])
            new_v[:, :, :n].copy_(self._values[layer][:, :, :n])
        self._keys[layer], self._values[layer] = new_k, new_v

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write new tokens' K/V ([batch, kv_heads, q, head_dim], on the compute device) into the pool."""
        n, q = self._length[layer], k.shape[2]
        self._reserve(layer, k, n + q)
        self._keys[layer][:, :, n : n + q].copy_(k)
        self._values[layer][:, :, n : n + q].copy_(v)
        self._length[layer] = n + q
        if self.host:
            self.counters.bytes_d2h += 2 * k.numel() * k.element_size()

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append a prompt chunk and return the layer's whole K/V on the device (prefill attention is dense:
        the chunk attends to everything stored before it, which is fetched, and to itself)."""
        if self._length[layer] == 0:
            self.append(layer, k, v)
            return k, v
        past_k, past_v = self.fetch(layer).wait()
        self.append(layer, k, v)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def write_slots(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Overwrite one slot per (batch, head) with a new token's K/V (eviction). slots: [batch, heads]."""
        index = slots.to("cpu")[:, :, None, None].expand(-1, -1, 1, k.shape[-1])
        self._keys[layer].scatter_(2, index, k.to("cpu"))
        self._values[layer].scatter_(2, index, v.to("cpu"))
        self.counters.bytes_d2h += 2 * k.numel() * k.element_size()

    def keep(self, layer: int, index: Tensor) -> None:
        """Evict every slot of a layer but those in ``index`` ([batch, heads, m]), which become slots 0..m-1.
        Done in host memory: nothing crosses to the compute device."""
        keys, values = self.keys(layer), self.values(layer)
        expanded = index.to(self.storage)[..., None].expand(-1, -1, -1, keys.shape[-1])
        kept = index.shape[2]
        new_k = self._alloc((*keys.shape[:2], max(kept, 1), keys.shape[-1]), keys.dtype)
        new_v = self._alloc((*keys.shape[:2], max(kept, 1), keys.shape[-1]), values.dtype)
        torch.gather(keys, 2, expanded, out=new_k[:, :, :kept])
        torch.gather(values, 2, expanded, out=new_v[:, :, :kept])
        self._release_store()
        self._keys[layer], self._values[layer], self._length[layer] = new_k, new_v, kept

    def _release_store(self) -> None:
        """Called before a store is replaced: a device-side gather may still be reading it, and a freed pinned
        block can be handed out again at once (rare: stores grow by a quarter and are cut once)."""
        if self._stream is not None and self.device_gather:
            self._stream.synchronize()

    def nbytes(self) -> int:
        """Bytes of K/V held (live tokens only, not spare capacity)."""
        total = 0
        for layer in range(self.num_layers):
            if self._keys[layer] is not None:
                k = self.keys(layer)
                total += 2 * k.numel() * k.element_size()
        return total

    # -- copies to the compute device ----------------------------------------------------------------------
    def ahead(self, work: Callable[..., object], *args: object) -> Transfer:
        """Run ``work(*args)`` on the worker thread (CPU, ``overlap="thread"``), in order with the copies, or
        now (CUDA: its kernels queue on the compute stream; no worker): a look-ahead that chooses what the
        next layer reads and starts its copy, overlapping the current layer. ``wait()`` returns its result.
        The worker runs it under the caller's grad and inference modes (both are per thread)."""
        if self._executor is None:
            return Transfer(work(*args), self.counters)
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def run() -> object:
            self._choosing = True
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    return work(*args)
            finally:
                self._choosing = False

        return Transfer(self._executor.submit(run), self.counters)

    def drain(self) -> None:
        """Wait until the worker has run everything queued so far (its copies' counters are then complete:
        a prefetch for the next step may still be queued when a step ends). On the worker itself (an
        observer reading stats), nothing: it would wait for itself."""
        if self._executor is not None and not on_worker():
            self._executor.submit(lambda: None).result()

    def take_over(
        self, queued: Future, copy: Callable[[], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor] | None:
        """A copy a thread needs now, still queued behind a look-ahead the worker is choosing for a later
        layer, is made by that thread itself (the choice takes longer than the copy; a copy queued behind
        copies waits its turn). Returns its result, or None when it stays the worker's."""
        if self._choosing and queued.cancel():
            return copy()
        return None

    @contextmanager
    def on_demand(self) -> Iterator[None]:
        """Count the fetches started inside as on demand: the layer that reads them waits for them, nothing
        runs beside them (``counters.bytes_on_demand``). Per thread."""
        self._demand.active = True
        try:
            yield
        finally:
            self._demand.active = False

    def fetch(self, layer: int, index: Tensor | None = None, extra: int = 0, now: bool = False) -> Transfer:
        """Start copying a layer's K/V (all of it, or the slots in ``index`` [batch, heads, n]) to the device.

        ``extra`` > 0 leaves that many uninitialised token slots after the copied ones, for the caller to
        fill with the new token's K/V: one copy into a buffer of the final size instead of copy + concatenate.
        ``now``: on a CPU, the calling thread makes the copy (a look-ahead on the worker that reads the copy
        itself would otherwise wait for a copy queued behind it).
        """
        stores, length = (self._keys[layer], self._values[layer]), self._length[layer]
        on_demand = getattr(self._demand, "active", False)
        if on_demand:
            tokens = length if index is None else index.shape[2]
            self.counters.bytes_on_demand += _copy_bytes(stores[0], tokens)
        if index is not None and not self.device_gather:
            index = index.to("cpu")
        # A copy on demand is waited for at once: handing it to the worker would only add the hand-off.
        if self._executor is not None and not on_demand and not now:
            copy = functools.partial(self._copy, stores, length, index, extra)
            queued = self._executor.submit(copy)
            return Transfer(queued, self.counters, take_over=functools.partial(self.take_over, queued, copy))
        if self._stream is None:
            return Transfer(self._copy(stores, length, index, extra), self.counters)
        issued = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(self.compute_device))
        timing = CopyTiming(_timed_event(), _timed_event())
        with torch.cuda.stream(self._stream):
            timing.start.record(self._stream)
            result = self._copy(stores, length, index, extra)
            timing.end.record(self._stream)
        timing.issue_s = time.perf_counter() - issued
        self.counters.timings.append(timing)
        # The copy stream reads a device index: it stays alive until the compute stream has waited for the
        # copy, so its memory cannot be handed to compute-stream work the copy still races with.
        return Transfer(result, self.counters, timing.end, timing, keep=index)

    def _copy(
        self, stores: tuple[Tensor, Tensor], length: int, index: Tensor | None, extra: int
    ) -> tuple[Tensor, Tensor]:
        batch, heads, _, dim = stores[0].shape
        if index is None:
            tokens = length
            out_k, out_v = (self._into(store[:, :, :length], extra) for store in stores)
        else:
            tokens = index.shape[2]
            rows = self._row_numbers(stores[0].shape, index, extra)
            shape = (batch, heads, tokens + extra, dim)
            out_k, out_v = (self._gather_rows(store, rows, shape) for store in stores)
        copied = _copy_bytes(stores[0], tokens)
        with self._counting:  # the worker and a thread that took a queued copy over may both count
            self.counters.bytes_h2d += copied
            self.counters.peak_bytes = max(self.counters.peak_bytes, copied)
            self.counters.copies += 1
        return out_k, out_v

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
        if self._stream is not None:  # no kernel may still read the pinned stores once they are dropped
            self._stream.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
