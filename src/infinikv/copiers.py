"""Where and when a pool's copies and look-aheads run: one interface, three implementations.

A :class:`Copier` takes a copy job (a function that makes the copy and returns its tensors) and hands back a
:class:`Transfer` at once; ``Transfer.wait()`` gives the tensors. It also runs a policy's look-ahead
(``ahead``: choosing what the next layer reads and starting its copy) and decides in which order a layer's
own work and the look-ahead for the next layer start (``in_order``). Nothing that uses a copier asks which
one it has:

* :class:`StreamCopier` (CUDA): the copy is queued on a side stream, and ``wait`` makes the compute stream
  wait on its event; look-aheads run at once (their kernels queue on the compute stream).
* :class:`ThreadCopier` (CPU, ``overlap="thread"``): copies and look-aheads are queued, in order, on a
  worker thread beside the decode thread, where a core is free for it (:func:`free_cores`: the decode
  thread's torch threads take theirs first). The workers are the process's, one per free core, shared by
  every copier: a copier is given one at its first queued job and keeps it, so its jobs stay in order, and
  an engine's sequences, a copier each, all look ahead beside the step's own work. Without a free core a
  copier runs everything at once, on the calling thread, as a worker sharing a core only contends with the
  decode thread. A decode step whose rows copied too little a layer in the step before to gain from the
  worker (:data:`WORKER_FROM_BYTES`, told by ``size_step``) also runs everything at once, on the calling
  thread.
* :class:`InlineCopier` (CPU, ``overlap="none"``): everything runs at once, on the calling thread.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

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

# A decode step whose rows copied less than this per layer in their step before runs its look-aheads and
# copies on the decode thread (``Copier.size_step``). Below it, handing each job over and the two threads'
# contention (the interpreter lock, memory bandwidth) cost more than running the job beside the layer saves.
# On the 2-core CPU of docs/benchmarks.md, with SmolLM2-135M: InfiniGen's and H2O's steps were faster
# without the worker at 8 rows x 2,048 tokens (5 MiB copied a layer) and every batch-1 cell measured,
# offload's at 1 x 2,048 (3 MiB); InfiniGen's much faster with it at 8 x 4,096 (10 MiB) and offload's at
# 8 x 2,048 (24 MiB).
WORKER_FROM_BYTES = 8 * 2**20


def free_cores() -> int:
    """The cores this process may run on that the decode thread's torch threads leave free."""
    return max(USABLE_CORES - torch.get_num_threads(), 0)


class _Worker:
    """One of the process's worker threads (:class:`ThreadCopier`), and whether it runs a look-ahead now."""

    def __init__(self, number: int):
        name = f"infinikv-worker-{number}"
        self.executor = ThreadPoolExecutor(1, initializer=_mark_worker, thread_name_prefix=name)
        self.choosing = False


_workers: list[_Worker] = []  # the process's, started as copiers first need them
_workers_lock = threading.Lock()
_given = itertools.count()  # copiers given a worker so far: the next takes the next worker, in turn


def _forget_workers() -> None:
    """A forked child has none of its parent's threads: its copiers start their own workers."""
    global _workers_lock
    _workers.clear()
    _workers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_workers)


def _next_worker() -> _Worker:
    """A worker for a copier's first queued job: the cores free now take them in turn."""
    with _workers_lock:
        turn = next(_given) % max(free_cores(), 1)
        while len(_workers) <= turn:
            _workers.append(_Worker(len(_workers)))
        return _workers[turn]


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

    def size_step(self, layer_bytes: int) -> None:
        """The rows of the decode step about to run copied ``layer_bytes`` per layer in their step before; a
        copier may choose by it where the step's jobs run (:class:`ThreadCopier`). Here nothing."""

    def in_order(self, own: Callable[[], None], ahead: Callable[[], None]) -> None:
        """Start a layer's ``own`` work and the look-ahead ``ahead`` for the next layer, in the order that
        overlaps them best: here the layer's own copy first, so that it does not queue behind the next
        layer's."""
        own()
        ahead()

    def overlaps(self) -> bool:
        """Whether look-aheads and copies started now run beside the decode thread's compute (a worker, a
        copy stream), so that starting one early gains. Here not: everything runs at once."""
        return False

    def settle(self) -> None:
        """Return once no copy still reads a store (before one is freed)."""

    def drain(self) -> None:
        """Return once everything started so far has run (its counters are then complete)."""

    def close(self) -> None:
        self.settle()


