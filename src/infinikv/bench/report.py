"""The benchmark's outputs: environment record, text table, PNG plots (matplotlib Agg), Markdown report.

Every plot and the report name the command that produced them, the hardware and the versions. The report
keeps anything below ``KEEP_MARKER`` in an existing file (hand-written notes such as profiling logs), so
regenerating it does not lose them.
"""

from __future__ import annotations

import os
import platform
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import torch
import transformers

from ..invariant import rows_as_vectors
from ..models import LoadedModel
from ..reporting import fmt, write_keeping_notes
from . import linkmodel
from .summary import against_offload

MIB = 2**20


# What each column of the measured table means, one line each in the report
COLUMNS = (
    ("tok/s", "decode tokens per second, whole batch"),
    ("TPOT", "time per output token (one decode step)"),
    ("MiB h2d/token", "bytes copied host→device per generated token"),
    ("KV moved", "those bytes as a share of what full offload moves"),
    (
        "on demand",
        "the part of those bytes copied without prefetch (started by the layer that reads them, once its "
        "own query exists), as a share of them",
    ),
    ("KV attended", "tokens each layer attended as a share of the cached tokens"),
    (
        "resident",
        "bytes the policy keeps on the compute device (partial keys, page summaries, the whole cache for "
        "dense) as a share of the dense KV cache",
    ),
    ("fetch buffer", "the largest single copy (one layer's fetched rows) on the same scale"),
    (
        "selector reads",
        "bytes its selector read to choose (InfiniGen's partial keys and look-ahead query projection, "
        "Quest's page summaries, the oracle's keys) on the scale of KV moved",
    ),
    (
        "selector time",
        "all of it, as a share of the step time; of it inline: the part the decode thread ran itself, the "
        "rest ran ahead on the pool's worker thread, beside the previous layer, on the second core",
    ),
    ("prefetch wait", "the part of the look-ahead and the copies not hidden behind compute, of the step"),
    ("peak RSS", "process resident memory (model included)"),
)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def bench_environment(loaded: LoadedModel, command: str) -> dict[str, Any]:
    """Where and with what a benchmark ran: the command, hardware, versions and commit."""
    device = loaded.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "command": command,
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device) + (f" ({gpu})" if gpu else ""),
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "infinikv_commit": _git_commit(),
        # how the engine's decode step computes each row alone (invariant.py): its last bits follow it
        "rows_alone": _rows_alone(loaded),
    }


def _rows_alone(loaded: LoadedModel) -> str:
    """How the engine's decode step computes each row of ``loaded``'s projections alone here."""
    return "vectors" if rows_as_vectors(loaded.model.get_output_embeddings().weight) else "classes"


def _footer(env: dict[str, Any]) -> str:
    return (
        f"{textwrap.fill(env['command'], 150)}\n"
        f"{env['cpu']} ({env['cpu_cores']} cores, {env['torch_threads']} threads), "
        f"device {env['device']}, {env['model']} {env['dtype']}; torch {env['torch']}, "
        f"transformers {env['transformers']}, infinikv {env['infinikv_commit']}"
    )


# -- text ----------------------------------------------------------------------------------------------------
def summary_table(result: dict[str, Any]) -> str:
    header = (
        "| batch | context | cache | tok/s | × dense | × offload | TTFT s | TPOT p50 ms | TPOT p99 ms | "
        "MiB h2d/token | KV moved | on demand | resident | fetch buffer | selector reads | selector time | "
        "of it inline | KV attended | prefetch wait | peak RSS MiB |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for cell in result["cells"]:
        for r in cell["rows"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['name']} | {r['decode_tokens_per_s']:.2f} | "
                f"{fmt(r['speedup_vs_dense'])} | {fmt(r['speedup_vs_offload'])} | {r['ttft_s']:.2f} | "
                f"{r['tpot_p50_s'] * 1e3:.1f} | {r['tpot_p99_s'] * 1e3:.1f} | "
                f"{r['bytes_h2d_per_token'] / MIB:.2f} | {r['kv_fraction_moved']:.1%} | "
                f"{r['on_demand_fraction']:.1%} | "
                f"{fmt(r['device_resident_fraction'], 1, scale=100)} % | {r['fetch_buffer_fraction']:.1%} | "
                f"{r['selector_fraction']:.1%} | "
                f"{r['selector_time_fraction']:.1%} | {r['selector_inline_fraction']:.1%} | "
                f"{r['kv_fraction_attended']:.1%} | "
                f"{r['prefetch_wait_fraction']:.1%} | {r['peak_host_rss_bytes'] / MIB:.0f} |"
            )
    return "\n".join(lines)


