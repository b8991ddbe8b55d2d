"""One benchmark run: build a batch, prefill it, time each greedy decode step, and read what the policy moved
and held. Real tokens.

An infinikv policy runs as the engine serves it (:class:`PolicyBatch`, on ``engine.ForcedRows``): each row
is one sequence with its own cache and policy instance, its prompt read in chunks from its start, and every
decode step is the engine's (``engine.ragged.decode_step``: no padding, each row's attention and selection
its own). A transformers peer has no such engine: its cache takes the batch whole through one
:class:`~infinikv.forward.Driver` (:class:`PeerBatch`), as transformers runs it.

Prefill modes (``BenchConfig.prefill``):

* ``shared``: :func:`record_shared_prefills` runs each context's prompt once at batch 1 through the real
  prefill path of one cache per prefill family (``Policy.prefill_family``; a policy of no family is a
  family of its own configuration), recorded by a :class:`~infinikv.forward.PrefillMemo`: a policy's as
  the engine reads a prompt (``Driver.read_prompt``), the peers' through the dense family's batch prefill.
  Every run then replays its family's recording into each row, through the same ``Cache.update`` calls the
  model makes, with the state prefill leaves besides the K/V (H2O's prompt scores), so long cells do not
  pay one full prefill per row and repeat. TTFT is then an estimate: the recorded batch-1 forward time x
  batch + the measured replay time.
* ``per-run``: every run prefills each row's own prompt through the model, and TTFT is measured.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..cache import InfinikvCache
from ..clock import now
from ..engine.forced import ForcedRows
from ..errors import InfinikvError
from ..forward import Driver, PrefillMemo
from ..models import LoadedModel
from ..policies import POLICIES, PolicyConfig, make_config, prepare
from .peers import peer_factory, peer_kv_bytes, peer_unavailable

Tensor = torch.Tensor


class PeakMemory:
    """Samples the process's resident set size on a thread (the peak of host memory during a run)."""

    def __init__(self, interval: float = 0.01):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


@dataclass
class RunMeasurement:
    """What one benchmark run measured."""

    step_s: list[float]
    ttft_s: float
    ingest_s: float  # the prefill call itself: a replay in shared mode, the forward passes per run
    stats_before: dict[str, Any]  # the policy's statistics after prefill ...
    stats_after: dict[str, Any]  # ... and after the last decode step
    copies: int  # host pool copy calls during decode, every row's
    row_copies: list[int]  # of them, each row's cache's (one entry for a peer's batch)
    peak_rss: int
    peak_device: int | None
    kv_bytes: dict[str, int | None]


@dataclass
class BenchEntry:
    """One cache the benchmark runs: an infinikv policy or a transformers peer."""

    name: str
    kind: str  # "policy" or "peer"
    make_cache: Callable[[], Cache]
    prefetches: bool  # starts the copy of layer i+1 during layer i (``Policy.prefetches``)
    # The policy whose prefill this entry's shared prefill replays (its own, or dense for the peers).
    prefill_policy: PolicyConfig | None = None
    compile: bool = False  # decode steps under torch.compile (forward.decode_call)

    def open(self, loaded: LoadedModel, batch: int) -> PolicyBatch | PeerBatch:
        """An empty batch of ``batch`` rows of this cache."""
        if self.kind == "policy":
            caches: list[InfinikvCache] = []
            try:
                for _ in range(batch):
                    caches.append(self.make_cache())
                return PolicyBatch(loaded, caches, self.compile)
            except BaseException:
                for cache in caches:
                    cache.close()
                raise
        # transformers' caches store what they are handed, so they can replay a dense-family prefill
        return PeerBatch(Driver(loaded, self.make_cache(), family="dense", compile=self.compile), batch)


class PolicyBatch:
    """An infinikv policy's rows, each one sequence as the engine serves it (``engine.ForcedRows``)."""

    def __init__(self, loaded: LoadedModel, caches: list[InfinikvCache], compile: bool):
        self.loaded = loaded
        self.caches = caches
        self.rows = ForcedRows(loaded, caches, compile=compile)

    def prefill(self, ids: Tensor, chunk: int, memo: PrefillMemo | None) -> tuple[Tensor, float, float]:
        """Each row's prompt, read from the start: with a ``memo``, the recording of ``ids[:1]`` replayed
        into every row, else row r's own ``ids[r]`` through the model. Returns the first generated token of
        each row [batch], the TTFT (an estimate when replayed) and the time of the prefill calls."""
        batch = len(self.caches)
        start = now(self.loaded.device)
        logits = [
            self.rows.prefill(row, ids[:1] if memo is not None else ids[row : row + 1], chunk, memo)
            for row in range(batch)
        ]
        ingest_s = now(self.loaded.device) - start
        recorded = self.rows.drivers[0].replayed
        ttft_s = ingest_s if recorded is None else recorded.forward_s * batch + ingest_s
        return torch.cat(logits).argmax(-1), ttft_s, ingest_s

    def step(self, tokens: Tensor) -> Tensor:
        """One decode step of every row; returns the next tokens [batch]."""
        return self.rows.step(range(len(self.caches)), tokens).argmax(-1)

    def stats(self) -> tuple[dict[str, Any], list[int]]:
        """The rows' statistics together (``ForcedRows.stats``) and each row's pool copy calls so far."""
        pools = [cache.policy.pool() for cache in self.caches]
        return self.rows.stats(), [pool.counters.copies if pool is not None else 0 for pool in pools]

    def kv_bytes(self) -> dict[str, int | None]:
        """The K/V bytes every row holds on the host and on the device."""
        rows = [cache.policy.kv_bytes() for cache in self.caches]
        return {place: sum(row[place] for row in rows) for place in ("host", "device")}

    def close(self) -> None:
        self.rows.close()


