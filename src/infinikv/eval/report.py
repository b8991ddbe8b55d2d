"""Sweep outputs: summary JSON, markdown tables, plots, and the results document.

Tables: retrieval score per task (RULER scoring, 0-100) and perplexity (with the dense reference on the same
windows), each with the policy's three costs as fractions of the dense KV cache: bytes fetched during decode,
bytes resident on the compute device, and bytes its selector read (``runner.COSTS``). The front
(:func:`front_lines`) is drawn over all three: a point is dominated only by one at least as accurate and no
costlier on every axis. Plots (matplotlib, Agg): mean retrieval score and perplexity against the fraction
fetched, one line per policy, one panel per model and context.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from ..policies import make_config
from ..reporting import MISSING, fmt, write_keeping_notes
from .runner import DECODE_PATH
from .sweep import (
    Cell,
    SweepConfig,
    cells,
    finished,
    is_measured,
    policy_label,
    policy_variants,
)

STALE = " †"  # a cell shown from a measurement under other knobs, samples or decode path than planned
EARLIER_PATH = "left-padded batch"  # the decode path of a record that names none (runner.DECODE_PATH)


def _selected(config: SweepConfig, done: dict[str, dict]) -> tuple[list[dict], list[Cell]]:
    """The planned cells' records and the cells with none. A cell measured only under other knobs than its
    policy's current ones (a default changed, a knob added since), other samples or on an earlier decode
    path is shown from its latest such record, with ``stale`` naming what differs, until a sweep measures it
    again."""
    latest = {record["key"]: record for record in done.values()}  # file order: the last one wins
    measured, missing = [], []
    for cell in cells(config):
        if is_measured(cell, done):
            record = done[cell.identity]
            path = _path_difference(record)
            measured.append({**record, "stale": path} if path else record)
        elif cell.key in latest:
            record = latest[cell.key]
            measured.append({**record, "stale": _differences(cell, record)})
        else:
            missing.append(cell)
    return measured, missing


def _differences(cell: Cell, record: dict) -> str:
    """What a record of ``cell`` ran with that differs from the plan: knobs (``name: then → now``, "–" where a
    knob did not exist) and retrieval samples."""
    config = make_config(cell.policy, **dict(cell.knobs))
    now, then = config.identity_knobs(config.knobs()), config.identity_knobs(record["result"]["knobs"])
    changed = [
        f"{name}: {then.get(name, MISSING)} → {value}"
        for name, value in now.items()
        if then.get(name) != value
    ]
    changed += [f"{name}: {value} → {MISSING}" for name, value in then.items() if name not in now]
    samples = record["result"].get("samples")
    if cell.kind == "retrieval" and samples != cell.samples:
        changed.append(f"samples: {samples} → {cell.samples}")
    path = _path_difference(record)
    return "; ".join([*changed, path] if path else changed)


def _path_difference(record: dict) -> str:
    """ "decode path: ... → ..." for a record measured on another decode path than today's, else ""."""
    path = record["result"].get("decode_path", EARLIER_PATH)
    return "" if path == DECODE_PATH else f"decode path: {path} → {DECODE_PATH}"


def _label(record: dict) -> str:
    cell = record["cell"]
    return policy_label(cell["policy"], cell["knobs"]) + (STALE if record.get("stale") else "")


def _mean(values: list[float | None]) -> float | None:
    """The mean of ``values``; None when one is missing (a cell measured before that cost was recorded)."""
    return sum(values) / len(values) if values and None not in values else None


