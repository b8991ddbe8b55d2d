"""Linear layers whose rows do not depend on their batchmates (``infinikv.invariant``), and the engine's
decode rows that use them."""

from __future__ import annotations

import pytest
import torch

from infinikv import invariant
from infinikv.engine.forced import ForcedRows
from infinikv.invariant import install, invariant_rows, linear_rows_alone, rows_alone
from infinikv.policies import POLICIES, make_config, prepare
from infinikv.testing import tiny_model


def counted_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on in the test, each ``invariant.linear_rows_alone`` product's number of rows, in order."""
    products: list[int] = []
    product = invariant.linear_rows_alone

    def counted(x, weight, bias=None):
        products.append(x.numel() // x.shape[-1])
        return product(x, weight, bias)

    monkeypatch.setattr(invariant, "linear_rows_alone", counted)
    return products


def test_each_row_of_a_product_is_what_it_is_alone_whatever_the_rows_beside_it():
    """A row's result is the same (bit for bit) alone, among a few rows, among more than one product
    holds, and first or last among them. (Plain products fail this on a CPU whose one-row kernel differs
    from its many-row ones, as MKL's float32 kernels do.)"""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(384, 96, generator=generator).to(dtype)
        bias = torch.randn(384, generator=generator).to(dtype)
        rows = torch.randn(40, 1, 96, generator=generator).to(dtype)
        low, high = invariant_rows(weight)
        assert 1 <= low <= 2 <= high or (low, high) == (1, 1)
        alone = linear_rows_alone(rows[:1], weight, bias)
        for count in (1, 2, 3, 15, 16, 17, 33, 40):
            for place in (0, count - 1):
                batch = torch.cat([rows[1:count][:place], rows[:1], rows[1:count][place:]])
                assert torch.equal(linear_rows_alone(batch, weight, bias)[place], alone[0]), (dtype, count)


def test_rows_on_the_cpu_in_float32_are_each_their_own_matrix_vector_product(monkeypatch):
    """Where the probe finds a batch of matrix-vector products giving each row the lone one's bits (this
    project's CPU, float32), a row's result is its plain lone product (its bias added apart), among any
    number of rows, and a lone row is computed alone: no other row is padded in beside it."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(576, 192, generator=generator)
    bias = torch.randn(576, generator=generator)
    if not invariant.rows_as_vectors(weight):
        pytest.skip("this CPU's batched matrix-vector products differ from its lone ones")
    rows = torch.randn(40, 192, generator=generator)
    lone = torch.cat([torch.nn.functional.linear(row[None], weight) for row in rows])
    for count in (1, 2, 3, 8, 33, 40):
        assert torch.equal(linear_rows_alone(rows[:count], weight), lone[:count]), count
        assert torch.equal(linear_rows_alone(rows[:count], weight, bias), lone[:count] + bias), count
    widths = []
    plain = torch.nn.functional.linear
    monkeypatch.setattr(invariant.F, "linear", lambda x, *args: widths.append(x.shape[0]) or plain(x, *args))
    linear_rows_alone(rows[:1], weight)
    assert widths == [1]


def test_rows_as_vectors_read_the_weight_block_by_block_with_the_whole_products_bits(monkeypatch):
    """Several rows as vectors take the weight a block of outputs at a time (a narrower last block
    included), and every row still gets its lone product over the whole weight, bit for bit."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(1000, 96, generator=generator)  # 1,000 outputs: blocks of 64, the last of 40
    if not invariant.rows_as_vectors(weight):
        pytest.skip("this CPU's batched matrix-vector products differ from its lone ones")
    monkeypatch.setattr(invariant, "BLOCK_BYTES", 64 * 96 * 4)
    assert invariant.block_outputs(weight) == 64
    widths = []
    plain = torch.bmm

    def noted(rows: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        widths.append(block.shape[2])
        return plain(rows, block)

    monkeypatch.setattr(invariant.torch, "bmm", noted)
    rows = torch.randn(9, 96, generator=generator)
    lone = torch.cat([torch.nn.functional.linear(row[None], weight) for row in rows])
    assert torch.equal(linear_rows_alone(rows, weight), lone)
    assert widths == [64] * 15 + [40]


def test_rows_run_as_vectors_only_where_a_pair_costs_more_than_a_lone_row(monkeypatch):
    """Where this CPU's product of two rows costs about what a lone row's does (its few-row kernel is fast),
    rows keep to their class of sizes: the vectors' products are not chosen, and each row still gets its
    lone bits."""
    monkeypatch.setattr(invariant, "pairs_cost_more", lambda dtype: False)
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(333, 77, generator=generator)  # a shape no other test probes
    assert not invariant.rows_as_vectors(weight)
    rows = torch.randn(5, 77, generator=generator)
    alone = linear_rows_alone(rows[2:3], weight)
    assert torch.equal(linear_rows_alone(rows, weight)[2], alone[0])


def test_the_choice_of_vectors_can_be_pinned_instead_of_timed(monkeypatch):
    """``INFINIKV_ROWS_ALONE`` pins the choice (no timing): ``classes`` keeps every weight to its class of
    rows, ``vectors`` takes vectors wherever the bits allow it, and any other value is one clear error."""
    from infinikv.errors import InputError

    monkeypatch.setattr(invariant, "pairs_cost_more", lambda dtype: pytest.fail("timed though pinned"))
    generator = torch.Generator().manual_seed(5)
    monkeypatch.setenv(invariant.ROWS_ALONE_ENV, "classes")
    assert not invariant.rows_as_vectors(torch.randn(211, 53, generator=generator))
    monkeypatch.setenv(invariant.ROWS_ALONE_ENV, "vectors")
    weight = torch.randn(212, 53, generator=generator)
    rows = torch.randn(4, 53, generator=generator)
    lone = torch.cat([torch.nn.functional.linear(row[None], weight) for row in rows])
    if invariant.rows_as_vectors(weight):  # this CPU's batched products agree with its lone ones
        assert torch.equal(linear_rows_alone(rows, weight), lone)
    monkeypatch.setenv(invariant.ROWS_ALONE_ENV, "fast")
    with pytest.raises(InputError, match="INFINIKV_ROWS_ALONE"):
        invariant.rows_as_vectors(torch.randn(213, 53, generator=generator))


def test_the_choice_another_process_is_given_is_the_pin_or_the_timing(monkeypatch):
    """``rows_alone_choice`` (what a cluster's workers are pinned to): the pin where there is one, untimed;
    else what timing pairs of rows decides."""
    monkeypatch.setenv(invariant.ROWS_ALONE_ENV, "classes")
    monkeypatch.setattr(invariant, "pairs_cost_more", lambda dtype: pytest.fail("timed though pinned"))
    assert invariant.rows_alone_choice() == "classes"
    monkeypatch.delenv(invariant.ROWS_ALONE_ENV)
    for costs_more, choice in ((True, "vectors"), (False, "classes")):
        monkeypatch.setattr(invariant, "pairs_cost_more", lambda dtype, answer=costs_more: answer)
        assert invariant.rows_alone_choice() == choice


def test_rounded_products_give_a_row_its_own_bits_in_every_draw():
    """In bfloat16 and float16 another kernel's sums show only in some rows once rounded (a 1,536-wide
    bfloat16 product's lone row differs from the same row among others in about one draw of 14 on this CPU;
    float16's differ with the number of rows, subnormal results included), so a probe of one draw can miss
    them: a lone row is always padded in bfloat16, and float16 runs a row at a time."""
    generator = torch.Generator().manual_seed(3)
    for dtype, shape in ((torch.bfloat16, (576, 1536)), (torch.float16, (64, 64)), (torch.float16, (32, 64))):
        weight = (torch.randn(*shape, generator=generator) * 0.02).to(dtype)
        for _ in range(200):
            rows = torch.randn(3, shape[1], generator=generator).to(dtype)
            alone = linear_rows_alone(rows[:1], weight)
            assert torch.equal(linear_rows_alone(rows, weight)[:1], alone), (dtype, shape)
            assert torch.equal(linear_rows_alone(rows.flip(0), weight)[-1:], alone), (dtype, shape)


def test_an_installed_models_linear_layers_run_rows_alone_only_when_asked():
    loaded = tiny_model("llama")
    install(loaded.model)
    install(loaded.model)  # once is enough; a second time changes nothing
    projection = loaded.model.model.layers[0].self_attn.q_proj
    rows = torch.randn(20, 1, projection.in_features)
    plain = torch.nn.functional.linear(rows, projection.weight)
    with torch.inference_mode():
        assert torch.equal(projection(rows), plain)
        with rows_alone():
            each = projection(rows)
            one = projection(rows[5:6])
    assert torch.equal(each[5], one[0])
    assert torch.equal(each, linear_rows_alone(rows, projection.weight))


def test_rows_laid_out_any_way_are_computed_as_alone():
    """Rows whose strides do not flatten (a transposed view) and no rows at all."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=generator)
    stored = torch.randn(1, 10, 48, generator=generator)
    rows = stored.transpose(0, 1)[:3]  # [3, 1, 48], not contiguous
    alone = linear_rows_alone(rows[1:2].contiguous(), weight)
    assert torch.equal(linear_rows_alone(rows, weight)[1], alone[0])
    assert linear_rows_alone(rows[:0], weight).shape == (0, 1, 64)


def _rows_together_are_as_alone(loaded, policy: str) -> None:
    """Three rows decoded together in the engine's step (30 steps) get, at every step, the logits each gets
    alone, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (1, n), generator=generator) for n in (150, 150, 90)]
    config = make_config(policy)
    prepare(config, loaded)

    def feed(rows: list[int]) -> list[torch.Tensor]:
        with ForcedRows(loaded, [config] * len(rows)) as forced:
            for i, r in enumerate(rows):
                forced.prefill(i, prompts[r], 32)
            tokens = torch.full((len(rows), 1), 7)
            steps = []
            for _ in range(30):
                logits = forced.step(list(range(len(rows))), tokens)
                tokens = logits.argmax(-1, keepdim=True)
                steps.append(logits)
            return steps

    together = feed([0, 1, 2])
    for r in range(3):
        assert all(torch.equal(a[r], b[0]) for a, b in zip(together, feed([r]), strict=True)), r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_decode_rows_in_a_rounded_dtype_are_as_alone(dtype, policy):
    """The engine's decode step in bfloat16 or float16, for every policy at its defaults: each row's logits
    are those it gets alone, bit for bit, at every step (a one-row kernel's sums differed from the batch's
    in some steps before)."""
    _rows_together_are_as_alone(tiny_model("llama", dtype=dtype), policy)


