"""Where and when a pool's copies and look-aheads run: one interface, three implementations.

A :class:`Copier` takes a copy job (a function that makes the copy and returns its tensors) and hands back a
:class:`Transfer` at once; ``Transfer.wait()`` gives the tensors. It also runs a policy's look-ahead
(``ahead``: choosing what the next layer reads and starting its copy) and decides in which order a layer's
own work and the look-ahead for the next layer start (``in_order``). Nothing that uses a copier asks which
one it has:

* :class:`StreamCopier` (CUDA): the copy is queued on a side stream, and ``wait`` makes the compute stream
  wait on its event; look-aheads run at once (their kernels queue on the compute stream).
* :class:`ThreadCopier` (CPU, ``overlap="thread"``): copies and look-aheads are queued, in order, on one
  worker thread, beside the decode thread, where a core is free for it (:func:`free_cores`): the decode
  thread's torch threads take theirs first, and the open copiers that queue work take the rest, oldest
  first (an engine's many sequences each have one; one that queued nothing for :data:`IDLE_S`, such as a
  pool left unclosed, gives its core up). A copier without a core runs everything at once, on the calling
  thread, as a worker sharing a core only contends with the decode thread: on a 2-core CPU at one torch
  thread, an engine step over eight sequences' InfiniGen pools takes 530 ms with a worker each, 390 ms
  with one (the first row's) and 400 ms with none.
* :class:`InlineCopier` (CPU, ``overlap="none"``): everything runs at once, on the calling thread.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import torch

Tensor = torch.Tensor
CopyJob = Callable[[], tuple[Tensor, ...]]


@dataclass
class TransferCounters:
    bytes_h2d: int = 0  # pool -> compute device
    bytes_d2h: int = 0  # new tokens' KV written into the pool
    bytes_on_demand: int = 0  # of bytes_h2d: copies started by the layer that reads them (not prefetched)
    wait_s: float = 0.0  # time the compute stream spent blocked on a copy
    copies: int = 0  # fetches (one layer's K, V and side tensors together)
    peak_bytes: int = 0  # the largest single fetch's K and V: the device buffer attention reads them from
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
    """A copy in flight, or look-ahead work that starts one (``Copier.ahead``). ``wait()`` returns its
    result, the copied tensors on the compute device for a copy; the time it blocks is counted.
    ``take_over``: for a queued copy, called first; it returns the copy's result when it made the copy on the
    waiting thread itself (``ThreadCopier``), else None."""

    def __init__(
        self,
        result: object,
        counters: TransferCounters,
        event: torch.cuda.Event | None = None,
        timing: CopyTiming | None = None,
        keep: object = None,
        take_over: Callable[[], tuple[Tensor, ...] | None] | None = None,
    ):
        self._result = result
        self._take_over = take_over
        self._keep = keep  # inputs the copy reads, held until the compute stream waits for the copy
        self._event = event
        self._counters = counters
        self._timing = timing

    def done(self) -> bool:
        """Whether the copy has finished (without waiting for it)."""
        if isinstance(self._result, Future):
            return self._result.done()
        return self._event is None or self._event.query()

    def wait(self) -> object:
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


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


_worker = threading.local()  # .active: this thread is a copier's worker


def _mark_worker() -> None:
    _worker.active = True


def on_worker() -> bool:
    """Whether the caller runs on a copier's worker thread (look-ahead work, beside the decode thread)."""
    return getattr(_worker, "active", False)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


USABLE_CORES = _usable_cores()


IDLE_S = 1.0  # a copier that queued nothing for this long gives its core up


def free_cores() -> int:
    """The cores this process may run on that the decode thread's torch threads leave free."""
    return max(USABLE_CORES - torch.get_num_threads(), 0)


class Copier:
    """Runs a pool's copies and look-aheads (module docstring); this base runs everything at once."""

    def __init__(self, counters: TransferCounters):
        self.counters = counters

    def copy(self, job: CopyJob, queue: bool = True, keep: object = None) -> Transfer:
        """Start ``job`` (a copy); ``queue=False``: the caller needs it at once (a copy on demand, or a
        look-ahead reading its own copy), so a worker would only add a hand-off. ``keep``: what the copy
        reads, held while it may still run."""
        return Transfer(job(), self.counters)

    def ahead(self, work: Callable[..., object], *args: object) -> Transfer:
        """Run ``work(*args)``, a look-ahead that chooses what the next layer reads and starts its copy, so
        that it overlaps the current layer where this copier can; ``wait()`` returns its result."""
        return Transfer(work(*args), self.counters)

    def in_order(self, own: Callable[[], None], ahead: Callable[[], None]) -> None:
        """Start a layer's ``own`` work and the look-ahead ``ahead`` for the next layer, in the order that
        overlaps them best: here the layer's own copy first, so that it does not queue behind the next
        layer's."""
        own()
        ahead()

    def settle(self) -> None:
        """Return once no copy still reads a store (before one is freed)."""

    def drain(self) -> None:
        """Return once everything started so far has run (its counters are then complete)."""

    def close(self) -> None:
        self.settle()


class InlineCopier(Copier):
    """CPU without overlap: every copy and look-ahead runs at once, on the calling thread."""


