"""``infinikv bench --ray``: the grid's (batch, context) cells side by side, one Ray task each.

Each task loads the model on its worker (on the GPU Ray gave it, with ``--gpus-per-task 1``) and runs the
one-cell grid through :func:`~infinikv.bench.grid.run_bench`, so a cell is measured exactly as it is in a
serial run (its own shared prefill). Cells are put back in grid order; each carries ``ran_on``: the host,
Ray node, GPUs and device it ran on, which the report lists. The result's environment is the first cell's
worker's. Tasks that share a machine's CPUs slow each other down: on a CPU node, spread cells only to see
them side by side, not to compare their speeds with a serial run's.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from tqdm import tqdm

from ..cluster import Spread
from ..errors import InfinikvError
from ..models import load
from .grid import BenchConfig, config_dict, run_bench
from .report import bench_environment


def run_bench_spread(
    model: str,
    device: str | None,
    config: BenchConfig,
    spread: Spread,
    command: str,
    progress: bool = True,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Like :func:`run_bench` on ``load(model, device, dtype)``, one Ray task per (batch, context) cell."""
    grid = [(batch, context) for context in config.contexts for batch in config.batches]
    work = partial(_one_cell, model, device, dtype, config, command)
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    environment: dict[str, Any] | None = None
    with tqdm(total=len(grid), desc="bench (Ray tasks)", unit="cell", disable=not progress) as bar:
        for ended in spread.run(work, grid):
            batch, context = ended.item
            if ended.error is not None:
                raise InfinikvError(f"bench cell batch {batch}, context {context} failed: {ended.error}")
            cell, cell_environment = ended.value
            cells[ended.item] = cell | {"ran_on": ended.where | {"device": cell_environment["device"]}}
            environment = environment or cell_environment
            bar.update()
    return {
        "config": config_dict(config),
        "cells": [cells[item] for item in grid],
        "environment": environment,
    }


def _one_cell(
    model: str,
    device: str | None,
    dtype: str | None,
    config: BenchConfig,
    command: str,
    item: tuple[int, int],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Ray task: one cell's result, and the environment it ran in."""
    batch, context = item
    loaded = load(model, device=device, dtype=dtype)
    result = run_bench(loaded, replace(config, batches=(batch,), contexts=(context,)), progress=False)
    return result["cells"][0], bench_environment(loaded, command)
