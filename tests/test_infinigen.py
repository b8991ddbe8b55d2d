"""The infinigen policy: equivalence with dense at full budget, selection rules, eviction."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import threading

import pytest
import torch

from infinikv.cache import InfinikvCache
from infinikv.engine.forced import ForcedRows
from infinikv.errors import PolicyError
from infinikv.forward import Driver
from infinikv.policies import InfiniGenConfig, InfiniGenPolicy, make_config, prepare, resolve_budget
from infinikv.policies.base import pick_top
from infinikv.policies.bounds import BlockBounds
from infinikv.policies.infinigen import blocks, calibration, rehearsal, skewfile
from infinikv.policies.infinigen.config import FOLLOWED_SHARE
from infinikv.policies.infinigen.rehearsal import Rehearsal
from infinikv.policies.infinigen.skewfile import RatioAtLength
from infinikv.policies.infinigen.slots import SlotTable, pack_nibbles, unpack_nibbles
from infinikv.testing import tiny_model

TEXT = "She had a lively, playful disposition, which delighted in anything ridiculous. " * 12
PROMPTS = [
    "The weather in the valley had been dry for weeks, and the farmers spoke of little else. " * 2,
    "A short one.",
]


@pytest.fixture(scope="module")
def skews(tiny, tiny_gemma):
    return {
        m.weights_id: calibration.calibrate(m, text=TEXT, tokens=256, save=False) for m in (tiny, tiny_gemma)
    }


@pytest.fixture
def calibrated(skews, monkeypatch):
    """The policy finds the in-memory calibration instead of a cached file."""
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skews.get(spec.weights_id))
    return skews


class _Spy:
    """Records each InfiniGen policy built while it is active, its rehearsals (the observer's
    :class:`~infinikv.policies.infinigen.rehearsal.Rehearsal` records, by policy, step and layer: a
    look-ahead on the pool's worker may report beside the decode thread) and what each decode step attended
    to."""

    def __init__(self, monkeypatch):
        self.records: list[Rehearsal] = []
        self._order: list[tuple[int, int, int]] = []  # (policy, step, layer) of each record
        self.inserting = threading.Lock()
        self.selections, self.policies, self.pool_lengths = [], [], []
        self.valid: list[torch.Tensor | None] = []  # each decode step's Selection.valid, as selections
        decode, init = InfiniGenPolicy.decode, InfiniGenPolicy.__init__

        def spy_init(policy, config, spec, device, skew=None, observer=None):
            init(policy, config, spec, device, skew=skew, observer=functools.partial(self.observe, policy))
            self.policies.append(policy)

        def spy_decode(policy, layer, k_new, v_new):
            selection = decode(policy, layer, k_new, v_new)
            self.selections.append((layer, selection.positions.clone(), policy.key_valid))
            self.valid.append(selection.valid)
            self.pool_lengths.append((layer, policy.host_pool.length(layer), policy.seq_length(layer)))
            return selection

        monkeypatch.setattr(InfiniGenPolicy, "__init__", spy_init)
        monkeypatch.setattr(InfiniGenPolicy, "decode", spy_decode)

    def observe(self, policy: InfiniGenPolicy, record: Rehearsal) -> None:
        # The partial key cache is the policy's live store: keep it as it was at this step, with its strides
        # (the buffer behind the view, copied), so that scores recomputed from it are computed the same way.
        slots, n = policy.layers[record.layer].slots, record.partial_keys.shape[-1]
        buffer = slots.unpacked(slots.partial.clone())  # 4-bit keys: one integer per column, as scored
        scale = None if slots.scale is None else slots.scale.clone()[..., :n]
        key = (self.policies.index(policy), record.step, record.layer)
        with self.inserting:
            at = bisect.bisect(self._order, key)
            self._order.insert(at, key)
            self.records.insert(at, dataclasses.replace(record, partial_keys=buffer[..., :n], scale=scale))

    def clear(self) -> None:
        self.records.clear()
        self._order.clear()


def _tokens(loaded, policy, prompts=PROMPTS, new=24, **knobs):
    if policy == "infinigen":  # these prompts are within the default floor; the tests check the budget's rule
        knobs.setdefault("min_tokens", 0)
        # the rules of token speculation, whose records hold every token's score; blocks are tested below
        knobs.setdefault("block_size", 0)
    return padded_batch_tokens(loaded, make_config(policy, **knobs), prompts, new)


@torch.inference_mode()
def padded_batch_tokens(loaded, config, prompts, new: int) -> tuple[list[list[int]], dict]:
    """Greedy tokens of ``prompts`` run as one left-padded batch through a ``Driver`` (the path the eval and
    the bench take; the engine gives each sequence a cache of its own), each row cut at its end of
    sequence, and the policy's statistics (with the first row's prompt tokens). These tests read one policy
    over a padded batch."""
    prepare(config, loaded)
    encoded = loaded.tokenizer(prompts, return_tensors="pt", padding=True)
    eos = loaded.tokenizer.eos_token_id
    rows: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    with Driver(loaded, InfinikvCache(loaded.model, config)) as driver:
        logits = driver.prefill(encoded["input_ids"], encoded["attention_mask"])
        for step in range(new):
            tokens = logits.argmax(dim=-1)
            for row, token in enumerate(tokens.tolist()):
                ended[row] = ended[row] or token == eos
                if not ended[row]:
                    rows[row].append(token)
            if all(ended) or step == new - 1:
                break
            logits = driver.step(tokens)
        stats = {"prompt_tokens": int(encoded["attention_mask"][0].sum()), **driver.stats()}
    return rows, stats


def test_config_validation():
    assert make_config("infinigen") == InfiniGenConfig()
    assert make_config("infinigen", alpha=math.inf).alpha == math.inf
    assert InfiniGenConfig().own_query_set() is None  # the calibrated layers
    assert make_config("infinigen", own_query_layers="none").own_query_set() == frozenset()
    assert make_config("infinigen", own_query_layers="3, 1").own_query_set() == {1, 3}
    for bad in (
        dict(alpha=-1),
        dict(alpha=math.nan),
        dict(n_sink=-1),
        dict(window=1.5),
        dict(partial_ratio=-0.1),
        dict(partial_ratio=1.5),
        dict(budget=-1),
        dict(capacity=0),
        dict(eviction="random"),
        dict(dense_layers=-1),
        dict(dense_layers=1.5),
        dict(first_layers="rehearsed"),
        dict(own_query_layers="x"),
        dict(own_query_layers="3,-1"),
        dict(own_query_layers="none,3"),
        dict(skew="yes"),
    ):
        with pytest.raises(PolicyError):
            make_config("infinigen", **bad)


@torch.inference_mode()
def _decode_logits(loaded, policy, steps: int = 12, **knobs) -> torch.Tensor:
    """Logits of ``steps`` decode steps over PROMPTS (left-padded batch), feeding fixed tokens."""
    encoded = loaded.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    mask = encoded["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = InfinikvCache(loaded.model, policy, **knobs)
    model_kwargs = dict(cache=cache, use_cache=True, logits_to_keep=1)
    loaded.model(input_ids=encoded["input_ids"], attention_mask=mask, position_ids=positions, **model_kwargs)
    out, position = [], positions[:, -1:]
    for step in range(steps):
        mask, position = torch.cat([mask, mask.new_ones(len(PROMPTS), 1)], dim=1), position + 1
        token = torch.full((len(PROMPTS), 1), 40 + 7 * step)
        logits = loaded.model(
            input_ids=token, attention_mask=mask, position_ids=position, **model_kwargs
        ).logits
        out.append(logits[:, -1])
    cache.close()
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(
    ("dense_layers", "first_layers", "partial_keys"),
    [
        (0, "dense", "int8"),
        (2, "dense", "model"),
        (2, "own", "int8"),
        (2, "own", "int16"),
        (2, "own", "int4"),
    ],
)
@pytest.mark.parametrize("block_size", [0, 1, 16])
def test_full_budget_equals_dense(
    kind, dense_layers, first_layers, partial_keys, block_size, tiny, tiny_gemma, calibrated
):
    loaded = tiny if kind == "llama" else tiny_gemma
    knobs = dict(
        alpha=math.inf,
        dense_layers=dense_layers,
        first_layers=first_layers,
        partial_keys=partial_keys,
        block_size=block_size,
    )
    dense, _ = _tokens(loaded, "dense")
    full, stats = _tokens(loaded, "infinigen", budget=1.0, **knobs)
    assert full == dense
    assert stats["selected_tokens_mean"] > 0  # layers really were rehearsed and selected
    # Logits match too, and the comparison is sensitive: a 3-token budget moves them.
    reference = _decode_logits(loaded, "dense")
    same = _decode_logits(loaded, "infinigen", budget=1.0, **knobs)
    assert torch.allclose(same, reference, atol=1e-4, rtol=1e-4)
    starved = _decode_logits(loaded, "infinigen", budget=3, **knobs)
    assert (starved - reference).abs().max() > 1e-2


def _speculation_inputs(loaded, monkeypatch, **knobs):
    """Run InfiniGen with ``knobs`` (token speculation unless they say otherwise): (the policy, its rehearsal
    records in order, each layer's attention inputs (x, position_ids) in order (the prefill's first), the
    run's stats)."""
    knobs.setdefault("block_size", 0)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep(i, kwargs):
        seen.setdefault(i, []).append((kwargs["hidden_states"].clone(), kwargs["position_ids"].clone()))

    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: keep(i, kwargs), with_kwargs=True
        )
        for i, layer in enumerate(loaded.model.model.layers)
    ]
    with monkeypatch.context() as patched:
        spy = _Spy(patched)
        try:
            _, stats = _tokens(loaded, "infinigen", new=4, budget=3, **knobs)
        finally:
            for hook in hooks:
                hook.remove()
    return spy.policies[-1], spy.records, seen, stats


