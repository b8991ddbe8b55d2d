"""Every registered policy through a short batched generation on tiny Llama and tiny Gemma-3.

Each policy has an entry in :data:`CASES`: the knobs at which it selects little (``tight``), the knobs at
which it must give dense's tokens (``full``), and ``expected``, the byte counters its module docstring
implies at the tight setting, worked out from the model's shapes (layers, KV heads, head_dim, element size,
sliding windows) and the batch's lengths alone. A registered policy without an entry fails
``test_every_policy_has_a_case``: a new policy declares its tight setting and its byte arithmetic here.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pytest
import torch

import infinikv
from infinikv import GenerationConfig, Generator, copiers
from infinikv.cache import InfinikvCache
from infinikv.engine import Engine, EngineConfig
from infinikv.forward import Driver, prompt_chunks
from infinikv.kvpool import KVPool
from infinikv.policies import POLICIES, PolicyConfig, make_config, prepare
from infinikv.policies.base import Policy

CHUNK = GenerationConfig().prefill_chunk  # the prompt chunk of a Generator's own engine

PROMPTS = ["A short one.", "A much longer prompt, padded on the left of its shorter batch mate " * 3]
NEW_TOKENS = 8
MODELS = ["tiny", "tiny_gemma"]


# -- the arithmetic ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """What a run's byte counters follow from: the model's shapes and the batch's lengths (the engine gives
    each row a cache of its own: a batch of one)."""

    layers: int
    kv_heads: int
    head_dim: int
    element: int  # bytes per K/V element
    windows: tuple[int | None, ...]  # per layer: its sliding window, or None
    real: tuple[int, ...]  # real prompt tokens per row (the batch is left-padded to the longest)
    steps: int  # decode steps (forwards after the prefill)

    @classmethod
    def of(cls, loaded, stats: list[dict]) -> Shapes:
        spec = loaded.spec
        element = torch.empty(0, dtype=loaded.model.dtype).element_size()
        return cls(
            layers=spec.num_layers,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            element=element,
            windows=tuple(spec.sliding_window),
            real=tuple(s["prompt_tokens"] for s in stats),
            steps=stats[0]["decode_steps"],
        )

    @property
    def batch(self) -> int:
        return len(self.real)

    @property
    def padded(self) -> int:
        return max(self.real)

    @property
    def final(self) -> int:
        """Slots per layer after the run: the padded prompt and one per decode step."""
        return self.padded + self.steps

    def past(self, step: int) -> int:
        """Slots of the padded batch before decode step ``step``'s token."""
        return self.padded + step

    def real_past(self, step: int) -> list[int]:
        """Each row's real past tokens before decode step ``step``'s token."""
        return [n + step for n in self.real]

    @property
    def slot_bytes(self) -> int:
        """K and V of one token slot, every row and KV head."""
        return self.batch * self.kv_heads * 2 * self.head_dim * self.element

    def moved(
        self, rows: Callable[[int, int], int], slot_bytes: int | None = None, prefill: bool = True
    ) -> int:
        """Bytes copied when ``rows(layer, step)`` slots (per row and KV head) cross per layer and step, and
        (``prefill``) when each prompt chunk but the first reads back the chunks before it, to attend to
        them."""
        total = sum(rows(layer, step) for layer in range(self.layers) for step in range(self.steps))
        if prefill:
            total += self.layers * sum(begin for begin, _ in prompt_chunks(self.padded, CHUNK))
        return total * (self.slot_bytes if slot_bytes is None else slot_bytes)

    def window_rows(self, layer: int, step: int) -> int:
        """A sliding layer reads the window - 1 slots before the new token."""
        return min(self.past(step), self.windows[layer] - 1)

    def unselected_rows(self, layer: int, step: int, dense_layers: int) -> int | None:
        """What a layer that does not choose reads: a sliding layer its window, one of the first
        ``dense_layers`` every past slot; None for a layer that chooses."""
        if self.windows[layer] is not None:
            return self.window_rows(layer, step)
        return self.past(step) if layer < dense_layers else None


def budget_tokens(budget: float, context: int, capped: bool = True) -> int:
    """A budget in tokens: <= 1 a fraction of ``context`` (rounded up, at least one), above 1 a count."""
    tokens = math.ceil(budget * context) if budget <= 1 else int(budget)
    return max(1, min(tokens, context) if capped or budget <= 1 else tokens)


def gathered(takes: list[int], have: list[int], past: int) -> int:
    """Slots a selecting layer copies per row and head: all ``past`` slots when every row takes all it
    ``have``s, else as many as the widest row takes (a narrower row's extras are hidden, not skipped)."""
    takes = [min(take, n) for take, n in zip(takes, have, strict=True)]
    return past if takes == have else max(takes)


def dense_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """Everything on the device, nothing moved."""
    return {"bytes_h2d": 0, "kv_bytes_host": 0, "kv_bytes_device": run.layers * run.final * run.slot_bytes}


