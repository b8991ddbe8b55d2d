"""The benchmark loop: prompts, prefill, timed decode steps, per-cell summaries and in-run ratios.

It drives ``InfinikvCache`` (or a transformers cache, for the peers) and the model's forward directly, as
``engine.Generator`` does, so every decode step can be timed on its own. Greedy decoding, real tokens.

Prefill modes:

* ``shared`` (default): each context length is prefilled once, batch 1, through the model (a
  ``DynamicCache``); every policy and peer then ingests that prompt K/V, repeated over the batch, through
  its own cache's ``update`` (the same call the model makes in prefill, chunk by chunk), so long cells do not
  pay one full prefill per policy, batch row and repeat. TTFT is then an estimate: the measured batch-1
  forward time x batch + the measured ingest time of the policy. Policies whose prefill needs the prompt's
  attention weights would see none (no registered policy needs them today).
* ``per-run``: every run prefills its batch through the model with its own cache (distinct rows), and TTFT
  is measured.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..cache import InfinikvCache, chunk_bounds
from ..errors import InfinikvError, InputError
from ..models import LoadedModel
from ..policies import POLICIES, make_config
from . import linkmodel
from .peers import PEERS, peer_factory, peer_kv_bytes, peer_unavailable

Tensor = torch.Tensor
PREFILL_MODES = ("shared", "per-run")
CROSSOVER_MARGIN = 0.1  # "pays off" = projected step at least 10 % faster than offload


@dataclass(frozen=True)
class BenchConfig:
    """The grid and how each cell is run.

    policies: infinikv policy names; peers: transformers caches (``PEERS``); batches x contexts: the cells;
    gen: tokens generated per sequence (the first from the prefill, then gen-1 timed decode steps); repeats:
    timed runs per policy and cell, interleaved across policies, medians reported; warmup: decode steps of
    an untimed run per policy and cell; prefill: ``shared`` or ``per-run`` (module docstring); knobs: policy
    knob values, each given to the policies that have it; corpus: text the prompts are cut from (None or
    unavailable: tokenizer-encoded filler)."""

    policies: tuple[str, ...] = ("dense", "offload")
    peers: tuple[str, ...] = ()
    batches: tuple[int, ...] = (1,)
    contexts: tuple[int, ...] = (1024,)
    gen: int = 128
    repeats: int = 3
    warmup: int = 4
    prefill: str = "shared"
    prefill_chunk: int = 2048
    knobs: tuple[tuple[str, Any], ...] = ()
    corpus: str | None = "austen"

    def __post_init__(self):
        if self.gen < 2:
            raise InputError(
                f"--gen must be at least 2 (one prefill token + timed decode steps), got {self.gen}"
            )
        if self.repeats < 1 or self.warmup < 0:
            raise InputError("--repeats must be at least 1 and --warmup at least 0")
        if self.prefill not in PREFILL_MODES:
            raise InputError(f"--prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if not self.batches or min(self.batches) < 1 or not self.contexts or min(self.contexts) < 2:
            raise InputError("--batch values must be >= 1 and --context values >= 2")
        if not self.policies and not self.peers:
            raise InputError("nothing to run: no policies and no peers")
        for name in self.peers:
            if name not in PEERS:
                raise InputError(f"unknown peer '{name}'; available: {', '.join(PEERS)}")
        for name in self.policies:
            make_config(name, **self.policy_knobs(name))  # unknown policy or bad knob value: fail now

    def policy_knobs(self, name: str) -> dict[str, Any]:
        own = {f for f in make_config(name).knobs()} if name in POLICIES else set()
        return {k: v for k, v in self.knobs if k in own}


# -- prompts and prefill -------------------------------------------------------------------------------------
def prompt_ids(loaded: LoadedModel, tokens: int, rows: int, corpus: str | None) -> tuple[Tensor, str]:
    """[rows, tokens] real token ids: consecutive slices of a corpus, else of repeated filler text."""
    tokenizer = loaded.tokenizer
    text, source = None, "filler"
    if corpus is not None:
        from ..data import load_corpus

        try:
            text, source = load_corpus(corpus), corpus
        except InfinikvError:
            text = None
    if text is None:
        text = " ".join(
            f"Line {i}: the {w} river ran past the {v} mill while {u} bells rang twice."
            for i, (w, v, u) in enumerate(
                zip(["slow", "cold", "wide"] * 400, ["old", "red"] * 600, ["six", "ten"] * 600, strict=False)
            )
        )
    needed = tokens * rows
    ids: list[int] = []
    start = 0
    while len(ids) < needed:  # encode only as much text as the grid needs (~6 characters per token)
        piece = text[start : start + max(4096, 8 * (needed - len(ids)))]
        if not piece:
            start, piece = 0, text[: 8 * needed]
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        start += len(piece)
    return torch.tensor(ids[:needed]).view(rows, tokens).to(loaded.device), source


def prefill_forward(loaded: LoadedModel, cache: Cache, ids: Tensor, chunk: int) -> Tensor:
    """Feed ``ids`` through the model in chunks; returns the last position's logits [batch, vocab]."""
    logits = None
    for begin, end in chunk_bounds(ids.shape[1], chunk):
        positions = torch.arange(begin, end, device=ids.device).expand(ids.shape[0], -1)
        logits = loaded.model(
            input_ids=ids[:, begin:end], position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        ).logits
    return logits[:, -1]


