"""Sweeps: models x contexts x (perplexity texts, retrieval tasks) x policies x knob values, resumable.

A sweep is described by one TOML or JSON file (see ``configs/``)::

    name = "reduced"
    out = "docs/results/reduced"          # cells.jsonl, summary.json, tables.md, plots
    report = "docs/results.md"            # written by `infinikv eval report`
    [[models]]
    name = "smollm2-135m"
    contexts = [2048, 4096]
    tasks = ["passkey"]                   # optional: this model's retrieval tasks instead of [retrieval]'s
    samples = 8                           # optional: this model's samples per retrieval cell
    [policies]                            # knob lists expand to every combination
    dense = {}
    quest = { budget = [0.05, 0.1, 0.2, 0.4] }
    streaming = { window = ["0.1*context"] }   # a fraction of each cell's context, in tokens
    [retrieval]
    tasks = ["passkey", "niah_single_1"]
    samples = 3
    depths = [0.1, 0.5, 0.9]
    [ppl]
    texts = ["austen"]
    prefill = 512                         # leading tokens fed densely; or instead:
    # scored = 512                        # the last 512 tokens of every window go through decode
    windows = 1
    contexts = [2048]                     # optional: fewer contexts than the models'

Cells of one model, context and target run one after another and share a
:class:`~infinikv.eval.runner.PrefillMemo`: the model runs over each prompt once per prefill family (all
policies that prefill densely; H2O at every budget), not once per policy.

Every finished cell is appended to ``cells.jsonl`` at once, so an interrupted sweep restarts where it
stopped: cells already in the file are skipped (a retrieval cell recorded with another number of samples
than the config now asks for is measured again). Policies not registered in this build are reported as
unavailable and skipped. Perplexity cells of a policy reuse the dense cell of the same model, text and
context (same windows) as their reference.

``--shard I/N`` measures only every N-th group of cells (a group = one model, context and target, all its
policies), starting at the I-th, so N processes can share one sweep; they append to the same ``cells.jsonl``.
With a :class:`~infinikv.cluster.Spread` (``--ray``) the driver sends one Ray task per group instead, and
appends each group's cells when its task ends (a group whose worker died is retried by Ray first). A cell
that fails, alone or with its group's task, is appended to ``failed.jsonl`` with its error and measured
again by the next run; the sweep goes on.

This module plans and measures; :mod:`infinikv.eval.report` reads the finished cells and writes the summary,
tables, plots and results document (it imports this module, never the reverse).
"""

from __future__ import annotations

import itertools
import json
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..cluster import Spread
from ..errors import InfinikvError, InputError
from ..models import LoadedModel, load
from ..policies import POLICIES, make_config
from . import ppl, retrieval
from .runner import COSTS, DECODE_PATH, PrefillMemo
from .tasks import TASKS


@dataclass(frozen=True)
class Cell:
    """One measurement: a policy with fixed knobs on one model, context and target (task or text)."""

    model: str
    context: int
    kind: str  # "ppl" or "retrieval"
    target: str  # task name or text name
    policy: str
    knobs: tuple[tuple[str, Any], ...] = ()
    samples: int | None = None  # retrieval samples; not in the key (see is_measured)

    @property
    def key(self) -> str:
        """The cell as planned: the knobs the sweep sets (recorded with each measurement)."""
        return json.dumps([self.model, self.context, self.kind, self.target, self.policy, list(self.knobs)])

    @property
    def identity(self) -> str:
        """What the cell measures: every knob of the policy, defaults included. A measurement stands for a
        planned cell when their identities match, so a changed default is measured again while a config
        that names a knob at its old default value finds the old cells."""
        knobs = make_config(self.policy, **dict(self.knobs)).knobs()
        return _identity(self.model, self.context, self.kind, self.target, self.policy, knobs)

    @property
    def group(self) -> tuple[str, int, str, str]:
        """Cells of one group share their prompts."""
        return self.model, self.context, self.kind, self.target

    @property
    def label(self) -> str:
        return policy_label(self.policy, dict(self.knobs))


def policy_label(policy: str, knobs: dict[str, Any]) -> str:
    return policy + "".join(f" {k}={v}" for k, v in sorted(knobs.items()))


@dataclass(frozen=True)
class SweepModel:
    """A model's entry: its contexts, and its own retrieval tasks and samples (None: the sweep's)."""

    name: str
    contexts: tuple[int, ...]
    tasks: tuple[str, ...] | None = None
    samples: int | None = None