@pytest.mark.parametrize("policy", ["dense", "infinigen", "quest"])
def test_decode_rows_in_float32_by_the_class_of_rows_are_as_alone(monkeypatch, policy):
    """In float32 on a CPU whose few-row kernel is fast (rows not run as vectors), the class of rows gives
    each row its lone logits too."""
    monkeypatch.setattr(invariant, "rows_as_vectors", lambda weight: False)
    _rows_together_are_as_alone(tiny_model("llama"), policy)


def test_infinigen_rows_stack_their_products_only_where_that_is_exact(monkeypatch):
    """An engine step's InfiniGen rows rehearse and project their new keys in one product where that gives
    each row its own bits (float32 and bfloat16 on the CPU), and apart in float16, whose CPU kernels change
    with the number of matrices (``base.stacks_rows_exactly``)."""
    from infinikv.policies.base import stacks_rows_exactly
    from infinikv.policies.infinigen import together

    stacked: list[int] = []
    projected: list[int] = []
    choose_together, partial_keys_together = together.choose_together, together.partial_keys_together

    def counted_choice(selectors, layer, queries, widths):
        stacked.append(len(selectors))
        return choose_together(selectors, layer, queries, widths)

    def counted_keys(policies, layer, k_new):
        given = partial_keys_together(policies, layer, k_new)
        projected.extend(1 for row in given if row is not None)
        return given

    monkeypatch.setattr(together, "choose_together", counted_choice)
    monkeypatch.setattr(together, "partial_keys_together", counted_keys)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (1, 150), generator=generator) for _ in range(3)]
    config = make_config("infinigen")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        stacked.clear()
        projected.clear()
        loaded = tiny_model("llama", dtype=dtype)
        prepare(config, loaded)
        with ForcedRows(loaded, [config] * 3) as forced:
            for row, prompt in enumerate(prompts):
                forced.prefill(row, prompt, 32)
            for _ in range(4):
                forced.step([0, 1, 2], torch.full((3, 1), 7))
        exact = stacks_rows_exactly(torch.empty(0, dtype=dtype))
        assert bool(stacked) == exact and bool(projected) == exact, dtype


