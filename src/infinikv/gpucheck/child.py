"""Step 3, one context of the benchmark, in a child process (``python -m infinikv.gpucheck context``): the
model built on the device, InfiniGen's skew calibrated, the prompt prefilled once at batch 1, then every
(batch, policy) cell decoded, measured and appended to ``rows.jsonl`` as soon as it ends."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
import traceback
from pathlib import Path
from typing import Any

from .plan import GIB, LABEL, Plan, log
from .preflight import release_pinned

H200 = ("NVIDIA H200", 4.8e12, 141e9, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB")


def _emit(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _random_text(tokens: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(tokens)]
    return " ".join(words)


def _ensure_calibration(loaded, tokens: int) -> str:
    """InfiniGen's skew for these random weights, calibrated once on random text and kept in the cache."""
    from ..policies.infinigen import cached_skew, calibrate

    found = cached_skew(loaded.spec)
    if found is None:
        found = calibrate(loaded, text=_random_text(tokens), tokens=tokens)
    return f"{found.source} ({found.tokens} tokens)"


def _host_pinned(which: str = "peak") -> int | None:
    """Pinned host bytes allocated now (``which="current"``) or at the peak since the last reset."""
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    return int(stats.get(f"allocated_bytes.{which}", stats.get(f"allocated_bytes.all.{which}", 0))) or None


def _reset_host_peak() -> None:
    import torch

    if torch.cuda.is_available() and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()


def _copy_timing(caches, row_copies: list[int], steps: int) -> dict[str, float | None]:
    """Per decode step, summed over the rows (each row's pool has its own copy stream, so copies that
    overlap count twice): the copy streams' time, the compute stream's stall on them, the hidden rest, and
    the host time spent issuing fetches; from the CUDA events of each row's pool's fetches in the decode
    steps (``row_copies``: how many, per row of ``caches``)."""
    pools = [cache.policy.pool() for cache in caches]
    timings = [
        timing
        for pool, copies in zip(pools, row_copies, strict=True)
        if pool is not None and copies
        for timing in pool.counters.timings[-copies:]  # the decode steps' fetches come last
    ]
    if not timings:
        return {"copy_s_per_step": None, "stalled_s_per_step": None, "hidden_s_per_step": None}
    copy_s = stalled_s = issue_s = 0.0
    for timing in timings:
        copy, stalled = timing.seconds()
        copy_s, stalled_s, issue_s = copy_s + copy, stalled_s + stalled, issue_s + timing.issue_s
    return {
        "copy_s_per_step": copy_s / steps,
        "stalled_s_per_step": stalled_s / steps,
        "hidden_s_per_step": max(copy_s - stalled_s, 0.0) / steps,
        "hidden_fraction": max(copy_s - stalled_s, 0.0) / copy_s if copy_s else None,
        "issue_s_per_step": issue_s / steps,
        # rows read from the pinned pool by a kernel (else host-staged)
        "device_gather": next(pool for pool in pools if pool is not None).device_gather,
    }


def _projections(row: dict[str, Any], h2d: float | None) -> dict[str, float]:
    from ..bench import linkmodel

    traffic = linkmodel.StepTraffic(**row["traffic"])
    device = linkmodel.Device(*H200)
    links = {"pcie5": linkmodel.LINKS["pcie5"], "pcie4": linkmodel.LINKS["pcie4"]}
    if h2d:
        links["measured"] = linkmodel.with_bandwidth(linkmodel.LINKS["pcie5"], h2d)
    return {f"h200/{name}": linkmodel.project(traffic, link, device).step_s for name, link in links.items()}


