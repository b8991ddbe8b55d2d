"""The baselines beside InfiniGen: h2o, streaming, quest, quant."""

from __future__ import annotations

import math

import pytest
import torch

from infinikv import GenerationConfig, Generator
from infinikv.engine.forced import ForcedRows
from infinikv.policies import make_config, make_policy
from infinikv.policies.base import (
    Policy,
    ScoredPolicy,
    attention_weights,
    per_kv_head,
    pick_each,
    pick_top,
    reserved_first,
    stacks_rows_exactly,
)
from infinikv.policies.quant import dequantize, pack, quantize, unpack

FULL = [
    ("h2o", {"budget": 100_000}),
    ("streaming", {"window": 100_000}),
    ("quest", {"budget": 1.0, "dense_layers": 0, "page_size": 4}),
    ("oracle", {"budget": 1.0, "dense_layers": 0}),
    ("quant", {"bits": 16}),
    ("quant", {"bits": 16, "scheme": "kivi"}),
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in knobs.items())}" for name, knobs in FULL]
PROMPTS = ["Left padding ahead.", "A longer prompt that makes the batch pad its shorter neighbour " * 4]


def _tokens(loaded, policy, prompts, new_tokens, **knobs):
    config = GenerationConfig(max_new_tokens=new_tokens, prefill_chunk=64)
    return [r.token_ids for r in Generator(loaded, policy, **knobs).generate(prompts, config)]


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
@pytest.mark.parametrize(("policy", "knobs"), FULL, ids=IDS)
def test_full_budget_matches_dense_tiny(policy, knobs, model, request):
    loaded = request.getfixturevalue(model)
    assert _tokens(loaded, policy, PROMPTS, 24, **knobs) == _tokens(loaded, "dense", PROMPTS, 24)


@pytest.fixture(scope="module")
def smollm2_dense(smollm2, long_prompt):
    return _tokens(smollm2, "dense", [long_prompt], 24)


@pytest.mark.real_model
@pytest.mark.parametrize(("policy", "knobs"), FULL, ids=IDS)
def test_full_budget_matches_dense_smollm2(policy, knobs, smollm2, long_prompt, smollm2_dense):
    assert _tokens(smollm2, policy, [long_prompt], 24, **knobs) == smollm2_dense


def _policy(tiny, name, **knobs):
    return make_policy(name, tiny.spec, torch.device("cpu"), **knobs)


def _kv(n, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, n, spec.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_streaming_keeps_sinks_and_window(tiny):
    policy = _policy(tiny, "streaming", n_sink=2, window=5)
    k, v = _kv(21, tiny.spec)
    policy.prefill(0, k[:, :, :20], v[:, :, :20])
    policy.set_key_valid(torch.arange(21)[None] >= 3)  # three left-padding slots
    selection = policy.decode(0, k[:, :, 20:], v[:, :, 20:])
    expected = [3, 4, 16, 17, 18, 19, 20]  # first two real tokens, then the window ending at the new one
    assert selection.positions[0, 0].tolist() == expected
    assert torch.equal(selection.values[:, :, 2:], v[:, :, 16:])
    policy.close()


def test_sinks_and_recent_is_one_rule_over_positions_in_any_order(tiny):
    """The base's rule of sinks and window (StreamingLLM's, the scored policies' and InfiniGen's reserved
    slots): a row's first real tokens and the last positions seen, never left padding, whatever order the
    positions come in (InfiniGen's slots hold them out of order once it evicts)."""
    policy = _policy(tiny, "streaming", n_sink=2, window=5)
    policy.set_key_valid(torch.stack([torch.arange(12) >= 3, torch.ones(12, dtype=torch.bool)]))
    order = torch.stack([torch.randperm(12, generator=torch.Generator().manual_seed(row)) for row in (0, 1)])
    cases = {3: [{3, 4, 9, 10, 11}, {0, 1, 9, 10, 11}], 12: [set(range(3, 12)), set(range(12))]}
    for recent, wanted in cases.items():
        near = policy.sinks_and_recent(order, 12, 2, recent)
        for row in (0, 1):
            marked = {p for p, hit in zip(order[row].tolist(), near[row].tolist(), strict=True) if hit}
            assert marked == wanted[row]
    policy.close()


def test_streaming_rerotation_equals_cache_positions(tiny):
    """A sink key re-rotated by the skipped count scores as if it sat right before the window."""
    spec = tiny.spec
    policy = _policy(tiny, "streaming", n_sink=1, window=3)
    gen = torch.Generator().manual_seed(1)
    q0, k0 = (
        torch.randn(1, 1, 1, spec.head_dim, generator=gen),
        torch.randn(1, 1, 1, spec.head_dim, generator=gen),
    )

    def rope(x, position):
        cos, sin = spec.rope(0, x, torch.tensor([[position]]))
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]

    policy.reserved(0, 40, 1)  # 40 past tokens: the sink at 0, then 37 skipped, then the window 38..40
    moved = rope(k0, 0).expand(1, 1, 3, -1).clone()
    policy.adjust_keys(0, torch.zeros(1, 1, 3, dtype=torch.long), moved)
    got = (rope(q0, 40) * moved[:, :, :1]).sum()
    assert torch.allclose(got, (rope(q0, 40) * rope(k0, 37)).sum(), atol=1e-4)  # sink at place 37
    assert not torch.allclose(got, (rope(q0, 40) * rope(k0, 0)).sum(), atol=1e-4)
    policy.close()