@torch.inference_mode()
def _rehearsed_from(loaded, policy, record, x, position_ids) -> bool:
    """Whether ``record``'s scores are those speculated from the attention input ``x``: its layer's query
    from x, in the layer's partial columns, against the partial key cache the record read."""
    spec, layer = loaded.spec, record.layer
    query = spec.query(layer, x, position_ids)
    grouped = query.reshape(query.shape[0], spec.num_kv_heads, spec.group_size, spec.head_dim)
    partial_query = record.to_partial(grouped) * spec.scaling(layer)
    row_columns = policy.decoding.row_columns[layer]
    scores = rehearsal.speculative_scores(
        partial_query, record.partial_keys, row_columns, record.real_slots, record.scale
    )
    return torch.equal(scores, record.scores)


def _check_sources(loaded, policy, records, seen, own) -> None:
    """Each rehearsal in order, one per managed layer and decode step, read the input of its own layer (the
    layers in ``own``) or of the layer before (the others), that step's and no other."""
    step_of = {layer: 0 for layer in seen}
    for record in records:
        step_of[record.layer] += 1
        assert record.step == step_of[record.layer]
        layer, step = record.layer, record.step  # the prefill's input is seen[i][0]
        source = layer if layer in own else layer - 1
        assert _rehearsed_from(loaded, policy, record, *seen[source][step])
        other = layer - 1 if layer in own else layer  # the input it must not have read
        if other >= 0:
            assert not _rehearsed_from(loaded, policy, record, *seen[other][step])


def test_first_layers_own_select_with_their_own_input(tiny, calibrated, monkeypatch):
    """With first_layers "own", layers below dense_layers fetch a budget's tokens chosen from their own
    attention input (not rehearsed from the layer before), before the look-ahead starts the next layer's
    copy, and the others still rehearse one layer ahead."""
    policy, records, seen, stats = _speculation_inputs(tiny, monkeypatch, dense_layers=3, first_layers="own")
    layers = tiny.spec.num_layers  # 4: layers 0-2 select with their own input, layer 3 is rehearsed
    order = [record.layer for record in records]
    assert order and order == list(range(layers)) * (len(order) // layers)  # every layer, every step
    _check_sources(tiny, policy, records, seen, own=(0, 1, 2))
    per_layer = stats["selected_tokens_per_layer"]
    assert all(per_layer[layer]["max"] <= 3 for layer in range(layers))
    _, dense_first = _tokens(tiny, "infinigen", new=4, budget=3, dense_layers=3, first_layers="dense")
    assert dense_first["selected_tokens_per_layer"][:3] == [None] * 3
    assert stats["decode_bytes_h2d"] < dense_first["decode_bytes_h2d"]


def test_own_query_layers_choose_with_their_own_input(tiny, calibrated, monkeypatch):
    """A later layer named in own_query_layers chooses from its own input, the others still one layer ahead;
    at full budget that is dense, token for token; a layer the model does not have is a clear error."""
    policy, records, seen, _ = _speculation_inputs(tiny, monkeypatch, dense_layers=1, own_query_layers="2")
    assert {record.layer for record in records} == {0, 1, 2, 3}
    _check_sources(tiny, policy, records, seen, own=(0, 2))  # layer 1 and 3 rehearsed from the one before
    dense, _ = _tokens(tiny, "dense")
    full, stats = _tokens(tiny, "infinigen", alpha=math.inf, budget=1.0, own_query_layers="2,3")
    assert full == dense
    assert stats["own_query_layers_used"] == [2, 3] and stats["own_query_source"] == "given"
    assert stats["layers_by_own_query"] == [0, 1, 2, 3]
    with pytest.raises(PolicyError, match="own_query_layers"):
        _tokens(tiny, "infinigen", own_query_layers=str(tiny.spec.num_layers))


def test_own_query_layers_that_prefetch_attend_to_their_own_choice(tiny, calibrated):
    """own_query_prefetch: an own-query layer prefetches the slots it chose at the step before and copies
    only what its own choice misses; it attends to exactly what it attends to without the prefetch (logits
    equal to the bit, also where a full pool evicts by fetch counts: the prefetch is not a use), with fewer
    bytes copied on demand and the prefetch's misses moved besides."""
    knobs = dict(budget=3, dense_layers=2, own_query_layers="3")
    evicting = dict(knobs, budget=0.5, capacity=0.7, eviction="counter", min_tokens=0)
    for setting in (knobs, evicting):
        ahead = _decode_logits(tiny, "infinigen", own_query_prefetch=True, **setting)
        waiting = _decode_logits(tiny, "infinigen", own_query_prefetch=False, **setting)
        assert torch.equal(ahead, waiting)
    _, with_prefetch = _tokens(tiny, "infinigen", new=6, own_query_prefetch=True, **knobs)
    _, without = _tokens(tiny, "infinigen", new=6, own_query_prefetch=False, **knobs)
    assert 0 < with_prefetch["bytes_h2d_on_demand"] < without["bytes_h2d_on_demand"]
    assert without["bytes_h2d_on_demand"] == without["bytes_h2d"] * 3 / 4  # layers 0, 1, 3 of 4
    assert with_prefetch["bytes_h2d"] > without["bytes_h2d"]
    assert with_prefetch["selected_tokens_per_layer"] == without["selected_tokens_per_layer"]
    dense, _ = _tokens(tiny, "dense")
    full, _ = _tokens(
        tiny, "infinigen", alpha=math.inf, budget=1.0, own_query_prefetch=True, own_query_layers="3"
    )
    assert full == dense


def test_own_query_layers_prefetch_what_they_chose_at_the_step_before(tiny, calibrated):
    """own_query_prefetch at full budget: each step's choice is the step before's plus the token that step
    added, so from the second step on each own-query layer (0, 1 and 3 here; layer 0's copy started in the
    step before) copies one row per sequence and KV head on demand."""
    knobs = dict(alpha=math.inf, budget=1.0, dense_layers=2, own_query_layers="3", own_query_prefetch=True)
    on_demand = [_tokens(tiny, "infinigen", new=new, **knobs)[1]["bytes_h2d_on_demand"] for new in (5, 6)]
    row = 2 * tiny.spec.head_dim * tiny.model.dtype.itemsize  # one token's K and V in one KV head
    assert on_demand[1] - on_demand[0] == 3 * len(PROMPTS) * tiny.spec.num_kv_heads * row


@pytest.mark.parametrize("every", [2, 3])
def test_select_every_at_full_budget_equals_dense(every, tiny, tiny_gemma, calibrated):
    """select_every > 1 at full budget: the steps between choices read everything there is, so the tokens
    are dense's, with own-query layers (prefetching or not), block speculation and sliding layers."""
    full = dict(alpha=math.inf, budget=1.0, select_every=every)
    for loaded, knobs in (
        (tiny, dict()),
        (tiny, dict(own_query_layers="3", own_query_prefetch=True)),
        (tiny, dict(block_size=16)),
        (tiny_gemma, dict()),
    ):
        dense, _ = _tokens(loaded, "dense")
        tokens, stats = _tokens(loaded, "infinigen", **full, **knobs)
        assert tokens == dense
        assert stats["selected_tokens_mean"] > 0
        same = _decode_logits(loaded, "infinigen", **full, **knobs)
        assert torch.allclose(same, _decode_logits(loaded, "dense"), atol=1e-4, rtol=1e-4)


def test_select_every_copies_nothing_on_demand_between_choices(tiny, calibrated):
    """select_every 2: a step between choices starts every layer's copy ahead, own-query layers' (0, 1 and 3
    here; layer 0's beside the step before's last layers) included, so decode step 6 (a step between) adds
    no bytes on demand, where a choosing step 6 does."""
    knobs = dict(budget=0.5, dense_layers=2, own_query_layers="3")
    for every, expected in ((2, 0), (1, None)):
        on_demand = [
            _tokens(tiny, "infinigen", new=new, select_every=every, **knobs)[1]["bytes_h2d_on_demand"]
            for new in (6, 7)  # 5 and 6 decode steps
        ]
        if expected is None:
            assert on_demand[1] > on_demand[0] > 0
        else:
            assert on_demand[1] == on_demand[0] > 0


def _reads(spy: _Spy, layer: int) -> list[list[list[set[int]]]]:
    """Per decode step, sequence and KV head: the positions ``layer`` attended to (its new token included)."""
    steps = []
    for (at, positions, _), valid in zip(spy.selections, spy.valid, strict=True):
        if at != layer:
            continue
        shown = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        steps.append(
            [
                [set(p[v].tolist()) for p, v in zip(rows, seen, strict=True)]
                for rows, seen in zip(positions, shown, strict=True)
            ]
        )
    return steps


@pytest.mark.parametrize("evicting", [False, True])
def test_select_every_chooses_every_nth_step_and_reads_again_between(evicting, tiny, calibrated, monkeypatch):
    """select_every 3: layers rehearse at decode steps 1, 4 and 7 only. At the steps between, each layer
    attends to what it attended to at the step before (that step's new token included) and, with nothing
    evicted, to at most FOLLOWED_SHARE of its budget more, each the one after a token it attended to then
    (its best read tokens, followed); with eviction, less at most the one token evicted. A choice leaves
    room for what the steps until the next one add, so the budget holds at every step."""
    knobs = dict(budget=0.4, select_every=3)
    if evicting:
        knobs.update(budget=0.5, capacity=0.7, eviction="counter")
    with monkeypatch.context() as patched:
        spy = _Spy(patched)
        _tokens(tiny, "infinigen", new=8, **knobs)
    assert {record.step for record in spy.records} == {1, 4, 7}
    budget = functools.partial(resolve_budget, knobs["budget"], floor=0)
    follows = [0]
    for record in spy.records:
        for count, real in zip(record.counts.tolist(), record.real_tokens, strict=True):
            if budget(real) < real:
                follow = math.ceil(budget(real) * FOLLOWED_SHARE)
                assert all(count + added * (follow + 1) <= budget(real + added) for added in range(3))
                follows.append(follow)
    followed = 0
    for layer in range(tiny.spec.num_layers):
        reads = _reads(spy, layer)
        assert len(reads) == 7
        for step in (2, 3, 5, 6):  # 1-based decode steps between choices
            for before, now in zip(reads[step - 2], reads[step - 1], strict=True):
                for held, read in zip(before, now, strict=True):
                    read = read - {max(read)}  # this step's own new token
                    if evicting:
                        assert read <= held and len(held - read) <= 1
                    else:
                        more = read - held
                        assert held <= read and len(more) <= max(follows)
                        assert all(position - 1 in held for position in more)
                        followed += len(more)
    assert evicting or followed > 0


def test_calibrated_own_query_layers_are_used_by_default_and_flags_override(tiny, skews, monkeypatch):
    """own_query_layers calibrated (the default): the layers the calibration names choose with their own
    input, each layer counting with the alpha calibrated for how it chooses; none, or a given list,
    overrides the calibrated layers."""
    skew = skews[tiny.weights_id]
    layers = tiny.spec.num_layers
    own_alphas, rehearsed_alphas = (
        [1.0 + layer for layer in range(layers)],
        [10.0 + layer for layer in range(layers)],
    )
    tuned = dataclasses.replace(
        skew.tuned,
        own_query_layers=(3,),
        alpha_per_layer_own=tuple(own_alphas),
        alpha_per_layer_rehearsed=tuple(rehearsed_alphas),
    )
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: dataclasses.replace(skew, tuned=tuned))
    cases = (
        (dict(), (0, 1, 3)),
        (dict(own_query_layers="none"), (0, 1)),
        (dict(own_query_layers=""), (0, 1)),
        (dict(own_query_layers="2,"), (0, 1, 2)),
        (dict(first_layers="dense"), (3,)),
    )
    for knobs, own in cases:
        policy, records, seen, stats = _speculation_inputs(tiny, monkeypatch, **knobs)
        assert records
        _check_sources(tiny, policy, records, seen, own)
        assert stats["layers_by_own_query"] == list(own)
        assert stats["own_query_layers_used"] == [layer for layer in own if layer >= 2]
        calibrated = "own_query_layers" not in knobs
        assert stats["own_query_source"].startswith("calibrated" if calibrated else "given")
        expected = [
            (own_alphas if layer in own else rehearsed_alphas)[layer]
            if layer >= 2 or knobs.get("first_layers") != "dense"
            else None
            for layer in range(layers)
        ]
        assert stats["alpha_used"] == expected
    older = dataclasses.replace(skew, tuned=None)  # a calibration without calibrated knobs of this version
    assert InfiniGenConfig().resolve_own_query(older)[0] == frozenset()


