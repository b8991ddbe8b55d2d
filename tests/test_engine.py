"""The engine on tiny models: requests that join mid-flight, hit the prefix cache or are preempted get the
tokens they get alone, for every registered policy; the pool's blocks; chunking; per-row sampling."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch

from infinikv.engine import Engine, EngineConfig, GenerationConfig
from infinikv.engine.blocks import BlockPool, PrefixCache, PrefixEntry, block_bytes, free_memory_bytes
from infinikv.engine.forced import ForcedRows
from infinikv.errors import InputError
from infinikv.forward import prompt_chunks
from infinikv.kvpool import KVPool
from infinikv.policies import POLICIES, Policy, make_config
from infinikv.testing import tiny_model

BLOCK = 16
CHUNK = 8  # two prompt chunks a block
GREEDY = GenerationConfig(max_new_tokens=12)


def ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


def run(engine: Engine, requests: list[tuple[list[int], object, GenerationConfig]], join_at=None) -> list:
    """Add ``requests`` (all at once, or request i at step ``join_at[i]``), step until all finish; the
    results in request order."""
    join_at = join_at or [0] * len(requests)
    seqs: dict[int, int] = {}
    results: list = [None] * len(requests)
    step = 0
    while any(r is None for r in results):
        for i, at in enumerate(join_at):
            if at == step:
                seqs[engine.add(*requests[i])] = i
        for out in engine.step():
            if out.result is not None:
                results[seqs[out.seq]] = out.result
        step += 1
        assert step < 10_000
    return results


def alone(tiny, prompt: list[int], policy, sampling=GREEDY) -> list[int]:
    engine = Engine(
        tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, prefix_cache=False, kv_memory=2**28)
    )
    return run(engine, [(prompt, policy, sampling)])[0].token_ids


def test_prompt_chunks_are_whole_blocks_from_the_start():
    for length in (1, 2, 15, 16, 17, 18, 33, 100):
        chunks = prompt_chunks(length, CHUNK)
        assert chunks[0][0] == 0 and chunks[-1][1] == length
        assert all(end == begin for (_, end), (begin, _) in zip(chunks[:-1], chunks[1:], strict=True))
        assert all(begin % CHUNK == 0 for begin, _ in chunks)
        assert all(end - begin >= 2 for begin, end in chunks) or length == 1  # none looks like a decode step
    assert prompt_chunks(17, 16) == [(0, 17)]
    assert prompt_chunks(33, 16) == [(0, 16), (16, 33)]


def scenario(
    loaded,
    config,
    document: list[int],
    questions: list[list[int]],
    chat: list[int],
    new: int,
    block: int,
    chunk: int,
):
    """The engine's three ways to share a run, each checked against the request alone with no prefix
    cache: (1) with a prefix cache, the second question joins mid-flight and starts with the first's
    document (a hit), and a chat request joins later; (2) without one, in a pool with room for both
    questions' prompts but not for both to grow, one of them is preempted and recomputed."""
    sampling = GenerationConfig(max_new_tokens=new)
    prompts = [document + question for question in questions] + [chat]
    roomy = Engine(loaded, EngineConfig(block_tokens=block, chunk_tokens=chunk, kv_memory=2**30))
    shared = run(roomy, [(p, config, sampling) for p in prompts], join_at=[0, 2, 4])
    per_block = block_bytes(loaded.spec, next(loaded.model.parameters()).dtype, block)
    admitted = [-(-(len(p) + 1) // block) for p in prompts[:2]]
    assert all(-(-(len(p) + new) // block) > n for p, n in zip(prompts, admitted, strict=False))  # they grow
    tight = EngineConfig(
        block_tokens=block, chunk_tokens=chunk, kv_memory=(sum(admitted) + 1) * per_block, prefix_cache=False
    )
    crowded = run(Engine(loaded, tight), [(p, config, sampling) for p in prompts[:2]], join_at=[0, 2])
    alone = Engine(loaded, EngineConfig(block_tokens=block, chunk_tokens=chunk, prefix_cache=False))
    for prompt, result in zip(prompts + prompts[:2], shared + crowded, strict=True):
        assert result.token_ids == run(alone, [(prompt, config, sampling)])[0].token_ids
    assert shared[1].stats["prefix_hit_tokens"] >= len(document) // block * block > 0
    assert sum(result.stats["preemptions"] for result in crowded) >= 1
    assert roomy.pool.used == roomy.pool.cached  # every sequence's blocks went back


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_joining_sharing_a_prefix_and_preemption_leave_every_row_its_own_tokens(tiny, policy):
    document = ids(tiny, "The harbour lantern glowed over the copper river while the falcon watched. " * 2)
    questions = [ids(tiny, "Question one?"), ids(tiny, "And a second question?")]
    chat = ids(tiny, "A short chat message.")
    scenario(tiny, make_config(policy), document, questions, chat, new=24, block=BLOCK, chunk=CHUNK)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_one_token_prompt_beside_a_longer_one_gets_its_tokens_alone(tiny, policy):
    """A prompt of one token is a prefill of one (nothing is cached before it), not a decode step, for every
    policy; a longer request decoding beside it is not disturbed."""
    config = make_config(policy)
    prompts = [ids(tiny, "The harbour lantern glowed over the copper river."), ids(tiny, "The")[:1]]
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    results = run(engine, [(prompt, config, GREEDY) for prompt in prompts], join_at=[0, 3])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == alone(tiny, prompt, config)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_finished_request_s_policy_is_freed_at_once(tiny, policy):
    """Once a request finishes, nothing holds its policy (and so its K/V): it is freed as the engine drops
    it, not when the interpreter's cycle collector next runs, so a server's memory follows its live
    requests. (A cache and its layers, and InfiniGen and its selector, used to hold each other.)"""
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    prompt = ids(tiny, "The harbour lantern glowed over the copper river.")
    gc.collect()
    # by type: a dead weak proxy among the objects raises on isinstance
    before = {id(o) for o in gc.get_objects() if issubclass(type(o), Policy)}
    gc.disable()
    try:
        run(engine, [(prompt, make_config(policy), GenerationConfig(max_new_tokens=3))])
        alive = [o for o in gc.get_objects() if issubclass(type(o), Policy) and id(o) not in before]
    finally:
        gc.enable()
    assert alive == []


def test_a_prompt_of_whole_cached_blocks_prefills_nothing(tiny):
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    prompt = ids(tiny, "x" * (3 * BLOCK))
    assert len(prompt) == 3 * BLOCK
    config = make_config("dense")
    first = run(engine, [(prompt, config, GREEDY)])[0]
    again = run(engine, [(prompt, config, GREEDY)])[0]
    assert again.stats["prefix_hit_tokens"] == 3 * BLOCK and again.token_ids == first.token_ids
    assert engine.stats()["prefix_hit_tokens"] == 3 * BLOCK
    assert engine.stats()["prefix_miss_tokens"] == 3 * BLOCK


def test_policies_of_one_prefill_family_share_blocks_and_others_do_not(tiny):
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    prompt = ids(tiny, "y" * (4 * BLOCK))
    run(engine, [(prompt, make_config("dense"), GREEDY)])
    offload = run(engine, [(prompt, make_config("offload"), GREEDY)])[0]
    quant = run(engine, [(prompt, make_config("quant"), GREEDY)])[0]
    assert offload.stats["prefix_hit_tokens"] == 4 * BLOCK  # offload's prompt is dense's
    assert quant.stats["prefix_hit_tokens"] == 0  # quant's later chunks attend to its own codes


def test_different_policies_share_decode_steps(tiny):
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, prefix_cache=False))
    prompts = [ids(tiny, "first prompt here"), ids(tiny, "second one"), ids(tiny, "and a third")]
    policies = [make_config("dense"), make_config("h2o"), make_config("quest", budget=0.5)]
    results = run(engine, list(zip(prompts, policies, [GREEDY] * 3, strict=True)))
    assert all(r.stats["batch_size"] > 1 for r in results)
    for prompt, policy, result in zip(prompts, policies, results, strict=True):
        assert result.stats["policy"] == policy_name(policy)
        assert result.token_ids == alone(tiny, prompt, policy)


def policy_name(config) -> str:
    return next(name for name, cls in POLICIES.items() if cls.config_class is type(config))


def test_a_seeded_row_draws_its_own_numbers_whatever_runs_beside_it(tiny):
    seeded = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=3)
    other = GenerationConfig(max_new_tokens=16, temperature=0.8, top_p=0.9)
    config = make_config("dense")
    prompt = ids(tiny, "once upon a time")
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, prefix_cache=False))
    together = run(engine, [(prompt, config, seeded), (ids(tiny, "noise"), config, other)], join_at=[0, 2])
    assert together[0].token_ids == alone(tiny, prompt, config, seeded)