def test_h2o_keeps_heavy_hitter(tiny):
    spec = tiny.spec
    policy = _policy(tiny, "h2o", budget=8, heavy_ratio=0.5, min_tokens=0)
    k, v = _kv(41, spec)
    k = k * 0.1
    direction = torch.randn(spec.head_dim)
    k[:, :, 5] = 4 * direction  # token 5 is what every query looks at
    q = direction.expand(1, spec.num_heads, 40, -1)
    past_k, past_v = policy.prefill(0, k[:, :, :40], v[:, :, :40])
    policy.attend(0, q, past_k, past_v, None, 1.0)
    selection = policy.decode(0, k[:, :, 40:], v[:, :, 40:])
    kept = selection.positions[0].tolist()
    assert all(5 in row for row in kept)
    assert all(row[-4:] == [37, 38, 39, 40] for row in kept)  # the recent window, new token included
    assert selection.keys.shape[2] == 8
    policy.attend(0, q[:, :, -1:], selection.keys, selection.values, None, 1.0)
    assert policy.host_pool.length(0) == 7  # evicted for real: budget - 1 between steps
    policy.close()


def test_h2o_prompt_scores_sum_the_attention_each_key_receives(tiny):
    spec = tiny.spec
    policy = _policy(tiny, "h2o", budget=8, min_tokens=0)
    k, v = _kv(600, spec, seed=4)
    q = torch.randn(1, spec.num_heads, 600, spec.head_dim, generator=torch.Generator().manual_seed(5))
    # Two prompt chunks of 300 rows (more than one block of scored rows each); the second with a mask that
    # also hides key 7 (as left padding would).
    mask = torch.ones(300, 600, dtype=torch.bool).tril(300)[None, None]
    mask[..., 7] = False
    policy.attend(0, q[:, :, :300], k[:, :, :300], v[:, :, :300], None, 0.3)
    policy.attend(0, q[:, :, 300:], k, v, mask, 0.3)
    first = attention_weights(q[:, :, :300], k[:, :, :300], None, 0.3).sum(dim=2)
    second = attention_weights(q[:, :, 300:], k, mask, 0.3).sum(dim=2)
    second[..., :300] += first
    expected = second.view(1, spec.num_kv_heads, spec.group_size, 600).sum(dim=2)
    torch.testing.assert_close(policy.score[0], expected, atol=1e-4, rtol=1e-5)
    policy.close()