@pytest.mark.parametrize("skewed", [True, False])
def test_selection_respects_budget_padding_and_top_token(tiny, calibrated, monkeypatch, skewed):
    spy = _Spy(monkeypatch)
    paper = dict(n_sink=0, window=0)  # the paper's rule: no reserved tokens
    _tokens(tiny, "infinigen", new=16, alpha=3.0, budget=0.25, skew=skewed, **paper)
    assert spy.records
    for record in spy.records:
        scores, real_tokens, index, per_row = record.scores, record.real_tokens, record.index, record.counts
        counts = (scores > scores.amax(-1, keepdim=True) - 3.0).sum(-1).float().mean(-1).ceil().long()
        for row in range(scores.shape[0]):
            cap = resolve_budget(0.25, real_tokens[row])
            assert per_row[row] == min(int(counts[row]), cap)  # mean threshold count, capped by the budget
            assert per_row[row] <= cap
        assert index.shape[-1] == int(per_row.max())
        chosen = torch.gather(scores, 2, index).sort(dim=-1, descending=True).values
        real = (scores > -math.inf).sum(-1)  # [batch, kv_heads] real (non-padding) slots
        for row in range(scores.shape[0]):
            # A row's own n' entries are never padding; a row with fewer real tokens than the batch's widest
            # selection is filled up with (masked) padding slots only after all its real tokens.
            assert bool((chosen[row, :, : per_row[row]] > -math.inf).all())
            finite = (chosen[row] > -math.inf).sum(-1)
            assert torch.equal(finite, torch.clamp(real[row], max=index.shape[-1]))
        best = scores.argmax(dim=-1, keepdim=True)
        assert bool((index == best).any(dim=-1).all())  # every head's top token is selected
    policy = spy.policies[-1]
    for layer, positions, key_valid in spy.selections:
        padded = ~key_valid  # [batch, positions]: the mask's left padding (the short prompt's)
        assert bool(padded[1].any())
        if policy.managed(layer):
            width, prompt = positions.shape[-1] - 1, padded.shape[1]
            for row in range(positions.shape[0]):
                chosen = positions[row, :, :-1]  # [kv_heads, width]; the last entry is the new token
                past_real = int(positions[row, 0, -1]) - int(padded[row].sum())
                is_padding = (chosen < prompt) & padded[row][chosen.clamp(max=prompt - 1)]
                assert ((~is_padding).sum(-1) == min(past_real, width)).all()


def test_a_count_by_the_budget_is_taken_on_the_host(tiny, calibrated, monkeypatch):
    """Where every row counts by its budget (alpha inf, nothing evicted), the gather's width comes from the
    host, with no read: it is the count rule's, row by row, in a left-padded batch."""
    spy = _Spy(monkeypatch)
    _tokens(tiny, "infinigen", new=6, alpha=math.inf, budget=0.25)
    assert spy.records
    for record in spy.records:
        counts = record.counts.tolist()
        assert len(set(counts)) > 1  # rows of different lengths: the widths differ
        assert record.index.shape[-1] == max(counts)
        taken = [record.index.shape[-1]] * len(counts) if record.valid is None else record.valid.sum(-1)
        for row, count in enumerate(counts):
            assert (torch.as_tensor(taken[row]) == count).all()


@pytest.mark.parametrize("partial_keys", ["int8", "int4"])
def test_a_choice_scored_and_picked_in_one_call_is_made_as_apart(tiny, calibrated, monkeypatch, partial_keys):
    """Where every row counts by its budget, the host loop scores and picks a layer in one call
    (``rehearsal.scores_and_pick_on_host``): a left-padded batch gets the tokens, and counts the bytes and
    selector reads, that the scores and the pick made apart give, with int8 keys and with packed int4 ones."""
    pytest.importorskip("numba")
    from infinikv.policies.infinigen import selector

    calls = []
    one_call = selector.scores_and_pick_on_host

    def counted(*arguments):
        calls.append(1)
        return one_call(*arguments)

    monkeypatch.setattr(selector, "scores_and_pick_on_host", counted)
    # few reserved slots, so that every row takes them all (a lift in one pass) from these short prompts
    knobs = {"alpha": math.inf, "budget": 0.25, "partial_keys": partial_keys, "n_sink": 1, "window": 2}
    together, together_stats = _tokens(tiny, "infinigen", new=8, **knobs)
    assert calls
    monkeypatch.setattr(selector, "lifts_in_one_pass", lambda takes, most: False)  # scored, then picked
    calls.clear()
    apart, apart_stats = _tokens(tiny, "infinigen", new=8, **knobs)
    assert not calls
    assert together == apart
    for name in ("decode_bytes_h2d", "selector_bytes", "selected_tokens_mean", "mean_tokens_attended"):
        assert together_stats[name] == apart_stats[name], name


