"""The GPU check: everything a GPU machine should confirm, in one run that fits a few minutes.

``python -m infinikv.gpucheck OUTDIR`` (``scripts/gpu_check.sh OUTDIR`` sets it up) does, in order:

1. **preflight**: Python, package versions, every infinikv module imports, the CUDA device, and the measured
   pinned host -> device copy bandwidth (one 1 GiB copy). Anything missing fails here, loudly.
2. **tests**: the tests marked ``cuda`` (tests/test_cuda.py) in a subprocess, JUnit XML kept.
3. **benchmark**: a model of a real size with random weights (``dummy:llama-3-8b``, see ``infinikv.dummy``;
   every figure is labelled "dummy weights") over batch x context cells, each context in its own subprocess
   with a timeout. Each context is prefilled once at batch 1 and every policy ingests that prompt's K/V
   repeated over the batch (the benchmark's shared prefill, ``infinikv.bench.measure``), then decodes a few
   greedy steps. Per policy: decode tok/s, TPOT, bytes host -> device, the copy stream's time per step and
   how much of it the compute stream waited for (CUDA events: hidden = copy - stalled), the host time spent
   issuing fetches (the row gather into pinned memory), peak device memory, peak pinned host memory, and the
   link model's projection of the same step (``infinikv.bench.linkmodel``) beside the measurement.
4. **report**: ``gpu_check.json`` and ``gpu_check.md`` in OUTDIR, rewritten after every context, and
   ``rows.jsonl``, appended after every policy run, so a run cut short still leaves its results.

InfiniGen runs with ``alpha=inf`` (the budget alone sets how many rows move: random weights do not have the
peaked attention that makes alpha meaningful), the paper's 20 % of the key columns (random weights give no
share of columns worth calibrating either) and a skew calibrated on random tokens.

``--tiny`` runs the same path on a tiny dummy model, tiny contexts and a few steps (on CPU when there is no
GPU): the test suite runs it so the check cannot rot.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import pkgutil
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

LABEL = "dummy weights"
REPO = Path(__file__).resolve().parents[2]  # the source tree: the check runs infinikv from src/
GIB = 1024**3
REQUIRED = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "tqdm", "psutil")
OPTIONAL = ("gguf", "rdata", "matplotlib", "pytest")  # not needed by the check; reported when present
H200 = ("NVIDIA H200", 4.8e12, 141e9, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB")
# Pinned bytes per byte of pool K/V until a run measures it: 2^k blocks, a growth while the old block is
# cached (none expected: the prompt leaves room for the decode steps), transient staging buffers.
HOST_RATIO_PRIOR = 1.5


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    budget: float
    steps: int
    prefill_chunk: int
    calibration_tokens: int
    cell_timeout: float
    deadline: float  # seconds for the whole check
    tests_timeout: float


FULL = Plan(
    model="dummy:llama-3-8b",
    batches=(8, 16),
    contexts=(16384, 32768),
    policies=("dense", "infinigen", "offload", "quest", "h2o"),
    budget=0.1,
    steps=8,
    prefill_chunk=8192,
    calibration_tokens=1024,
    cell_timeout=100.0,
    deadline=470.0,
    tests_timeout=120.0,
)
TINY = dataclasses.replace(
    FULL,
    model="dummy:tiny",
    batches=(1, 2),
    contexts=(96,),
    steps=4,
    prefill_chunk=64,
    calibration_tokens=64,
    cell_timeout=60.0,
    deadline=120.0,
    tests_timeout=60.0,
)


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- 1. preflight --------------------------------------------------------------------------------------------
def preflight(need_cuda: bool) -> dict[str, Any]:
    """Versions, imports and the device; raises SystemExit with one clear line when something is missing."""
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    missing = []
    for name in REQUIRED + OPTIONAL:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
            if name in REQUIRED:
                missing.append(name)
    if missing:
        raise SystemExit(
            f"gpu-check: missing packages: {', '.join(missing)} (nothing is installed from a network)"
        )
    import torch

    if need_cuda and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device visible to torch (use --tiny for the CPU smoke run)")
    import infinikv

    if not (REPO / "tests" / "test_cuda.py").exists():  # the check needs the tests beside the source
        raise SystemExit(f"gpu-check: run from a source checkout (PYTHONPATH=src), not {infinikv.__file__}")
    failed = []
    for module in pkgutil.walk_packages(infinikv.__path__, "infinikv."):
        if module.name.endswith("__main__"):  # importing it would run the command line
            continue
        if module.name.startswith("infinikv.serve") and importlib.util.find_spec("fastapi") is None:
            continue  # the server's extras are not needed to measure, and a GPU box may lack them
        try:
            importlib.import_module(module.name)
        except Exception as exc:  # any import error is a finding; report them all at once
            failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
    if failed:
        raise SystemExit("gpu-check: infinikv modules fail to import:\n  " + "\n  ".join(failed))
    out: dict[str, Any] = {
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "infinikv": infinikv.__file__,
    }
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out["device"] = props.name
        out["device_memory_bytes"] = props.total_memory
        out["h2d_pinned_bytes_per_s"] = _measure_h2d()
    import psutil

    memory = psutil.virtual_memory()
    out["host_memory_bytes"], out["host_available_bytes"] = memory.total, memory.available
    out["cpu_count"] = os.cpu_count()
    return out


def _measure_h2d(size: int = GIB, repeats: int = 3) -> float:
    """Best of a few pinned host -> device copies of ``size`` bytes, in bytes/s."""
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del host, device
    _release_pinned()
    return size / best


def _release_pinned() -> None:
    """Give cached pinned blocks back (the pinned allocator keeps freed blocks, rounded up to 2^k bytes)."""
    import torch

    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- 2. tests ------------------------------------------------------------------------------------------------
def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    cmd += [f"--junitxml={xml}"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        (out / "cuda-tests.log").write_text(str(exc.stdout or "") + str(exc.stderr or ""))
        return {"status": "timeout", "timeout_s": timeout}
    (out / "cuda-tests.log").write_text(done.stdout + done.stderr)
    result: dict[str, Any] = {"returncode": done.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    if xml.exists():
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for key in ("tests", "failures", "errors", "skipped"):
            result[key] = int(suite.get(key, 0))
        result["failed"] = []
        for case in suite.iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if problem is not None:
                result["failed"].append(f"{case.get('name')}: {problem.get('message', '')[:300]}")
    result["status"] = "passed" if done.returncode == 0 else "failed"
    return result


# -- 3. one context, in a subprocess -------------------------------------------------------------------------
def _emit(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _random_text(tokens: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(tokens)]
    return " ".join(words)


def _ensure_calibration(loaded, tokens: int) -> str:
    """InfiniGen's skew for these random weights, calibrated once on random text and kept in the cache."""
    from .policies.infinigen import cached_skew, calibrate

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