def test_quest_picks_page_of_max_logit(tiny):
    spec = tiny.spec
    policy = _policy(tiny, "quest", budget=16, page_size=4, dense_layers=0, min_tokens=0)
    k, v = _kv(64, spec, seed=3)
    query = torch.randn(1, spec.num_heads, spec.head_dim)
    k[:, :, 42] = 3 * query[:, :: spec.group_size]  # one token per KV head aligned with its first query head
    policy.prefill(0, k, v)
    policy.query = lambda layer: query  # the layer's real query this step
    pages = policy.score(0, 64, 1).argmax(dim=-1, keepdim=True)  # the page with the highest bound
    grouped = query.view(1, spec.num_kv_heads, spec.group_size, -1)
    best = torch.einsum("bhgd,bhnd->bhgn", grouped, k).amax(dim=2).argmax(dim=-1)
    assert torch.equal(pages[..., 0], best // 4)
    assert (best == 42).all()
    policy.close()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quant_round_trip_within_half_step(bits):
    x = torch.randn(2, 3, 50, 8, 16) * torch.linspace(0.1, 5, 16)
    codes, scale, minimum = quantize(x, bits, dim=-1)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    assert pack(codes, bits).shape[-1] == 16 * bits // 8
    error = (dequantize(codes, scale, minimum) - x).abs()
    assert (error <= scale / 2 * (1 + 1e-4) + 1e-6).all()


def test_kivi_decodes_a_prompt_shorter_than_its_full_precision_tail(tiny):
    """Until residual + group_size tokens exist, KIVI has quantized nothing: the tail holds every token, it
    attends to them all in full precision (so it is dense) and moves no bytes."""
    knobs = dict(scheme="kivi", group_size=4, residual=16)
    config = GenerationConfig(max_new_tokens=6)
    prompt = "Hi."
    assert len(tiny.tokenizer(prompt)["input_ids"]) + 6 < 16
    result = Generator(tiny, "quant", **knobs).generate(prompt, config)[0]
    assert result.token_ids == Generator(tiny, "dense").generate(prompt, config)[0].token_ids
    assert result.stats["bytes_h2d"] == 0


def test_quant_bytes_shrink_by_expected_factor(tiny):
    head_dim = tiny.spec.head_dim
    moved = {}
    for bits in (16, 4):
        result = Generator(tiny, "quant", bits=bits, group_size=head_dim).generate(
            PROMPTS[1], GenerationConfig(max_new_tokens=8)
        )[0]
        moved[bits] = result.stats["bytes_h2d"]
    # fp32 K/V: head_dim * 4 bytes per row; 4-bit: head_dim / 2 bytes of codes + a scale and a minimum.
    expected = (head_dim // 2 + 2 * 4) / (head_dim * 4)
    assert moved[4] == pytest.approx(expected * moved[16])


@pytest.mark.parametrize("scheme", ["group", "kivi"])
def test_quant_copies_codes_and_scales_in_one_fetch_per_layer(tiny, scheme):
    """The scales and minimums live in the codes' pool, so each decode step makes one fetch per layer."""
    policy = _policy(tiny, "quant", bits=4, scheme=scheme, group_size=4, residual=4)
    spec, layer = tiny.spec, 0
    policy.prefill(layer, *_kv(40, spec))
    copies = policy.host_pool.counters.copies
    policy.decode(layer, *_kv(1, spec, seed=1))
    assert policy.host_pool.counters.copies == copies + 1
    policy.close()


def test_oracle_takes_the_top_k_of_the_real_scores(tiny):
    """At a small budget the oracle picks, per KV head, exactly the k best tokens by the real logits, each
    query head measured against its own best, then the max over the group."""
    spec, layer, n = tiny.spec, 1, 40
    policy = _policy(tiny, "oracle", budget=5, dense_layers=1, min_tokens=0)
    k, v = _kv(n, spec, seed=4)
    policy.prefill(layer, k, v)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, spec.num_heads, 1, spec.head_dim, generator=gen)
    # Head 0 of each group puts a huge logit on slot 0 (a sink); its group mates must still get their picks.
    query[:, :: spec.group_size] = 50 * k[:, :, :1] / k[:, :, :1].norm(dim=-1, keepdim=True)
    policy.take_query(layer, query[:, :, -1])
    index, valid = policy.select(layer, n, 1)
    assert valid is None

    scaling = spec.attention[layer].scaling
    logits = torch.einsum("bhd,bhnd->bhn", query[:, :, 0], k.repeat_interleave(spec.group_size, 1)) * scaling
    relative = logits - logits.amax(-1, keepdim=True)
    expected = relative.view(1, spec.num_kv_heads, spec.group_size, n).amax(2).topk(5, -1).indices
    assert torch.equal(index, expected.sort(-1).values)
    assert (index == 0).any(-1).all()  # the sink is kept ...
    others = relative.view(1, spec.num_kv_heads, spec.group_size, n)[:, :, 1].argmax(-1, keepdim=True)
    assert (index == others).any(-1).all()  # ... and so is the other head's best token
    policy.close()


def test_oracle_reserves_sinks_and_window_within_its_budget(tiny):
    spec, layer, n = tiny.spec, 1, 40
    policy = _policy(tiny, "oracle", budget=8, dense_layers=1, n_sink=2, window=3, min_tokens=0)
    k, v = _kv(n, spec, seed=6)
    policy.set_key_valid(torch.tensor([[False] * 5 + [True] * (n - 5)]))  # five slots of left padding
    policy.prefill(layer, k, v)
    query = torch.randn(1, spec.num_heads, 1, spec.head_dim, generator=torch.Generator().manual_seed(7))
    policy.take_query(layer, query[:, :, -1])
    index, _valid = policy.select(layer, n, 1)
    assert index.shape[-1] == 8
    for head in index[0].tolist():
        assert {5, 6, 37, 38, 39} <= set(head) and min(head) >= 5  # sinks after the padding, the window
    policy.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "kv_heads", "group", "rows", "tokens"), [(1, 3, 3, 1, 411), (4, 2, 4, 3, 97)]
)
def test_per_kv_head_is_the_repeated_product_bit_for_bit(batch, kv_heads, group, rows, tokens, dtype):
    generator = torch.Generator().manual_seed(tokens)
    query = torch.randn(batch, rows, kv_heads * group, 64, generator=generator).transpose(1, 2).to(dtype)
    keys = torch.randn(batch, kv_heads, tokens, 64, generator=generator).to(dtype)
    weights = (
        torch.randn(batch, kv_heads * group, rows, tokens, generator=generator).softmax(dim=-1).to(dtype)
    )
    repeated = keys.repeat_interleave(group, dim=1)
    assert torch.equal(per_kv_head(query, keys.transpose(-1, -2)), query @ repeated.transpose(-1, -2))
    assert torch.equal(per_kv_head(weights, keys), weights @ repeated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stacked_rows_attend_as_alone_where_the_helper_says_so(dtype):
    """Where ``stacks_rows_exactly`` holds (H2O attends an engine step's rows stacked), each row's explicit
    weights and output over stacked rows are its own, bit for bit, for the widths and row counts an engine
    step brings; float16 on this CPU is where they are not, and the helper says no."""
    assert stacks_rows_exactly(torch.empty(0, dtype=dtype)) == (dtype != torch.float16)
    if not stacks_rows_exactly(torch.empty(0, dtype=dtype)):
        return
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 7, 9, 16, 33, 411):
        for rows in (2, 4, 16):
            q = torch.randn(rows, 9, 1, 64, generator=generator).to(dtype)
            k, v = (torch.randn(rows, 3, tokens, 64, generator=generator).to(dtype) for _ in range(2))
            mask = torch.rand(rows, 3, 1, tokens, generator=generator) > 0.2
            weights = attention_weights(q, k, mask, 0.125)
            out = per_kv_head(weights.to(dtype), v)
            for r in range(rows):
                alone = attention_weights(q[r : r + 1], k[r : r + 1], mask[r : r + 1], 0.125)
                assert torch.equal(weights[r : r + 1], alone)
                assert torch.equal(out[r : r + 1], per_kv_head(alone.to(dtype), v[r : r + 1]))