def run_context(args: argparse.Namespace) -> None:
    """Child process: prefill one context once, then every (batch, policy) cell; rows go to rows.jsonl."""
    import torch

    from ..bench.grid import BenchConfig
    from ..bench.measure import make_entries, record_shared_prefills, run_once
    from ..bench.prompts import prompt_ids
    from ..bench.summary import kv_token_bytes, summarise_runs
    from ..forward import PrefillMemo
    from ..models import load
    from ..policies.infinigen.config import PAPER_PARTIAL_RATIO

    plan = Plan(**json.loads(args.plan))
    out, context = Path(args.out), args.context
    rows_path = out / "rows.jsonl"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    loaded = load(plan.model, device=device)
    log(f"context {context}: {plan.model} built on {device} in {time.perf_counter() - started:.1f} s")
    # the budget's selection without a floor (at the tiny check's 96 tokens a floor would be most of it)
    knobs = (
        ("budget", plan.budget),
        ("min_tokens", 0),
        ("alpha", math.inf),
        ("partial_ratio", PAPER_PARTIAL_RATIO),
    )
    config = BenchConfig(
        policies=plan.policies,
        batches=plan.batches,
        contexts=(context,),
        gen=plan.steps + 1,
        repeats=1,
        warmup=0,
        prefill_chunk=plan.prefill_chunk,
        knobs=knobs,
        corpus=None,
    )
    skew_source = (
        _ensure_calibration(loaded, plan.calibration_tokens) if "infinigen" in plan.policies else None
    )
    # The prompt leaves room for the decode steps: prompt + generated tokens = the cell's context, so a pool
    # sized for the prompt (pinned blocks of 2^k bytes, used whole) never grows while decoding.
    prompt = context - plan.steps
    ids, source = prompt_ids(loaded, prompt, 1, None)
    entries, _ = make_entries(loaded, {name: config.policy_knobs(name) for name in config.policies}, ())
    memo = PrefillMemo(per_config=True)  # one batch-1 prefill per prefill family, replayed over the batch
    prefill_start = time.perf_counter()
    record_shared_prefills(loaded, entries, ids, plan.prefill_chunk, memo)
    prefill_s = time.perf_counter() - prefill_start
    log(f"context {context}: batch-1 prefills of {prompt} tokens {prefill_s:.2f} s")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    host_ratio = args.host_ratio
    for batch in plan.batches:
        cell_start = time.perf_counter()
        kv = kv_token_bytes(loaded) * batch * context
        for entry in entries:
            base = {"batch": batch, "context": context, "prompt_tokens": prompt, "name": entry.name}
            base["label"] = LABEL
            held = _host_pinned("current") or 0  # the prefill memo stays pinned under every cell
            reason = _cannot_run(entry.name, kv, weights, held, host_ratio, device)
            if time.perf_counter() - cell_start > plan.cell_timeout:
                reason = f"cell time budget ({plan.cell_timeout:.0f} s) spent"
            if reason is not None:
                log(f"b{batch} ctx{context} {entry.name}: skipped ({reason})")
                _emit(rows_path, {**base, "skipped": reason})
                continue
            made = []

            def make_cache(entry=entry, made=made):
                made.append(entry.make_cache())
                return made[-1]

            _reset_host_peak()
            failure = None  # (row key, reason) of a run that did not finish
            try:
                run = run_once(
                    loaded,
                    dataclasses.replace(entry, make_cache=make_cache),
                    ids,
                    batch,
                    memo,
                    plan.steps,
                    plan.prefill_chunk,
                )
            except torch.OutOfMemoryError as exc:
                log(f"b{batch} ctx{context} {entry.name}: out of memory")
                failure = ("skipped", f"out of memory: {str(exc).splitlines()[0][:200]}")
            except Exception as exc:  # one policy's failure is a finding; the others still run
                traceback.print_exc()
                failure = ("failed", f"{type(exc).__name__}: {str(exc)[:300]}")
            if failure is not None:
                # outside the except block: its traceback's frames would keep the failed run's pool alive
                made.clear()
                release_pinned()
                _emit(rows_path, {**base, failure[0]: failure[1]})
                continue
            row = summarise_runs(loaded, entry, [run], batch, prompt)
            row.update(base)
            row["tpot_mean_s"] = sum(run.step_s) / len(run.step_s)
            row["steady_decode_tokens_per_s"] = batch / row["tpot_p50_s"] if row["tpot_p50_s"] else None
            row.update(_copy_timing(made, run.row_copies, plan.steps))
            row["peak_pinned_host_bytes"] = _host_pinned()
            if row["peak_pinned_host_bytes"] and row["kv_host_bytes"]:
                # Per byte of the batch's whole K/V, over what was pinned before the cell: a policy whose
                # pool keeps a budget (h2o) still stages the whole prompt once.
                row["pinned_per_kv_byte"] = max(row["peak_pinned_host_bytes"] - held, 0) / kv
                host_ratio = max(host_ratio, row["pinned_per_kv_byte"])
            row["projected_step_s_h200"] = _projections(row, args.h2d)
            row["prompt_source"], row["skew"] = source, skew_source if entry.name == "infinigen" else None
            row["prefill_s_batch1_all_families"] = prefill_s
            made.clear()
            release_pinned()  # else the next policy's fit check counts this one's cached pinned blocks
            _emit(rows_path, row)
            log(
                f"b{batch} ctx{context} {entry.name}: {row['steady_decode_tokens_per_s']:.1f} tok/s, "
                f"TPOT {1e3 * row['tpot_p50_s']:.1f} ms, {row['bytes_h2d_per_step'] / 1e9:.2f} GB/step"
            )
        release_pinned()


def _cannot_run(name: str, kv: int, weights: int, held: int, host_ratio: float, device) -> str | None:
    """Why a run would not fit in memory, or None: dense keeps the K/V on the device (plus the spare of its
    growth, a quarter), the others in pinned host memory: ``held`` bytes already pinned plus ``host_ratio``
    x the K/V (measured or the prior). A misjudged dense run still ends as a recorded out-of-memory row."""
    import psutil
    import torch

    if device.type != "cuda":
        return None
    if name == "dense":
        total = torch.cuda.get_device_properties(device).total_memory
        need = weights + 1.25 * kv + 8 * GIB  # + the shared prefill's K/V and activations
        return None if need < total else f"device memory: ~{need / GIB:.0f} GiB needed of {total / GIB:.0f}"
    need, available = host_ratio * kv, psutil.virtual_memory().available
    if need > 0.85 * (available + held) - held:
        return f"host memory: ~{need / GIB:.0f} GiB pinned needed, {available / GIB:.0f} GiB available"
    return None
