"""One benchmark run: build a cache, prefill it through a :class:`~infinikv.forward.Driver`, time each
decode step, and read what the policy moved and held. Greedy decoding, real tokens.

Prefill modes (``BenchConfig.prefill``):

* ``shared``: :func:`record_shared_prefills` runs each context's prompt once at batch 1 through the real
  prefill path of one cache per prefill family (``Policy.prefill_family``; a policy of no family is a
  family of its own configuration), recorded by a :class:`~infinikv.forward.PrefillMemo`. Every run then
  replays its family's recording repeated over the batch, through the same ``Cache.update`` calls the
  model makes, with the state prefill leaves besides the K/V (H2O's prompt scores), so long cells do not pay
  one full prefill per cache, batch row and repeat. TTFT is then an estimate: the recorded batch-1 forward
  time x batch + the measured replay time. The transformers peers replay the dense family's recording.
* ``per-run``: every run prefills its batch through the model with its own cache (distinct rows), and TTFT
  is measured.
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
    copies: int  # host pool copy calls during decode
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

    def driver(self, loaded: LoadedModel) -> Driver:
        # transformers' caches store what they are handed, so they can replay a dense-family prefill.
        family = "dense" if self.kind == "peer" else None
        return Driver(loaded, self.make_cache(), family=family, compile=self.compile)


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
    """Run the batch-1 prompt ``ids`` [1, tokens] through the prefill of each entry's ``prefill_policy``,
    so ``memo`` holds one recording per prefill family (later ones of a family just replay)."""
    done: set[PolicyConfig] = set()
    for entry in entries:
        if entry.prefill_policy in done:
            continue
        done.add(entry.prefill_policy)
        try:
            cache = InfinikvCache(loaded.model, entry.prefill_policy, device=loaded.device)
            with Driver(loaded, cache) as driver:
                driver.prefill(ids, chunk=chunk, memo=memo)
        except (InfinikvError, NotImplementedError):
            continue  # nothing recorded: the entry's own runs meet the same error and report it


def prefill(
    loaded: LoadedModel, driver: Driver, ids: Tensor, batch: int, chunk: int, memo: PrefillMemo | None
) -> tuple[Tensor, float, float]:
    """Prefill ``driver``'s cache with ``batch`` rows: with a ``memo``, the recording of ``ids[:1]``
    replayed over the rows, else ``ids[:batch]`` through the model. Returns the first generated token
    [batch, 1], the TTFT (an estimate when replayed) and the time of the prefill call."""
    start = now(loaded.device)
    if memo is not None:
        logits = driver.prefill(ids[:1], chunk=chunk, memo=memo, repeat=batch)
    else:
        logits = driver.prefill(ids[:batch], chunk=chunk)
    ingest_s = now(loaded.device) - start
    recorded = driver.replayed
    ttft_s = ingest_s if recorded is None else recorded.forward_s * batch + ingest_s
    return logits.argmax(-1)[:, None], ttft_s, ingest_s


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
    """Prefill (see :func:`prefill`), then ``steps`` greedy decode steps, each timed on its own."""
    device = loaded.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakMemory() as memory:
        driver = entry.driver(loaded)
        try:
            token, ttft_s, ingest_s = prefill(loaded, driver, ids, batch, chunk, memo)
            before, copies_before = _policy_stats(driver)
            times = []
            for _ in range(steps):
                start = now(device)
                token = driver.step(token).argmax(-1)
                times.append(now(device) - start)
            after, copies_after = _policy_stats(driver)
            if driver.policy is not None:
                kv_bytes: dict[str, int | None] = dict(driver.policy.kv_bytes())
            else:
                kv_bytes = {"host": 0, "device": peer_kv_bytes(driver.cache)}
        finally:
            driver.close()
            del driver
    peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return RunMeasurement(
        times,
        ttft_s,
        ingest_s,
        before,
        after,
        copies_after - copies_before,
        memory.peak,
        peak_device,
        kv_bytes,
    )


def _policy_stats(driver: Driver) -> tuple[dict[str, Any], int]:
    if driver.policy is None:
        return {}, 0
    pool = driver.policy.pool()
    return driver.stats(), pool.counters.copies if pool is not None else 0