def _copy_timing(cache, copies: int, steps: int) -> dict[str, float | None]:
    """Per decode step: the copy stream's time, the compute stream's stall on it, the hidden rest, and the
    host time spent issuing fetches; from the CUDA events of the pool's last ``copies`` fetches."""
    pool = cache.policy.pool()
    timings = pool.counters.timings if pool is not None else []
    if not timings or not copies:
        return {"copy_s_per_step": None, "stalled_s_per_step": None, "hidden_s_per_step": None}
    copy_s = stalled_s = issue_s = 0.0
    for timing in timings[-copies:]:  # the decode steps' fetches come last
        copy, stalled = timing.seconds()
        copy_s, stalled_s, issue_s = copy_s + copy, stalled_s + stalled, issue_s + timing.issue_s
    return {
        "copy_s_per_step": copy_s / steps,
        "stalled_s_per_step": stalled_s / steps,
        "hidden_s_per_step": max(copy_s - stalled_s, 0.0) / steps,
        "hidden_fraction": max(copy_s - stalled_s, 0.0) / copy_s if copy_s else None,
        "issue_s_per_step": issue_s / steps,
        "device_gather": pool.device_gather,  # rows read from the pinned pool by a kernel (else host-staged)
    }


def _projections(row: dict[str, Any], h2d: float | None) -> dict[str, float]:
    from .bench import linkmodel

    traffic = linkmodel.StepTraffic(**row["traffic"])
    device = linkmodel.Device(*H200)
    links = {"pcie5": linkmodel.LINKS["pcie5"], "pcie4": linkmodel.LINKS["pcie4"]}
    if h2d:
        links["measured"] = linkmodel.with_bandwidth(linkmodel.LINKS["pcie5"], h2d)
    return {f"h200/{name}": linkmodel.project(traffic, link, device).step_s for name, link in links.items()}