def projection_table(result: dict[str, Any]) -> str:
    keys = [f"{d}/{link}" for d in linkmodel.DEVICES for link in linkmodel.LINKS]
    lines = ["| batch | context | cache | " + " | ".join(keys) + " |", "|" + "---|" * (3 + len(keys))]
    for cell in result["cells"]:
        for r in cell["rows"]:
            steps = " | ".join(f"{r['projected_step_s'][k] * 1e3:.2f}" for k in keys)
            lines.append(f"| {r['batch']} | {r['context']} | {r['name']} | {steps} |")
    return "\n".join(lines)


def crossover_table(result: dict[str, Any]) -> str:
    lines = [
        "| batch | context | policy / device | no longer ≥10 % faster than offload above |",
        "|---|---|---|---|",
    ]
    for cell in result["cells"]:
        for key, bw in cell["crossover"].items():
            where = "never (in 0.1 GB/s – 10 TB/s)" if bw is None else f"{bw / 1e9:.1f} GB/s"
            lines.append(f"| {cell['batch']} | {cell['context']} | {key} | {where} |")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------------------------
def write_plots(result: dict[str, Any], directory: Path) -> list[str]:
    """Throughput vs batch and vs context, bytes per token, projected crossover. Returns the file paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    env = result["environment"]
    cells = result["cells"]
    names = list(dict.fromkeys(r["name"] for c in cells for r in c["rows"]))
    batches = sorted({c["batch"] for c in cells})
    contexts = sorted({c["context"] for c in cells})

    def value(name: str, batch: int, context: int, key: str) -> float | None:
        for c in cells:
            if c["batch"] == batch and c["context"] == context:
                for r in c["rows"]:
                    if r["name"] == name:
                        return r[key]
        return None

    def finish(fig, path: Path) -> str:
        fig.text(0.01, 0.005, _footer(env), fontsize=6, va="bottom", family="monospace")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return str(path)

    paths = []
    for axis, fixed, xs, label in (
        ("batch", contexts, batches, "batch size"),
        ("context", batches, contexts, "context (tokens)"),
    ):
        fig, axes = plt.subplots(1, len(fixed), figsize=(4.2 * len(fixed), 3.8), squeeze=False)
        for ax, f in zip(axes[0], fixed, strict=True):
            for name in names:
                pts = [
                    (
                        x,
                        value(
                            name,
                            x if axis == "batch" else f,
                            f if axis == "batch" else x,
                            "decode_tokens_per_s",
                        ),
                    )
                    for x in xs
                ]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name)
            ax.set_title(f"{'context' if axis == 'batch' else 'batch'} {f}")
            ax.set_xlabel(label)
            ax.set_ylabel("decode tokens/s (batch total)")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Measured decode throughput vs {axis}", fontsize=10)
        paths.append(finish(fig, directory / f"throughput_vs_{axis}.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"b{c['batch']}\nctx{c['context']}" for c in cells]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [value(name, c["batch"], c["context"], "bytes_h2d_per_token") or 0.0 for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], [y / MIB for y in ys], width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(cells))], labels, fontsize=7)
    ax.set_ylabel("MiB host→device per generated token")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.legend(fontsize=7)
    ax.set_title("Measured bytes moved host→device per token", fontsize=10)
    paths.append(finish(fig, directory / "bytes_per_token.png"))

    paths.append(_crossover_plot(result, directory, plt, finish))
    return paths


def _crossover_plot(result: dict[str, Any], directory: Path, plt, finish) -> str:
    """Projected speedup of each selective policy over offload vs link bandwidth (the link model)."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.2))
    device = linkmodel.DEVICES["a6000"]
    bandwidths = np.logspace(9, 12.5, 120)
    plotted = False
    for cell in result["cells"]:
        for name, fast, slow in against_offload(cell["rows"]):
            speedup = [
                linkmodel.speedup(fast, slow, linkmodel.with_bandwidth(linkmodel.LINKS["pcie3"], bw), device)
                for bw in bandwidths
            ]
            ax.plot(bandwidths / 1e9, speedup, label=f"{name} b{cell['batch']} ctx{cell['context']}")
            plotted = True
    for link in linkmodel.LINKS.values():
        ax.axvline(link.bandwidth / 1e9, color="grey", ls=":", lw=1)
        ax.text(
            link.bandwidth / 1e9,
            ax.get_ylim()[1] if ax.lines else 1,
            link.name,
            fontsize=6,
            rotation=90,
            va="top",
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.1, color="black", lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("host→device link bandwidth (GB/s)")
    ax.set_ylabel("projected step-time speedup over offload")
    ax.set_title(
        f"MODEL, not a measurement: where selective fetching stops paying off ({device.name})", fontsize=9
    )
    ax.grid(alpha=0.3, which="both")
    if plotted:
        ax.legend(fontsize=6)
    return finish(fig, directory / "crossover.png")


# -- Markdown ------------------------------------------------------------------------------------------------
def ran_where(result: dict[str, Any]) -> list[str]:
    """A line saying where each cell ran, when the cells ran as Ray tasks (``--ray``); else none."""
    spots = [
        f"batch {c['batch']} × {c['context']} on {c['ran_on']['host']} (Ray node {c['ran_on']['node']}, "
        f"{c['ran_on']['device']}{', GPU ' + '/'.join(c['ran_on']['gpus']) if c['ran_on']['gpus'] else ''})"
        for c in result["cells"]
        if "ran_on" in c
    ]
    if not spots:
        return []
    return ["- Ray: each cell ran as its own task, side by side: " + "; ".join(spots) + "."]


def write_bench_report(result: dict[str, Any], path: Path) -> None:
    """docs/benchmarks.md: setup, measured table, plots, GPU projection and crossover (notes kept)."""
    env = result["environment"]
    config = result["config"]
    skipped = {(s["name"], s["reason"]) for c in result["cells"] for s in c["skipped"]}
    plots = result.get("plots", [])
    rel = [os.path.relpath(p, path.parent) for p in plots]
    parts = [
        "# Benchmarks",
        "",
        "Generated by one command (rerun it to regenerate this file and the plots):",
        "",
        f"```\n{env['command']}\n```",
        "",
        f"- Hardware: {env['cpu']}, {env['cpu_cores']} cores, {env['torch_threads']} torch threads; "
        f"compute device {env['device']}",
        f"- Versions: torch {env['torch']}, transformers {env['transformers']}, "
        f"infinikv {env['infinikv_commit']}",
        f"- Model {env['model']} ({env['dtype']}); greedy decoding; {config['gen']} tokens generated per "
        f"sequence (the first from the prefill, then {config['gen'] - 1} timed decode steps); "
        f"{config['repeats']} timed runs per cache and cell after an untimed warm-up of {config['warmup']} "
        "steps, runs interleaved across caches; medians over the runs.",
        f"- Prefill mode `{config['prefill']}`"
        + (
            ": each context is prefilled once at batch 1 per prefill family (through the real prefill of "
            "one cache of the family, recorded: a policy's as the engine reads a prompt, the transformers "
            "caches' through the dense one's batch prefill) and every run replays that recording into each "
            "row (a peer's: over its batch), K/V and prefill state (H2O's prompt scores) alike, so TTFT = "
            "recorded batch-1 forward × batch + the cache's measured replay time (an estimate)."
            if config["prefill"] == "shared"
            else ": every run prefills each row's own prompt through the model (a policy's rows one after "
            "the other, as the engine reads them; a peer's batch at once); TTFT is measured."
        ),
        f"- Prompts: real tokens cut from `{result['cells'][0]['prompt_source']}`.",
        *ran_where(result),
        "- Ratios (× dense, × offload, KV moved vs offload) are computed within this one run, cell by cell, "
        "from runs interleaved in time, so machine load affects both sides alike; absolute numbers on a "
        "shared machine are noisy.",
        "",
        "Columns:",
        "",
        *(f"- {name}: {meaning}" for name, meaning in COLUMNS),
        "",
        "On a CPU, host and device are the same memory: copies are real copies and counted, but there is no "
        "link, which is why the projection below exists.",
        "",
        "## Measured",
        "",
        summary_table(result),
        "",
    ]
    if skipped:
        parts += ["Skipped:", ""] + [f"- `{name}`: {reason}" for name, reason in sorted(skipped)] + [""]
    parts += [f"![{Path(p).stem}]({p})" for p in rel if "crossover" not in p] + [""]
    parts += [
        "## GPU projection (a model, not a measurement)",
        "",
        "Projected decode-step time in ms from the measured bytes moved, copy calls and tokens attended "
        "(`infinikv.bench.linkmodel`): link time = bytes / bandwidth + copies × 10 µs; device time = "
        "(weights + attended K/V + the selector's reads) / device memory bandwidth; policies that declare "
        "`prefetches` (their look-ahead starts the next layer's copy) overlap the two layer by layer, the "
        "others wait for the copy. Figures are public theoretical peaks:",
        "",
    ]
    parts += [
        f"- {link.name}: {link.bandwidth / 1e9:g} GB/s — {link.source}" for link in linkmodel.LINKS.values()
    ]
    parts += [f"- {d.name}: {d.bandwidth / 1e9:g} GB/s — {d.source}" for d in linkmodel.DEVICES.values()]
    parts += ["", projection_table(result), "", "### Crossover", "", crossover_table(result), ""]
    parts += [f"![{Path(p).stem}]({p})" for p in rel if "crossover" in p] + [""]
    write_keeping_notes(path, "\n".join(parts))
