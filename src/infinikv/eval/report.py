"""Sweep outputs: summary JSON, markdown tables, plots, and the results document.

Tables: retrieval score per task (RULER scoring, 0-100) and perplexity (with the dense reference on the same
windows), each with the policy's fraction of the KV cache fetched during decode. Plots (matplotlib, Agg):
mean retrieval score and perplexity against that fraction, one line per policy, one panel per model and
context.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from ..reporting import fmt, write_keeping_notes
from .sweep import Cell, SweepConfig, cells, finished, is_measured, policy_label, policy_variants


def _selected(config: SweepConfig, done: dict[str, dict]) -> tuple[list[dict], list[Cell]]:
    planned = list(cells(config))
    measured = [done[c.identity] for c in planned if is_measured(c, done)]
    missing = [c for c in planned if not is_measured(c, done)]
    return measured, missing


def retrieval_table(records: list[dict]) -> str:
    """Rows: model, context, policy; columns: tasks, mean, KV fraction."""
    rows = [r for r in records if r["cell"]["kind"] == "retrieval"]
    if not rows:
        return ""
    tasks = list(dict.fromkeys(r["cell"]["target"] for r in rows))
    grouped: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        c = r["cell"]
        row = (c["model"], c["context"], policy_label(c["policy"], c["knobs"]))
        grouped.setdefault(row, {})[c["target"]] = r
    lines = [
        "| model | context | policy | " + " | ".join(tasks) + " | mean | KV fetched |",
        "|---|---:|---|" + "---:|" * (len(tasks) + 2),
    ]
    for (model, context, label), by_task in grouped.items():
        scores = [by_task[t]["result"]["score"] if t in by_task else None for t in tasks]
        present = [s for s in scores if s is not None]
        fractions = [f for r in by_task.values() if (f := r["result"]["kv_fraction"]) is not None]
        mean = sum(present) / len(present) if present else None
        fraction = sum(fractions) / len(fractions) if fractions else None
        cols = " | ".join(fmt(s, 1) for s in scores)
        lines.append(f"| {model} | {context} | {label} | {cols} | {fmt(mean, 1)} | {fmt(fraction, 3)} |")
    return "\n".join(lines)


def ppl_table(records: list[dict]) -> str:
    rows = [r for r in records if r["cell"]["kind"] == "ppl"]
    if not rows:
        return ""
    lines = [
        "| model | text | context | policy | ppl | dense ppl | Δ ppl | last-block ppl | KV fetched |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, res = r["cell"], r["result"]
        label = policy_label(c["policy"], c["knobs"])
        delta = res["ppl"] - res["dense"]["ppl"]
        last = res["blocks"][-1]["ppl"]
        lines.append(
            f"| {c['model']} | {c['target']} | {c['context']} | {label} | {res['ppl']:.3f} | "
            f"{res['dense']['ppl']:.3f} | {delta:+.3f} | {last:.3f} | {fmt(res['kv_fraction'], 3)} |"
        )
    return "\n".join(lines)


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
        f"- Cells measured: {summary['measured']} of {planned} planned in this config.",
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
- **Scoring.** RULER's string_match_all (fraction of reference strings found in the answer), exact match of
  the first number for passkey.
"""