def test_dense_and_sliding_layers(tiny_gemma, calibrated, monkeypatch):
    spy = _Spy(monkeypatch)
    _tokens(tiny_gemma, "infinigen", prompts=[PROMPTS[0]], new=8, dense_layers=1)
    window = tiny_gemma.spec.sliding_window[0]
    for layer, positions, _ in spy.selections:
        seen = spy.policies[-1].seq_length(layer)
        newest = int(positions[0, 0, -1])
        if layer == 0:  # sliding: its window only, the newest window - 1 tokens plus the new one
            expected = torch.arange(newest - window + 1, newest + 1)
            assert torch.equal(positions[0, 0].sort().values, expected)
        elif layer == 2:  # sliding too (also not dense, since dense_layers=1 covers layer 0 only)
            assert positions.shape[-1] == window
        else:  # global layers 1, 3: rehearsed, a subset of all positions
            assert positions.shape[-1] <= seen
    assert not spy.policies[-1].managed(0) and spy.policies[-1].managed(1)


def test_counter_eviction_keeps_pool_within_capacity(tiny, calibrated, monkeypatch):
    spy = _Spy(monkeypatch)
    prompt = ["Call me Ishmael. Some years ago, never mind how long precisely, having little money. " * 2]
    _, stats = _tokens(tiny, "infinigen", prompts=prompt, new=120, capacity=0.5, budget=0.3)
    policy = spy.policies[-1]
    assert stats["evicted_tokens"] > 0
    for _, length, seen in spy.pool_lengths:
        assert length <= math.ceil(0.5 * seen)
    for layer in range(tiny.spec.num_layers):
        slots = policy.layers[layer].slots
        pos = slots.view("pos")
        assert slots.n == policy.host_pool.length(layer)
        # The newest tokens are never evicted, and each position is held at most once.
        seen = policy.seq_length(layer)
        newest = torch.arange(seen - slots.n // 2, seen)
        assert bool(torch.isin(newest, pos[0, 0]).all()) and bool(torch.isin(newest, pos[0, 1]).all())
        assert pos[0, 0].unique().numel() == slots.n
        # cut to capacity, the tables grow as the pool does, not back to the prompt's reservation
        assert slots.pos.shape[2] <= max(2 * slots.n, 256)
        if policy.managed(layer):  # evicted tokens left the partial key cache with the pool
            keys = policy.host_pool.keys(layer)
            expected = policy.partial_query(layer, keys).transpose(2, 3)  # the keys in the partial columns
            stored = rehearsal.dequantized(slots.unpacked(slots.view("partial")), slots.view("scale"))
            assert torch.allclose(stored, expected, atol=expected.abs().max().item() / 100)


def test_a_prompts_tables_are_sized_once_for_it_and_its_decode_steps(tiny, calibrated):
    """Reading a prompt reserves its length (``Policy.reserve``): every layer's slot tables are first made
    for it and a quarter more (at least 256 slots), so neither its chunks nor its first decode steps copy
    them into larger ones."""
    prompt = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    with ForcedRows(tiny, [make_config("infinigen")]) as forced:
        forced.prefill(0, prompt, 32)
        policy = forced.drivers[0].cache.policy
        tables = [state.slots.pos for state in policy.layers]
        assert {table.shape[2] for table in tables} == {300 + 256}
        for token in range(8):
            forced.step([0], torch.tensor([[token + 3]]))
        assert all(state.slots.pos is table for state, table in zip(policy.layers, tables, strict=True))


def test_absolute_capacity(tiny, calibrated, monkeypatch):
    spy = _Spy(monkeypatch)
    _, stats = _tokens(tiny, "infinigen", prompts=[PROMPTS[0]], new=40, capacity=64, eviction="lru")
    assert max(length for _, length, _ in spy.pool_lengths) == 64
    assert stats["kv_bytes_host"] == 64 * 2 * 2 * 16 * 4 * tiny.spec.num_layers


def _constructed(tiny, eviction: str, padded: bool) -> InfiniGenPolicy:
    """A policy whose layer 2 holds 8 tokens (positions 0..7) in a pool of 8, so that the next token
    overwrites one; position 0 is left padding if ``padded``."""
    config = InfiniGenConfig(eviction=eviction, capacity=8, own_query_layers="none")
    policy = InfiniGenPolicy(config, tiny.spec, torch.device("cpu"))
    k = torch.randn(1, 2, 8, 16)
    policy.set_key_valid(torch.tensor([[not padded] + [True] * 7]))
    policy.prefill(2, k, k.clone())
    return policy


def _victims(policy: InfiniGenPolicy, fetches: list[int], last: list[int]) -> list[int]:
    """Per KV head, the slot of layer 2 that the next decode token overwrites, once the 8 slots were fetched
    ``fetches`` times and last used at steps ``last``."""
    policy.fetch_own(2, None, None)  # no input: layer 2 reads its whole pool (chosen now, not on a worker)
    slots = policy.layers[2].slots
    assert slots.tracks_use == (policy.config.eviction != "fifo")  # fifo evicts by position alone
    if slots.tracks_use:
        slots.view("fetches")[:] = torch.tensor(fetches)
        slots.view("last")[:] = torch.tensor(last)
    k_new = torch.randn(1, 2, 1, 16)
    policy.decode(2, k_new, k_new.clone())
    pos = slots.view("pos")[0]  # [kv_heads, 8]
    assert slots.n == 8 and bool((pos == 8).sum(dim=-1).eq(1).all())  # one slot per head overwritten
    return (pos == 8).int().argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "eviction, fetches, last, victim",
    [
        # slots 0..3 are the older half (the candidates), 4..7 the newest half (never evicted)
        ("fifo", [9, 0, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0], 0),
        ("lru", [0] * 8, [3, 5, 2, 4, 1, 1, 1, 1], 2),
        ("counter", [3, 3, 1, 2, 0, 0, 0, 0], [0] * 8, 2),
        ("counter", [3, 1, 1, 2, 0, 0, 0, 0], [0] * 8, 1),  # ties go to the older token
    ],
)
def test_eviction_rules(tiny, calibrated, eviction, fetches, last, victim):
    # without padding the rule decides
    assert _victims(_constructed(tiny, eviction, padded=False), fetches, last) == [victim, victim]
    # a padding slot always goes first
    assert _victims(_constructed(tiny, eviction, padded=True), fetches, last) == [0, 0]


def test_heads_of_a_group_are_compared_on_their_own_scale(tiny):
    """A token within alpha of the best score of any query head of a KV group is counted and fetched: one
    head's strong attention sink must not hide the tokens another head of the group needs."""
    spec = tiny.spec
    d, kv, group = spec.head_dim, spec.num_kv_heads, spec.group_size
    partial_keys = torch.eye(d)[:, :8].expand(1, kv, d, 8)  # key t = e_t: q·k_t = q[t]
    sink = [20.0, 0, 0, 0, 0, 0, 0, 0]  # head 0 of each group: everything on slot 0
    spread = [0.0, 3, 3, 3, -10, -10, -10, -10]  # head 1: slots 1..3, logits far below the other head's
    partial_query = torch.zeros(1, kv, group, d)
    partial_query[..., :8] = torch.tensor([sink, spread] + [sink] * (group - 2))
    scores = rehearsal.speculative_scores(partial_query, partial_keys)
    counts = rehearsal.count_within(scores, 5.0, [resolve_budget(1.0, 8)])
    index, valid = pick_top(scores, counts.tolist())
    assert counts.tolist() == [4]
    assert valid is None and index[0].tolist() == [[0, 1, 2, 3]] * kv