def costs(results: list[dict]) -> dict[str, float | None]:
    """A point's three costs (fractions of the dense KV cache), averaged over ``results`` (its cells'):
    ``moved`` (bytes fetched during decode; 0 for a policy that keeps its cache on the device), ``resident``
    (bytes kept on the compute device) and ``selector`` (bytes its selector read, on the scale of ``moved``);
    None where a cell did not record it. ``shown`` is the tables' "KV fetched" column (``kv_fraction``) and
    ``buffer`` their "fetch buffer" (the largest single copy, shown beside the costs but not one of them)."""
    moved = [(r["kv_fetched_fraction"] or 0.0) if "kv_fetched_fraction" in r else None for r in results]
    return {
        "shown": _mean([r["kv_fraction"] for r in results]),
        "moved": _mean(moved),
        "resident": _mean([r.get("device_resident_fraction") for r in results]),
        "selector": _mean([r.get("selector_fraction") for r in results]),
        "buffer": _mean([r.get("fetch_buffer_fraction") for r in results]),
    }


def _cost_cells(point: dict[str, float | None]) -> str:
    shown = (point["shown"], point["resident"], point["buffer"], point["selector"])
    return " | ".join(fmt(value, 3) for value in shown)


COST_HEADER = "KV fetched | resident | fetch buffer | selector reads"
COST_ALIGN = "---:|" * (COST_HEADER.count("|") + 1)  # the cost columns' separator cells


def retrieval_table(records: list[dict]) -> str:
    """Rows: model, context, policy; columns: tasks, mean, KV fraction."""
    rows = [r for r in records if r["cell"]["kind"] == "retrieval"]
    if not rows:
        return ""
    tasks = list(dict.fromkeys(r["cell"]["target"] for r in rows))
    grouped: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        c = r["cell"]
        row = (c["model"], c["context"], _label(r))
        grouped.setdefault(row, {})[c["target"]] = r
    lines = [
        "| model | context | policy | " + " | ".join(tasks) + f" | mean | {COST_HEADER} |",
        "|---|---:|---|" + "---:|" * (len(tasks) + 1) + COST_ALIGN,
    ]
    for (model, context, label), by_task in grouped.items():
        scores = [by_task[t]["result"]["score"] if t in by_task else None for t in tasks]
        present = [s for s in scores if s is not None]
        mean = sum(present) / len(present) if present else None
        cols = " | ".join(fmt(s, 1) for s in scores)
        point = costs([r["result"] for r in by_task.values()])
        lines.append(f"| {model} | {context} | {label} | {cols} | {fmt(mean, 1)} | {_cost_cells(point)} |")
    return "\n".join(lines)


def ppl_table(records: list[dict]) -> str:
    rows = [r for r in records if r["cell"]["kind"] == "ppl"]
    if not rows:
        return ""
    lines = [
        f"| model | text | context | policy | ppl | dense ppl | Δ ppl | last-block ppl | {COST_HEADER} |",
        "|---|---|---:|---|---:|---:|---:|---:|" + COST_ALIGN,
    ]
    for r in rows:
        c, res = r["cell"], r["result"]
        label = _label(r)
        delta = res["ppl"] - res["dense"]["ppl"]
        last = res["blocks"][-1]["ppl"]
        lines.append(
            f"| {c['model']} | {c['target']} | {c['context']} | {label} | {res['ppl']:.3f} | "
            f"{res['dense']['ppl']:.3f} | {delta:+.3f} | {last:.3f} | {_cost_cells(costs([res]))} |"
        )
    return "\n".join(lines)


def dominates(a: dict, b: dict) -> bool:
    """Whether point ``a`` dominates ``b``: at least as accurate and no costlier on every axis, better on one.
    Points are dicts with ``accuracy`` (higher is better) and the three :func:`costs`."""
    axes = ("moved", "resident", "selector")
    no_worse = a["accuracy"] >= b["accuracy"] and all(a[axis] <= b[axis] for axis in axes)
    better = a["accuracy"] > b["accuracy"] or any(a[axis] < b[axis] for axis in axes)
    return no_worse and better