@pytest.mark.parametrize("split", [False, True])
def test_rows_projected_beside_a_layers_own_input_are_as_alone_and_its_next_call_takes_its_own(
    monkeypatch, split
):
    """``project_beside``: the other rows' results and, at the layer's next call with its own input, that
    input's, each as alone, from one product (``split``: from several, where a product holds fewer rows
    than both have); the kept result serves that call once, and only that one; a nested ``rows_alone``
    that ends keeps it for the outer one."""

    loaded = tiny_model("llama")
    install(loaded.model)
    projection = loaded.model.model.layers[1].self_attn.q_proj
    if split:  # products of two rows at most: both inputs' three rows take two
        monkeypatch.setattr(invariant, "rows_as_vectors", lambda weight: False)
        monkeypatch.setattr(invariant, "invariant_rows", lambda weight: (2, 2))
    generator = torch.Generator().manual_seed(2)
    own = torch.randn(1, 1, projection.in_features, generator=generator)
    others = torch.randn(2, 1, projection.in_features, generator=generator)
    products = counted_products(monkeypatch)
    with torch.inference_mode(), rows_alone():
        with rows_alone():  # as the engine's shared queries project, inside the step's own
            beside = invariant.project_beside(projection, own, others)
        taken = projection(own)
        assert products == [3]  # one call for both, none for the layer's own
        again = projection(own)
        assert products == [3, 1]  # taken once
        invariant.project_beside(projection, own, others)
        other_input = projection(own.clone())
        assert products == [3, 1, 3, 1]  # only the very input it was given takes it
        invariant.project_beside(projection, own, others)
    with torch.inference_mode(), rows_alone():
        projection(own)  # dropped when the outermost rows_alone ended
    assert products == [3, 1, 3, 1, 3, 1]
    alone = invariant.linear_rows_alone
    for row in range(2):
        assert torch.equal(beside[row], alone(others[row : row + 1], projection.weight, projection.bias)[0])
    for result in (taken, again, other_input):
        assert torch.equal(result, alone(own, projection.weight, projection.bias))