@dataclass
class SharedPrefill:
    """One prompt's K/V per layer ([1, kv_heads, tokens, head_dim]), its first token and forward time."""

    keys: list[Tensor]
    values: list[Tensor]
    first_token: Tensor  # [1]
    forward_s: float

    def ingest(self, cache: Cache, batch: int, chunk: int) -> None:
        """Hand the prompt K/V, repeated over ``batch`` rows, to ``cache`` chunk by chunk as prefill does."""
        for begin, end in chunk_bounds(self.keys[0].shape[2], chunk):
            for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
                k_rows = k[:, :, begin:end].expand(batch, -1, -1, -1).contiguous()
                v_rows = v[:, :, begin:end].expand(batch, -1, -1, -1).contiguous()
                cache.update(k_rows, v_rows, layer)


@torch.inference_mode()
def shared_prefill(loaded: LoadedModel, ids: Tensor, chunk: int) -> SharedPrefill:
    cache = DynamicCache(config=loaded.model.config)
    start = _now(loaded.device)
    logits = prefill_forward(loaded, cache, ids[:1], chunk)
    forward_s = _now(loaded.device) - start
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return SharedPrefill(keys, values, logits.argmax(-1), forward_s)


# -- one run -------------------------------------------------------------------------------------------------
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
class Sample:
    """What one run measured."""

    step_s: list[float]
    ttft_s: float
    ingest_s: float
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    copies: int
    peak_rss: int
    peak_device: int | None
    kv_bytes: dict[str, int | None]


@dataclass
class Runner:
    """Runs one entry (policy or peer) on one cell."""

    name: str
    kind: str  # "policy" or "peer"
    make_cache: Callable[[], Cache]
    overlapped: bool  # prefetches layer i+1 during layer i
    partial_ratio: float = 0.0  # share of key columns the rehearsal reads (InfiniGen)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _policy_stats(cache: Cache) -> tuple[dict[str, Any], int]:
    if not isinstance(cache, InfinikvCache):
        return {}, 0
    pool = cache.policy.pool()
    return cache.policy.stats(), pool.counters.copies if pool is not None else 0