class ThreadCopier(Copier):
    """CPU: copies and look-aheads run in order on one worker thread, beside the decode thread, while a core
    is free for it (module docstring); else at once, on the calling thread. The thread starts at the first
    job queued."""

    # open copiers that have had work to queue, in the order they first had some: the free cores go to the
    # first ones that queued work within IDLE_S
    _open: ClassVar[list[weakref.ref[ThreadCopier]]] = []
    _open_lock = threading.RLock()  # re-entrant: forgetting runs in GC passes

    def __init__(self, counters: TransferCounters):
        super().__init__(counters)
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(1, initializer=_mark_worker)
        self._choosing = False  # the worker runs a look-ahead now
        self._queued = False  # jobs went to the worker since it was last drained for running at once
        self._ref: weakref.ref[ThreadCopier] | None = None  # on the open list (from the first job to queue)
        self._last_job = 0.0  # time.monotonic() of the last job this copier had to queue

    def _has_core(self) -> bool:
        """Whether a free core is this copier's: the open ones that queued work within ``IDLE_S`` take them,
        oldest first."""
        free = free_cores()
        if free == 0 or self._ref is None:
            return False
        now = time.monotonic()
        for ref in ThreadCopier._open:
            copier = ref()
            if copier is None or now - copier._last_job > IDLE_S:
                continue
            if copier is self:
                return True
            free -= 1
            if free == 0:
                return False
        return False

    @staticmethod
    def _forget(
        ref: weakref.ref[ThreadCopier],
        open_list: list[weakref.ref[ThreadCopier]] = _open,
        lock=_open_lock,
    ) -> None:
        """Take a copier off the open list (closed, or collected unclosed; the list and lock are bound here,
        as a collection may run at interpreter exit)."""
        with lock:
            if ref in open_list:
                open_list.remove(ref)

    def _executor_for_job(self) -> ThreadPoolExecutor | None:
        """The executor to queue a job on, or None to run it on the calling thread: closed, or no free core
        (the jobs queued before then run first, so copies and look-aheads keep their order). On the worker
        itself (a look-ahead starting its copy), its own executor: it queues behind what runs."""
        if self._executor is None or on_worker():
            return self._executor
        self._last_job = time.monotonic()
        if self._ref is None:  # the first job to queue: join the open ones
            self._ref = weakref.ref(self, ThreadCopier._forget)
            with ThreadCopier._open_lock:
                ThreadCopier._open.append(self._ref)
        if self._has_core():
            self._queued = True
            return self._executor
        if self._queued:
            self.drain()
            self._queued = False
        return None

    def copy(self, job: CopyJob, queue: bool = True, keep: object = None) -> Transfer:
        worker = self._executor_for_job() if queue else None
        if worker is None:  # wanted now, closed, or no core for the worker: on this thread
            return Transfer(job(), self.counters)
        queued = worker.submit(job)
        return Transfer(queued, self.counters, take_over=lambda: self._take_over(queued, job))

    def _take_over(self, queued: Future, job: CopyJob) -> tuple[Tensor, ...] | None:
        """A copy a thread needs now, still queued behind a look-ahead the worker is choosing for a later
        layer, is made by that thread itself (the choice takes longer than the copy; a copy queued behind
        copies waits its turn). Returns its result, or None when it stays the worker's."""
        if self._choosing and queued.cancel():
            return job()
        return None

    def ahead(self, work: Callable[..., object], *args: object) -> Transfer:
        """Queued on the worker, in order with the copies, under the caller's grad and inference modes (both
        are per thread)."""
        worker = self._executor_for_job()
        if worker is None:  # closed, or no core for the worker: on this thread
            return Transfer(work(*args), self.counters)
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def run() -> object:
            self._choosing = True
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    return work(*args)
            finally:
                self._choosing = False

        return Transfer(worker.submit(run), self.counters)

    def in_order(self, own: Callable[[], None], ahead: Callable[[], None]) -> None:
        """The look-ahead is queued first, so it runs beside the layer's own choice; a copy the layer then
        queues behind it is made by the decode thread itself when needed (``Transfer.wait``). Without a core
        for the worker, as the base orders them."""
        if self._executor is None or not self._has_core():
            super().in_order(own, ahead)
            return
        ahead()
        own()

    def drain(self) -> None:
        """On the worker itself (an observer reading stats), nothing: it would wait for itself; nor where
        nothing went to the worker (its thread is not started for it)."""
        if self._executor is not None and self._queued and not on_worker():
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for what is queued and stop the worker; a later copy runs on the calling thread (statistics
        read after a run)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
            if self._ref is not None:
                ThreadCopier._forget(self._ref)


class StreamCopier(Copier):
    """CUDA: copies on a side stream, timed by events; look-aheads at once (their kernels queue on the
    compute stream, the copies they start on the side stream)."""

    def __init__(self, counters: TransferCounters, device: torch.device):
        super().__init__(counters)
        self.device = device
        self._stream = torch.cuda.Stream(device)

    def copy(self, job: CopyJob, queue: bool = True, keep: object = None) -> Transfer:
        issued = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        timing = CopyTiming(_timed_event(), _timed_event())
        with torch.cuda.stream(self._stream):
            timing.start.record(self._stream)
            result = job()
            timing.end.record(self._stream)
        timing.issue_s = time.perf_counter() - issued
        self.counters.timings.append(timing)
        # The copy stream reads a device index: it stays alive until the compute stream has waited for the
        # copy, so its memory cannot be handed to compute-stream work the copy still races with.
        return Transfer(result, self.counters, timing.end, timing, keep=keep)

    def settle(self) -> None:
        """A device-side gather may still be reading a pinned store, and a freed pinned block can be handed
        out again at once."""
        self._stream.synchronize()


def make_copier(device: torch.device, counters: TransferCounters, overlap: str = "thread") -> Copier:
    """The copier for a pool whose copies go to ``device``: a side stream on CUDA, else a worker thread
    (``overlap="thread"``) or none (``"none"``)."""
    if device.type == "cuda":
        return StreamCopier(counters, device)
    return ThreadCopier(counters) if overlap == "thread" else InlineCopier(counters)