def offload_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """Each step copies every layer's whole KV (every slot of the padded batch); all of it on the host."""
    return {
        "bytes_h2d": run.moved(lambda layer, step: run.past(step)),
        "kv_bytes_host": run.layers * run.final * run.slot_bytes,
        "kv_bytes_device": 0,
    }


def streaming_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """A full layer copies its n_sink sinks and window - 1 recent tokens (the new token completes the
    window); a sliding layer its window."""

    def rows(layer: int, step: int) -> int:
        if run.windows[layer] is not None:
            return run.window_rows(layer, step)
        have = run.real_past(step)
        return gathered([config.n_sink + config.window - 1] * run.batch, have, run.past(step))

    return {
        "bytes_h2d": run.moved(rows),
        "kv_bytes_host": run.layers * run.final * run.slot_bytes,
        "kv_bytes_device": 0,
    }


def oracle_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """A managed layer copies the budget's top tokens of each row's real past (sinks and window counted in
    it); the first dense_layers layers copy everything, sliding layers their window."""

    def rows(layer: int, step: int) -> int:
        fixed = run.unselected_rows(layer, step, config.dense_layers)
        if fixed is not None:
            return fixed
        have = run.real_past(step)
        return gathered([budget_tokens(config.budget, n) for n in have], have, run.past(step))

    return {
        "bytes_h2d": run.moved(rows),
        "kv_bytes_host": run.layers * run.final * run.slot_bytes,
        "kv_bytes_device": 0,
    }