def test_rehearsal_functions_alone():
    """The rehearsal's pure functions on crafted tensors: with every column, the speculated scores are the
    real logits, each query head relative to its own best, then the max over its KV group; a row scoring
    with fewer columns gets the scores it would get alone; at alpha inf the count is the budget, capped by
    the real slots; a ragged pick keeps each row's own best, ascending, and hides exactly the extras."""
    torch.manual_seed(0)
    batch, kv, group, d, n = 2, 2, 3, 8, 10
    query, keys = torch.randn(batch, kv, group, d), torch.randn(batch, kv, n, d)
    logits = torch.matmul(query, keys.transpose(2, 3))  # [batch, kv_heads, group, slots]
    expected = (logits - logits.amax(dim=-1, keepdim=True)).amax(dim=2)
    scores = rehearsal.speculative_scores(query, keys.transpose(2, 3))
    assert scores.shape == (batch, kv, n) and torch.allclose(scores, expected, atol=1e-6)
    assert bool((scores.amax(dim=-1) == 0).all())

    # left padding: hidden at -inf, the rest as before
    real = torch.ones(batch, kv, n, dtype=torch.bool)
    real[1, :, :3] = False
    masked = rehearsal.speculative_scores(query, keys.transpose(2, 3), real_slots=real)
    assert bool((masked[1, :, :3] == -math.inf).all()) and torch.equal(masked[0], scores[0])
    logits_1 = logits[1, :, :, 3:]
    assert torch.allclose(
        masked[1, :, 3:], (logits_1 - logits_1.amax(-1, keepdim=True)).amax(dim=1), atol=1e-6
    )

    # row 1 scores with columns 1, 4, 6 of each head: as it would alone with only those columns
    own = torch.tensor([[1, 4, 6], [0, 2, 7]])
    narrow = rehearsal.speculative_scores(query, keys.transpose(2, 3), ((torch.tensor([1]), own),))
    alone_q = torch.gather(query[1:], 3, own[None, :, None, :].expand(1, kv, group, -1))
    alone_k = torch.gather(keys[1:], 3, own[None, :, None, :].expand(1, kv, n, -1))
    alone = rehearsal.speculative_scores(alone_q, alone_k.transpose(2, 3))
    assert torch.equal(narrow[0], scores[0]) and torch.allclose(narrow[1:], alone, atol=1e-6)
    assert not torch.allclose(narrow[1:], scores[1:], atol=1e-3)

    # count_within: per sequence, the mean over KV heads of the slots within alpha of the head's best,
    # rounded up, reserved slots counted whatever their score, capped by the budget and the real slots
    inf = math.inf
    crafted = torch.tensor(
        [
            [[0.0, -1, -2, -6, -9], [0, -0.5, -7, -8, -9]],  # within 2.5: 3 and 2 slots
            [[-inf, -inf, 0, -3, -4], [-inf, -inf, -1, 0, -10]],  # 1 and 2; 3 real slots
        ]
    )
    assert rehearsal.count_within(crafted, 2.5, [9, 9]).tolist() == [3, 2]
    assert rehearsal.count_within(crafted, 2.5, [2, 1]).tolist() == [2, 1]
    assert rehearsal.count_within(crafted, inf, [4, 9]).tolist() == [4, 3]  # the budget, or the real slots
    assert rehearsal.count_within(masked, inf, [4, 9]).tolist() == [4, n - 3]
    reserved = torch.zeros(2, 2, 5, dtype=torch.bool)
    reserved[0, 1, 3:] = True  # two more on row 0's head 1: (3 + 4) / 2, rounded up
    assert rehearsal.count_within(crafted, 2.5, [9, 9], reserved).tolist() == [4, 2]
    alpha = torch.tensor([2.5, inf])[:, None, None]  # one alpha per sequence
    assert rehearsal.count_within(crafted, alpha, [5, 5]).tolist() == [3, 3]

    # pick_top with ragged counts: each row's own top entries (ties at the cut to the earlier slot: each
    # head's best is exactly 0 here), ascending, the extras hidden by valid
    def first(scores: torch.Tensor, take: int) -> torch.Tensor:
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :take].sort(dim=-1).values

    takes = [4, 2]
    index, valid = pick_top(masked, takes)
    assert index.shape == (batch, kv, 4) and valid is not None and valid.shape == index.shape
    assert bool((index[..., 1:] > index[..., :-1]).all())  # ascending slots, no repeats
    for row, take in enumerate(takes):
        assert valid[row].sum(dim=-1).tolist() == [take] * kv
        for head in range(kv):
            assert torch.equal(index[row, head][valid[row, head]], first(masked[row, head], take))
    assert bool(valid[0].all())  # the widest row hides nothing
    equal, none = pick_top(masked, [3, 3])
    assert none is None and torch.equal(equal, first(masked, 3))


def test_missing_calibration_is_a_clear_error(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    cache = InfinikvCache(tiny.model, "infinigen")
    ids = tiny.tokenizer(["hello there"], return_tensors="pt")["input_ids"]
    with pytest.raises(PolicyError, match="no InfiniGen calibration"), torch.inference_mode():
        tiny.model(input_ids=ids, cache=cache, use_cache=True)


def test_stats(tiny, calibrated):
    _, stats = _tokens(tiny, "infinigen", prompts=[PROMPTS[0]], new=12, alpha=2.0)
    assert 0 < stats["kv_fetch_fraction"] < 1
    assert stats["decode_bytes_h2d"] <= stats["bytes_h2d"]
    per_layer = stats["selected_tokens_per_layer"]
    assert all(layer["max"] >= layer["mean"] > 0 for layer in per_layer)  # the first two with their own query
    assert stats["selector_s"] > 0 and stats["kv_bytes_device"] > 0 and stats["evicted_tokens"] == 0
    # the rehearsal read at least the partial keys it holds, once per decode step after the first
    assert stats["selector_bytes"] > stats["kv_bytes_device"]


@pytest.mark.real_model
def test_smollm2_full_budget_equals_dense(smollm2, long_prompt, monkeypatch):
    made = calibration.calibrate(smollm2, text=long_prompt, tokens=512, save=False)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: made)
    dense, _ = _tokens(smollm2, "dense", prompts=[long_prompt], new=32)
    full, stats = _tokens(smollm2, "infinigen", prompts=[long_prompt], new=32, alpha=math.inf, budget=1.0)
    assert full == dense
    assert stats["kv_fetch_fraction"] == pytest.approx(1.0)


def test_other_model_calibration_is_rejected_by_the_policy(calibrated, tiny):
    other = tiny_model("llama", seed=2)
    with pytest.raises(skewfile.SkewError):
        InfiniGenPolicy(InfiniGenConfig(), other.spec, torch.device("cpu"), skew=calibrated[tiny.weights_id])


def test_sinks_and_recent_window_are_always_fetched_and_counted(tiny, calibrated, monkeypatch):
    spy = _Spy(monkeypatch)
    _tokens(tiny, "infinigen", new=12, alpha=0.5, budget=0.6, n_sink=2, window=4)
    padding = (~spy.selections[-1][2]).sum(dim=1)  # [batch] left-padding tokens per sequence (the mask's)
    assert bool(padding.any()) and spy.records
    for record in spy.records:
        scores, real_tokens, index, per_row = record.scores, record.real_tokens, record.index, record.counts
        reserved = record.reserved
        seen = max(real_tokens) + int(padding.min())  # mask columns seen by the layer
        for row in range(scores.shape[0]):
            first = int(padding[row])
            expected = {first, first + 1, *range(seen - 4, seen)}  # slots = positions (no eviction)
            for head in range(scores.shape[1]):
                assert {int(s) for s in reserved[row, head].nonzero()} == expected
                own = index[row, head] if record.valid is None else index[row, head][record.valid[row, head]]
                assert len(own) == per_row[row]
                assert expected <= set(own.tolist())  # fetched, among the row's own n' entries
        wanted = (scores > scores.amax(-1, keepdim=True) - 0.5) | reserved
        counts = wanted.sum(-1).float().mean(-1).ceil().long()
        for row in range(scores.shape[0]):
            assert per_row[row] == min(int(counts[row]), resolve_budget(0.6, real_tokens[row]))


def test_default_knobs_are_the_calibrated_ones_and_flags_override(tiny, calibrated, skews):
    tuned = skews[tiny.weights_id].tuned
    assert tuned.alpha in calibration.tuning.ALPHAS and "dense attention" in tuned.rule
    assert tuned.partial_ratio in calibration.tuning.RATIOS and "full-width" in tuned.ratio_rule
    _, stats = _tokens(tiny, "infinigen", prompts=[PROMPTS[0]], new=4)
    assert stats["knobs"]["alpha"] == 0 and stats["knobs"]["partial_ratio"] == 0  # 0 = calibrated
    # every layer has its own calibrated alpha (the first two scored with their own query)
    expected = list(tuned.alpha_per_layer)
    assert None not in expected
    assert stats["alpha_used"] == expected and stats["alpha_source"].startswith("calibrated")
    first = tuned.ratio_by_length[0]  # the calibration text's window first
    assert first == RatioAtLength(
        tokens=256,
        partial_ratio=tuned.partial_ratio,
        curve=tuple(point.recall for point in tuned.ratio_curve),
        layer_curves=first.layer_curves,
    )
    assert stats["partial_ratio_used"] == [tuned.partial_ratio]  # a prompt shorter than 256 tokens
    assert stats["partial_ratio_source"].startswith("calibrated at 256 tokens")
    _, stats = _tokens(tiny, "infinigen", prompts=[PROMPTS[0]], new=4, alpha=5.0, partial_ratio=0.5)
    assert stats["alpha_used"] == [5.0] * tiny.spec.num_layers
    assert stats["alpha_source"] == "given"
    assert stats["partial_ratio_used"] == [0.5] and stats["partial_ratio_source"] == "given"
    older = dataclasses.replace(skews[tiny.weights_id], tuned=None)  # no calibrated knobs of this version
    policy = InfiniGenPolicy(InfiniGenConfig(), tiny.spec, torch.device("cpu"), skew=older)
    assert policy.alpha(2) == (5.0, "paper (this calibration has none)")
    assert policy.config.resolve("partial_ratio", older, tokens=100) == (
        0.2,
        "paper (this calibration has none)",
    )


def test_calibration_repeats_the_ratio_rule_at_longer_windows(tiny):
    """A text long enough for a longer window (``tuning.LENGTHS`` within the model's context) gets a ratio
    of its own there, from the same rule; a prompt takes the widest ratio of the shortest window at least as
    long as itself and the longer ones."""
    skew = calibration.calibrate(tiny, text=TEXT * 6, tokens=256, save=False)  # ~5.8k byte tokens
    by_length = skew.tuned.ratio_by_length
    assert [entry.tokens for entry in by_length] == [256, 4096]  # 8192 is past the tiny model's context
    for entry in by_length:
        assert entry.partial_ratio == calibration.tuning.pick_ratio(list(entry.curve))
    config = InfiniGenConfig()
    assert config.resolve("partial_ratio", skew, tokens=300)[0] == by_length[1].partial_ratio
    assert config.resolve("partial_ratio", skew, tokens=9000)[0] == by_length[1].partial_ratio
    widest = max(entry.partial_ratio for entry in by_length)
    assert config.resolve("partial_ratio", skew, tokens=256)[0] == widest
    assert config.widest_ratio(skew) == max(entry.partial_ratio for entry in by_length)


