"""From a cell's runs to its table rows: medians over the repeats, ratios within the run, link-model
projections, and where each selective policy stops paying off against offload (the crossover)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..models import LoadedModel
from . import linkmodel
from .measure import COMPILED, BenchEntry, RunMeasurement

CROSSOVER_MARGIN = 0.1  # "pays off" = projected step at least 10 % faster than offload


def kv_token_bytes(loaded: LoadedModel) -> int:
    """Bytes of K and V for one token across all layers, one sequence."""
    spec = loaded.spec
    element = next(loaded.model.parameters()).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element


def summarise_runs(
    loaded: LoadedModel, entry: BenchEntry, runs: list[RunMeasurement], batch: int, context: int
) -> dict[str, Any]:
    """One row: medians over the repeats of what the runs measured, plus the link-model projections."""
    steps = len(runs[0].step_s)
    med = statistics.median
    per_step = [sum(s.step_s) / steps for s in runs]
    token_bytes = kv_token_bytes(loaded)
    # Full offload moves every cached token of every layer each step: the reference for "fraction fetched".
    offload_bytes = token_bytes * batch * sum(context + s for s in range(steps))
    if entry.kind == "policy":
        moved = med([_delta(s, "bytes_h2d") for s in runs])
        copies = med([2 * s.copies for s in runs]) / steps  # one fetch = a K copy and a V copy
        attended = med([float(s.stats_after.get("mean_tokens_attended", 0.0)) for s in runs])
    else:
        moved = float(offload_bytes) if entry.prefetches else 0.0  # the offloading peer moves every layer
        copies = 2.0 * loaded.spec.num_layers if entry.prefetches else 0.0
        attended = context + (steps + 1) / 2  # dense: all cached tokens plus the new one
    mean_cached = context + (steps + 1) / 2
    selector_s = med([_delta(s, "selector_s") for s in runs]) / steps
    selector_inline_s = med([_delta(s, "selector_inline_s") for s in runs]) / steps
    on_demand = med([_delta(s, "bytes_h2d_on_demand") for s in runs]) if entry.kind == "policy" else 0.0
    selector_bytes = med([_delta(s, "selector_bytes") for s in runs]) / steps
    wait = med([_delta(s, "prefetch_wait_s") for s in runs]) / steps
    step_s = med(per_step)
    dense_kv = token_bytes * batch * (context + steps)  # the cache after the last step, held densely
    resident = runs[-1].kv_bytes.get("device")
    row: dict[str, Any] = {
        "name": entry.name,
        "kind": entry.kind,
        "batch": batch,
        "context": context,
        "decode_steps": steps,
        "repeats": len(runs),
        "decode_tokens_per_s": med([batch * steps / sum(s.step_s) for s in runs]),
        "step_s": step_s,
        "ttft_s": med([s.ttft_s for s in runs]),
        "ingest_s": med([s.ingest_s for s in runs]),
        "tpot_p50_s": med([_percentile(s.step_s, 50) for s in runs]),
        "tpot_p99_s": med([_percentile(s.step_s, 99) for s in runs]),
        "bytes_h2d_per_step": moved / steps,
        "bytes_h2d_per_token": moved / steps / batch,
        "kv_fraction_moved": moved / offload_bytes if offload_bytes else 0.0,
        "kv_fraction_attended": attended / mean_cached,
        "copies_per_step": copies,
        # the three costs: bytes moved (above), bytes resident on the device, and the selector's work
        "device_resident_fraction": resident / dense_kv if resident is not None else None,
        "fetch_buffer_fraction": med([float(s.stats_after.get("fetch_peak_bytes", 0)) for s in runs])
        / dense_kv,
        "selector_bytes_per_step": selector_bytes,
        "selector_fraction": selector_bytes * steps / offload_bytes if offload_bytes else 0.0,
        "selector_s_per_step": selector_s,
        # all the selector's time, and the part the decode thread ran itself (the rest ran ahead, on the
        # pool's worker, beside the previous layer: only what the step then waits for shows as prefetch wait)
        "selector_time_fraction": selector_s / step_s if step_s else 0.0,
        "selector_inline_fraction": selector_inline_s / step_s if step_s else 0.0,
        # bytes copied without prefetch (started by the layer that reads them) / bytes moved
        "on_demand_fraction": on_demand / moved if moved else 0.0,
        "prefetch_wait_s_per_step": wait,
        "prefetch_wait_fraction": wait / step_s if step_s else 0.0,
        "peak_host_rss_bytes": max(s.peak_rss for s in runs),
        "peak_device_bytes": max(s.peak_device for s in runs) if runs[0].peak_device is not None else None,
        "kv_host_bytes": runs[-1].kv_bytes.get("host"),
        "kv_device_bytes": runs[-1].kv_bytes.get("device"),
    }
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    traffic = linkmodel.StepTraffic(
        bytes_h2d=row["bytes_h2d_per_step"],
        copies=copies,
        device_read_bytes=weights + attended * token_bytes * batch + selector_bytes,
        overlapped=entry.prefetches,
        layers=loaded.spec.num_layers,
        bytes_on_demand=on_demand / steps,
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


def against_offload(
    rows: list[dict[str, Any]],
) -> list[tuple[str, linkmodel.StepTraffic, linkmodel.StepTraffic]]:
    """(name, its traffic, offload's traffic) for each selective policy of a cell that moves bytes: the
    pairs the crossover table and plot compare. Empty when offload did not run."""
    by_name = {r["name"]: r for r in rows}
    if "offload" not in by_name:
        return []
    slow = linkmodel.StepTraffic(**by_name["offload"]["traffic"])
    return [
        (row["name"], linkmodel.StepTraffic(**row["traffic"]), slow)
        for row in rows
        if row["kind"] == "policy"
        and row["name"] not in ("dense", "offload")
        and not row["name"].endswith(COMPILED)  # the same bytes as its eager row
        and row["bytes_h2d_per_step"]
    ]


def crossovers(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per device: the link bandwidth (bytes/s) above which each selective policy's projected step is no
    longer ``CROSSOVER_MARGIN`` faster than offload's."""
    return {
        f"{name}/{d}": linkmodel.crossover_bandwidth(fast, slow, device, margin=CROSSOVER_MARGIN)
        for name, fast, slow in against_offload(rows)
        for d, device in linkmodel.DEVICES.items()
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation between closest ranks
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _delta(run: RunMeasurement, key: str) -> float:
    return float(run.stats_after.get(key, 0.0)) - float(run.stats_before.get(key, 0.0))