@dataclass(frozen=True)
class SweepConfig:
    """A parsed sweep file. ``policies`` maps a policy name to its knob grid (lists expand)."""

    name: str
    out: Path
    models: tuple[SweepModel, ...]
    policies: dict[str, dict[str, Any]]
    tasks: tuple[str, ...] = ()
    samples: int = 3
    depths: tuple[float, ...] = retrieval.DEFAULT_DEPTHS
    chat: str = "off"
    texts: tuple[str, ...] = ()
    prefill: int | None = 512  # None: context - scored
    scored: int | None = None
    windows: int = 1
    ppl_contexts: tuple[int, ...] | None = None
    seed: int = 0
    report: Path | None = None
    source: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def read_config(path: str | Path) -> SweepConfig:
    """Parse a TOML or JSON sweep file (paths inside it are relative to the current directory)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise InputError(f"sweep config not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read sweep config {path}: {exc}") from None
    try:
        models = tuple(
            SweepModel(
                m["name"],
                tuple(int(c) for c in m["contexts"]),
                tuple(m["tasks"]) if "tasks" in m else None,
                int(m["samples"]) if "samples" in m else None,
            )
            for m in raw["models"]
        )
        retrieval_part = raw.get("retrieval", {})
        ppl_part = raw.get("ppl", {})
        config = SweepConfig(
            name=raw.get("name", path.stem),
            out=Path(raw.get("out", f"runs/sweep-{path.stem}")),
            models=models,
            policies={name: dict(knobs) for name, knobs in raw["policies"].items()},
            tasks=tuple(retrieval_part.get("tasks", ())),
            samples=int(retrieval_part.get("samples", 3)),
            depths=tuple(float(d) for d in retrieval_part.get("depths", retrieval.DEFAULT_DEPTHS)),
            chat=retrieval_part.get("chat", "off"),
            texts=tuple(ppl_part.get("texts", ())),
            prefill=None if "scored" in ppl_part else int(ppl_part.get("prefill", 512)),
            scored=int(ppl_part["scored"]) if "scored" in ppl_part else None,
            windows=int(ppl_part.get("windows", 1)),
            ppl_contexts=tuple(int(c) for c in ppl_part["contexts"]) if "contexts" in ppl_part else None,
            seed=int(raw.get("seed", 0)),
            report=Path(raw["report"]) if "report" in raw else None,
            source=path,
            raw=raw,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"sweep config {path}: missing or bad field {exc}") from None
    if "scored" in ppl_part and "prefill" in ppl_part:
        raise InputError(f"sweep config {path}: [ppl] takes prefill or scored, not both")
    named = set(config.tasks).union(*(m.tasks or () for m in config.models))
    unknown = sorted(named - set(TASKS))
    if unknown:
        known = ", ".join(TASKS)
        raise InputError(f"sweep config {path}: unknown tasks {', '.join(unknown)}; available: {known}")
    return config


def ppl_prefill(config: SweepConfig, context: int) -> int:
    """Tokens prefilled densely in a perplexity window of ``context`` tokens."""
    return config.prefill if config.scored is None else context - config.scored


def policy_variants(config: SweepConfig) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(policy, knobs) for every combination of knob values, dense first; and the unavailable policies."""
    variants: list[tuple[str, dict[str, Any]]] = []
    unavailable = []
    for name, grid in sorted(config.policies.items(), key=lambda item: item[0] != "dense"):
        if name not in POLICIES:
            unavailable.append(name)
            continue
        names = sorted(grid)
        values = [grid[k] if isinstance(grid[k], list) else [grid[k]] for k in names]
        for combo in itertools.product(*values):
            knobs = dict(zip(names, combo, strict=True))
            make_config(name, **resolve_knobs(knobs, 4096))  # fail early on a bad knob
            variants.append((name, knobs))
    return variants, unavailable


def resolve_knobs(knobs: dict[str, Any], context: int) -> dict[str, Any]:
    """Turn ``"<fraction>*context"`` knob values into token counts for ``context``."""
    out = {}
    for name, value in knobs.items():
        if isinstance(value, str) and value.endswith("*context"):
            try:
                value = max(1, round(float(value.removesuffix("*context")) * context))
            except ValueError:
                raise InputError(f"knob {name}: expected '<fraction>*context', got '{value}'") from None
        out[name] = value
    return out


def cells(config: SweepConfig, shard: tuple[int, int] = (0, 1)) -> Iterator[Cell]:
    """Every cell of the sweep (of one shard), grouped by model (loaded once), dense first in each group."""
    variants, _ = policy_variants(config)
    index, count = shard
    groups = [
        (model.name, context, kind, target, _samples(config, model) if kind == "retrieval" else None)
        for model in config.models
        for context in model.contexts
        for kind, targets in (
            ("ppl", _ppl_texts(config, context)),
            ("retrieval", config.tasks if model.tasks is None else model.tasks),
        )
        for target in targets
    ]
    for model, context, kind, target, samples in groups[index::count]:
        for policy, knobs in variants:
            yield Cell(model, context, kind, target, policy, _frozen(knobs, context), samples)