@torch.inference_mode()
def run_once(
    loaded: LoadedModel,
    runner: Runner,
    ids: Tensor,
    shared: SharedPrefill | None,
    steps: int,
    chunk: int,
) -> Sample:
    device, model = loaded.device, loaded.model
    batch, context = ids.shape
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakMemory() as memory:
        cache = runner.make_cache()
        try:
            start = _now(device)
            if shared is not None:
                shared.ingest(cache, batch, chunk)
                ingest_s = _now(device) - start
                ttft_s = shared.forward_s * batch + ingest_s
                token = shared.first_token.expand(batch)[:, None]
            else:
                token = prefill_forward(loaded, cache, ids, chunk).argmax(-1)[:, None]
                ttft_s = ingest_s = _now(device) - start
            before, copies_before = _policy_stats(cache)
            positions = torch.full((batch, 1), context, device=device, dtype=torch.long)
            times = []
            for step in range(steps):
                start = _now(device)
                logits = model(
                    input_ids=token,
                    position_ids=positions + step,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits
                token = logits[:, -1:].argmax(-1)
                times.append(_now(device) - start)
            after, copies_after = _policy_stats(cache)
            if isinstance(cache, InfinikvCache):
                kv_bytes: dict[str, int | None] = dict(cache.policy.kv_bytes())
            else:
                kv_bytes = {"host": 0, "device": peer_kv_bytes(cache)}
        finally:
            if isinstance(cache, InfinikvCache):
                cache.close()
            del cache
    peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return Sample(
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


# -- the grid ------------------------------------------------------------------------------------------------
def make_runners(loaded: LoadedModel, config: BenchConfig) -> tuple[list[Runner], list[dict[str, str]]]:
    """What will run, and what is skipped with the reason."""
    runners, skipped = [], []
    for name in config.policies:
        policy_config = make_config(name, **config.policy_knobs(name))
        cls = POLICIES[name]
        runners.append(
            Runner(
                name,
                "policy",
                lambda c=policy_config: InfinikvCache(loaded.model, c, device=loaded.device),
                overlapped=cls.prefetches,
                partial_ratio=float(policy_config.knobs().get("partial_ratio", 0.0)),
            )
        )
    for name in config.peers:
        reason = peer_unavailable(name, loaded.device)
        if reason is not None:
            skipped.append({"name": name, "reason": reason})
            continue
        runners.append(
            Runner(name, "peer", peer_factory(name, loaded.model), overlapped=name == "hf-offloaded")
        )
    return runners, skipped


def run_bench(loaded: LoadedModel, config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run the grid; returns {"config", "model", "cells": [...]} (see ``summarise`` for each row's fields)."""
    if "infinigen" in config.policies:
        from ..policies.infinigen import ensure_skew

        ensure_skew(loaded)  # InfiniGen needs the model's skewing matrices: calibrate once if none is cached
    runners, skipped_peers = make_runners(loaded, config)
    steps = config.gen - 1
    cells = []
    total = len(config.contexts) * len(config.batches) * len(runners) * config.repeats
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    for context in config.contexts:
        if context + config.gen > loaded.max_context:
            raise InputError(
                f"context {context} + gen {config.gen} exceeds the model's {loaded.max_context} tokens"
            )
        all_ids, source = prompt_ids(loaded, context, max(config.batches), config.corpus)
        shared = None
        if config.prefill == "shared":
            bar.set_postfix_str(f"prefill {context} tokens")
            shared = shared_prefill(loaded, all_ids, config.prefill_chunk)
        for batch in config.batches:
            ids = all_ids[:1].expand(batch, -1) if shared is not None else all_ids[:batch]
            samples: dict[str, list[Sample]] = {r.name: [] for r in runners}
            failed: list[dict[str, str]] = []
            live = list(runners)
            for repeat in range(-1 if config.warmup else 0, config.repeats):
                for runner in list(live):
                    bar.set_postfix_str(
                        f"b{batch} ctx{context} {runner.name} {'warm-up' if repeat < 0 else repeat}"
                    )
                    try:
                        sample = run_once(
                            loaded,
                            runner,
                            ids,
                            shared,
                            config.warmup if repeat < 0 else steps,
                            config.prefill_chunk,
                        )
                    except (InfinikvError, NotImplementedError) as exc:
                        failed.append({"name": runner.name, "reason": f"{type(exc).__name__}: {exc}"})
                        live.remove(runner)
                        bar.update(config.repeats)
                        continue
                    if repeat >= 0:
                        samples[runner.name].append(sample)
                        bar.update(1)
            rows = [summarise(loaded, r, samples[r.name], batch, context) for r in live]
            add_ratios(rows)
            cells.append(
                {
                    "batch": batch,
                    "context": context,
                    "prompt_source": source,
                    "prefill_forward_s_batch1": round(shared.forward_s, 4) if shared is not None else None,
                    "rows": rows,
                    "skipped": skipped_peers + failed,
                    "crossover": crossovers(rows),
                }
            )
        del shared
    bar.close()
    return {"config": _config_dict(config), "cells": cells}


def _config_dict(config: BenchConfig) -> dict[str, Any]:
    out = {k: getattr(config, k) for k in config.__dataclass_fields__}
    out["knobs"] = dict(config.knobs)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# -- summaries -----------------------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation between closest ranks
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _delta(sample: Sample, key: str) -> float:
    return float(sample.stats_after.get(key, 0.0)) - float(sample.stats_before.get(key, 0.0))


def _rehearsal_s(sample: Sample) -> float:
    keys = [k for k in sample.stats_after if "rehearsal" in k and k.endswith("_s")]
    return sum(_delta(sample, k) for k in keys)


def kv_token_bytes(loaded: LoadedModel) -> int:
    """Bytes of K and V for one token across all layers, one sequence."""
    spec = loaded.spec
    element = next(loaded.model.parameters()).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element


def summarise(
    loaded: LoadedModel, runner: Runner, samples: list[Sample], batch: int, context: int
) -> dict[str, Any]:
    """One row: medians over the repeats of what the runs measured, plus the link-model projections."""
    steps = len(samples[0].step_s)
    med = statistics.median
    per_step = [sum(s.step_s) / steps for s in samples]
    token_bytes = kv_token_bytes(loaded)
    # Full offload moves every cached token of every layer each step: the reference for "fraction fetched".
    offload_bytes = token_bytes * batch * sum(context + s for s in range(steps))
    if runner.kind == "policy":
        moved = med([_delta(s, "bytes_h2d") for s in samples])
        copies = med([2 * s.copies for s in samples]) / steps  # one fetch = a K copy and a V copy
        attended = med([float(s.stats_after.get("mean_tokens_attended", 0.0)) for s in samples])
    else:
        moved = float(offload_bytes) if runner.overlapped else 0.0  # the offloading peer moves every layer
        copies = 2.0 * loaded.spec.num_layers if runner.overlapped else 0.0
        attended = context + (steps + 1) / 2  # dense: all cached tokens plus the new one
    mean_cached = context + (steps + 1) / 2
    rehearsal = med([_rehearsal_s(s) for s in samples]) / steps
    wait = med([_delta(s, "prefetch_wait_s") for s in samples]) / steps
    step_s = med(per_step)
    row: dict[str, Any] = {
        "name": runner.name,
        "kind": runner.kind,
        "batch": batch,
        "context": context,
        "decode_steps": steps,
        "repeats": len(samples),
        "decode_tokens_per_s": med([batch * steps / sum(s.step_s) for s in samples]),
        "step_s": step_s,
        "ttft_s": med([s.ttft_s for s in samples]),
        "ingest_s": med([s.ingest_s for s in samples]),
        "tpot_p50_s": med([_percentile(s.step_s, 50) for s in samples]),
        "tpot_p99_s": med([_percentile(s.step_s, 99) for s in samples]),
        "bytes_h2d_per_step": moved / steps,
        "bytes_h2d_per_token": moved / steps / batch,
        "kv_fraction_moved": moved / offload_bytes if offload_bytes else 0.0,
        "kv_fraction_attended": attended / mean_cached,
        "copies_per_step": copies,
        "rehearsal_s_per_step": rehearsal,
        "rehearsal_fraction": rehearsal / step_s if step_s else 0.0,
        "prefetch_wait_s_per_step": wait,
        "prefetch_wait_fraction": wait / step_s if step_s else 0.0,
        "peak_host_rss_bytes": max(s.peak_rss for s in samples),
        "peak_device_bytes": max(s.peak_device for s in samples)
        if samples[0].peak_device is not None
        else None,
        "kv_host_bytes": samples[-1].kv_bytes.get("host"),
        "kv_device_bytes": samples[-1].kv_bytes.get("device"),
    }
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    element_row = token_bytes // (2 * loaded.spec.num_layers)  # one layer's K (or V), one token
    traffic = linkmodel.StepTraffic(
        bytes_h2d=row["bytes_h2d_per_step"],
        copies=copies,
        device_read_bytes=weights
        + attended * token_bytes * batch
        + runner.partial_ratio * element_row * loaded.spec.num_layers * mean_cached * batch,
        overlapped=runner.overlapped,
        layers=loaded.spec.num_layers,
    )
    row["traffic"] = {k: getattr(traffic, k) for k in traffic.__dataclass_fields__}
    row["projected_step_s"] = {
        f"{d}/{link}": linkmodel.project(traffic, linkmodel.LINKS[link], linkmodel.DEVICES[d]).step_s
        for d in linkmodel.DEVICES
        for link in linkmodel.LINKS
    }
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios to dense and offload of the same cell (same run, same repeats), when those ran."""
    by_name = {r["name"]: r for r in rows}
    for row in rows:
        for ref in ("dense", "offload"):
            other = by_name.get(ref)
            ok = other is not None and other["decode_tokens_per_s"] > 0
            row[f"speedup_vs_{ref}"] = (
                row["decode_tokens_per_s"] / other["decode_tokens_per_s"] if ok else None
            )
        offload = by_name.get("offload")
        moved = offload["bytes_h2d_per_step"] if offload else 0
        row["bytes_vs_offload"] = row["bytes_h2d_per_step"] / moved if moved else None


def crossovers(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per device: the link bandwidth (bytes/s) above which each selective policy's projected step is no
    longer ``CROSSOVER_MARGIN`` faster than offload's."""
    by_name = {r["name"]: r for r in rows}
    if "offload" not in by_name:
        return {}
    slow = linkmodel.StepTraffic(**by_name["offload"]["traffic"])
    out = {}
    for row in rows:
        if row["kind"] != "policy" or row["name"] in ("dense", "offload") or not row["bytes_h2d_per_step"]:
            continue
        fast = linkmodel.StepTraffic(**row["traffic"])
        for d, device in linkmodel.DEVICES.items():
            out[f"{row['name']}/{d}"] = linkmodel.crossover_bandwidth(
                fast, slow, device, margin=CROSSOVER_MARGIN
            )
    return out