def quest_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """A managed layer copies whole pages (the budget, less the unfinished page and the new token, in whole
    pages) and the unfinished page; the device holds, per full-attention layer (the dense_layers too), the
    minimums and maximums of the widest row's pages and one page of unfinished keys."""
    size = config.page_size

    def rows(layer: int, step: int) -> int:
        fixed = run.unselected_rows(layer, step, config.dense_layers)
        if fixed is not None:
            return fixed
        have = run.real_past(step)
        pages, held = [n // size for n in have], [n % size for n in have]
        budgets = [budget_tokens(config.budget, n + 1, capped=False) for n in have]
        takes = [max(0, (b - h - 1) // size) for b, h in zip(budgets, held, strict=True)]
        takes = [min(take, n) for take, n in zip(takes, pages, strict=True)]
        if takes == pages:
            return run.past(step)
        return max(takes) * size + max(held)

    full_layers = sum(window is None for window in run.windows)
    pages = max((n + run.steps) // size for n in run.real)
    metadata = run.batch * run.kv_heads * run.head_dim * run.element * (2 * pages + size)
    return {
        "bytes_h2d": run.moved(rows),
        "kv_bytes_host": run.layers * run.final * run.slot_bytes,
        "kv_bytes_device": full_layers * metadata,
    }


def h2o_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """A layer keeps the widest row's budget - 1 slots (its window - 1 on a sliding layer), the prompt cut
    to that at the first step, and copies all it keeps each step. The device holds, per kept slot, its
    accumulated score (float32), position (int64) and whether it is alive (bool)."""

    def kept(layer: int) -> int:
        window = run.windows[layer]
        if window is not None:
            return window - 1
        return max(budget_tokens(config.budget, n, capped=False) for n in run.real) - 1

    held = sum(min(kept(layer), run.final) for layer in range(run.layers))
    return {
        "bytes_h2d": run.moved(lambda layer, step: min(kept(layer), run.past(step))),
        "kv_bytes_host": held * run.slot_bytes,
        "kv_bytes_device": held * run.batch * run.kv_heads * (4 + 8 + 1),
    }


def quant_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """Group scheme: per token and head, the packed codes of K and V (bits / 8 bytes a value) and a scale
    and a minimum per group of min(group_size, head_dim) values of each; every step copies a full layer
    whole and a sliding layer its window. 16 bits: stored as is."""
    assert not config.kivi, "the arithmetic below is the group scheme's"
    if config.bits == 16:
        slot = run.slot_bytes
    else:
        groups = run.head_dim // min(config.group_size, run.head_dim)
        per_head = 2 * run.head_dim * config.bits // 8 + 2 * 2 * groups * run.element
        slot = run.batch * run.kv_heads * per_head

    def rows(layer: int, step: int) -> int:
        return run.past(step) if run.windows[layer] is None else run.window_rows(layer, step)

    return {
        "bytes_h2d": run.moved(rows, slot),
        "kv_bytes_host": run.layers * run.final * slot,
        "kv_bytes_device": 0,
    }


def infinigen_bytes(run: Shapes, config: PolicyConfig) -> dict[str, int]:
    """alpha inf counts every real token, so the budget alone decides: a managed layer copies each row's
    budget (of its real tokens) as wide as the widest row; a layer it does not manage copies all it holds,
    a sliding one its window - 1 slots (its pool keeps the window). The device holds the managed layers'
    partial keys, ⌈partial_ratio·head_dim⌉ columns per slot as stored (int8 and a float16 scale by default).
    Capacity 1: nothing is evicted."""
    assert math.isinf(config.alpha) and config.capacity == 1 and config.partial_ratio
    own = config.first_layers == "own"  # the first dense_layers layers select too, by their own query
    managed = [
        window is None and (layer >= config.dense_layers or own) for layer, window in enumerate(run.windows)
    ]

    def rows(layer: int, step: int) -> int:
        if managed[layer]:
            return max(budget_tokens(config.budget, max(n, 1)) for n in run.real_past(step))
        if run.windows[layer] is not None:
            return run.window_rows(layer, step)
        return run.past(step)

    def held(layer: int) -> int:
        window = run.windows[layer]
        return run.final if window is None else min(run.final, window)

    columns = max(1, math.ceil(config.partial_ratio * run.head_dim))
    return {
        "bytes_h2d": run.moved(rows),
        "decode_bytes_h2d": run.moved(rows, prefill=False),
        "offload_equivalent_bytes_h2d": run.moved(lambda layer, step: run.past(step), prefill=False),
        "kv_bytes_host": sum(held(layer) for layer in range(run.layers)) * run.slot_bytes,
        "kv_bytes_device": sum(managed)
        * run.batch
        * run.kv_heads
        * int(config.bytes_per_token(columns, run.element))
        * run.final,
    }


# -- one entry per policy ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    tight: dict  # knobs at which the policy selects (or stores) little
    expected: Callable[[Shapes, PolicyConfig], dict[str, int]]  # its byte counters at ``tight``
    selects: bool  # at ``tight`` each layer attends to fewer tokens than dense
    full: dict = field(default_factory=dict)  # knobs at which it gives dense's tokens


CASES: dict[str, Case] = {
    "dense": Case({}, dense_bytes, selects=False),
    "offload": Case({}, offload_bytes, selects=False),
    "streaming": Case({"n_sink": 2, "window": 8}, streaming_bytes, selects=True, full={"window": 100_000}),
    "quest": Case(
        {"budget": 0.25, "page_size": 4, "dense_layers": 1, "min_tokens": 0},
        quest_bytes,
        selects=True,
        full={"budget": 1.0, "dense_layers": 0, "page_size": 4},
    ),
    "h2o": Case(
        {"budget": 0.25, "heavy_ratio": 0.25, "min_tokens": 0},
        h2o_bytes,
        selects=True,
        full={"budget": 100_000},
    ),
    "quant": Case({"bits": 2, "group_size": 8}, quant_bytes, selects=False, full={"bits": 16}),
    "infinigen": Case(
        {
            "budget": 0.25,
            "alpha": math.inf,
            "partial_ratio": 0.25,
            "window": 8,
            "dense_layers": 1,
            "min_tokens": 0,
        },
        infinigen_bytes,
        selects=True,
        full={"budget": 1.0, "alpha": math.inf, "dense_layers": 0, "capacity": 1.0},
    ),
    "oracle": Case(
        {"budget": 0.25, "n_sink": 1, "window": 8, "min_tokens": 0},
        oracle_bytes,
        selects=True,
        full={"budget": 1.0, "dense_layers": 0},
    ),
}


def case(policy: str) -> Case:
    if policy not in CASES:
        pytest.fail(f"policy '{policy}' has no entry in CASES (its tight setting and byte arithmetic)")
    return CASES[policy]


def test_every_policy_has_a_case():
    """A registered policy must declare its tight setting; an entry must name a registered policy."""
    assert set(POLICIES) - set(CASES) == set(), "registered policies without an entry in CASES"
    assert set(CASES) - set(POLICIES) == set(), "entries in CASES for no registered policy"
    for name, entry in CASES.items():
        make_config(name, **entry.tight)  # every knob is the policy's, in range
        make_config(name, **entry.full)


# -- the runs ------------------------------------------------------------------------------------------------
def _run(loaded, policy: str, knobs: dict):
    generator = Generator(loaded, policy, **knobs)  # may calibrate (InfiniGen) before the hook goes on
    finite = []
    hook = loaded.model.lm_head.register_forward_hook(
        lambda _module, _inputs, logits: finite.append(bool(logits.isfinite().all()))
    )
    try:
        results = generator.generate(PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS))
    finally:
        hook.remove()
    return results, finite


@pytest.fixture(scope="module")
def dense_runs():
    return {}


def _dense(model: str, loaded, dense_runs: dict):
    if model not in dense_runs:
        dense_runs[model] = _run(loaded, "dense", {})[0]
    return dense_runs[model]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_matrix(policy, model, request, dense_runs):
    entry = case(policy)
    loaded = request.getfixturevalue(model)
    results, finite = _run(loaded, policy, entry.tight)
    dense = _dense(model, loaded, dense_runs)

    assert len(results) == len(PROMPTS)
    # one forward per prompt chunk, then one per further token for all rows together
    chunks = sum(len(prompt_chunks(len(loaded.tokenizer(p)["input_ids"]), CHUNK)) for p in PROMPTS)
    assert all(finite) and len(finite) == chunks + NEW_TOKENS - 1
    for result, reference in zip(results, dense, strict=True):
        assert 1 <= len(result.token_ids) <= NEW_TOKENS
        assert result.stats["policy"] == policy
        # Strictly less than the whole context for a policy that selects; all of it for the others.
        attended, whole = result.stats["mean_tokens_attended"], reference.stats["mean_tokens_attended"]
        assert attended < whole if entry.selects else attended == whole

    stats = [result.stats for result in results]
    assert [s["prompt_tokens"] for s in stats] == [len(loaded.tokenizer(p)["input_ids"]) for p in PROMPTS]
    for row in stats:  # each row's counters are its own cache's: a batch of one, unpadded
        run = Shapes.of(loaded, [row])
        expected = entry.expected(run, make_config(policy, **entry.tight))
        assert {"bytes_h2d", "kv_bytes_host", "kv_bytes_device"} <= set(expected)
        got = {key: row.get(key) for key in expected}
        assert got == expected, f"{policy} on {model}: counters differ from the shapes' arithmetic"
    if policy != "dense":
        assert stats[0]["kv_bytes_host"] > 0
    if policy not in ("dense", "offload"):  # the tight setting moves less than full offload
        run = Shapes.of(loaded, [stats[0]])
        assert stats[0]["bytes_h2d"] < offload_bytes(run, make_config("offload"))["bytes_h2d"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_full_setting_is_dense(policy, model, request, dense_runs):
    """At its full setting every policy attends to everything it holds at full precision: dense, token for
    token (the oracle at full budget is the ceiling of token selection)."""
    loaded = request.getfixturevalue(model)
    results, _ = _run(loaded, policy, case(policy).full)
    assert [r.token_ids for r in results] == [r.token_ids for r in _dense(model, loaded, dense_runs)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_full_setting_is_dense_in_bfloat16(policy, tiny_bf16, dense_runs):
    """The same in bfloat16 (``--dtype bfloat16``): every policy's full setting gives dense's tokens, both in
    bfloat16."""
    results, finite = _run(tiny_bf16, policy, case(policy).full)
    assert all(finite)
    assert [r.token_ids for r in results] == [r.token_ids for r in _dense("tiny_bf16", tiny_bf16, dense_runs)]


# what a run moved and held, as opposed to how long it took
COUNTED = ("bytes_h2d", "bytes_d2h", "bytes_h2d_on_demand", "fetch_peak_bytes", "selector_bytes")
COUNTED += ("kv_bytes_host", "kv_bytes_device", "mean_tokens_attended")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_worker_thread_changes_nothing(policy, tiny, monkeypatch):
    """With a core free beside the decode thread and steps that copy enough to gain from it, the look-aheads
    and copies of every sequence run on the worker their pools share; with no core, or steps below
    ``WORKER_FROM_BYTES``, all at once; steps that take turns, one way then the other. Tokens and counters
    are the same."""
    where = []
    ahead = KVPool.ahead

    def watched(pool: KVPool, work, *args):
        return ahead(pool, lambda *a: where.append(copiers.on_worker()) or work(*a), *args)

    steps: Counter = Counter()  # per copier
    size_step = copiers.ThreadCopier.size_step

    def taking_turns(copier: copiers.ThreadCopier, layer_bytes: int) -> None:  # large, small, large, ...
        steps[id(copier)] += 1
        size_step(copier, 0 if steps[id(copier)] % 2 else 2)

    monkeypatch.setattr(KVPool, "ahead", watched)
    runs = []
    for free, worker_from, turns in ((1, 0, False), (0, 0, False), (1, 2**62, False), (1, 1, True)):
        monkeypatch.setattr(copiers, "USABLE_CORES", torch.get_num_threads() + free)
        monkeypatch.setattr(copiers, "WORKER_FROM_BYTES", worker_from)
        if turns:
            monkeypatch.setattr(copiers.ThreadCopier, "size_step", taking_turns)
        where.clear()
        results, _ = _run(tiny, policy, case(policy).tight)
        runs.append([(r.token_ids, [r.stats[key] for key in COUNTED]) for r in results])
        if POLICIES[policy].prefetches:  # on the worker exactly where a core was free for steps this large
            assert where and set(where) == ({True, False} if turns else {free == 1 and worker_from == 0})
    assert runs[0] == runs[1] == runs[2] == runs[3]


FLOORED = [
    name for name, policy in POLICIES.items() if "min_tokens" in policy.config_class.__dataclass_fields__
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", FLOORED)
def test_a_context_within_the_floor_is_dense(policy, model, request, dense_runs):
    """A row whose context (prompt and new tokens) is within the policy's floor (``min_tokens``) attends to
    everything, whatever its budget: dense's tokens, where the same tight budget without the floor departs."""
    loaded = request.getfixturevalue(model)
    dense = [r.token_ids for r in _dense(model, loaded, dense_runs)]
    longest = max(len(loaded.tokenizer(p)["input_ids"]) for p in PROMPTS) + NEW_TOKENS
    floored, _ = _run(loaded, policy, {**case(policy).tight, "min_tokens": longest})
    assert [r.token_ids for r in floored] == dense
    unfloored, _ = _run(loaded, policy, case(policy).tight)  # min_tokens 0
    assert unfloored[0].stats["mean_tokens_attended"] < floored[0].stats["mean_tokens_attended"]


# -- batch invariance ----------------------------------------------------------------------------------------
# A prompt's greedy tokens must not depend on its batchmates. The padding of the short prompt below is a
# multiple of every page and group size used here (192 tokens); MISALIGNED pads it by 189.
ALIGNED = [
    "A short one.",
    "A short one." + "Sixty-four characters of a longer prompt, padded to line up. ok " * 3,
]
MISALIGNED = PROMPTS
KIVI = {"scheme": "kivi", "group_size": 4, "residual": 4}
CALIBRATED = {"alpha": 0.0, "partial_ratio": 0.0}  # InfiniGen's calibrated count rule and columns


VARIANTS = [pytest.param(policy, policy, {}, id=policy) for policy in POLICIES]
VARIANTS.append(pytest.param("quant-kivi", "quant", KIVI, id="quant-kivi"))
VARIANTS.append(pytest.param("infinigen-calibrated", "infinigen", CALIBRATED, id="infinigen-calibrated"))
VARIANTS.append(pytest.param("infinigen-every-3", "infinigen", {"select_every": 3}, id="infinigen-every-3"))
PER_LAYER = {**CALIBRATED, "column_allocation": "per_layer"}
VARIANTS.append(pytest.param("infinigen-per-layer", "infinigen", PER_LAYER, id="infinigen-per-layer"))
INT4 = {**CALIBRATED, "partial_keys": "int4"}  # packed two to a byte, cut to each row's columns
VARIANTS.append(pytest.param("infinigen-int4", "infinigen", INT4, id="infinigen-int4"))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("padding", ["aligned", "misaligned"])
@pytest.mark.parametrize(("variant", "policy", "extra"), VARIANTS)
def test_batch_invariance(variant, policy, extra, padding, model, request):
    loaded = request.getfixturevalue(model)
    knobs = {**case(policy).tight, **extra}
    prompts = ALIGNED if padding == "aligned" else MISALIGNED
    assert len(loaded.tokenizer(prompts[1])["input_ids"]) - len(
        loaded.tokenizer(prompts[0])["input_ids"]
    ) == (192 if padding == "aligned" else 189)
    generator = Generator(loaded, policy, **knobs)
    config = GenerationConfig(max_new_tokens=16)
    batched = generator.generate(prompts, config)
    for prompt, together in zip(prompts, batched, strict=True):
        alone = generator.generate([prompt], config)[0]
        assert together.token_ids == alone.token_ids, f"{prompt[:20]!r} changed by its batchmate"


@pytest.mark.parametrize("model", MODELS)
def test_batch_invariance_across_prefill_chunks(model, request):
    """Prompts longer than a prefill chunk with 2-bit KV, whose later chunks attend to the quantized earlier
    ones: each row's chunks are cut where they are cut alone, so its greedy tokens are its own."""
    loaded = request.getfixturevalue(model)
    generator = Generator(loaded, "quant", **case("quant").tight)
    config = GenerationConfig(max_new_tokens=16, prefill_chunk=32)
    batched = generator.generate(MISALIGNED, config)
    for prompt, together in zip(MISALIGNED, batched, strict=True):
        assert together.token_ids == generator.generate([prompt], config)[0].token_ids


# -- knob combinations ---------------------------------------------------------------------------------------
# Every pair of two knobs' non-default values, of every policy, on a row of its own or shared: the values
# come from each knob's declaration (policies/config.knob), so a new knob joins without an entry here.
def knob_values(config_class: type[PolicyConfig]) -> dict[str, list]:
    """Per knob, the values other than its default it is tried at: its ``examples``; else a bool's other
    value, a string's other choices, or numbers around the default within the knob's range (its low end,
    one and two steps up; half and twice a fraction; inf where it is allowed)."""
    values = {}
    for f in fields(config_class):
        meta, default = f.metadata, f.default
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if meta.get("examples"):
            tried = list(meta["examples"])
        elif kind == "bool":
            tried = [not default]
        elif kind == "str":
            tried = [choice for choice in meta.get("choices") or () if choice != default]
        else:
            low, high = meta.get("low"), meta.get("high")
            if kind == "int":
                tried = [v for v in (low, default + 1, 2 * default + 2) if v is not None]
            else:
                tried = [default / 2, 2 * default] if default > 0 else [1.0]
                tried += [math.inf] if meta.get("allow_inf") else []
            tried = [max(v, low) if low is not None else v for v in tried]
            tried = [min(v, high) if high is not None else v for v in tried]
            tried = [int(v) if kind == "int" else float(v) for v in tried]
        values[f.name] = [v for i, v in enumerate(tried) if v != default and v not in tried[:i]]
    return values


def covering_rows(values: dict[str, list]) -> list[dict]:
    """Rows of knob values (a knob left out keeps its default) in which every pair of two knobs' values
    appears at least once: greedily, each row starts from a pair not yet covered and gives every other knob
    the value that covers the most pairs not yet covered with the knobs set before it."""
    names = list(values)
    uncovered = [
        ((a, i), (b, j))
        for x, a in enumerate(names)
        for b in names[x + 1 :]
        for i in range(len(values[a]))
        for j in range(len(values[b]))
    ]
    left = set(map(frozenset, uncovered))
    rows = []
    while left:
        (a, i), (b, j) = next(pair for pair in uncovered if frozenset(pair) in left)
        row = {a: i, b: j}
        for name in names:
            if name not in row:
                gains = [
                    sum(frozenset([(other, k), (name, v)]) in left for other, k in row.items())
                    for v in range(len(values[name]))
                ]
                if max(gains) > 0:
                    row[name] = gains.index(max(gains))
        left -= {frozenset(pair) for pair in itertools.combinations(row.items(), 2)}
        rows.append({name: values[name][index] for name, index in row.items()})
    return rows


def knob_pairs() -> list:
    params = []
    for policy, registered in POLICIES.items():
        values = knob_values(registered.config_class)
        rows = (
            covering_rows(values) if len(values) > 1 else [{name: v} for name in values for v in values[name]]
        )
        params += [pytest.param(policy, row, id=f"{policy}-{n}") for n, row in enumerate(rows)]
    return params


def test_every_knob_has_values_to_try_alone():
    """Each knob is tried at one value or more, each valid on its own: a knob whose valid values its type
    and range do not say declares ``examples``."""
    for policy, registered in POLICIES.items():
        for name, tried in knob_values(registered.config_class).items():
            assert tried, f"{policy}.{name}: no value to try; declare examples= in its knob()"
            for value in tried:
                make_config(policy, **{name: value})


def test_the_rows_cover_every_pair():
    values = {"a": [1, 2], "b": ["x"], "c": [True], "d": [3, 4, 5]}
    rows = covering_rows(values)
    for (a, tried_a), (b, tried_b) in itertools.combinations(values.items(), 2):
        for va, vb in itertools.product(tried_a, tried_b):
            assert any(row.get(a) == va and row.get(b) == vb for row in rows), (a, va, b, vb)
    assert len(rows) < sum(len(x) * len(y) for x, y in itertools.combinations(values.values(), 2))


@pytest.mark.parametrize(("policy", "row"), knob_pairs())
def test_knob_combinations(policy, row, tiny, dense_runs, monkeypatch):
    """Every covering row generates without error with finite logits; a budgeted policy's managed layers
    attend within their budget at every step; and with the policy's full setting on top, dense's tokens."""
    attended: list[tuple[int, float]] = []
    record = Policy.record_attended

    def recording(self, layer, n_tokens):
        attended.append((layer, float(n_tokens)))
        record(self, layer, n_tokens)

    monkeypatch.setattr(Policy, "record_attended", recording)
    results, finite = _run(tiny, policy, row)
    assert all(finite) and all(1 <= len(r.token_ids) <= NEW_TOKENS for r in results)
    config = make_config(policy, **row)
    if "budget" in config.knobs():
        longest = max(r.stats["prompt_tokens"] + len(r.token_ids) for r in results)
        cap = budget_tokens(config.budget, longest, capped=True)
        cap = max(cap, min(config.min_tokens, longest)) + 1  # the floor, and the token being decoded
        cap += config.knobs().get("page_size", 0)  # whole pages: the last one chosen may overrun
        leading = config.knobs().get("dense_layers", 0)
        if policy == "infinigen" and config.first_layers == "own":
            leading = 0  # the first layers choose with their own query, within the budget
        over = [(layer, n) for layer, n in attended if layer >= leading and n > cap]
        assert not over, f"{policy} {row}: attended past its budget of {cap} tokens: {over[:4]}"
    dense = [r.token_ids for r in _dense("tiny", tiny, dense_runs)]
    full, _ = _run(tiny, policy, {**row, **case(policy).full})
    assert [r.token_ids for r in full] == dense, f"{policy} {row} at full setting departs from dense"


# -- host reads ----------------------------------------------------------------------------------------------
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
PACKAGE = os.path.dirname(infinikv.__file__) + os.sep  # reads made by infinikv's own code


def _count_reads(monkeypatch) -> tuple[threading.Event, list[tuple[str, str, str]]]:
    """From now on in the test, the host reads (what was read, by which function, in which file)
    infinikv's code makes, on any thread, while the event returned is set."""
    counting, reads = threading.Event(), []

    def counted(name: str, method: Callable) -> Callable:
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if counting.is_set() and caller.co_filename.startswith(PACKAGE):
                reads.append((name, caller.co_name, os.path.basename(caller.co_filename)))
            return method(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    return counting, reads


def _decode_reads(loaded, config, monkeypatch) -> list[tuple[str, str, str]]:
    """The host reads infinikv's code makes in four decode steps of a left-padded batch, on the decode
    thread or the pool's worker."""
    prepare(config, loaded)
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :11] = 0  # the first row is 29 tokens, left-padded
    with Driver(loaded, InfinikvCache(loaded.model, config, device=loaded.device)) as driver:
        tokens = driver.prefill(ids, mask, chunk=16).argmax(dim=-1)
        with monkeypatch.context() as patched:
            counting, reads = _count_reads(patched)
            pool = driver.policy.pool()
            for _ in range(4):
                counting.set()
                logits = driver.step(tokens)
                if pool is not None:
                    pool.drain()  # the look-ahead the step queued, too
                counting.clear()
                tokens = logits.argmax(dim=-1)
    return reads


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("setting", ["defaults", "tight"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_decode_step_reads_nothing_back(policy, setting, model, request, monkeypatch):
    """A decode step of a left-padded batch makes no host read in infinikv's code (a value read back from a
    tensor: ``item``, ``tolist``, ``bool``, ``int``, ``nonzero`` ...), on the decode thread or the pool's
    worker: each would stall a GPU's queue, and a step that reads none can be captured whole. (InfiniGen
    counts by its budget here, as at its defaults on the registry's models.)"""
    knobs = case(policy).tight if setting == "tight" else {}
    config = make_config(policy, **knobs)
    assert _decode_reads(request.getfixturevalue(model), config, monkeypatch) == []


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("setting", ["defaults", "tight"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_an_engine_decode_step_reads_back_only_its_new_tokens(policy, setting, model, request, monkeypatch):
    """An engine's decode step over rows of different lengths (each through its own cache, as the server
    runs them) makes one host read in infinikv's code, on any thread: the rows' new tokens, handed to the
    requests. The policies' work for those rows reads nothing back."""
    loaded = request.getfixturevalue(model)
    config = make_config(policy, **(case(policy).tight if setting == "tight" else {}))
    prepare(config, loaded)
    engine = Engine(
        loaded, EngineConfig(block_tokens=16, chunk_tokens=16, kv_memory=2**26, prefix_cache=False)
    )
    generator = torch.Generator().manual_seed(0)
    for length in (29, 40, 47):
        prompt = torch.randint(3, 200, (length,), generator=generator).tolist()
        engine.add(prompt, config, GenerationConfig(64))
    while len(engine.step()) < 3:  # until every row decodes (a step outputs a token per decoding row)
        pass
    counting, reads = _count_reads(monkeypatch)
    for _ in range(4):
        counting.set()
        assert len(engine.step()) == 3
        for row in engine.running:
            pool = row.driver.policy.pool()
            if pool is not None:
                pool.drain()  # the look-ahead the step queued, too
        counting.clear()
    assert reads == [("tolist", "_decode", "engine.py")] * 4


@pytest.mark.parametrize("knobs", [{"alpha": 5.0}, {"alpha": 5.0, "block_size": 4}], ids=["tokens", "blocks"])
def test_an_infinigen_alpha_count_reads_only_the_gather_width(tiny, knobs, monkeypatch):
    """Where an alpha counts, n' (the paper's) sets the width of the gather InfiniGen starts, so it is read
    back, once per choosing layer, and nothing else is."""
    config = make_config("infinigen", budget=0.25, min_tokens=0, **knobs)
    reads = _decode_reads(tiny, config, monkeypatch)
    assert reads and {file for _, _, file in reads} == {"selector.py"}  # the choice's width, and nothing else


# -- compiled decode steps -----------------------------------------------------------------------------------
def _padded_batch_tokens(loaded, config: PolicyConfig, compile: bool) -> list[list[int]]:
    """Greedy tokens of a left-padded batch of two, decoded through a Driver (eager or compiled)."""
    prepare(config, loaded)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    cache = InfinikvCache(loaded.model, config, device=loaded.device)
    with Driver(loaded, cache, compile=compile) as driver:
        tokens = driver.prefill(ids, mask, chunk=8).argmax(dim=-1)
        out = [tokens]
        for _ in range(NEW_TOKENS - 1):
            tokens = driver.step(tokens).argmax(dim=-1)
            out.append(tokens)
    return torch.stack(out, dim=1).tolist()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_decode_steps_give_the_eager_tokens(policy, model, request, dense_runs):
    """Decode steps under torch.compile (the policy's calls eager, in or between the graphs) give every
    policy's eager greedy tokens at its tight setting, and dense's at its full one: through the engine
    (rows of different lengths, each through its own cache) and through a left-padded batch's Driver."""
    entry, loaded = case(policy), request.getfixturevalue(model)
    for knobs, reference in ((entry.tight, None), (entry.full, _dense(model, loaded, dense_runs))):
        if reference is None:
            reference = Generator(loaded, policy, **knobs).generate(PROMPTS, GenerationConfig(NEW_TOKENS))
        compiled = Generator(loaded, policy, compile=True, **knobs).generate(
            PROMPTS, GenerationConfig(NEW_TOKENS)
        )
        assert [r.token_ids for r in compiled] == [r.token_ids for r in reference], f"{policy} {knobs}"
        config = make_config(policy, **knobs)
        eager = _padded_batch_tokens(loaded, config, compile=False)
        assert _padded_batch_tokens(loaded, config, compile=True) == eager, f"{policy} {knobs}, padded batch"


def test_a_compiled_decode_step_runs_the_models_own_work_as_graphs(tiny_gemma, monkeypatch):
    """Compiled, a decode step no longer calls the model's own modules from Python (the final norm here runs
    inside a graph), through a Driver and through the engine (a Generator's); eager, it calls them every
    step. Prompt chunks run eagerly either way."""
    norm = tiny_gemma.model.model.norm
    forward = norm.forward
    eager_decode_calls = []

    def counted(hidden, *args, **kwargs):
        if not torch.compiler.is_compiling() and hidden.shape[1] == 1:
            eager_decode_calls.append(1)
        return forward(hidden, *args, **kwargs)

    monkeypatch.setattr(norm, "forward", counted)
    config = make_config("infinigen")
    for compile in (False, True):
        eager_decode_calls.clear()
        _padded_batch_tokens(tiny_gemma, config, compile=compile)
        assert len(eager_decode_calls) == (0 if compile else NEW_TOKENS - 1), f"Driver, compile={compile}"
        eager_decode_calls.clear()
        generator = Generator(tiny_gemma, config, compile=compile)
        results = generator.generate(PROMPTS, GenerationConfig(NEW_TOKENS))
        decoded = max(len(r.token_ids) for r in results) - 1  # the engine's decode steps
        assert len(eager_decode_calls) == (0 if compile else decoded), f"engine, compile={compile}"


def test_a_compiled_decode_step_on_the_cpu_is_one_graph(tiny_gemma):
    """On the CPU the policy's calls are opaque operators inside the step's graph, not graph breaks: a
    compiled step of the engine and of a left-padded batch's Driver breaks nowhere, InfiniGen's look-ahead
    and Quest's choice with the layer's query included."""
    from torch._dynamo.utils import counters

    for policy in ("infinigen", "quest"):
        torch._dynamo.reset()
        counters.clear()
        config = make_config(policy)
        compiled = _padded_batch_tokens(tiny_gemma, config, compile=True)
        assert compiled == _padded_batch_tokens(tiny_gemma, config, compile=False), policy
        Generator(tiny_gemma, config, compile=True).generate(PROMPTS, GenerationConfig(NEW_TOKENS))
        assert counters["stats"]["unique_graphs"] > 0, policy
        assert not counters["graph_break"], (policy, dict(counters["graph_break"]))


def test_a_compiled_step_hands_the_cache_tensors_the_graph_does_not_reuse(tiny, monkeypatch):
    """The cache may keep what it is handed past the call (a look-ahead queued on a pool's worker keeps the
    layer's input; a layer waiting for its query, its new K/V), and the compiled graph reuses its tensors'
    memory after their last use: after compiled steps, every input and new K/V the cache was handed still
    holds what it held then."""
    from infinikv.engine.ragged import RaggedCache

    handed: list[tuple[torch.Tensor, torch.Tensor]] = []
    before_attention, store_and_select = RaggedCache.before_attention, RaggedCache.store_and_select

    def keeps_input(self, layer, x, mask, position_ids):
        handed.append((x, x.clone()))
        return before_attention(self, layer, x, mask, position_ids)

    def keeps_new(self, layer, k, v):
        handed.extend([(k, k.clone()), (v, v.clone())])
        return store_and_select(self, layer, k, v)

    monkeypatch.setattr(RaggedCache, "before_attention", keeps_input)
    monkeypatch.setattr(RaggedCache, "store_and_select", keeps_new)
    Generator(tiny, "quest", compile=True).generate(PROMPTS, GenerationConfig(NEW_TOKENS))
    assert handed
    assert all(torch.equal(kept, then) for kept, then in handed)


def test_a_model_compiled_by_its_user_runs_the_policy_between_graphs(tiny, monkeypatch):
    """Outside the engine's compiled step (``forward.decode_call``), a model its user compiled breaks its
    graphs at the policy's calls: ``generate`` with an InfinikvCache gives the eager tokens."""
    config = make_config("quest")
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(3))

    def greedy() -> list[int]:
        cache = InfinikvCache(tiny.model, config, device=tiny.device)
        out = tiny.model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    eager = greedy()
    monkeypatch.setattr(tiny.model, "forward", torch.compile(tiny.model.forward))
    assert greedy() == eager


def test_a_shared_engine_decides_whether_its_steps_are_compiled(tiny):
    from infinikv import Engine, EngineConfig
    from infinikv.errors import InputError

    engine = Engine(tiny, EngineConfig(compile=True))
    assert Generator(tiny, "dense", engine=engine, compile=True).engine is engine
    with pytest.raises(InputError, match="shared engine"):
        Generator(tiny, "dense", engine=engine)
    with pytest.raises(InputError, match="True or False"):
        Generator(tiny, "dense", engine=engine, compile=1)