def _samples(config: SweepConfig, model: SweepModel) -> int:
    return config.samples if model.samples is None else model.samples


def _ppl_texts(config: SweepConfig, context: int) -> tuple[str, ...]:
    return config.texts if config.ppl_contexts is None or context in config.ppl_contexts else ()


def _frozen(knobs: dict[str, Any], context: int) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(resolve_knobs(knobs, context).items()))


def _identity(model: str, context: int, kind: str, target: str, policy: str, knobs: dict[str, Any]) -> str:
    if policy in POLICIES:  # a knob added later at its default leaves earlier measurements standing
        knobs = POLICIES[policy].config_class.identity_knobs(knobs)
    return json.dumps([model, context, kind, target, policy, sorted(knobs.items())])


def record_identity(record: dict[str, Any]) -> str:
    """:attr:`Cell.identity` of a recorded measurement: its cell with every knob the policy ran with."""
    cell = record["cell"]
    return _identity(
        cell["model"],
        cell["context"],
        cell["kind"],
        cell["target"],
        cell["policy"],
        record["result"]["knobs"],
    )


def finished(out: Path) -> dict[str, dict[str, Any]]:
    """Cells already measured (by :attr:`Cell.identity`; the latest of equal ones), from ``cells.jsonl``; a
    torn last line is ignored."""
    path = out / "cells.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[record_identity(record)] = record
    return done


def is_measured(cell: Cell, done: dict[str, dict[str, Any]]) -> bool:
    """Whether ``done`` holds ``cell``, measured as planned: with every knob of the policy as now (see
    :attr:`Cell.identity`) and, for retrieval, as many samples (raising the samples re-measures a grid).
    Knobs resolved from a calibration (InfiniGen's alpha and partial ratio 0) are compared as given:
    recalibrating under a new rule does not by itself re-measure their cells."""
    record = done.get(cell.identity)
    return record is not None and (cell.kind != "retrieval" or record["result"]["samples"] == cell.samples)


def is_current(cell: Cell, done: dict[str, dict[str, Any]]) -> bool:
    """Whether ``cell`` is measured (:func:`is_measured`) with every cost recorded (``runner.COSTS``) on
    today's decode path (``runner.DECODE_PATH``): a cell measured before the costs were, or on a left-padded
    batch's Driver, is measured again by the next sweep; the report shows it until then."""
    if not is_measured(cell, done):
        return False
    result = done[cell.identity]["result"]
    return all(cost in result for cost in COSTS) and result.get("decode_path") == DECODE_PATH


def run_cell(
    cell: Cell,
    loaded: LoadedModel,
    config: SweepConfig,
    done: dict[str, dict],
    memo: PrefillMemo,
    progress: bool = True,
) -> dict[str, Any]:
    policy = make_config(cell.policy, **dict(cell.knobs))
    if cell.kind == "ppl":
        prefill = ppl_prefill(config, cell.context)
        ppl_config = ppl.PerplexityConfig(cell.target, cell.context, prefill, config.windows)
        reference = done.get(_dense_identity(cell), {}).get("result")
        if reference is not None and reference.get("decode_path") != DECODE_PATH:
            reference = None  # measured on an earlier decode path: dense is measured again beside this cell
        return ppl.perplexity(loaded, policy, ppl_config, reference=reference, progress=progress, memo=memo)
    return retrieval.evaluate(
        loaded, policy, cell.target, cell.context, cell.samples, config.depths, config.seed, config.chat,
        progress=progress, memo=memo,
    )  # fmt: skip


def _dense_identity(cell: Cell) -> str:
    """The dense cell of ``cell``'s group: a perplexity cell's reference."""
    return Cell(cell.model, cell.context, "ppl", cell.target, "dense").identity


@dataclass(frozen=True)
class Outcome:
    """A cell measured (``record``, the line ``cells.jsonl`` gets) or failed (``error``, one line)."""

    cell: Cell
    record: dict[str, Any] | None = None
    error: str | None = None


def measure_group(
    config: SweepConfig, group: list[Cell], loaded: LoadedModel, done: dict[str, dict], progress: bool = True
) -> Iterator[Outcome]:
    """Measure the cells of one group in order (dense first), sharing one prefill memo; adds each record
    to ``done`` (the group's perplexity cells find their dense reference there)."""
    memo = PrefillMemo()
    try:
        for cell in group:
            try:
                result = run_cell(cell, loaded, config, done, memo, progress)
            except InfinikvError as exc:
                yield Outcome(cell, error=str(exc))
                continue
            record = {"key": cell.key, "cell": cell.__dict__ | {"knobs": dict(cell.knobs)}, "result": result}
            done[cell.identity] = record
            yield Outcome(cell, record)
    finally:
        memo.clear()  # the next group's prompts differ: free this group's K/V


