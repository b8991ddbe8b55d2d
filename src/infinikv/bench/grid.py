"""The benchmark grid: which caches run on which (batch, context) cells, in what order.

For each context the prompt is cut once (``prompts``); in the ``shared`` prefill mode its batch-1 prefill is
recorded once per prefill family (``measure.record_shared_prefills``). Each cell then runs every cache
``repeats`` times after an untimed warm-up, interleaved across caches so machine load affects all alike
(``measure.run_once``), and becomes one row per cache with ratios and crossovers (``summary``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ..data import CORPORA, load_corpus
from ..engine.blocks import block_bytes, free_memory_bytes
from ..errors import InfinikvError, InputError
from ..forward import PrefillMemo
from ..models import LoadedModel
from ..policies import POLICIES, make_config
from .measure import RunMeasurement, make_entries, record_shared_prefills, run_once
from .peers import PEERS
from .prompts import prompt_ids
from .summary import add_ratios, crossovers, summarise_runs

PREFILL_MODES = ("shared", "per-run")


@dataclass(frozen=True)
class BenchConfig:
    """The grid and how each cell is run.

    policies: infinikv policy names; peers: transformers caches (``PEERS``); batches x contexts: the cells;
    gen: tokens generated per sequence (the first from the prefill, then gen-1 timed decode steps); repeats:
    timed runs per policy and cell, interleaved across policies, medians reported; warmup: decode steps of
    an untimed run per policy and cell; prefill: ``shared`` or ``per-run`` (module docstring); knobs: policy
    knob values, each given to the policies that have it; corpus: text the prompts are cut from, a registered
    corpus or a UTF-8 file (None, or a registered corpus that cannot be fetched: tokenizer-encoded filler);
    compile: each policy also runs compiled (``measure.make_entries``), a row of its own beside the eager
    one."""

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
    compile: bool = False

    def __post_init__(self):
        if self.gen < 2:
            raise InputError(
                f"--gen must be at least 2 (one prefill token + timed decode steps), got {self.gen}"
            )
        if self.repeats < 1 or self.warmup < 0:
            raise InputError("--repeats must be at least 1 and --warmup at least 0")
        if self.prefill_chunk < 2:  # as GenerationConfig's: a chunk of one would be read as a decode step
            raise InputError(f"--prefill-chunk must be at least 2, got {self.prefill_chunk}")
        if self.prefill not in PREFILL_MODES:
            raise InputError(f"--prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if not self.batches or min(self.batches) < 1 or not self.contexts or min(self.contexts) < 2:
            raise InputError("--batch values must be >= 1 and --context values >= 2")
        if not self.policies and not self.peers:
            raise InputError("nothing to run: no policies and no peers")
        if self.compile and not self.policies:
            raise InputError("--compile runs infinikv policies compiled, and no policy is asked for")
        if self.compile and self.warmup < 2:  # the first compiled steps compile (and compile again once)
            raise InputError(f"--compile needs --warmup of at least 2, got {self.warmup}")
        for name in self.peers:
            if name not in PEERS:
                raise InputError(f"unknown peer '{name}'; available: {', '.join(PEERS)}")
        for name in self.policies:
            make_config(name, **self.policy_knobs(name))  # unknown policy or bad knob value: fail now
        if self.corpus is not None and self.corpus not in CORPORA:
            load_corpus(self.corpus)  # a missing or unreadable file, or an unknown name: fail now

    def policy_knobs(self, name: str) -> dict[str, Any]:
        own = {f for f in make_config(name).knobs()} if name in POLICIES else set()
        return {k: v for k, v in self.knobs if k in own}


def check_sizes(loaded: LoadedModel, config: BenchConfig) -> None:
    """Refuse, before any run, a context whose generated tokens (``gen``, and the warm-up's steps) pass the
    model's context, or a batch whose K/V the machine's free memory cannot hold (every run holds its batch's
    K/V once: dense on the device, the others in the host pool)."""
    dtype = loaded.dtype
    fed = max(config.gen, config.warmup + 1)
    for context in config.contexts:
        if context + fed > loaded.max_context:
            raise InputError(
                f"context {context} + {fed} generated tokens (--gen, --warmup) exceeds the model's "
                f"{loaded.max_context} tokens"
            )
        need, free = block_bytes(loaded.spec, dtype, context + fed) * max(config.batches), free_memory_bytes()
        if need > free:
            raise InputError(
                f"batch {max(config.batches)} at context {context} needs {need / 2**30:.1f} GiB of K/V, more "
                f"than the {free / 2**30:.1f} GiB of memory free"
            )


def run_bench(loaded: LoadedModel, config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run the grid; returns {"config", "cells": [...]} (see ``summary.summarise_runs`` for each row)."""
    check_sizes(loaded, config)
    policies = {name: config.policy_knobs(name) for name in config.policies}
    entries, skipped_peers = make_entries(loaded, policies, config.peers, config.compile)
    steps = config.gen - 1
    cells = []
    total = len(config.contexts) * len(config.batches) * len(entries) * config.repeats
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    memo = PrefillMemo(per_config=True) if config.prefill == "shared" else None
    for context in config.contexts:
        ids, source = prompt_ids(loaded, context, max(config.batches), config.corpus)
        if memo is not None:
            bar.set_postfix_str(f"prefill {context} tokens")
            memo.clear()
            record_shared_prefills(loaded, entries, ids[:1], config.prefill_chunk, memo)
        for batch in config.batches:
            runs: dict[str, list[RunMeasurement]] = {e.name: [] for e in entries}
            failed: list[dict[str, str]] = []
            live = list(entries)
            for repeat in range(-1 if config.warmup else 0, config.repeats):
                for entry in list(live):
                    bar.set_postfix_str(
                        f"b{batch} ctx{context} {entry.name} {'warm-up' if repeat < 0 else repeat}"
                    )
                    try:
                        run = run_once(
                            loaded,
                            entry,
                            ids,
                            batch,
                            memo,
                            config.warmup if repeat < 0 else steps,
                            config.prefill_chunk,
                        )
                    except (InfinikvError, NotImplementedError) as exc:
                        failed.append({"name": entry.name, "reason": f"{type(exc).__name__}: {exc}"})
                        live.remove(entry)
                        bar.update(config.repeats)
                        continue
                    if repeat >= 0:
                        runs[entry.name].append(run)
                        bar.update(1)
            rows = [summarise_runs(loaded, e, runs[e.name], batch, context) for e in live]
            add_ratios(rows)
            cells.append(
                {
                    "batch": batch,
                    "context": context,
                    "prompt_source": source,
                    "rows": rows,
                    "skipped": skipped_peers + failed,
                    "crossover": crossovers(rows),
                }
            )
    if memo is not None:
        memo.clear()
    bar.close()
    return {"config": config_dict(config), "cells": cells}


def config_dict(config: BenchConfig) -> dict[str, Any]:
    out = {k: getattr(config, k) for k in config.__dataclass_fields__}
    out["knobs"] = dict(config.knobs)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
