"""The check's command line and its parent process: preflight, the tests marked ``cuda``, one child process
per context with a timeout and what is left of the deadline, and the report rewritten after each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .. import gpucheck
from ..cliargs import int_list
from ..cluster import Spread, spread_from_args
from ..cluster import add_arguments as add_ray_arguments
from ..errors import InputError
from .child import run_context
from .plan import FULL, HOST_RATIO_PRIOR, LABEL, TINY, Plan, log, plan_problem
from .preflight import preflight
from .report import read_rows, write_report
from .tests import NOT_RUN, run_tests


def run_check(
    out: Path, plan: Plan, tiny: bool, run_cuda_tests: bool = True, spread: Spread | None = None
) -> int:
    """The whole check into ``out``; 0 when the tests (where they ran) and every context passed, else 1.
    With ``spread``, the contexts run side by side, one Ray task each (one GPU each with ``gpus=1``)."""
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
    write_report(out, report)
    if run_cuda_tests:
        log("tests marked cuda")
        report["tests"] = run_tests(out, plan.tests_timeout)
    else:
        report["tests"] = {"status": f"{NOT_RUN} (--no-tests)"}
    log(f"tests: {report['tests'].get('status')} {report['tests']}")
    write_report(out, report)
    report["contexts"] = []
    if spread is not None:
        _contexts_on_ray(out, plan, report, spread)
    else:
        _contexts_in_turn(out, plan, report, started)
    report["rows"] = read_rows(out)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    write_report(out, report)
    log(f"done in {report['wall_s']} s: {out / 'gpu_check.md'}")
    tests_ok = report["tests"]["status"] == "passed" or report["tests"]["status"].startswith(NOT_RUN)
    rows_ok = not any("failed" in row for row in report["rows"])
    ok = tests_ok and rows_ok and all(c["status"] == "ok" for c in report["contexts"])
    return 0 if ok else 1


def _contexts_in_turn(out: Path, plan: Plan, report: dict[str, Any], started: float) -> None:
    """Each context in a child process, in turn, within what is left of the deadline; a context's
    measured pinned-host ratio sizes the next one's pinned budget."""
    pre = report["preflight"]
    host_ratio = HOST_RATIO_PRIOR
    with tempfile.TemporaryDirectory(prefix="infinikv-gpucheck-") as cache:
        env = {**os.environ, "INFINIKV_CACHE": cache}  # the dummy model's skew lives and dies here
        for context in sorted(plan.contexts):
            left = plan.deadline - (time.perf_counter() - started)
            budget = min(left, _context_timeout(plan))
            if budget < 30:
                report["contexts"].append({"context": context, "status": "not run: check deadline reached"})
                continue
            cmd = _child_command(out, context, plan, host_ratio, pre.get("h2d_pinned_bytes_per_s"))
            log(f"context {context}: subprocess, timeout {budget:.0f} s")
            status = _run_child(cmd, env, budget, out / f"context-{context}.log")
            report["contexts"].append({"context": context, "status": status})
            rows = read_rows(out)
            host_ratio = max([host_ratio] + [r.get("pinned_per_kv_byte") or 0 for r in rows])
            report["rows"] = rows
            write_report(out, report)


def _contexts_on_ray(out: Path, plan: Plan, report: dict[str, Any], spread: Spread) -> None:
    """Every context at once, one Ray task each; a context's rows, log and status land as its task ends,
    with the host, node and GPUs it ran on."""
    work = partial(_context_task, plan, report["preflight"].get("h2d_pinned_bytes_per_s"))
    contexts = ", ".join(map(str, plan.contexts))
    log(f"contexts {contexts}: one Ray task each, timeout {_context_timeout(plan):.0f} s")
    for ended in spread.run(work, sorted(plan.contexts)):
        where = ended.where
        if ended.error is not None:
            report["contexts"].append({"context": ended.item, "status": f"failed: {ended.error}"})
        else:
            status, rows, text = ended.value
            (out / f"context-{ended.item}.log").write_text(text)
            with open(out / "rows.jsonl", "a") as handle:
                handle.writelines(json.dumps(row | {"ran_on": where}) + "\n" for row in rows)
            report["contexts"].append({"context": ended.item, "status": status, "ran_on": where})
        log(f"context {ended.item}: {report['contexts'][-1]['status']} on {where.get('host', '?')}")
        report["rows"] = read_rows(out)
        write_report(out, report)


def _context_task(plan: Plan, h2d: float | None, context: int) -> tuple[str, list[dict[str, Any]], str]:
    """A Ray task: one context's child process in a folder of the worker's own; its status, rows and log."""
    with tempfile.TemporaryDirectory(prefix="infinikv-gpucheck-") as folder:
        here = Path(folder)
        package_root = str(Path(__file__).resolve().parents[2])  # this worker's infinikv, for the child
        env = {**os.environ, "INFINIKV_CACHE": str(here / "cache"), "PYTHONPATH": package_root}
        cmd = _child_command(here, context, plan, HOST_RATIO_PRIOR, h2d)
        status = _run_child(cmd, env, _context_timeout(plan), here / "context.log")
        return status, read_rows(here), (here / "context.log").read_text()


def _context_timeout(plan: Plan) -> float:
    return plan.cell_timeout * len(plan.batches) + 90


def _child_command(out: Path, context: int, plan: Plan, host_ratio: float, h2d: float | None) -> list[str]:
    cmd = [sys.executable, "-m", "infinikv.gpucheck", "context", str(out), "--context", str(context)]
    cmd += ["--plan", json.dumps(dataclasses.asdict(plan)), "--host-ratio", str(host_ratio)]
    return cmd + (["--h2d", str(h2d)] if h2d else [])


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infinikv.gpucheck", description=gpucheck.__doc__.splitlines()[0]
    )
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
    add_ray_arguments(check, "the contexts side by side, one Ray task each (with --gpus-per-task 1)")
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
            "batches": int_list(args.batches) if args.batches is not None else None,
            "contexts": int_list(args.contexts) if args.contexts is not None else None,
            "policies": tuple(args.policies.split(",")) if args.policies else None,
            "steps": args.steps,
            "deadline": args.deadline,
            "cell_timeout": args.cell_timeout,
        }
    except argparse.ArgumentTypeError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    problem = plan_problem(plan)
    try:
        spread = spread_from_args(args) if problem is None else None
    except InputError as exc:
        problem = str(exc)
    if problem is not None:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    return run_check(args.out, plan, args.tiny, run_cuda_tests=not args.no_tests, spread=spread)