def test_each_sequence_takes_the_ratio_of_its_prompt_length(tiny, skews, monkeypatch):
    """With ratios per length, a short and a long prompt batched together each get their own columns and
    generate what they generate alone; the store keeps the widest columns the batch needs. (A shorter
    window's ratio counts where it is the wider: the short prompt takes 0.75, the long one its own 0.25.)"""
    short, long = "A short one.", PROMPTS[0]
    length = len(tiny.tokenizer(short)["input_ids"])
    ratios = (RatioAtLength(length, 0.75, ()), RatioAtLength(4096, 0.25, ()))
    tuned = dataclasses.replace(skews[tiny.weights_id].tuned, ratio_by_length=ratios)
    skew = dataclasses.replace(skews[tiny.weights_id], tuned=tuned)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    spy = _Spy(monkeypatch)
    d = tiny.spec.head_dim
    alone = []
    for prompt, ratio in ((short, 0.75), (long, 0.25)):
        tokens, stats = _tokens(tiny, "infinigen", prompts=[prompt], new=8, budget=0.5, window=0)
        alone += tokens
        assert stats["partial_ratio_used"] == [ratio]
        assert spy.policies[-1].layers[2].slots.partial.shape[2] == math.ceil(ratio * d)
    tokens, stats = _tokens(tiny, "infinigen", prompts=[short, long], new=8, budget=0.5, window=0)
    assert tokens == alone
    assert stats["partial_ratio_used"] == [0.75, 0.25]
    assert spy.policies[-1].layers[2].slots.partial.shape[2] == math.ceil(0.75 * d)


def _alphas_per_layer(tuned: skewfile.Tuned, per_layer: list[float | None]) -> skewfile.Tuned:
    """``tuned`` with ``per_layer`` as each layer's calibrated alpha, however the layer chooses."""
    ways = ("alpha_per_layer", "alpha_per_layer_own", "alpha_per_layer_rehearsed")
    return dataclasses.replace(tuned, **dict.fromkeys(ways, tuple(per_layer)))


def test_calibrated_alphas_count_only_at_the_ratio_they_were_calibrated_at(tiny, skews, monkeypatch):
    """A sequence whose prompt length takes other columns than the calibration text's fetches its budget
    (the top scores); the one at the calibrated ratio counts with its layer's alpha; batched, each generates
    what it generates alone; a given alpha counts every sequence."""
    short, long = "A short one.", PROMPTS[0]
    length = len(tiny.tokenizer(short)["input_ids"])
    tuned = skews[tiny.weights_id].tuned
    # the long prompt's window narrower than the calibration text's: it takes its own, the short the text's
    ratios = (
        RatioAtLength(length, tuned.partial_ratio, ()),
        RatioAtLength(4096, tuned.partial_ratio / 2, ()),
    )
    # alpha 0.01 on every layer: few tokens within it, so the count is far below the budget
    per_layer = [0.01] * tiny.spec.num_layers
    tuned = dataclasses.replace(_alphas_per_layer(tuned, per_layer), ratio_by_length=ratios)
    skew = dataclasses.replace(skews[tiny.weights_id], tuned=tuned)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    spy = _Spy(monkeypatch)
    # int8 keys kept (should the budget cut the calibrated columns): int4 ones count every row by its budget
    knobs = dict(new=8, budget=0.5, window=0, keys_when_cut="cut")
    alone = []
    for prompt, rule in ((short, "alpha"), (long, "budget")):
        tokens, stats = _tokens(tiny, "infinigen", prompts=[prompt], **knobs)
        alone += tokens
        assert stats["count_rule_used"][0].startswith(rule)
    spy.clear()
    tokens, stats = _tokens(tiny, "infinigen", prompts=[short, long], **knobs)
    assert tokens == alone
    assert stats["count_rule_used"][0] == "alpha" and stats["count_rule_used"][1].startswith("budget")
    assert spy.records
    for record in spy.records:
        scores, real_tokens, per_row = record.scores, record.real_tokens, record.counts
        within = (scores > scores.amax(-1, keepdim=True) - 0.01).sum(-1).float().mean(-1).ceil().long()
        available = int((scores[1] > -math.inf).sum(-1).min())
        assert int(per_row[0]) == min(int(within[0]), resolve_budget(0.5, real_tokens[0]))
        assert int(per_row[1]) == min(available, resolve_budget(0.5, real_tokens[1]))
        assert int(per_row[1]) > int(within[1])  # the alpha would have fetched fewer
    _, stats = _tokens(tiny, "infinigen", prompts=[short, long], alpha=0.01, **knobs)
    assert stats["count_rule_used"] == ["alpha", "alpha"]


