"""The request queue and the one worker thread that runs the model.

The HTTP layer ``submit``s a :class:`Job` (a prompt's token ids, a policy config, sampling settings) and
reads its events from an asyncio queue: ``("text", piece)`` while it streams, then ``("done",
RequestResult)``, ``("error", message)``, ``("timeout", message)`` or ``("shutdown", message)``. A job whose
client went away is
cancelled at the next step, and so is one still running at its deadline (``--request-timeout``).

:class:`ContinuousScheduler` (the default) steps an :class:`~infinikv.engine.Engine`: a job joins the
running batch at the next step, whatever its policy and sampling settings, and leaves it when it is done;
long prompts are read in chunks between decode steps; admission goes by the pool's blocks, and the prefix
cache (on unless ``--no-prefix-cache``) lets a prompt that starts like an earlier one prefill only the rest.

:class:`StaticScheduler` (``--scheduler static``, kept to measure against) takes the oldest waiting job plus
every other waiting job with the same policy config and sampling settings (up to ``max_batch``) and runs
them as one ``Generator.generate`` call; a new job waits for the running batch to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine, EngineConfig
from ..errors import InfinikvError
from ..generate import GenerationConfig, Generator, RequestResult, batch_engine
from ..models import LoadedModel
from ..policies import PolicyConfig, policy_of
from .metrics import ServerMetrics

log = logging.getLogger("infinikv.serve")


class QueueFull(Exception):
    """More jobs are waiting than the server takes."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new jobs."""


@dataclass(eq=False)
class Job:
    prompt: list[int]  # token ids: the HTTP side tokenised the prompt, and generate takes them as they are
    policy: PolicyConfig
    sampling: GenerationConfig
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    serial: int = 0
    answered: bool = False  # set by the HTTP side once the client got the final event
    timeout: float | None = None  # seconds from submission to the deadline (None: none)
    submitted: float = field(default_factory=time.monotonic)

    @property
    def batch_key(self) -> tuple:
        """Which jobs the static scheduler may run in one batch."""
        # Seeded sampling runs alone: rows of a batch draw from one random generator, so a batchmate
        # would change which numbers this request gets.
        if self.sampling.seed is not None and self.sampling.temperature > 0:
            return ("alone", self.serial)
        # Rows stop at their own max_tokens (Generator.generate's row limits): that may differ in a batch.
        return (self.policy, dataclasses.replace(self.sampling, max_new_tokens=1))

    def emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the request's coroutine (called from the worker thread)."""
        # A closed loop means the server has shut down and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.cancelled.set()

    def overdue(self) -> bool:
        """Whether the job's deadline has passed."""
        return self.timeout is not None and time.monotonic() - self.submitted > self.timeout

    def stopped(self) -> bool:
        """Whether the job should end at the next step: its client left, or its deadline passed."""
        return self.cancelled.is_set() or self.overdue()

    def emit_timeout(self, tokens: int) -> None:
        self.emit(
            "timeout",
            f"the request ran past the server's deadline of {self.timeout:g} s (--request-timeout) and was "
            f"cancelled after {tokens} new tokens",
        )


class _QueueWorker:
    """What both schedulers share: the queue's limits and lock, the job serials, and the worker thread."""

    def __init__(self, metrics: ServerMetrics, max_queue: int, request_timeout: float | None, name: str):
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self._lock = threading.Condition()
        self._stopping = False
        self._serials = itertools.count()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _work(self) -> None:
        raise NotImplementedError

    def _new_job(
        self, prompt: list[int], policy: PolicyConfig, sampling: GenerationConfig, stream: bool
    ) -> Job:
        loop = asyncio.get_running_loop()
        serial = next(self._serials)
        return Job(prompt, policy, sampling, stream, loop, serial=serial, timeout=self.request_timeout)

    def _check_room(self, queued: int) -> None:
        """ShuttingDown or QueueFull for a job that would join ``queued`` others (caller holds the lock)."""
        if self._stopping:
            raise ShuttingDown
        if queued >= self.max_queue:
            raise QueueFull