class InlineCopier(Copier):
    """CPU without overlap: every copy and look-ahead runs at once, on the calling thread."""


class ThreadCopier(Copier):
    """CPU: copies and look-aheads run in order on a worker thread the process's copiers share, beside the
    decode thread, while a core is free for it and the step is large enough to gain from it (module
    docstring); else at once, on the calling thread."""

    def __init__(self, counters: TransferCounters):
        super().__init__(counters)
        self._worker: _Worker | None = None  # given at the first job queued
        self._closed = False
        self._queued = False  # jobs went to the worker since it was last drained for running at once
        self._small_step = False  # the step now running is below WORKER_FROM_BYTES (size_step)

    def size_step(self, layer_bytes: int) -> None:
        self._small_step = layer_bytes < WORKER_FROM_BYTES

    def _uses_worker(self) -> bool:
        """Whether jobs started now go to the worker: open, a core free for it, and a step large enough."""
        return not self._closed and not self._small_step and free_cores() > 0

    def overlaps(self) -> bool:
        return self._uses_worker()

    def _executor_for_job(self) -> ThreadPoolExecutor | None:
        """The executor to queue a job on, or None to run it on the calling thread: closed, no free core, or
        a small step (the jobs queued before then run first, so copies and look-aheads keep their order).
        On the worker itself (a look-ahead starting its copy), the same one: it queues behind what runs."""
        if on_worker():
            return None if self._worker is None else self._worker.executor
        if self._closed:
            return None
        if self._uses_worker():
            if self._worker is None:
                self._worker = _next_worker()
            self._queued = True
            return self._worker.executor
        if self._queued:
            self.drain()
            self._queued = False
        return None

    def copy(self, job: CopyJob, queue: bool = True, keep: object = None) -> Transfer:
        worker = self._executor_for_job() if queue else None
        if worker is None:  # wanted now, closed, no core for the worker or a small step: on this thread
            return Transfer(job(), self.counters)
        queued = worker.submit(job)
        return Transfer(queued, self.counters, take_over=lambda: self._take_over(queued, job))

    def _take_over(self, queued: Future, job: CopyJob) -> tuple[Tensor, ...] | None:
        """A copy a thread needs now, still queued while the worker runs a look-ahead (this pool's or another
        one's), is made by that thread itself (the choice takes longer than the copy; a copy queued behind
        copies waits its turn). Returns its result, or None when it stays the worker's."""
        if self._worker.choosing and queued.cancel():
            return job()
        return None

    def ahead(self, work: Callable[..., object], *args: object) -> Transfer:
        """Queued on the worker, in order with the copies, under the caller's grad and inference modes (both
        are per thread)."""
        worker = self._executor_for_job()
        if worker is None:  # closed, no core for the worker or a small step: on this thread
            return Transfer(work(*args), self.counters)
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        chooser = self._worker

        def run() -> object:
            chooser.choosing = True
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    return work(*args)
            finally:
                chooser.choosing = False

        return Transfer(worker.submit(run), self.counters)

    def in_order(self, own: Callable[[], None], ahead: Callable[[], None]) -> None:
        """The look-ahead is queued first, so it runs beside the layer's own choice; a copy the layer then
        queues behind it is made by the decode thread itself when needed (``Transfer.wait``). Without the
        worker (:meth:`_uses_worker`), as the base orders them."""
        if not self._uses_worker():
            super().in_order(own, ahead)
            return
        ahead()
        own()

    def drain(self) -> None:
        """On the worker itself (an observer reading stats), nothing: it would wait for itself; nor where
        nothing went to the worker (its thread is not started for it)."""
        if self._worker is not None and self._queued and not on_worker():
            self._worker.executor.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for what it queued; a later copy runs on the calling thread (statistics read after a run).
        The worker stays, for the other copiers."""
        self.drain()
        self._closed = True


class StreamCopier(Copier):
    """CUDA: copies on a side stream, timed by events; look-aheads at once (their kernels queue on the
    compute stream, the copies they start on the side stream)."""

    def __init__(self, counters: TransferCounters, device: torch.device):
        super().__init__(counters)
        self.device = device
        self._stream = torch.cuda.Stream(device)

    def overlaps(self) -> bool:
        return True

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