def test_each_layer_counts_with_its_own_calibrated_alpha(tiny, skews, monkeypatch):
    """alpha 0: every managed layer uses the alpha calibrated for it (a layer without one, the alpha for all
    layers); the count rule runs with that layer's alpha."""
    skew = skews[tiny.weights_id]
    layers = tiny.spec.num_layers
    # the tiny model's speculated scores span about 0.1: 0.01 and 0.05 count differently
    per_layer = [None, None, 0.01] + [None] * (layers - 3)  # layer 3 on: none, so the alpha for all
    tuned = dataclasses.replace(_alphas_per_layer(skew.tuned, per_layer), alpha=0.05)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: dataclasses.replace(skew, tuned=tuned))
    spy = _Spy(monkeypatch)
    _, stats = _tokens(tiny, "infinigen", prompts=[PROMPTS[0]], new=6, window=0)
    expected = [0.05, 0.05, 0.01] + [0.05] * (layers - 3)  # the first two select with their own query
    assert stats["alpha_used"] == expected
    records = spy.records
    assert records  # every layer rehearsed once per step
    assert sorted(r.layer for r in records) == sorted(list(range(layers)) * (len(records) // layers))

    def count(record, alpha):
        scores = record.scores
        within = (scores > scores.amax(-1, keepdim=True) - alpha).sum(-1).float().mean(-1).ceil().long()
        return min(int(within[0]), resolve_budget(0.2, record.real_tokens[0]))

    for record in records:  # each layer counted with its own alpha
        assert int(record.counts[0]) == count(record, expected[record.layer])
    for layer in range(layers):  # and the other alpha would have counted otherwise
        other = 0.05 if expected[layer] == 0.01 else 0.01
        assert any(
            int(record.counts[0]) != count(record, other) for record in records if record.layer == layer
        )


def test_the_calibrated_ratio_sets_the_partial_key_columns(tiny, calibrated, skews):
    """The partial key cache is as wide as the ratio in use: the calibrated one by default, else the given."""
    skew = skews[tiny.weights_id]
    spec = tiny.spec
    keys = torch.randn(1, spec.num_kv_heads, 5, spec.head_dim)
    calibrated_ratio = skew.tuned.partial_ratio
    given = 0.25 if calibrated_ratio > 0.5 else 1.0  # a width the calibrated ratio does not give
    assert math.ceil(given * spec.head_dim) != math.ceil(calibrated_ratio * spec.head_dim)
    for knobs, ratio in ((dict(), calibrated_ratio), (dict(partial_ratio=given), given)):
        # token speculation: no block bounds share the device budget, which holds every calibrated column
        config = InfiniGenConfig(block_size=0, **knobs)
        policy = InfiniGenPolicy(config, spec, torch.device("cpu"), skew=skew)
        policy.prefill(2, keys, keys.clone())
        width = math.ceil(ratio * spec.head_dim)
        assert policy.layers[2].slots.view("partial").shape == (1, spec.num_kv_heads, width, 5)
        assert policy.partial_query(2, keys).shape[-1] == width


@pytest.mark.parametrize("partial_keys", ["int4", "int8", "int16", "model"])
@pytest.mark.parametrize("device_budget", [0.125, 0.04])
@pytest.mark.parametrize("block_size", [0, 16])
def test_the_device_budget_bounds_the_partial_keys_held(
    partial_keys, device_budget, block_size, tiny, tiny_gemma, skews, monkeypatch
):
    """At calibrated ratios, the partial key cache (with its scales and any block bounds) stays within the
    device budget's share of the dense KV cache of the same tokens, at several prompt lengths, on both model
    families."""
    for loaded in (tiny, tiny_gemma):
        skew = skews[loaded.weights_id]
        wide = (RatioAtLength(40, 1.0, ()), RatioAtLength(4096, 1.0, ()))  # ask for every column
        tuned = dataclasses.replace(skew.tuned, partial_ratio=1.0, ratio_by_length=wide)
        monkeypatch.setattr(
            skewfile, "cached_skew", lambda spec, s=skew, t=tuned: dataclasses.replace(s, tuned=t)
        )
        spec = loaded.spec
        for words in (3, 30, 90):
            prompt = ["one two three four " * words]
            _, stats = _tokens(
                loaded,
                "infinigen",
                prompts=prompt,
                new=6,
                partial_keys=partial_keys,
                device_budget=device_budget,
                block_size=block_size,
            )
            tokens = stats["prompt_tokens"] + 6 - 1  # what the cache holds after the last step
            element = next(loaded.model.parameters()).element_size()
            dense = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element * tokens
            assert 0 < stats["kv_bytes_device"] <= device_budget * dense
            if loaded is tiny:  # every layer managed: the budget bounds the columns where all would not fit
                stored = stats["partial_keys_stored"]  # int8 that would be cut is stored as int4
                config = InfiniGenConfig(
                    partial_keys=stored, device_budget=device_budget, block_size=block_size
                )
                whole = config.bytes_per_token(spec.head_dim, element)
                fits = whole <= device_budget * 2 * spec.head_dim * element
                assert (stats["partial_columns_cap"] == spec.head_dim) == fits


def test_int8_keys_the_budget_would_cut_are_stored_as_int4(tiny, skews, monkeypatch):
    """keys_when_cut int4 (the default): where the device budget holds fewer of a calibrated ratio's columns
    as int8 than as int4, the keys are stored as int4 with more columns, and select as int4 keys asked for
    select; where int8 holds them all, or with keys_when_cut cut, they stay int8."""
    spec = tiny.spec
    for ratio, expected in ((1.0, "int4"), (0.5, "int8")):  # 16 columns do not fit as int8, 8 do
        skew = skews[tiny.weights_id]
        wide = (RatioAtLength(40, ratio, ()), RatioAtLength(4096, ratio, ()))
        tuned = dataclasses.replace(skew.tuned, partial_ratio=ratio, ratio_by_length=wide)
        monkeypatch.setattr(
            skewfile, "cached_skew", lambda spec, s=skew, t=tuned: dataclasses.replace(s, tuned=t)
        )
        knobs = dict(prompts=[TEXT[:300]], new=6, budget=0.3)
        tokens, stats = _tokens(tiny, "infinigen", **knobs)
        assert stats["partial_keys_stored"] == expected
        cut_tokens, cut = _tokens(tiny, "infinigen", keys_when_cut="cut", **knobs)
        assert cut["partial_keys_stored"] == "int8"
        if expected == "int4":
            assert stats["partial_columns_cap"] == spec.head_dim > cut["partial_columns_cap"]
            assert tokens == _tokens(tiny, "infinigen", partial_keys="int4", **knobs)[0]
        else:
            assert (tokens, stats["kv_bytes_device"]) == (cut_tokens, cut["kv_bytes_device"])


def _allocating(skew, curves: dict[int, tuple[float, ...]], ratio: float):
    """``skew`` whose calibration has one window, at ``ratio``, with per-layer recall ``curves``."""
    entry = RatioAtLength(4096, ratio, (), tuple(curves.items()))
    return dataclasses.replace(skew, tuned=dataclasses.replace(skew.tuned, ratio_by_length=(entry,)))


def test_columns_allocated_per_layer_go_where_recall_gains_most_within_the_uniform_total(
    tiny, skews, monkeypatch
):
    """column_allocation per_layer: each rehearsed layer's partial key cache is as wide as the ratio
    calibration's curves allocate it, a layer whose recall gains more per column wider than the uniform
    ratio and one that gains less narrower, the columns together no more than the uniform ratio's, within
    the device budget; every sequence is counted by its budget."""
    spec, d = tiny.spec, tiny.spec.head_dim
    easy = (0.9, 0.91, 0.915, 0.92, 0.925, 0.93, 0.935)  # recall per tuning.RATIOS
    hard = (0.2, 0.4, 0.55, 0.65, 0.7, 0.85, 0.9)
    skew = _allocating(skews[tiny.weights_id], {2: easy, 3: hard}, 0.5)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    spy, held = _Spy(monkeypatch), {}
    for allocation in ("uniform", "per_layer"):
        _, stats = _tokens(
            tiny, "infinigen", prompts=[TEXT[:400]], new=4, budget=0.3, column_allocation=allocation
        )
        policy = spy.policies[-1]
        held[allocation] = {layer: policy.layers[layer].slots.view("partial").shape[2] for layer in (2, 3)}
        element = next(tiny.model.parameters()).element_size()
        dense = 2 * spec.num_layers * spec.num_kv_heads * d * element * (stats["prompt_tokens"] + 3)
        assert stats["kv_bytes_device"] <= 0.125 * dense
    uniform, allocated = held["uniform"], held["per_layer"]
    assert uniform == {2: d // 2, 3: d // 2}
    assert allocated[3] > d // 2 > allocated[2] and sum(allocated.values()) <= sum(uniform.values())
    by_layer = stats["partial_ratio_by_layer"]
    assert [math.ceil(by_layer[0][layer] * d) for layer in (2, 3)] == [allocated[2], allocated[3]]
    assert set(stats["count_rule_used"]) == {"budget (columns allocated per layer)"}


def test_columns_allocated_per_layer_nest_across_windows_and_batch_rows(tiny, skews, monkeypatch):
    """Two calibration windows that allocate differently: a batch whose prompts fall in either gets, row by
    row, the tokens each gets alone (a row's columns are among the store's, the longer window's)."""
    easy = (0.9, 0.91, 0.915, 0.92, 0.925, 0.93, 0.935)
    hard = (0.2, 0.4, 0.55, 0.65, 0.7, 0.85, 0.9)
    windows = (
        RatioAtLength(200, 0.3, (), ((2, hard), (3, easy))),
        RatioAtLength(4096, 0.5, (), ((2, easy), (3, hard))),
    )
    skew = skews[tiny.weights_id]
    skew = dataclasses.replace(skew, tuned=dataclasses.replace(skew.tuned, ratio_by_length=windows))
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    prompts = [TEXT[:100], TEXT[:400]]  # 100 and 400 tokens: one in each window
    knobs = dict(new=8, budget=0.3, column_allocation="per_layer")
    batch, stats = _tokens(tiny, "infinigen", prompts=prompts, **knobs)
    assert batch == [_tokens(tiny, "infinigen", prompts=[prompt], **knobs)[0][0] for prompt in prompts]
    short, long = stats["partial_ratio_by_layer"]
    assert short != long and all(short[layer] <= long[layer] for layer in (2, 3))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_columns_allocated_per_layer_at_full_budget_equal_dense(kind, tiny, tiny_gemma, calibrated):
    loaded = tiny if kind == "llama" else tiny_gemma
    dense, _ = _tokens(loaded, "dense")
    full, stats = _tokens(loaded, "infinigen", budget=1.0, column_allocation="per_layer")
    assert full == dense and stats["selected_tokens_mean"] > 0


def test_columns_allocated_per_layer_need_a_calibration_with_curves(tiny, skews, monkeypatch):
    skew = _allocating(skews[tiny.weights_id], {}, 0.5)  # a record written before the curves were kept
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    with pytest.raises(PolicyError, match="run `infinikv calibrate"):
        _tokens(tiny, "infinigen", new=2, column_allocation="per_layer")
    _tokens(tiny, "infinigen", new=2)  # uniform columns need no curves


def test_partial_keys_quantized_at_16_bits_select_what_unquantized_ones_select(tiny, calibrated, monkeypatch):
    """int16 partial keys (a scale per token) choose, layer by layer and step by step, the slots that partial
    keys in the model's dtype choose, until the first pick where two scores tie at the cut within int16's
    resolution (after it the runs attend differently); int8 ones hold 1/4 of the bytes (float32 model) plus
    the scales, int4 ones half int8's (two to a byte)."""
    spy, runs, held = _Spy(monkeypatch), {}, {}
    for partial_keys in ("model", "int16", "int8", "int4"):
        first = len(spy.records)
        _, stats = _tokens(
            tiny, "infinigen", new=16, partial_keys=partial_keys, budget=0.3, partial_ratio=0.5
        )
        runs[partial_keys], held[partial_keys] = spy.records[first:], stats["kv_bytes_device"]
    same = 0
    for exact, quantized in zip(runs["model"], runs["int16"], strict=True):
        if torch.equal(exact.index, quantized.index):
            same += 1
            continue
        scores = exact.scores
        for row in range(scores.shape[0]):
            for head in range(scores.shape[1]):
                picked = set(exact.index[row, head].tolist()), set(quantized.index[row, head].tolist())
                differ = torch.tensor(sorted(picked[0] ^ picked[1]), dtype=torch.long)
                if len(differ):
                    spread = scores[row, head, differ]
                    assert float(spread.max() - spread.min()) <= 1e-3 * float(scores[row, head].abs().max())
        break
    assert same >= len(runs["model"]) // 2 > 0
    columns = math.ceil(0.5 * tiny.spec.head_dim)
    assert held["int8"] == held["model"] * (columns + 2) // (4 * columns)
    assert held["int4"] == held["model"] * (math.ceil(columns / 2) + 2) // (4 * columns)


@pytest.mark.parametrize("columns", [1, 6, 7])
def test_4_bit_partial_keys_are_stored_two_to_a_byte_and_read_back_exactly(columns):
    """int4 partial keys: the packed table holds ⌈columns/2⌉ bytes per slot, reads back the integers
    quantize gave, and keeps a subset of its columns as a table of those columns alone would."""
    values = torch.randn(2, 3, 5, columns)
    integers, scale = rehearsal.quantize(values, 4)
    assert int(integers.abs().max()) <= 7
    packed, plain = SlotTable(packed=True), SlotTable()
    for table in (packed, plain):
        table.append(torch.zeros(2, 3, 5, dtype=torch.long), integers, 0, scale)
    assert packed.view("partial").shape == (2, 3, math.ceil(columns / 2), 5)
    assert torch.equal(packed.unpacked(packed.view("partial")), plain.view("partial"))
    assert packed.nbytes() == 2 * 3 * 5 * (math.ceil(columns / 2) + 2)
    kept = torch.tensor([[columns - 1, 0]] * 3) if columns > 1 else torch.zeros(3, 1, dtype=torch.long)
    for table in (packed, plain):
        table.keep_columns(kept)
    assert torch.equal(packed.unpacked(packed.view("partial")), plain.view("partial"))


def test_a_context_within_the_floor_attends_everything_whatever_alpha_counts(tiny, calibrated):
    """With a finite alpha the count rule takes fewer tokens than the budget; a sequence whose context is
    within ``min_tokens`` takes them all, and gets dense's tokens."""
    prompt = [PROMPTS[0]]
    longest = len(tiny.tokenizer(prompt[0])["input_ids"]) + 24
    dense, _ = _tokens(tiny, "dense", prompts=prompt)
    knobs = dict(alpha=0.5, budget=0.1, partial_ratio=0.25)
    floored, stats = _tokens(tiny, "infinigen", prompts=prompt, min_tokens=longest, **knobs)
    assert floored == dense
    _, unfloored = _tokens(tiny, "infinigen", prompts=prompt, min_tokens=0, **knobs)
    assert unfloored["mean_tokens_attended"] < stats["mean_tokens_attended"]


LONG = [TEXT[:700], TEXT[:333]]  # long enough that candidate blocks leave tokens out; padding not a block's


def _picks(records: list[Rehearsal]) -> list[tuple]:
    """What each rehearsal fetched: (layer, step, counts, each row's own slots per head)."""
    picks = []
    for record in records:
        index, valid = record.index, record.valid
        own = [
            [index[row, head][valid[row, head]].tolist() if valid is not None else index[row, head].tolist()]
            for row in range(index.shape[0])
            for head in range(index.shape[1])
        ]
        picks.append((record.layer, record.step, record.counts.tolist(), own))
    return picks


# the tiny model's logits are small: at alpha 0.03 some heads want more than one budget of candidates
@pytest.mark.parametrize(
    ("alpha", "window", "candidates"), [(3.0, 32, 2.0), (0.03, 0, 1.0), (math.inf, 32, 2.0)]
)
def test_block_speculation_with_blocks_of_one_token_selects_what_token_speculation_selects(
    alpha, window, candidates, tiny, calibrated, monkeypatch
):
    """Blocks of one token (their bounds are their scores) choose, layer by layer and step by step, the slots
    token speculation chooses, with ragged counts, padding, the reserved window, and heads whose every
    candidate comes within alpha (counted again over all tokens)."""
    spy, runs, stats = _Spy(monkeypatch), {}, {}
    for block_size in (0, 1):
        first = len(spy.records)
        knobs = dict(alpha=alpha, budget=0.25, window=window, block_candidates=candidates)
        tokens, stats[block_size] = _tokens(
            tiny, "infinigen", prompts=LONG, new=12, block_size=block_size, **knobs
        )
        runs[block_size] = (tokens, _picks(spy.records[first:]))
    assert runs[1] == runs[0]
    assert stats[0]["block_steps"] == 0 < stats[1]["block_steps"]
    if alpha < 1:  # heads that want more than their candidates: the count falls back to every token
        assert stats[1]["block_recounts"] > 0


def test_block_speculation_chooses_within_the_budget_among_candidate_blocks(tiny, calibrated, monkeypatch):
    """Blocks of 16 tokens: each row fetches its budget's tokens (alpha inf), its recent window among them,
    only from its candidate blocks, in ascending slots; and it generates what it generates alone."""
    spy = _Spy(monkeypatch)
    knobs = dict(new=12, alpha=math.inf, budget=0.2, block_size=16, block_candidates=1.5)
    batched, stats = _tokens(tiny, "infinigen", prompts=LONG, **knobs)
    assert stats["block_steps"] > 0
    for record in spy.records:
        candidates = record.scores > -math.inf  # the candidates' scores, -inf off them
        assert bool((candidates.sum(-1) < record.real_slots.sum(-1)).all())  # some tokens left out
        for row, budget in enumerate(resolve_budget(0.2, n) for n in record.real_tokens):
            assert int(record.counts[row]) == budget
            for head in range(record.index.shape[1]):
                own = record.index[row, head]
                if record.valid is not None:
                    own = own[record.valid[row, head]]
                assert len(own) == budget and bool((own[1:] > own[:-1]).all())
                assert bool(candidates[row, head, own].all())
                assert set(record.reserved[row, head].nonzero()[:, 0].tolist()) <= set(own.tolist())
    alone = [_tokens(tiny, "infinigen", prompts=[prompt], **knobs)[0][0] for prompt in LONG]
    assert batched == alone


@pytest.mark.parametrize("bits", [8, 4])
def test_block_bounds_bound_every_token_of_their_block(bits):
    """Each block's stored max (min) is at least (at most) every value of its tokens' partial keys, after the
    bounds are built, widened by new tokens and taken again after an overwrite; rows with different
    padding start their blocks at their first real token. 4-bit keys are read from a packed store."""
    torch.manual_seed(0)
    batch, heads, n, k, size = 2, 2, 45, 7, 8
    padding = [0, 11]
    keys, scale = rehearsal.quantize(torch.randn(batch, heads, n + 4, k) * 3, bits)
    slots = torch.arange(n + 4)
    unpack = None if bits == 8 else functools.partial(unpack_nibbles, columns=k)

    def real_at(index):
        return index >= torch.tensor(padding)[:, None, None]

    def store():  # as the policy stores them: slots last, 4-bit ones two to a byte
        stored = keys if bits == 8 else pack_nibbles(keys)
        return stored.transpose(2, 3).contiguous(), scale.transpose(2, 3).contiguous()

    bounds = BlockBounds(size, padding, torch.device("cpu"), dtype=blocks.BOUND_DTYPE, outward=True)
    bounds.build(n, blocks.partial_values(*store(), unpack), real_at, batch, heads)
    for extra in range(4):  # new tokens, one slot each
        bounds.extend(
            n + extra,
            rehearsal.dequantized(
                keys[:, :, n + extra : n + extra + 1], scale[:, :, n + extra : n + extra + 1]
            ),
        )
    keys[0, 1, 20] = 7  # an overwrite (the largest 4-bit value), then its block again
    read = blocks.partial_values(*store(), unpack)
    bounds.refresh(bounds.block_of(torch.full((batch, heads, 1), 20)), n + 4, read, real_at)
    values = rehearsal.dequantized(keys, scale)
    for row in range(batch):
        first = bounds.block_of(torch.tensor([[[padding[row]]]]))[0, 0, 0]
        assert (
            int(first) * size + padding[row] % size - size == padding[row]
        )  # its first token starts a block
        for head in range(heads):
            for slot in range(padding[row], n + 4):
                block = int(bounds.block_of(slots[slot].view(1, 1, 1).expand(batch, 1, 1))[row, 0, 0])
                high, low = (
                    bounds.bounds[row, head, block, :k].float(),
                    -bounds.bounds[row, head, block, k:].float(),
                )
                assert bool((high >= values[row, head, slot]).all()) and bool(
                    (low <= values[row, head, slot]).all()
                )
                assert bool(bounds.filled[row, head, block])
    assert not bool(bounds.filled[1, :, 0].any())  # block 0: padding alone


def test_block_bounds_follow_a_pool_that_evicts(tiny, calibrated, monkeypatch):
    """With a pool at half the tokens seen, overwritten slots take their block's bounds again: at the end
    every managed layer's bounds still bound each real token's partial key in its block."""
    spy = _Spy(monkeypatch)
    _, stats = _tokens(
        tiny, "infinigen", prompts=LONG, new=40, capacity=0.5, budget=0.2, block_size=16, block_candidates=1.0
    )
    assert stats["evicted_tokens"] > 0 and stats["block_steps"] > 0
    policy = spy.policies[-1]
    for layer in range(tiny.spec.num_layers):
        slots = policy.layers[layer].slots
        if not policy.managed(layer) or slots.bounds is None:
            continue
        bounds, n = slots.bounds, slots.n
        keys = slots.unpacked(slots.view("partial"))
        values = rehearsal.dequantized(keys, slots.view("scale")).transpose(2, 3)
        every = torch.arange(n).expand(*values.shape[:2], n)
        block = bounds.block_of(every)
        real = policy.real_slots(layer)
        k = values.shape[-1]
        table = torch.gather(bounds.bounds.float(), 2, block[..., None].expand(-1, -1, -1, 2 * k))
        assert bool(((table[..., :k] >= values) | ~real[..., None]).all())
        assert bool(((-table[..., k:] <= values) | ~real[..., None]).all())