def run_context(args: argparse.Namespace) -> None:
    """Child process: prefill one context once, then every (batch, policy) cell; rows go to rows.jsonl."""
    import torch

    from .bench.grid import BenchConfig
    from .bench.measure import make_entries, record_shared_prefills, run_once
    from .bench.prompts import prompt_ids
    from .bench.summary import kv_token_bytes, summarise_runs
    from .forward import PrefillMemo
    from .models import load
    from .policies.infinigen.policy import PAPER_PARTIAL_RATIO

    plan = Plan(**json.loads(args.plan))
    out, context = Path(args.out), args.context
    rows_path = out / "rows.jsonl"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    loaded = load(plan.model, device=device)
    log(f"context {context}: {plan.model} built on {device} in {time.perf_counter() - started:.1f} s")
    knobs = (("budget", plan.budget), ("alpha", math.inf), ("partial_ratio", PAPER_PARTIAL_RATIO))
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
                made.clear()
                _release_pinned()
                log(f"b{batch} ctx{context} {entry.name}: out of memory")
                _emit(rows_path, {**base, "skipped": f"out of memory: {str(exc).splitlines()[0][:200]}"})
                continue
            except Exception as exc:  # one policy's failure is a finding; the others still run
                traceback.print_exc()
                made.clear()
                _release_pinned()
                _emit(rows_path, {**base, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            row = summarise_runs(loaded, entry, [run], batch, prompt)
            row.update(base)
            row["tpot_mean_s"] = sum(run.step_s) / len(run.step_s)
            row["steady_decode_tokens_per_s"] = batch / row["tpot_p50_s"] if row["tpot_p50_s"] else None
            row.update(_copy_timing(made[-1], run.copies, plan.steps))
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
            _release_pinned()  # else the next policy's fit check counts this one's cached pinned blocks
            _emit(rows_path, row)
            log(
                f"b{batch} ctx{context} {entry.name}: {row['steady_decode_tokens_per_s']:.1f} tok/s, "
                f"TPOT {1e3 * row['tpot_p50_s']:.1f} ms, {row['bytes_h2d_per_step'] / 1e9:.2f} GB/step"
            )
        _release_pinned()


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


# -- 4. the parent: plan, children, report -------------------------------------------------------------------
def run_check(out: Path, plan: Plan, tiny: bool, run_cuda_tests: bool = True) -> int:
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").unlink(missing_ok=True)
    log("preflight")
    report: dict[str, Any] = {"label": LABEL, "plan": dataclasses.asdict(plan), "tiny": tiny}
    report["preflight"] = preflight(need_cuda=not tiny)
    pre = report["preflight"]
    log(f"python {pre['versions']['python']}, torch {pre['versions']['torch']}, cuda {pre['cuda']}")
    if pre.get("h2d_pinned_bytes_per_s"):
        log(f"{pre['device']}: pinned host -> device {pre['h2d_pinned_bytes_per_s'] / 1e9:.1f} GB/s")
    _write(out, report)
    if run_cuda_tests:
        log("tests marked cuda")
        report["tests"] = run_tests(out, plan.tests_timeout)
    else:
        report["tests"] = {"status": "not run (--no-tests)"}
    log(f"tests: {report['tests'].get('status')} {report['tests']}")
    _write(out, report)
    report["contexts"] = []
    host_ratio = HOST_RATIO_PRIOR
    with tempfile.TemporaryDirectory(prefix="infinikv-gpucheck-") as cache:
        env = {**os.environ, "INFINIKV_CACHE": cache}  # the dummy model's skew lives and dies here
        for context in sorted(plan.contexts):
            left = plan.deadline - (time.perf_counter() - started)
            budget = min(left, plan.cell_timeout * len(plan.batches) + 90)
            if budget < 30:
                report["contexts"].append({"context": context, "status": "not run: check deadline reached"})
                continue
            cmd = [sys.executable, "-m", "infinikv.gpucheck", "context", str(out), "--context", str(context)]
            cmd += ["--plan", json.dumps(dataclasses.asdict(plan)), "--host-ratio", str(host_ratio)]
            if pre.get("h2d_pinned_bytes_per_s"):
                cmd += ["--h2d", str(pre["h2d_pinned_bytes_per_s"])]
            log(f"context {context}: subprocess, timeout {budget:.0f} s")
            status = _run_child(cmd, env, budget, out / f"context-{context}.log")
            report["contexts"].append({"context": context, "status": status})
            rows = _rows(out)
            host_ratio = max([host_ratio] + [r.get("pinned_per_kv_byte") or 0 for r in rows])
            report["rows"] = rows
            _write(out, report)
    report["rows"] = _rows(out)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    _write(out, report)
    log(f"done in {report['wall_s']} s: {out / 'gpu_check.md'}")
    tests_ok = report["tests"]["status"] in ("passed", "not run (--no-tests)")
    rows_ok = not any("failed" in row for row in report["rows"])
    ok = tests_ok and rows_ok and all(c["status"] == "ok" for c in report["contexts"])
    return 0 if ok else 1


def _run_child(cmd: list[str], env: dict[str, str], timeout: float, log_path: Path) -> str:
    with open(log_path, "w") as handle:
        child = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return f"killed after {timeout:.0f} s (rows written before are kept)"
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        return f"failed (exit {code}): {tail[0][:300]}"
    return "ok"


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(render(report))


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    """The Markdown report: what ran, on what, and every measured row beside its projection."""
    pre, plan = report.get("preflight", {}), report["plan"]
    versions = pre.get("versions", {})
    lines = [
        f"# GPU check ({LABEL})",
        "",
        f"Model `{plan['model']}` ({LABEL}: speed and bytes are the real shapes'; its text is noise). "
        f"Device: {pre.get('device', 'CPU')}; Python {versions.get('python')}, torch {versions.get('torch')} "
        f"(CUDA {pre.get('torch_cuda')}), transformers {versions.get('transformers')}. "
        f"Budget {plan['budget']} for infinigen (alpha=inf), quest and h2o; {plan['steps']} greedy decode "
        "steps after a shared batch-1 prefill; one run per cell.",
        "",
    ]
    if pre.get("h2d_pinned_bytes_per_s"):
        lines += [f"Measured pinned host → device copy: {pre['h2d_pinned_bytes_per_s'] / 1e9:.1f} GB/s.", ""]
    tests = report.get("tests")
    if tests:
        lines += [f"Tests marked `cuda`: **{tests.get('status')}** ({_counts(tests)}).", ""]
        lines += [f"- failed: {name}" for name in tests.get("failed", [])]
    for entry in report.get("contexts", []):
        lines.append(f"- context {entry['context']}: {entry['status']}")
    lines += [
        "",
        "| batch | context | policy | tok/s (batch / TPOT) | TPOT p50 ms | GB H2D/step | copy ms/step "
        "| stalled ms/step | hidden % | issue ms/step | peak device GiB | peak pinned GiB "
        "| projected ms (H200, PCIe 5 / measured link) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report.get("rows", []):
        head = f"| {row['batch']} | {row['context']} | {row['name']} |"
        if "skipped" in row or "failed" in row:
            reason = f"skipped: {row['skipped']}" if "skipped" in row else f"**failed**: {row['failed']}"
            lines.append(f"{head} {reason} |" + " |" * 10)
            continue
        projected = row.get("projected_step_s_h200", {})
        lines.append(
            f"{head} {_fmt(row.get('steady_decode_tokens_per_s'))} | {_fmt(row['tpot_p50_s'], 1e3)} "
            f"| {_fmt(row['bytes_h2d_per_step'], 1e-9, 3)} | {_fmt(row.get('copy_s_per_step'), 1e3)} "
            f"| {_fmt(row.get('stalled_s_per_step'), 1e3)} | {_fmt(row.get('hidden_fraction'), 100, 0)} "
            f"| {_fmt(row.get('issue_s_per_step'), 1e3)} | {_fmt(row.get('peak_device_bytes'), 1 / GIB)} "
            f"| {_fmt(row.get('peak_pinned_host_bytes'), 1 / GIB)} "
            f"| {_fmt(projected.get('h200/pcie5'), 1e3)} / {_fmt(projected.get('h200/measured'), 1e3)} |"
        )
    lines += [
        "",
        "copy = the copy stream's time per step (CUDA events around each fetch, including the host row "
        "gather it waits on); stalled = the compute stream's wait for those copies; hidden = copy − stalled; "
        "issue = host time inside fetch. The projection is `infinikv.bench.linkmodel` fed with the measured "
        "bytes and tokens attended (its DEVICES lack the H200: 4.8 TB/s, 141 GB, from NVIDIA's datasheet).",
        "",
        f"Produced by `scripts/gpu_check.sh{' --tiny' if report.get('tiny') else ''}`"
        + (f" in {report['wall_s']} s." if "wall_s" in report else " (in progress or cut short)."),
        "",
    ]
    return "\n".join(lines)


def _counts(tests: dict[str, Any]) -> str:
    keys = ("tests", "failures", "errors", "skipped")
    return ", ".join(f"{tests[k]} {k}" for k in keys if k in tests) or tests.get("status", "")


# -- command line --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infinikv.gpucheck", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", help="the whole check (default)")
    check.add_argument("out", type=Path)
    check.add_argument("--tiny", action="store_true", help="tiny model and contexts (CPU when no GPU)")
    check.add_argument("--model", help="a dummy:<shape> (default: dummy:llama-3-8b, tiny: dummy:tiny)")
    check.add_argument("--batches", help="comma-separated batch sizes")
    check.add_argument("--contexts", help="comma-separated context lengths (tokens)")
    check.add_argument("--policies", help="comma-separated policies")
    check.add_argument("--steps", type=int, help="decode steps per run")
    check.add_argument("--deadline", type=float, help="seconds for the whole check")
    check.add_argument("--cell-timeout", type=float, help="seconds per (batch, context) cell")
    check.add_argument("--no-tests", action="store_true", help="skip the tests marked cuda")
    context = sub.add_parser("context", help=argparse.SUPPRESS)
    context.add_argument("out")
    context.add_argument("--context", type=int, required=True)
    context.add_argument("--plan", required=True)
    context.add_argument("--host-ratio", type=float, default=HOST_RATIO_PRIOR)
    context.add_argument("--h2d", type=float, default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("check", "context", "-h", "--help"):
        argv.insert(0, "check")
    args = parser.parse_args(argv)
    if args.command == "context":
        run_context(args)
        return 0
    if args.command != "check":
        parser.print_help()
        return 2
    plan = TINY if args.tiny else FULL
    try:
        overrides = {
            "model": args.model,
            "batches": _ints(args.batches),
            "contexts": _ints(args.contexts),
            "policies": tuple(args.policies.split(",")) if args.policies else None,
            "steps": args.steps,
            "deadline": args.deadline,
            "cell_timeout": args.cell_timeout,
        }
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    problem = _plan_problem(plan)
    if problem is not None:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    return run_check(args.out, plan, args.tiny, run_cuda_tests=not args.no_tests)


def _plan_problem(plan: Plan) -> str | None:
    """What is wrong with ``plan``, in one line, or None."""
    from .dummy import DUMMIES, PREFIX
    from .errors import InfinikvError
    from .policies import make_config

    shape = DUMMIES.get(plan.model.removeprefix(PREFIX)) if plan.model.startswith(PREFIX) else None
    if shape is None:
        return f"--model must be a dummy:<shape> model ({', '.join(PREFIX + k for k in DUMMIES)})"
    if plan.steps < 1:
        return f"--steps must be at least 1, got {plan.steps}"
    limit = shape.config["max_position_embeddings"]
    for context in plan.contexts:
        if not plan.steps + 2 <= context <= limit:
            return f"context {context} must leave room for {plan.steps} steps and fit {plan.model} ({limit})"
    for name in plan.policies:
        try:
            make_config(name)
        except InfinikvError as exc:
            return str(exc)
    return None


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise ValueError(f"values must be positive, got {text!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