def test_abort_frees_the_sequence_and_bad_requests_fail_before_queueing(tiny):
    engine = Engine(
        tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, prefix_cache=False, kv_memory=2**24)
    )
    seq = engine.add(ids(tiny, "hello there"), make_config("dense"), GenerationConfig(max_new_tokens=50))
    engine.step()
    assert engine.abort(seq).finish_reason == "cancelled"
    assert not engine.has_work and engine.pool.used == 0
    assert engine.abort(seq) is None
    with pytest.raises(InputError, match="empty"):
        engine.add([], make_config("dense"), GREEDY)
    with pytest.raises(InputError, match="context"):
        engine.add([5] * tiny.max_context, make_config("dense"), GREEDY)
    small = Engine(
        tiny,
        EngineConfig(
            block_tokens=BLOCK,
            chunk_tokens=CHUNK,
            kv_memory=3 * block_bytes(tiny.spec, next(tiny.model.parameters()).dtype, BLOCK),
        ),
    )
    with pytest.raises(InputError, match="blocks"):
        small.add([5] * (4 * BLOCK), make_config("dense"), GREEDY)


def test_the_prefix_cache_evicts_least_recently_used_blocks_a_block_after_its_followers():
    pool = BlockPool(4, BLOCK)
    cache = PrefixCache(pool)
    assert pool.grow(1, 2 * BLOCK) and not pool.grow(2, 3 * BLOCK) and pool.held == {1: 2}
    root = PrefixCache.root("m", "dense", BLOCK)
    tokens = list(range(BLOCK))
    first = PrefixEntry(PrefixCache.chain(root, tokens), root, [], None, None)
    second = PrefixEntry(PrefixCache.chain(first.digest, tokens), first.digest, [], None, None)
    other = PrefixEntry(PrefixCache.chain(root, tokens[::-1]), root, [], None, None)
    cache.add(first)
    cache.add(second)
    assert pool.free == 0 and cache.match(root, tokens * 2) == [first, second]
    cache.add(other)  # the pool is full: the least recently used block nothing follows goes (second)
    assert cache.match(root, tokens * 2) == [first] and pool.cached == 2
    assert cache.evictable(keep=frozenset({first.digest})) == 1
    assert cache.evict(2, keep=frozenset({first.digest})) == 1 and cache.match(root, tokens) == [first]
    pool.release(1)
    assert cache.evict(5) == 1 and len(cache) == 0 and pool.used == 0