class StaticScheduler(_QueueWorker):
    def __init__(
        self,
        loaded: LoadedModel,
        metrics: ServerMetrics,
        max_batch: int = 8,
        max_queue: int = 64,
        request_timeout: float | None = None,
        compile: bool = False,
        kv_memory: int | None = None,
    ):
        super().__init__(metrics, max_queue, request_timeout, "infinikv-generate")
        self.loaded = loaded
        self.max_batch = max_batch
        self.compile = compile  # decode steps under torch.compile (EngineConfig.compile)
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        # One engine for every KV configuration (its memory budget, ``kv_memory`` bytes, is taken once), a
        # Generator per one
        chunk = min(GenerationConfig().prefill_chunk, loaded.max_context)
        self._engine = batch_engine(loaded, chunk, compile, kv_memory)
        self._generators: dict[PolicyConfig, Generator] = {}
        self.batches_served = 0

    # -- the HTTP side ------------------------------------------------------------------------------------
    def submit(
        self, prompt: list[int], policy: PolicyConfig, sampling: GenerationConfig, stream: bool
    ) -> Job:
        job = self._new_job(prompt, policy, sampling, stream)
        with self._lock:
            self._check_room(len(self._waiting))
            self._waiting.append(job)
            self.metrics.queue_length.set(len(self._waiting))
            self._lock.notify()
        return job

    def prepare(self, policy: PolicyConfig) -> None:
        """Build (and calibrate, for InfiniGen) a policy's generator ahead of its first request."""
        self._generator(policy)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._running)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting and running ones, and wait for the worker to finish."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            for job in self._running:
                job.cancel()
            self.metrics.queue_length.set(0)
            self._lock.notify_all()
        for job in waiting:
            job.emit("shutdown", "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                batch = self._take_batch()
                self._running = batch
                self.metrics.queue_length.set(len(self._waiting))
                self.metrics.running.set(len(batch))
            if batch:
                self._serve(batch)
            with self._lock:
                self._running = []
                self.metrics.running.set(0)

    def _take_batch(self) -> list[Job]:
        """The oldest live job and the waiting jobs that can share its batch (caller holds the lock)."""
        live = [job for job in self._waiting if not job.cancelled.is_set()]
        if not live:
            self._waiting.clear()
            return []
        key = live[0].batch_key
        batch = [job for job in live if job.batch_key == key][: self.max_batch]
        chosen = set(map(id, batch))
        self._waiting = deque(job for job in live if id(job) not in chosen)
        return batch

    def _generator(self, policy: PolicyConfig) -> Generator:
        if policy not in self._generators:
            generator = Generator(self.loaded, policy, engine=self._engine, compile=self.compile)
            self._generators[policy] = generator
        return self._generators[policy]

    def _serve(self, batch: list[Job]) -> None:
        limits = [job.sampling.max_new_tokens for job in batch]
        policy = batch[0].policy
        sampling = dataclasses.replace(batch[0].sampling, max_new_tokens=max(limits))
        name = policy_of(policy).name
        started = time.perf_counter()

        def on_text(row: int, piece: str) -> None:
            if batch[row].stream:
                batch[row].emit("text", piece)

        try:
            generator = self._generator(policy)
            results: list[RequestResult] = generator.generate(
                [job.prompt for job in batch],
                sampling,
                on_text=on_text,
                cancelled=lambda row: batch[row].stopped(),
                row_max_new_tokens=limits,
            )
        except Exception as exc:  # a failed batch must not stop the server
            log.exception("generation failed for a batch of %d", len(batch))
            # Rows it left in the shared engine would be stepped with every later batch's.
            for seq in [seq.id for seq in (*self._engine.running, *self._engine.waiting)]:
                with contextlib.suppress(Exception):  # its cache may be the one that failed
                    self._engine.abort(seq)
            for job in batch:
                job.emit("error", f"generation failed: {exc}")
            return
        stats = results[0].stats
        name = stats.get("policy", name)
        self.metrics.record_batch(
            name,
            rows=len(batch),
            prompt_tokens=sum(r.stats["prompt_tokens"] for r in results),
            new_tokens=sum(len(r.token_ids) for r in results),
            stats=stats,
        )
        self.batches_served += 1
        log.info("batch of %d (%s) done in %.2f s", len(batch), name, time.perf_counter() - started)
        for job, result in zip(batch, results, strict=True):
            if result.finish_reason == "cancelled" and self._stopping:  # stop() cut it short
                job.emit("shutdown", "the server is shutting down")
            elif result.finish_reason == "cancelled" and job.overdue() and not job.cancelled.is_set():
                job.emit_timeout(len(result.token_ids))
            else:
                job.emit("done", result)


class ContinuousScheduler(_QueueWorker):
    """Jobs in and out of one engine between its steps, on one worker thread."""

    def __init__(
        self,
        loaded: LoadedModel,
        metrics: ServerMetrics,
        engine: EngineConfig = EngineConfig(),
        max_queue: int = 64,
        request_timeout: float | None = None,
    ):
        super().__init__(metrics, max_queue, request_timeout, "infinikv-engine")
        self.engine = Engine(loaded, engine)
        self._inbox: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # engine sequence id -> job (touched by the worker only)
        self._counted = {"prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "preemptions": 0}
        self.metrics.kv_blocks.labels(state="total").set(self.engine.pool.total)

    # -- the HTTP side ------------------------------------------------------------------------------------
    def submit(
        self, prompt: list[int], policy: PolicyConfig, sampling: GenerationConfig, stream: bool
    ) -> Job:
        """Queue a job; an InputError (before anything is queued) when it could never fit the pool."""
        self.engine.check(prompt, sampling)
        job = self._new_job(prompt, policy, sampling, stream)
        with self._lock:
            self._check_room(len(self._inbox) + len(self.engine.waiting))
            self._inbox.append(job)
            self._lock.notify()
        return job

    def prepare(self, policy: PolicyConfig) -> None:
        """A policy's model-level work (InfiniGen's calibration) ahead of its first request."""
        self.engine.prepare(policy)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self._jobs)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, end the waiting and running ones, and wait for the worker to finish."""
        with self._lock:
            self._stopping = True
            waiting, self._inbox = list(self._inbox), deque()
            self._lock.notify_all()
        for job in waiting:
            job.emit("shutdown", "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self.engine.has_work and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    break
                arrived, self._inbox = list(self._inbox), deque()
            for job in arrived:
                self._add(job)
            try:
                self._cancel_departed()
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not stop the server: its requests fail
                log.exception("an engine step failed")
                self._fail_running(f"generation failed: {exc}")
                continue
            for out in outputs:
                job = self._jobs[out.seq]
                if out.text and job.stream:
                    job.emit("text", out.text)
                if out.result is not None:
                    self._done(out.seq, out.result)
            self._record_engine()
        for seq in list(self._jobs):
            self._jobs[seq].emit("shutdown", "the server is shutting down")
            with contextlib.suppress(Exception):  # its cache may be the one that failed
                self.engine.abort(seq)
        self._jobs.clear()

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        if job.overdue():  # it waited in the queue past its deadline
            job.emit_timeout(0)
            return
        try:
            self._jobs[self.engine.add(job.prompt, job.policy, job.sampling)] = job
        except InfinikvError as exc:
            job.emit("error", str(exc))
        except Exception as exc:  # e.g. a policy's preparation failing: this request fails, not the server
            log.exception("a request could not be added")
            job.emit("error", f"generation failed: {exc}")

    def _cancel_departed(self) -> None:
        """End the jobs whose client left (their result, for the metrics) or whose deadline passed."""
        for seq, job in list(self._jobs.items()):
            if not job.stopped():
                continue
            result = self.engine.abort(seq)
            if not job.cancelled.is_set():  # overdue
                self._jobs.pop(seq)
                job.emit_timeout(0 if result is None else len(result.token_ids))
            elif result is not None:
                self._done(seq, result)

    def _done(self, seq: int, result: RequestResult) -> None:
        job = self._jobs.pop(seq)
        stats = result.stats
        self.metrics.record_batch(
            stats.get("policy", policy_of(job.policy).name),  # cancelled before it ran: no policy stats
            rows=stats.get("batch_size", 1),
            prompt_tokens=stats.get("prompt_tokens", len(job.prompt)),
            new_tokens=len(result.token_ids),
            stats=stats,
        )
        job.emit("done", result)

    def _fail_running(self, message: str) -> None:
        """A failed step: every request not still waiting in the engine's queue gets ``message`` and is
        released (those it ran, one it was admitting, one that finished earlier in the step, whose result
        the failure lost); those waiting stay queued."""
        waiting = {seq.id for seq in self.engine.waiting}
        for seq in [seq for seq in self._jobs if seq not in waiting]:
            with contextlib.suppress(Exception):  # its cache may be the one that failed
                self.engine.abort(seq)
            self._jobs.pop(seq).emit("error", message)

    def _record_engine(self) -> None:
        stats = self.engine.stats()
        self.metrics.queue_length.set(len(self.engine.waiting))
        self.metrics.running.set(len(self.engine.running))
        for state in ("used", "cached"):
            self.metrics.kv_blocks.labels(state=state).set(stats[f"blocks_{state}"])
        for name, counter in (
            ("prefix_hit_tokens", self.metrics.prefix_tokens.labels(result="hit")),
            ("prefix_miss_tokens", self.metrics.prefix_tokens.labels(result="miss")),
            ("preemptions", self.metrics.preemptions),
        ):
            counter.inc(stats[name] - self._counted[name])
            self._counted[name] = stats[name]