def test_a_projection_made_ahead_of_a_layers_own_call_serves_that_call_once(monkeypatch):
    """``project_ahead``: the layer's next call with that very input takes the result (one product for
    both), once; a result kept beside it already is returned, not computed again; outside ``rows_alone``
    nothing is kept."""
    loaded = tiny_model("llama")
    install(loaded.model)
    projection = loaded.model.model.layers[1].self_attn.q_proj
    generator = torch.Generator().manual_seed(3)
    own = torch.randn(2, 1, projection.in_features, generator=generator)
    others = torch.randn(1, 1, projection.in_features, generator=generator)
    alone = linear_rows_alone(own, projection.weight, projection.bias)
    products = counted_products(monkeypatch)
    with torch.inference_mode(), rows_alone():
        ahead = invariant.project_ahead(projection, own)
        taken = projection(own)
        assert products == [2]
        projection(own)
        assert products == [2, 2]  # taken once
        invariant.project_beside(projection, own, others)
        kept = invariant.project_ahead(projection, own)
        projection(own)
        assert products == [2, 2, 3]  # the beside product serves both
        invariant.project_ahead(projection, own)
        loaded.model.model.layers[1].self_attn.k_proj(own)  # another layer's call with that input
        projection(own.clone())  # an equal input, not that very one
        assert products == [2, 2, 3, 2, 2, 2]
        projection(own)
        assert products == [2, 2, 3, 2, 2, 2]  # still kept for its own call
    with torch.inference_mode():
        invariant.project_ahead(projection, own)
        with rows_alone():
            projection(own)
    assert products == [2, 2, 3, 2, 2, 2, 2]  # nothing was kept outside rows_alone
    assert torch.equal(ahead, alone) and torch.equal(taken, alone) and torch.equal(kept, alone)


def test_a_choice_by_a_layers_own_query_projects_it_once_for_the_choice_and_the_layer(monkeypatch):
    """InfiniGen's own-query layers (its first two at the defaults) choose by their own query before the
    layer projects it; an engine step projects it once for both (``SharedQueries``, ``project_ahead``):
    the logits are those of projecting it twice, with one product fewer per own-query layer and step."""
    from infinikv import spec

    loaded = tiny_model("llama")
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 200, (1, n), generator=generator) for n in (150, 110)]
    config = make_config("infinigen")
    prepare(config, loaded)
    products = counted_products(monkeypatch)

    def feed() -> tuple[list[torch.Tensor], int, int]:
        products.clear()
        with ForcedRows(loaded, [config] * 2) as forced:
            for row, prompt in enumerate(prompts):
                forced.prefill(row, prompt, 32)
            tokens, steps = torch.full((2, 1), 7), []
            products.clear()
            for _ in range(6):
                logits = forced.step([0, 1], tokens)
                tokens = logits.argmax(-1, keepdim=True)
                steps.append(logits)
            return steps, len(products), len(forced.drivers[0].cache.policy.decoding.own_query)

    once, products_once, own_layers = feed()
    monkeypatch.setattr(spec, "project_ahead", lambda module, own: module(own))
    twice, products_twice, _ = feed()
    assert own_layers >= 2
    assert products_twice - products_once == 6 * own_layers
    for a, b in zip(once, twice, strict=True):
        assert torch.equal(a, b)