def test_engine_config_is_checked():
    bad_configs = (
        {"block_tokens": 1},
        {"step_tokens": 0},
        {"max_running": True},
        {"kv_memory": -1},
        {"block_tokens": 48, "chunk_tokens": 32},  # a block would end inside a chunk
        {"compile": "no"},  # a string is not a yes or no
        {"prefix_cache": 1},
    )
    for bad in bad_configs:
        with pytest.raises(InputError):
            EngineConfig(**bad)


def test_a_pool_the_machine_cannot_hold_or_that_holds_no_block_is_refused(tiny):
    """The pool is an account of memory: one larger than the machine has available, or too small for one
    block, is refused when the engine starts, before any request is admitted."""
    with pytest.raises(InputError, match="more than the .* GiB this machine has available"):
        Engine(tiny, EngineConfig(kv_memory=free_memory_bytes() * 4))
    with pytest.raises(InputError, match="holds no block of 128 tokens"):
        Engine(tiny, EngineConfig(block_tokens=128, kv_memory=1))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_questions_sent_together_read_their_document_once(tiny, policy):
    """Neither prompt is cached when both arrive; the one with fewer tokens left reads first, and the other
    takes the blocks it cached meanwhile, into a cache that already holds part of its prompt, instead of
    computing them again (steps run outside inference mode here, as the server's worker runs them)."""
    document = ids(tiny, "copper river lantern " * 20)  # 420 tokens: 26 whole blocks
    prompts = [document + ids(tiny, "First?"), document + ids(tiny, "And the second one?")]
    config = make_config(policy)
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    results = run(engine, [(p, config, GREEDY) for p in prompts])
    assert results[0].stats["prefix_hit_tokens"] == 0
    assert results[1].stats["prefix_hit_tokens"] == len(document) // BLOCK * BLOCK
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == alone(tiny, prompt, config)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_sequence_takes_cached_blocks_into_a_cache_it_has_started(tiny, policy):
    """One chunk a step: the first request reads half a block, the second (fewer tokens left) then reads
    the whole document and caches it, and the first takes the rest of the document from the cache into a
    cache that already holds part of its prompt."""
    document = ids(tiny, "copper river lantern " * 4)  # 84 tokens: five whole blocks
    prompts = [document + ids(tiny, "A longer first question?"), document + ids(tiny, "Short?")]
    config = make_config(policy)
    engine = Engine(
        tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, step_tokens=CHUNK, kv_memory=2**28)
    )
    results = run(engine, [(p, config, GREEDY) for p in prompts], join_at=[0, 1])
    assert 0 < results[0].stats["prefix_hit_tokens"] < len(document)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == alone(tiny, prompt, config)