def groups_of(todo: list[Cell]) -> list[list[Cell]]:
    """``todo`` cut into runs of cells of one group (as :func:`cells` orders them)."""
    return [list(run) for _, run in itertools.groupby(todo, key=lambda cell: cell.group)]


class Ledger:
    """Where outcomes land: a measured cell in ``cells.jsonl``, a failed one in ``failed.jsonl`` (with its
    error; a later run measures it again) and one line on stderr."""

    def __init__(self, out: Path):
        path = out / "cells.jsonl"
        torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self._cells = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the sweep; __exit__ closes)
        if torn:
            self._cells.write("\n")  # close an interrupted line so the next record starts on its own
        self._failed_path = out / "failed.jsonl"
        self.failures = 0  # cells that failed in this run

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self._cells.close()

    def write(self, outcome: Outcome) -> None:
        if outcome.record is not None:
            self._cells.write(json.dumps(outcome.record) + "\n")
            self._cells.flush()
            return
        cell = outcome.cell
        self.failures += 1
        line = f"sweep: {cell.label} on {cell.target}@{cell.context} failed: {outcome.error}"
        tqdm.write(line, file=sys.stderr)  # above the progress bar, which is drawn again below it
        with open(self._failed_path, "a", encoding="utf-8") as failed:
            failed.write(json.dumps({"key": cell.key, "error": outcome.error}) + "\n")


def run_sweep(
    config: SweepConfig,
    loader: Callable[[str], LoadedModel] = load,
    progress: bool = True,
    shard: tuple[int, int] = (0, 1),
    spread: Spread | None = None,
) -> int:
    """Measure every cell (of ``shard``) not yet in ``cells.jsonl`` with its costs (:func:`is_current`),
    appending each as it finishes; with ``spread``, one Ray task per group (:mod:`infinikv.cluster`), each
    group's cells appended when its task ends. :func:`infinikv.eval.report.write_outputs` turns the finished
    cells into tables and plots. Returns how many cells failed (``failed.jsonl``; the sweep goes on past
    each)."""
    config.out.mkdir(parents=True, exist_ok=True)
    done = finished(config.out)
    _, unavailable = policy_variants(config)
    for name in unavailable:
        print(f"sweep: policy '{name}' is not in this build; its cells are skipped", file=sys.stderr)
    todo = [c for c in cells(config, shard) if not is_current(c, done)]
    bar = tqdm(total=len(todo), desc=f"sweep {config.name}", unit="cell", disable=not progress)
    with Ledger(config.out) as ledger, bar:
        if spread is None:
            loaded: LoadedModel | None = None
            for group in groups_of(todo):
                if loaded is None or loaded.name != group[0].model:
                    loaded = loader(group[0].model)
                for outcome in measure_group(config, group, loaded, done):
                    ledger.write(outcome)
                    bar.update()
            return ledger.failures
        # a task gets only the dense references its perplexity cells need, not every finished record
        wanted = {_dense_identity(cell) for cell in todo if cell.kind == "ppl"}
        references = {identity: done[identity] for identity in wanted & done.keys()}
        work = partial(_measure_remotely, config, loader, references)
        for ended in spread.run(work, groups_of(todo)):
            outcomes = ended.value or [
                Outcome(cell, error=f"task failed: {ended.error}") for cell in ended.item
            ]
            for outcome in outcomes:
                ledger.write(outcome)
            bar.update(len(outcomes))
            bar.set_postfix_str(f"last group on {ended.where.get('host', '?')}")
        return ledger.failures


def _measure_remotely(
    config: SweepConfig, loader: Callable[[str], LoadedModel], done: dict[str, dict], group: list[Cell]
) -> list[Outcome]:
    """A Ray task: one group's outcomes. The worker keeps its last model for the next group."""
    loaded = _WORKER_MODEL.get((loader, group[0].model))
    if loaded is None:
        _WORKER_MODEL.clear()
        loaded = _WORKER_MODEL[(loader, group[0].model)] = loader(group[0].model)
    return list(measure_group(config, group, loaded, dict(done), progress=False))


# In a Ray worker: the model the last group loaded, by (loader, name), so the next group of the same model
# on this worker does not load it again.
_WORKER_MODEL: dict[tuple[Callable[[str], LoadedModel], str], LoadedModel] = {}


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise InputError(f"shard: expected I/N such as 0/2, got '{text}'") from None
    if not 0 <= index < count:
        raise InputError(f"shard: expected 0 <= I < N, got '{text}'")
    return index, count