class PeerBatch:
    """A transformers cache's batch, whole, through one :class:`~infinikv.forward.Driver`."""

    def __init__(self, driver: Driver, batch: int):
        self.driver = driver
        self.batch = batch

    def prefill(self, ids: Tensor, chunk: int, memo: PrefillMemo | None) -> tuple[Tensor, float, float]:
        """As :meth:`PolicyBatch.prefill`, the batch in one prefill: with a ``memo``, the recording of
        ``ids[:1]`` repeated over the rows, else ``ids[:batch]`` through the model."""
        device = self.driver.loaded.device
        start = now(device)
        if memo is not None:
            logits = self.driver.prefill(ids[:1], chunk=chunk, memo=memo, repeat=self.batch)
        else:
            logits = self.driver.prefill(ids[: self.batch], chunk=chunk)
        ingest_s = now(device) - start
        recorded = self.driver.replayed
        ttft_s = ingest_s if recorded is None else recorded.forward_s * self.batch + ingest_s
        return logits.argmax(-1), ttft_s, ingest_s

    def step(self, tokens: Tensor) -> Tensor:
        return self.driver.step(tokens).argmax(-1)

    def stats(self) -> tuple[dict[str, Any], list[int]]:
        return {}, [0]

    def kv_bytes(self) -> dict[str, int | None]:
        return {"host": 0, "device": peer_kv_bytes(self.driver.cache)}

    def close(self) -> None:
        self.driver.close()


COMPILED = "+compile"  # the name of a policy's compiled twin: "dense+compile"


def make_entries(
    loaded: LoadedModel,
    policies: dict[str, dict[str, Any]],
    peers: tuple[str, ...],
    compile: bool = False,
) -> tuple[list[BenchEntry], list[dict[str, str]]]:
    """What will run (``policies``: name -> knobs; with ``compile``, each policy also as a twin whose decode
    steps run compiled, named ``<policy>+compile``), and which peers are skipped, with the reason. Runs
    each policy's model-level preparation (``Policy.prepare``, e.g. InfiniGen's calibration) once."""
    entries, skipped = [], []
    for name, knobs in policies.items():
        config = make_config(name, **knobs)
        prepare(config, loaded)
        for compiled in (False, True) if compile else (False,):
            entries.append(
                BenchEntry(
                    name + COMPILED if compiled else name,
                    "policy",
                    lambda c=config: InfinikvCache(loaded.model, c, device=loaded.device),
                    prefetches=POLICIES[name].prefetches,
                    prefill_policy=config,
                    compile=compiled,
                )
            )
    for name in peers:
        reason = peer_unavailable(name, loaded.device)
        if reason is not None:
            skipped.append({"name": name, "reason": reason})
            continue
        entries.append(
            BenchEntry(
                name,
                "peer",
                peer_factory(name, loaded.model),
                prefetches=name == "hf-offloaded",
                prefill_policy=make_config("dense"),
            )
        )
    return entries, skipped


def record_shared_prefills(
    loaded: LoadedModel, entries: list[BenchEntry], ids: Tensor, chunk: int, memo: PrefillMemo
) -> None:
    """Run the batch-1 prompt ``ids`` [1, tokens] through the prefill of each entry's ``prefill_policy``, as
    the entry's runs read it (a policy's from its start, as the engine does; a peer's as one batch), so
    ``memo`` holds one recording per prefill family and path (later ones just replay)."""
    done: set[tuple[str, PolicyConfig]] = set()
    for entry in entries:
        if (entry.kind, entry.prefill_policy) in done:
            continue
        done.add((entry.kind, entry.prefill_policy))
        try:
            cache = InfinikvCache(loaded.model, entry.prefill_policy, device=loaded.device)
            with Driver(loaded, cache) as driver:
                if entry.kind == "policy":
                    driver.read_prompt(ids, chunk, memo)
                else:
                    driver.prefill(ids, chunk=chunk, memo=memo)
        except (InfinikvError, NotImplementedError):
            continue  # nothing recorded: the entry's own runs meet the same error and report it


@torch.inference_mode()
def run_once(
    loaded: LoadedModel,
    entry: BenchEntry,
    ids: Tensor,
    batch: int,
    memo: PrefillMemo | None,
    steps: int,
    chunk: int,
) -> RunMeasurement:
    """Prefill ``batch`` rows (``PolicyBatch.prefill``), then ``steps`` greedy decode steps, each timed on
    its own."""
    device = loaded.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakMemory() as memory:
        rows = entry.open(loaded, batch)
        try:
            token, ttft_s, ingest_s = rows.prefill(ids, chunk, memo)
            before, copies_before = rows.stats()
            times = []
            for _ in range(steps):
                start = now(device)
                token = rows.step(token)
                times.append(now(device) - start)
            after, copies_after = rows.stats()
            kv_bytes = rows.kv_bytes()
        finally:
            rows.close()
            del rows
    peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    row_copies = [end - begin for begin, end in zip(copies_before, copies_after, strict=True)]
    return RunMeasurement(
        times,
        ttft_s,
        ingest_s,
        before,
        after,
        sum(row_copies),
        row_copies,
        memory.peak,
        peak_device,
        kv_bytes,
    )
