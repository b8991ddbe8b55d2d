"""The request queue and the one worker thread that runs the model.

The HTTP layer ``submit``s a :class:`Job` (a prompt's token ids, a policy config, sampling settings) and
reads its events from an asyncio queue: ``("text", piece)`` while it streams, then ``("done",
RequestResult)`` or ``("error", message)``. The worker takes the oldest waiting job plus every other
waiting job with the same policy config and sampling settings (up to ``max_batch``) and runs them as one
``Generator.generate`` call; rows finish independently, and a job whose client went away is cancelled at
the next decode step. Jobs with different policies never share a batch, so each batch's cache and policy
instance is its own. A new job waits for the running batch to end (no joining a batch mid-flight).
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

from ..generate import GenerationConfig, Generator, RequestResult
from ..models import LoadedModel
from ..policies import PolicyConfig
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

    @property
    def batch_key(self) -> tuple:
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


class Scheduler:
    def __init__(self, loaded: LoadedModel, metrics: ServerMetrics, max_batch: int = 8, max_queue: int = 64):
        self.loaded = loaded
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._lock = threading.Condition()
        self._stopping = False
        self._serials = itertools.count()
        self._generators: dict[PolicyConfig, Generator] = {}  # one per config: prepare() runs once
        self._thread = threading.Thread(target=self._work, name="infinikv-generate", daemon=True)
        self.batches_served = 0

    # -- the HTTP side ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(
        self, prompt: list[int], policy: PolicyConfig, sampling: GenerationConfig, stream: bool
    ) -> Job:
        job = Job(prompt, policy, sampling, stream, asyncio.get_running_loop(), serial=next(self._serials))
        with self._lock:
            if self._stopping:
                raise ShuttingDown
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
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
            job.emit("error", "the server is shutting down")
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
            self._generators[policy] = Generator(self.loaded, policy)
        return self._generators[policy]

    def _serve(self, batch: list[Job]) -> None:
        limits = [job.sampling.max_new_tokens for job in batch]
        policy = batch[0].policy
        sampling = dataclasses.replace(batch[0].sampling, max_new_tokens=max(limits))
        name = type(policy).__name__
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
                cancelled=lambda row: batch[row].cancelled.is_set(),
                row_max_new_tokens=limits,
            )
        except Exception as exc:  # a failed batch must not stop the server
            log.exception("generation failed for a batch of %d", len(batch))
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
            job.emit("done", result)