def front_lines(records: list[dict]) -> list[str]:
    """Per model, context and measure: the points no other point dominates over accuracy and the three costs
    (:func:`dominates`), and each InfiniGen point that a point of another policy dominates, with that point.
    Cells without all three costs recorded are left out, and said to be."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        c, res = r["cell"], r["result"]
        retrieval = c["kind"] == "retrieval"
        point = {
            "label": _label(r),
            "policy": c["policy"],
            "accuracy": res["score"] if retrieval else -res["ppl"],
            **costs([res]),
        }
        measure = f"{c['target']} score" if retrieval else f"perplexity on {c['target']}"
        groups.setdefault((c["model"], c["context"], measure), []).append(point)
    lines = []
    for (model, context, measure), points in groups.items():
        placed = [p for p in points if None not in (p["moved"], p["resident"], p["selector"])]
        if not placed:
            continue
        front = [p["label"] for p in placed if not any(dominates(q, p) for q in placed)]
        beaten = []
        for p in placed:
            rivals = [q["label"] for q in placed if q["policy"] != p["policy"] and dominates(q, p)]
            if p["policy"] == "infinigen" and rivals:
                beaten.append(f"{p['label']} (by {rivals[0]})")
        line = f"{model}, {context} tokens, {measure}: front {', '.join(front)}"
        line += f"; InfiniGen points dominated: {', '.join(beaten) if beaten else 'none'}"
        if len(placed) < len(points):
            line += f" ({len(points) - len(placed)} cells without all three costs left out)"
        lines.append(line + ".")
    return lines


def plot(records: list[dict], kind: str, path: Path) -> bool:
    """Score (retrieval) or perplexity against the KV fraction; one panel per (model, context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
    series: dict[tuple, dict[tuple, list[float]]] = {}
    for r in records:
        c, res = r["cell"], r["result"]
        if c["kind"] != kind or res["kv_fraction"] is None:
            continue
        variant = (c["policy"], json.dumps(c["knobs"], sort_keys=True))
        value = res["score"] if kind == "retrieval" else res["ppl"]
        entry = series.setdefault((c["model"], c["context"]), {}).setdefault(variant, [])
        entry.append((res["kv_fraction"], value))
    for panel, variants in series.items():
        for (policy, _), values in variants.items():
            xs = [x for x, _ in values]
            ys = [y for _, y in values]
            points.setdefault(panel, {}).setdefault(policy, []).append((sum(xs) / len(xs), sum(ys) / len(ys)))
    if not points:
        return False
    panels = sorted(points)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for policy, xy in sorted(points[panel].items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=policy)
        ax.set_title(f"{panel[0]} @ {panel[1]} tokens")
        ax.set_xscale("log")  # the selective policies sit between 2 and 45 %, dense at 1
        if kind == "ppl":
            ax.set_yscale("log")  # a broken variant (2-bit KV) would flatten the rest
        ax.set_xlabel("fraction of KV fetched per decode step (log)")
        ax.set_ylabel("mean retrieval score (0-100)" if kind == "retrieval" else "perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(config: SweepConfig) -> dict[str, Any]:
    """summary.json, tables.md and the PNG plots in ``config.out`` from every finished cell (every shard's);
    returns the summary."""
    measured, missing = _selected(config, finished(config.out))
    unavailable = policy_variants(config)[1]
    plots = [
        name
        for kind, name in (("retrieval", "accuracy_vs_kv.png"), ("ppl", "ppl_vs_kv.png"))
        if plot(measured, kind, config.out / name)
    ]
    tables = "\n\n".join(t for t in (retrieval_table(measured), ppl_table(measured)) if t)
    (config.out / "tables.md").write_text(tables + "\n", encoding="utf-8")
    summary = {
        "name": config.name,
        "config": config.raw,
        "environment": environment(),
        "measured": len(measured),
        "missing": [c.key for c in missing],
        "unavailable_policies": unavailable,
        "plots": plots,
        "cells": measured,
    }
    (config.out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


def environment() -> dict[str, Any]:
    import torch

    versions = {}
    for package in ("infinikv", "torch", "transformers", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "versions": versions,
    }


def write_report(config: SweepConfig, summary: dict[str, Any], command: str, notes: str = "") -> Path:
    """The results document (``config.report``) from a finished sweep."""
    if config.report is None:
        raise ValueError("the sweep config names no report path")
    env = summary["environment"]
    rel = os.path.relpath(config.out, config.report.parent)
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    planned = summary["measured"] + len(summary["missing"])
    stale = [r for r in summary["cells"] if r.get("stale")]
    lines = [
        "# Results",
        "",
        f"Generated by `{command}` on {datetime.now(UTC).strftime('%Y-%m-%d')}. "
        "Edit only below the marker at the end.",
        "",
        f"- Machine: {env['platform']}, {env['cpu_count']} CPU cores ({env['torch_threads']} torch threads), "
        f"compute device: {env['device']}.",
        f"- Versions: Python {env['python']}, {versions}.",
        f"- Sweep config: `{config.source}`; raw cells: `{config.out}/cells.jsonl`, summary: "
        f"`{config.out}/summary.json`.",
        f"- Cells measured: {summary['measured']} of {planned} planned in this config"
        + (
            f", {len(stale)} of them shown from an earlier measurement (marked{STALE}, listed at the end)."
            if stale
            else "."
        ),
    ]
    if summary["unavailable_policies"]:
        lines.append(
            "- Policies in the config but not in this build (skipped): "
            + ", ".join(summary["unavailable_policies"])
            + "."
        )
    if notes:
        lines += ["", notes.strip()]
    lines += ["", "## Method", "", METHOD.strip()]
    for kind, title, setup, table, image in (
        ("retrieval", "Retrieval", retrieval_setup, retrieval_table, "accuracy_vs_kv.png"),
        ("ppl", "Perplexity", _ppl_setup, ppl_table, "ppl_vs_kv.png"),
    ):
        groups = _by_model_and_context([r for r in summary["cells"] if r["cell"]["kind"] == kind])
        if not groups:
            continue
        lines += ["", f"## {title}", "", setup(config)]
        for (model, context), records in groups.items():
            lines += ["", f"### {model}, {context} tokens", "", table(records)]
        if image in summary["plots"]:
            lines += ["", f"![{title.lower()} vs KV fetched]({rel}/{image})"]
    front = front_lines(summary["cells"])
    if front:
        lines += ["", "## The front", "", FRONT.strip(), ""] + [f"- {line}" for line in front]
    if stale:
        lines += ["", "## Shown from an earlier measurement", "", STALE_TEXT.strip(), ""]
        lines += [f"- {line}" for line in _stale_lines(stale)]
    if summary["missing"]:
        lines += ["", "## Not measured in this run", ""]
        variants = len(policy_variants(config)[0])
        lines += [f"- {line}" for line in _missing_lines(summary["missing"], variants)]
    write_keeping_notes(config.report, "\n".join(lines))
    return config.report


def _by_model_and_context(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["cell"]["model"], record["cell"]["context"]), []).append(record)
    return groups


STALE_TEXT = f"""
Cells marked{STALE} were measured under other knobs than their policy's current ones (a default changed, or
a knob was added since), or on an earlier decode path, and have not been measured again yet; the next sweep
re-measures them. The earlier decode path (`{EARLIER_PATH}`) fed the rows of a batch, left-padded, through
one cache and read a prompt in chunks cut back from its end; the engine's reads each row alone, in chunks
from its start, and gives each row's projections the bits they have alone. So a figure measured there can
differ: most perplexities in their third decimal or not at all, quantized KV's by a few percent (its codes
round those small differences either way), and past one prefill chunk the fetch buffer grows, since the
prefill's largest copy sets it (read from the start, the last chunk copies the longest prefix). What each
ran with differs from the plan as follows (then → now; – where a knob did not exist):
"""


def _stale_lines(stale: list[dict]) -> list[str]:
    """One line per difference: how many cells, of which policies, and what differed."""
    grouped: dict[str, list[str]] = {}
    for record in stale:
        grouped.setdefault(record["stale"], []).append(record["cell"]["policy"])
    return [
        f"{len(policies)} cells ({', '.join(dict.fromkeys(policies))}): {difference}"
        for difference, policies in grouped.items()
    ]


def _missing_lines(keys: list[str], variants: int) -> list[str]:
    """One line per model, context and target: the policy variants not measured there."""
    grouped: dict[tuple, list[str]] = {}
    for key in keys:
        model, context, kind, target, policy, knobs = json.loads(key)
        label = policy_label(policy, dict(knobs))
        measure = "perplexity" if kind == "ppl" else "retrieval"
        grouped.setdefault((model, context, measure, target), []).append(label)
    return [
        f"{m}, {c} tokens, {k} on {t}: "
        + ("every policy variant" if len(labels) == variants else ", ".join(labels))
        for (m, c, k, t), labels in grouped.items()
    ]


FRONT = """
A point (policy and setting) is dominated when another is at least as accurate (retrieval score, or
perplexity) and no costlier on each of the three axes (KV fetched, counting 0 for a cache kept on the device;
resident; selector reads), and better on one. Each measure's front lists the points nothing dominates.
"""


def retrieval_setup(config: SweepConfig) -> str:
    depths = ", ".join(str(d) for d in config.depths)
    per_model = {c.model: c.samples for c in cells(config) if c.kind == "retrieval"}
    if len(set(per_model.values())) == 1:
        samples = next(iter(per_model.values()))
        count = f"{samples} samples per task and context (seeds {config.seed}..{config.seed + samples - 1}, "
    else:
        each = ", ".join(f"{n} for {model}" for model, n in per_model.items())
        count = f"samples per task and context: {each} (sample i has seed {config.seed} + i, "
    return (
        f"{count}needle depths cycling through {depths}); question decoded through the policy, answer "
        f"greedy; chat template: {config.chat}. Scores 0-100 (passkey: exact match; others: RULER "
        "string_match_all)."
    )


def _ppl_setup(config: SweepConfig) -> str:
    fed = f"first {config.prefill}" if config.scored is None else f"all but the last {config.scored}"
    return (
        f"{config.windows} window(s) per text from its start; {fed} tokens prefilled, every "
        "later token fed through the decode path (teacher forcing). 'dense ppl' is measured on the same "
        "windows; 'last-block ppl' is the last 256-position block."
    )


METHOD = """
- **Decode path.** Every scored prediction is made in a decode step with the policy choosing what each
  layer attends to: perplexity feeds the text one token at a time after a dense prefill (teacher forcing);
  retrieval prefills the context, then feeds the question and the answer prefix one token at a time, then
  generates the answer greedily.
- **KV fetched.** Bytes the policy copied from the host pool during decode divided by what full offload
  (every layer's whole cache, every step) would copy for the same steps; for policies that keep their cache
  on the compute device (dense and any such policy) it is the fraction of cached tokens attended instead
  (dense = 1).
- **Resident.** Bytes the policy keeps on the compute device at the end of the run (its KV cache, partial
  keys, page summaries, scores) divided by the dense KV cache of the same tokens (dense = 1). The largest
  single copy (the fetch buffer: one layer's fetched K/V rows, on the same scale; quant's: its codes, not
  the scales copied with them) is shown in its own column (`fetch_buffer_fraction`); it is not an axis of
  the front.
- **Selector reads.** Bytes the policy's selector read to choose what to fetch during decode (InfiniGen: its
  partial keys and the look-ahead query projection; Quest: page summaries; the oracle: every key; H2O: its
  accumulated scores), on the scale of KV fetched. Its share of the decode time is `selector_time_fraction`.
- **Scoring.** RULER's string_match_all (fraction of reference strings found in the answer), exact match of
  the first number for passkey.
"""