def test_a_decode_step_hands_off_its_rows_tokens_in_one_read(tiny, monkeypatch):
    """Each row samples on the device with its own settings (greedy, sampled, seeded); the step's new tokens
    then cross to the host together: one read per step, whatever the number of rows."""
    import os
    import sys

    import infinikv

    package = os.path.dirname(infinikv.__file__) + os.sep
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    sampled = GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    for text, sampling in (
        ("one prompt", GREEDY),
        ("another, longer prompt here", sampled),
        ("a third", GREEDY),
    ):
        engine.add(ids(tiny, text), make_config("dense"), sampling)
    while (
        len(engine.running) < 3 or engine.waiting or any(s.phase.name != "DECODING" for s in engine.running)
    ):
        engine.step()
    reads = []

    def counted(name, method):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(package):
                reads.append((name, os.path.basename(caller.co_filename)))
            return method(self, *args, **kwargs)

        return read

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    outputs = engine.step()
    assert len(outputs) == 3 and reads == [("tolist", "engine.py")]


def test_a_compiled_engine_compiles_its_decode_step_before_the_first_request():
    """With ``compile=True`` the engine's first prepare compiles the decode step (a warm-up generation at one
    row and at two), so that no request's step compiles: requests at one, two and three rows, of other
    lengths, run on what the warm-up compiled; and the warm-up leaves nothing behind."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # what other tests compiled must not be reused here
    loaded = tiny_model("llama")
    engine = Engine(loaded, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, compile=True))
    before, stats = counters["stats"]["unique_graphs"], engine.stats()
    engine.prepare(make_config("dense"))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before  # the warm-up compiled
    assert not engine.has_work and engine.stats() == stats  # and left no blocks, entries or counts behind
    prompts = [ids(loaded, text) for text in ("a first request", "then a second one", "and a third, longer")]
    for rows in (1, 2, 3):
        run(
            engine,
            [(prompt, make_config("dense"), GenerationConfig(max_new_tokens=6)) for prompt in prompts[:rows]],
        )
    assert counters["stats"]["unique_graphs"] == graphs


def test_an_engine_step_projects_the_look_ahead_queries_once_for_every_row(tiny, monkeypatch):
    """InfiniGen's look-ahead projects a layer's query from each row's input: a step of three rows projects
    it once for all of them (and rotates it once), not once per row: each layer's queries are asked for
    once a step, its query weights are multiplied at most twice (the model's own projection and the
    look-ahead's, or once where one serves both: ``invariant.project_beside``, ``project_ahead``), and
    the rotary embedding runs twice."""
    from infinikv import invariant, spec

    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    for text in ("one prompt", "another, longer prompt here", "a third"):
        engine.add(ids(tiny, text), make_config("infinigen"), GenerationConfig(max_new_tokens=12))
    for _ in range(20):  # until all three decode
        if len(engine.running) == 3 and all(s.phase.name == "DECODING" for s in engine.running):
            break
        engine.step()
    layer_of = {id(attention.q_proj.weight): layer for layer, attention in enumerate(tiny.spec.attention)}
    products: Counter = Counter()
    product = invariant.linear_rows_alone

    def counted_product(x, weight, bias=None):
        products[layer_of.get(id(weight))] += 1
        return product(x, weight, bias)

    monkeypatch.setattr(invariant, "linear_rows_alone", counted_product)
    queried: Counter = Counter()  # a layer's queries projected for the policies (SharedQueries)
    rotated = spec.ModelSpec.rotated_query

    def counted_query(self, layer, *args):
        queried[layer] += 1
        return rotated(self, layer, *args)

    monkeypatch.setattr(spec.ModelSpec, "rotated_query", counted_query)
    rotary = tiny.model.get_decoder().rotary_emb
    forward, rotations = rotary.forward, []
    monkeypatch.setattr(
        rotary, "forward", lambda *args, **kwargs: rotations.append(1) or forward(*args, **kwargs)
    )
    assert len(engine.step()) == 3
    assert queried and set(queried.values()) == {1}
    assert all(products[layer] in (1, 2) for layer in range(tiny.spec.num_layers))
    assert len(rotations) == 2


def test_an_engine_step_sizes_every_row_s_copier_by_all_its_rows(tiny, monkeypatch):
    """Where a step's copies and look-aheads run depends on what all its rows copied
    (``KVPool.size_step``), not each row alone: the step's pools are sized together, once a step."""
    told: list[list[int]] = []
    monkeypatch.setattr(KVPool, "size_step", staticmethod(lambda pools: told.append(sorted(map(id, pools)))))
    prompts = [torch.tensor([ids(tiny, text)]) for text in ("one prompt", "another, longer prompt here")]
    with ForcedRows(tiny, [make_config("h2o")] * 2) as forced:
        for row, prompt in enumerate(prompts):
            forced.prefill(row, prompt, CHUNK)
        forced.step([0, 1], torch.tensor([[1], [2]]))
        assert told == [sorted(id(driver.cache.policy.pool()) for driver in forced.drivers)]


@pytest.mark.parametrize("knobs", [{}, {"budget": 0.1, "min_tokens": 0}])
def test_infinigen_rows_of_a_step_are_rehearsed_together_and_choose_as_alone(tiny, knobs, monkeypatch):
    """An engine step's InfiniGen rows look ahead together (``InfiniGenPolicy.plan_rows``): a layer's
    rehearsal scores the rows of one form in one product, and each row still gets its tokens alone, whatever
    joins beside it and however long its prompt."""
    from infinikv.policies.infinigen import together as infinigen

    together: Counter = Counter()
    choose_together = infinigen.choose_together

    def counted(selectors, layer, queries, widths):
        together[len(selectors)] += 1
        return choose_together(selectors, layer, queries, widths)

    monkeypatch.setattr(infinigen, "choose_together", counted)
    config = make_config("infinigen", **knobs)
    texts = [
        "The harbour lantern glowed over the copper river while the falcon watched. " * k for k in (3, 1, 2)
    ]
    prompts = [ids(tiny, text) for text in texts]
    engine = Engine(tiny, EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, kv_memory=2**28))
    results = run(engine, [(prompt, config, GREEDY) for prompt in prompts], join_at=[0, 1, 4])
    assert together and max(together) >= 2
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == alone(tiny, prompt, config)


