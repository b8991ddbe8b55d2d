"""Step 4, the report: ``gpu_check.json`` (everything measured) and ``gpu_check.md`` (the Markdown table of
every row beside its projection), rewritten after every context from ``rows.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..reporting import fmt
from .plan import GIB, LABEL


def read_rows(out: Path) -> list[dict[str, Any]]:
    """The rows appended to ``rows.jsonl`` so far, one per policy run."""
    path = out / "rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``gpu_check.json`` and ``gpu_check.md`` in ``out``, from the report as it stands."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(render(report))


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
        where = entry.get("ran_on")  # a Ray task's (--ray)
        gpus = f", GPU {'/'.join(where['gpus'])}" if where and where["gpus"] else ""
        spot = f" (Ray task on {where['host']}, node {where['node']}{gpus})" if where else ""
        lines.append(f"- context {entry['context']}: {entry['status']}{spot}")
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
        pcie5, measured = (fmt(projected.get(f"h200/{link}"), 1, scale=1e3) for link in ("pcie5", "measured"))
        cells = [
            fmt(row.get("steady_decode_tokens_per_s"), 1),
            fmt(row["tpot_p50_s"], 1, scale=1e3),
            fmt(row["bytes_h2d_per_step"], 3, scale=1e-9),
            fmt(row.get("copy_s_per_step"), 1, scale=1e3),
            fmt(row.get("stalled_s_per_step"), 1, scale=1e3),
            fmt(row.get("hidden_fraction"), 0, scale=100),
            fmt(row.get("issue_s_per_step"), 1, scale=1e3),
            fmt(row.get("peak_device_bytes"), 1, scale=1 / GIB),
            fmt(row.get("peak_pinned_host_bytes"), 1, scale=1 / GIB),
            f"{pcie5} / {measured}",
        ]
        lines.append(f"{head} {' | '.join(cells)} |")
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