def test_pick_top_breaks_ties_at_the_cut_by_slot_alone_and_batched():
    """Entries tied at a row's cut go to the earlier slots, whatever the batch around the row (a top-k's own
    tie order depends on the gather's width); without ties the pick is the plain top-k, ascending."""
    torch.manual_seed(0)
    short = torch.randn(1, 1, 64)
    short[..., 6] = short[..., 30] = 10.0
    batch = torch.cat([short, torch.randn(1, 1, 64)])
    alone, valid_alone = pick_top(short, [1])
    together, valid = pick_top(batch, [1, 40])
    assert valid_alone is None and alone[0, 0].tolist() == [6]
    assert together[0, 0][valid[0, 0]].tolist() == [6] and int(valid[1, 0].sum()) == 40
    flat = torch.zeros(1, 2, 20)
    flat[..., :4] = -math.inf  # left padding is never tied with a real slot
    assert pick_top(flat, [5])[0].tolist() == [[[4, 5, 6, 7, 8]] * 2]
    scores = torch.randn(3, 2, 100)
    expected = scores.topk(30, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(pick_top(scores, [30] * 3)[0], expected)


@pytest.mark.parametrize("takes", [[12, 12, 12], [3, 12, 30], [5, 5, 5]])
def test_pick_top_takes_reserved_entries_first_by_their_own_order(takes):
    """``reserved`` entries come before all others and among themselves by score, padding stays out, ties
    go to the earlier slot: exactly the pick over :func:`reserved_first`'s lifted scores, whether a row takes
    all of its reserved entries (lifted in one pass) or fewer (rows of 5 and 3 below 8 reserved)."""
    torch.manual_seed(1)
    scores = torch.randn(3, 2, 60).mul(2).round().div(2)  # half steps: many ties
    scores[1, :, :7] = -math.inf  # left padding, some of it reserved below
    scores[2, 1, ::3] = -math.inf
    reserved = torch.zeros(3, 1, 60, dtype=torch.bool)
    reserved[..., [0, 1, 2, 55, 56, 57, 58, 59]] = True
    reserved[1, 0, [7, 8]] = True  # the row's own sinks, after its padding
    got = pick_top(scores, takes, reserved)
    expected = pick_top(reserved_first(scores, reserved), takes)
    assert torch.equal(got[0], expected[0])
    assert (got[1] is None) == (expected[1] is None)
    if got[1] is not None:
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("takes", [[20, 23, 9], [9, 9, 9]], ids=["own counts", "one count"])
@pytest.mark.parametrize("reserve", [False, True])
def test_pick_each_gives_every_sequence_its_pick_alone(reserve, takes):
    """Sequences of different lengths, padded at the end with -inf and picked in one pass: each row's first
    ``takes[r]`` entries are its own ``pick_top`` over its slots alone, ties (half steps) included, whether
    the rows take counts of their own (each cut at its count) or one count (one pass, no order)."""
    torch.manual_seed(2)
    lengths = [50, 23, 64]
    rows = [torch.randn(1, 2, n).mul(2).round().div(2) for n in lengths]
    reserved = [torch.zeros(1, 2, n, dtype=torch.bool) for n in lengths]
    for near, n in zip(reserved, lengths, strict=True):
        near[..., [0, 1, n - 3, n - 2, n - 1]] = reserve
    padded = torch.full((3, 2, 64), -math.inf)
    lifted = torch.zeros(3, 2, 64, dtype=torch.bool)
    for r, (row, near, n) in enumerate(zip(rows, reserved, lengths, strict=True)):
        padded[r, :, :n], lifted[r, :, :n] = row[0], near[0]
    index = pick_each(padded, takes, lifted, 5)
    assert index.shape == (3, 2, max(takes))
    for r, (row, near, take) in enumerate(zip(rows, reserved, takes, strict=True)):
        own, valid = pick_top(row, [take], near, 5)
        assert valid is None and torch.equal(index[r : r + 1, :, :take], own)


@pytest.mark.parametrize("policy", ["quest", "oracle"])
def test_a_policy_that_chooses_with_its_query_takes_the_models_own(tiny, policy, monkeypatch):
    """Quest and the oracle choose with the layer's real query: the one the model computed, handed over at
    attention (equal to the layer's input projected again, as they once did), never a second projection."""
    spec_type, projected, handed = type(tiny.spec), {}, []
    real_query, real_before, real_take = spec_type.query, Policy.before_attention, ScoredPolicy.take_query

    def before_attention(self, layer, x, position_ids, queries=None):  # a decode step's layer, its input
        if self.chooses_with_query(layer):
            projected[id(self), layer] = real_query(self.spec, layer, x, position_ids)[:, :, -1]
        real_before(self, layer, x, position_ids, queries)

    def take_query(self, layer, query):
        handed.append(torch.equal(query, projected.pop((id(self), layer))))
        real_take(self, layer, query)

    computed = []
    monkeypatch.setattr(
        spec_type, "query", lambda self, *args: computed.append(args[0]) or real_query(self, *args)
    )
    monkeypatch.setattr(Policy, "before_attention", before_attention)
    monkeypatch.setattr(ScoredPolicy, "take_query", take_query)
    config = GenerationConfig(max_new_tokens=6, prefill_chunk=64)
    Generator(tiny, policy, budget=0.3, min_tokens=0, dense_layers=0).generate(PROMPTS, config)
    assert handed and all(handed) and not projected
    assert computed == []  # the policy projected no query itself


def test_dense_stores_are_sized_once_for_a_prompt_and_its_decode_steps(tiny):
    """Reading a prompt reserves its length (``Policy.reserve``): each layer's K/V store is first made for
    it and a quarter more (at least 256 slots), so neither its chunks nor its first decode steps copy it
    into a larger one."""
    prompt = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    with ForcedRows(tiny, [make_config("dense")]) as forced:
        forced.prefill(0, prompt, 32)
        policy = forced.drivers[0].cache.policy
        stores = [keys for keys, _ in policy.kv]
        assert {keys.shape[2] for keys in stores} == {300 + 256}
        for token in range(8):
            forced.step([0], torch.tensor([[token + 3]]))
        assert all(keys is store for (keys, _), store in zip(policy.kv, stores, strict=True))


def test_a_dense_store_reserved_for_a_long_prompt_holds_it_and_a_quarter_more(tiny):
    """Past 1,024 tokens the quarter is more than the 256-slot floor."""
    policy = make_policy(make_config("dense"), tiny.spec, torch.device("cpu"))
    policy.reserve(2000)
    k = torch.randn(1, tiny.spec.num_kv_heads, 32, tiny.spec.head_dim)
    policy.prefill(0, k, k.clone())
    assert policy.kv[0][0].shape[2] == 2000 + 500