def alike_prompts(tiny) -> list[list[int]]:
    """Three prompts of one length and different text, then one half as long."""
    texts = [
        "The harbour lantern glowed over the copper river while the falcon watched. " * 3,
        "A quiet orchard kept its pears until the frost came down from the hills at dusk. " * 3,
        "Seven sailors counted the stars and argued about the tide until the bell rang. " * 3,
    ]
    length = min(len(ids(tiny, text)) for text in texts)
    return [ids(tiny, text)[:length] for text in texts] + [ids(tiny, texts[0])[: length // 2]]


@pytest.mark.parametrize("knobs", [{}, {"budget": 0.3, "min_tokens": 0, "page_size": 4}])
def test_quest_rows_of_a_step_choose_together_and_as_alone(tiny, knobs, monkeypatch):
    """An engine step's Quest rows pick their pages in one pass (``ScoredPolicy.take_query_rows``); each row
    still gets its tokens alone, and counts the bytes it counts alone, whatever its length and budget and
    whatever the rows beside it hold."""
    from infinikv.policies.quest import QuestPolicy

    together: Counter = Counter()
    score_rows = QuestPolicy.score_rows.__func__

    def counted(cls, policies, layer):
        together[len(policies)] += 1
        return score_rows(cls, policies, layer)

    monkeypatch.setattr(QuestPolicy, "score_rows", classmethod(counted))
    quest = make_config("quest", **knobs)
    prompts = alike_prompts(tiny)
    config = EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, prefix_cache=False, kv_memory=2**28)
    wider = make_config("quest", **{**knobs, "budget": 0.5})  # another budget: chosen with the others
    requests = [(prompt, quest, GREEDY) for prompt in prompts] + [(prompts[1], wider, GREEDY)]
    results = run(Engine(tiny, config), requests, join_at=[0, 0, 0, 1, 0])
    assert max(together, default=0) >= 4  # rows picked in one pass
    costs = ("bytes_h2d", "bytes_h2d_on_demand", "selector_bytes", "mean_tokens_attended")
    for request, result in zip(requests, results, strict=True):
        by_itself = run(Engine(tiny, config), [request])[0]
        assert result.token_ids == by_itself.token_ids
        assert [result.stats[name] for name in costs] == [by_itself.stats[name] for name in costs]


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
@pytest.mark.parametrize("knobs", [{}, {"budget": 0.3, "min_tokens": 0, "heavy_ratio": 0.7}])
def test_h2o_rows_of_a_step_attend_together_and_as_alone(model, knobs, monkeypatch, request):
    """An engine step's H2O rows whose kept sets are as wide attend and evict as one
    (``H2OPolicy.attend_rows``); each row's logits are still those it gets alone, bit for bit, and it
    counts the bytes it counts alone, whatever its length, budget and tokens seen and whatever the rows
    beside it hold."""
    from infinikv.policies.h2o import H2OPolicy

    tiny = request.getfixturevalue(model)  # Gemma-3: its sliding layers' masks stack too
    together: Counter = Counter()
    decode_together = H2OPolicy.decode_together.__func__

    def counted(cls, policies, layer, rows, scaling):
        together[len(policies)] += 1
        return decode_together(cls, policies, layer, rows, scaling)

    monkeypatch.setattr(H2OPolicy, "decode_together", classmethod(counted))
    h2o, wider = make_config("h2o", **knobs), make_config("h2o", **{**knobs, "budget": 0.5})
    prompts = alike_prompts(tiny)
    prompts.append(prompts[1])  # with another budget: another width
    configs = [h2o, h2o, h2o, h2o, wider]
    starts = [0, 0, 3, 1, 0]  # the third starts late: as wide as the first two, with fewer tokens seen
    costs = ("bytes_h2d", "bytes_h2d_on_demand", "selector_bytes", "mean_tokens_attended")

    def feed(rows: list[int]) -> tuple[dict[int, list[torch.Tensor]], list[list]]:
        logits: dict[int, list[torch.Tensor]] = {r: [] for r in rows}
        with ForcedRows(tiny, [configs[r] for r in rows]) as forced:
            for i, r in enumerate(rows):
                forced.prefill(i, torch.tensor([prompts[r]]), CHUNK)
            for step in range(12):
                now = [i for i, r in enumerate(rows) if starts[r] <= step]
                if now:
                    tokens = torch.tensor([[(5 * step + rows[i]) % 90 + 3] for i in now])
                    for i, out in zip(now, forced.step(now, tokens), strict=True):
                        logits[rows[i]].append(out)
            return logits, [[driver.stats()[name] for name in costs] for driver in forced.drivers]

    logits, counted_costs = feed(list(range(len(prompts))))
    assert max(together, default=0) >= 3  # rows attended in one pass
    for r in range(len(prompts)):
        own_logits, own_costs = feed([r])
        assert all(torch.equal(a, b) for a, b in zip(logits[r], own_logits[r], strict=True))
        assert counted_costs[r] == own_costs[0]


def test_a_step_that_brings_two_stop_strings_cuts_at_the_earliest():
    """When one token's text completes two stop strings, the answer ends before the earlier one in the text,
    whichever the request listed first."""
    from infinikv.engine.sequence import Sequence

    texts = {1: "x", 2: "xab"}  # the second token adds "ab": both stop strings at once
    sampling = GenerationConfig(max_new_tokens=8, stop=("b", "a"))
    seq = Sequence(0, [5], make_config("dense"), sampling, torch.Generator(), b"")
    for token in (1, 2):
        seq.advance(token, set(), lambda ids, **_: texts[len(ids)])
    assert seq.finish == "stop" and seq.text == "x"


@pytest.mark.parametrize("step_tokens", [CHUNK, 256], ids=["a-chunk-a-step", "whole-prompts"])
def test_a_preempted_prompt_is_counted_once_by_the_prefix_cache(tiny, step_tokens):
    """A preempted sequence reads its prompt again (from the blocks it cached, or by prefilling), whether
    it was preempted while decoding or while its prompt was still being read; the prefix cache's hit and
    miss counters, and the request's own hits, count each prompt token once."""
    document = ids(tiny, "copper river lantern " * 4)
    # the second prompt is long enough to be still read, a chunk a step, when the first needs a block
    prompts = [document + ids(tiny, "First?"), document * 3 + ids(tiny, "And the second one?")]
    new = 40
    per_block = block_bytes(tiny.spec, next(tiny.model.parameters()).dtype, BLOCK)
    admitted = sum(-(-(len(p) + 1) // BLOCK) for p in prompts)
    memory = (admitted + 1) * per_block
    config = EngineConfig(block_tokens=BLOCK, chunk_tokens=CHUNK, step_tokens=step_tokens, kv_memory=memory)
    engine = Engine(tiny, config)
    sampling = GenerationConfig(max_new_tokens=new)
    results = run(engine, [(p, make_config("dense"), sampling) for p in prompts], join_at=[0, 2])
    assert sum(result.stats["preemptions"] for result in results) >= 1
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] + stats["prefix_miss_tokens"] == sum(map(len, prompts))
    assert stats["prefix_hit_tokens"] == sum(result.stats["prefix_hit_tokens"] for result in results)