INFINIGEN_SCHEDULES = [{}, {"own_query_prefetch": True}, {"select_every": 2}]


@pytest.mark.parametrize(
    ("kind", "policy", "knobs"),
    [("llama", name, {}) for name in POLICIES if name != "infinigen"]
    + [("llama", "infinigen", knobs) for knobs in INFINIGEN_SCHEDULES]
    + [("gemma3", "infinigen", {})],
)
def test_a_look_ahead_put_off_to_the_layer_it_plans_changes_nothing(monkeypatch, kind, policy, knobs):
    """Where nothing runs beside the decode thread (here every step is below the worker's size), an
    engine step runs a prefetching policy's look-ahead at the start of the layer it plans, and InfiniGen's
    rehearsal projects its query in one product with that layer's own (``SharedQueries.beside``), which
    the layer's own query projection then takes: logits and counted statistics are those of the
    look-ahead run at once, at every step, for every policy at its defaults, InfiniGen also with its
    own-query layers' prefetch and choices every other step (and on Gemma-3's sliding and global layers,
    whose queries are normalised per head)."""
    from infinikv import copiers, spec
    from infinikv.engine import ragged

    monkeypatch.setattr(copiers, "WORKER_FROM_BYTES", 2**62)
    products = counted_products(monkeypatch)
    beside: list[int] = []
    project_beside = spec.project_beside

    def counted_beside(module, own, others):
        beside.append(1)
        return project_beside(module, own, others)

    monkeypatch.setattr(spec, "project_beside", counted_beside)
    loaded = tiny_model(kind)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (1, n), generator=generator) for n in (150, 110)]
    config = make_config(policy, **knobs)
    put_off: list[bool] = []
    puts_off = ragged.RaggedCache.puts_off

    def recorded(self, *args):
        put_off.append(puts_off(self, *args))
        return put_off[-1]

    def feed(at_once: bool) -> tuple[list[torch.Tensor], dict]:
        products.clear()
        monkeypatch.setattr(ragged.RaggedCache, "puts_off", (lambda *_: False) if at_once else recorded)
        with ForcedRows(loaded, [config] * 2) as forced:
            for row, prompt in enumerate(prompts):
                forced.prefill(row, prompt, 32)
            tokens = torch.full((2, 1), 7)
            steps = []
            for _ in range(12):
                logits = forced.step([0, 1], tokens)
                tokens = logits.argmax(-1, keepdim=True)
                steps.append(logits)
            return steps, forced.stats(), len(products)

    at_once, at_once_stats, products_at_once = feed(at_once=True)
    assert not beside
    later, later_stats, products_later = feed(at_once=False)
    assert any(put_off) == POLICIES[policy].prefetches
    # each projection beside a layer's own input is one product, and that layer's own call then makes none
    assert bool(beside) == (policy == "infinigen")
    assert products_at_once - products_later == len(beside)
    assert all(torch.equal(a, b) for a, b in zip(at_once, later, strict=True))
    counted = [{k: v for k, v in s.items() if not k.endswith("_s")} for s in (at_once_stats, later_stats)]
    assert counted[0] == counted[1]  # everything but times


def test_a_look_ahead_is_put_off_only_where_nothing_would_overlap_it():
    """Not from layer 0 (it plans itself too), not for a target other than the next layer, not in a
    compiled step, and not where the copier overlaps its work (a worker, a copy stream)."""
    from types import SimpleNamespace

    from infinikv.engine.ragged import RaggedCache

    spec = tiny_model("llama").spec

    def policy(overlaps: bool | None) -> SimpleNamespace:
        pool = (
            None if overlaps is None else SimpleNamespace(copier=SimpleNamespace(overlaps=lambda: overlaps))
        )
        return SimpleNamespace(pool=lambda: pool)

    eager, compiled = RaggedCache(spec, [], [4]), RaggedCache(spec, [], [4], compiled=True)
    assert eager.puts_off(1, policy(False), {2}) and eager.puts_off(2, policy(None), {3})
    assert not eager.puts_off(0, policy(False), {0, 1})
    assert not eager.puts_off(1, policy(False), set())
    assert not eager.puts_off(1, policy(True), {2})
    assert not compiled.puts_off(1, policy(False), {2})
