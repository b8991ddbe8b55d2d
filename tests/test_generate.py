"""Engine, cache and pool on tiny random models: equivalence with transformers, batching, accounting."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from infinikv import GenerationConfig, Generator, InfinikvCache, copiers
from infinikv.errors import InputError, PolicyError
from infinikv.forward import Driver, chunk_bounds, prompt_chunks
from infinikv.kvpool import KVPool
from infinikv.testing import tiny_model

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "hi", "A longer prompt, of medium size."]


def reference_tokens(loaded, prompt: str, new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own generate with its default cache."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        enc = loaded.tokenizer(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    finally:
        model.set_attn_implementation(previous)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def run(loaded, policy, prompts, new_tokens=24, **kwargs):
    config = GenerationConfig(max_new_tokens=new_tokens, **kwargs)
    return Generator(loaded, policy).generate(prompts, config)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", ["dense", "offload"])
def test_greedy_matches_transformers_generate(kind, policy):
    loaded = tiny_model(kind)
    prompt = PROMPTS[0] * 4  # longer than the tiny gemma3's sliding window
    expected = reference_tokens(loaded, prompt, 32)
    got = run(loaded, policy, [prompt], 32)[0]
    assert got.token_ids == expected


@pytest.mark.parametrize("policy", ["dense", "offload"])
def test_batch_rows_match_single_runs(tiny, policy):
    batched = run(tiny, policy, PROMPTS)
    for prompt, result in zip(PROMPTS, batched, strict=True):
        alone = run(tiny, policy, [prompt])[0]
        assert result.token_ids == alone.token_ids
        assert result.stats["prompt_tokens"] == len(tiny.tokenizer(prompt)["input_ids"])


def test_chunked_prefill_gives_same_tokens(tiny):
    whole = run(tiny, "dense", [PROMPTS[0]], prefill_chunk=4096)[0]
    chunked = run(tiny, "offload", [PROMPTS[0]], prefill_chunk=16)[0]
    assert chunked.token_ids == whole.token_ids


def test_offload_moves_the_whole_cache_every_step(tiny):
    """Each row has a cache of its own (no left padding): every step copies that row's whole KV."""
    spec = tiny.spec
    prompts = PROMPTS[:2]
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    for prompt, result in zip(prompts, run(tiny, "offload", prompts, new_tokens=10), strict=True):
        length = len(tiny.tokenizer(prompt)["input_ids"])
        read_back = sum(begin for begin, _ in prompt_chunks(length, GenerationConfig().prefill_chunk))
        steps = result.stats["decode_steps"]
        assert steps == 9  # each later prompt chunk reads back the ones before it, each step everything
        decode = sum(per_token * (length + step) for step in range(steps))
        assert result.stats["bytes_h2d"] == per_token * read_back + decode
        assert result.stats["kv_bytes_host"] == per_token * (length + steps)
    dense = run(tiny, "dense", prompts, new_tokens=10)[0]
    assert dense.stats["bytes_h2d"] == 0 and dense.stats["kv_bytes_host"] == 0


def test_cache_is_a_drop_in_for_generate(tiny):
    prompt = PROMPTS[0]
    expected = reference_tokens(tiny, prompt, 16)
    enc = tiny.tokenizer(prompt, return_tensors="pt")
    cache = InfinikvCache(tiny.model, "offload")
    out = tiny.model.generate(**enc, cache=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out[0, enc["input_ids"].shape[1] :].tolist() == expected
    assert cache.stats()["bytes_h2d"] > 0


def test_sampling_is_reproducible_and_top_p_floor_is_greedy(tiny):
    first = run(tiny, "dense", [PROMPTS[1]], temperature=1.0, top_p=0.9, seed=7)[0]
    again = run(tiny, "dense", [PROMPTS[1]], temperature=1.0, top_p=0.9, seed=7)[0]
    other = run(tiny, "dense", [PROMPTS[1]], temperature=1.0, top_p=0.9, seed=8)[0]
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    greedy = run(tiny, "dense", [PROMPTS[1]])[0]
    tiny_p = run(tiny, "dense", [PROMPTS[1]], temperature=1.0, top_p=1e-6, seed=3)[0]
    assert tiny_p.token_ids == greedy.token_ids
    unseeded = [run(tiny, "dense", [PROMPTS[1]], temperature=1.0)[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # no seed: a fresh random stream per call


def test_stop_string_and_streaming(tiny):
    full = run(tiny, "dense", [PROMPTS[0]], new_tokens=20)[0]
    stop = full.text[5:8]
    assert len(stop) == 3
    pieces: list[str] = []
    config = GenerationConfig(max_new_tokens=20, stop=(stop,))
    result = Generator(tiny, "dense").generate([PROMPTS[0]], config, on_text=lambda _r, p: pieces.append(p))[
        0
    ]
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == result.text


def test_eos_ends_a_sequence(tiny):
    eos = tiny.tokenizer.eos_token_id
    generator = Generator(tiny, "dense")
    first = run(tiny, "dense", [PROMPTS[2]], new_tokens=5)[0].token_ids[0]
    generator.engine.eos_ids = {first}
    result = generator.generate([PROMPTS[2]], GenerationConfig(max_new_tokens=5))[0]
    assert result.finish_reason == "eos" and result.token_ids == []
    assert eos is not None


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([""], {}, "empty"),
        (["   "], {}, "empty"),
        (["x" * 600], {"max_new_tokens": 10}, "exceeds the model's context of 512"),
        ([[]], {}, "empty"),
        ([[10**9]], {}, "token ids must be whole numbers"),
        ([[5, -1]], {}, "token ids must be whole numbers"),
        ([[1.5]], {}, "token ids must be whole numbers"),
        ([torch.tensor([5, 6])], {}, "a string or a list of token ids, got a Tensor"),
        ([b"hello"], {}, "a string or a list of token ids, got a bytes"),
    ],
)
def test_bad_prompts(prompts, kwargs, message):
    loaded = tiny_model(max_context=512)
    with pytest.raises(InputError, match=message):
        Generator(loaded, "dense").generate(prompts, GenerationConfig(**kwargs))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda g: g.generate(["hi"], None), "config must be a GenerationConfig, got NoneType"),
        (lambda g: g.generate(None), "prompts must be a string or an iterable of prompts, got NoneType"),
        (lambda g: g.generate(["hi"], on_text=5), "on_text must be callable"),
        (lambda g: g.generate(["hi"], cancelled="no"), "cancelled must be callable"),
        (lambda g: g.generate(["hi"], row_max_new_tokens=[]), "one limit per prompt"),
        (lambda g: Generator(None), "loaded must be a model from infinikv.models.load, got NoneType"),
        (lambda g: Generator("smollm2-135m"), "loaded must be a model from infinikv.models.load, got str"),
    ],
)
def test_bad_arguments_are_input_errors(tiny, call, message):
    """A wrong type for an argument is an InputError naming it, before any model work (it was an
    AttributeError or TypeError from deep inside, or, for a callback, from the middle of a run)."""
    with pytest.raises(InputError, match=message):
        call(Generator(tiny, "dense"))


@pytest.mark.parametrize(
    "kwargs", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_bad_generation_numbers(kwargs):
    with pytest.raises(InputError):
        GenerationConfig(**kwargs)


def test_unknown_policy_and_knob(tiny):
    with pytest.raises(PolicyError, match="unknown policy"):
        Generator(tiny, "nonesuch")
    with pytest.raises(PolicyError, match="has no knob"):
        Generator(tiny, "dense", budget=0.5)


def test_token_id_prompts_equal_their_text(tiny, monkeypatch):
    """A prompt given as the tokenizer's ids generates what its text does, alone or beside text prompts, and
    is not tokenised again; an empty one is refused like empty text."""
    ids = [tiny.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    texts = run(tiny, "dense", PROMPTS, 8)
    mixed = run(tiny, "dense", [ids[0], PROMPTS[1], ids[2]], 8)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in texts]
    assert [r.stats["prompt_tokens"] for r in mixed] == [len(row) for row in ids]
    seen: list[tuple] = []
    tokenize = type(tiny.tokenizer).__call__
    monkeypatch.setattr(
        type(tiny.tokenizer),
        "__call__",
        lambda self, *args, **kw: seen.append(args) or tokenize(self, *args, **kw),
    )
    alone = run(tiny, "dense", [ids[1]], 8)[0]
    monkeypatch.undo()
    assert alone.token_ids == texts[1].token_ids and seen == []
    with pytest.raises(InputError, match="prompt 2 is empty"):
        run(tiny, "dense", [ids[0], []], 2)


def test_pool_append_grow_fetch_and_gather():
    pool = KVPool(1, torch.device("cpu"), overlap="thread")
    chunks = [torch.randn(2, 3, n, 4) for n in (200, 100, 1)]
    for chunk in chunks:
        pool.append(0, chunk, -chunk)
    whole = torch.cat(chunks, dim=2)
    keys, values = pool.fetch(0).wait()
    assert torch.equal(keys, whole) and torch.equal(values, -whole)
    index = torch.tensor([[[0, 5, 300]] * 3] * 2)
    keys, _ = pool.fetch(0, index).wait()
    assert torch.equal(keys, whole[:, :, [0, 5, 300]])
    assert pool.counters.bytes_h2d == 2 * whole.numel() * 4 + 2 * 2 * 3 * 3 * 4 * 4
    assert pool.counters.bytes_d2h == 2 * whole.numel() * 4
    pool.close()


def test_pool_fetches_named_tensors_in_one_copy():
    """Side tensors on their own slot axis are copied with the K/V they belong to, in the order asked; the
    fetch buffer counts the K/V."""
    pool = KVPool(1, torch.device("cpu"), overlap="thread")
    k, scale = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 2, 1)  # one scale per 4 tokens
    pool.append(0, k, -k, scale=scale)
    assert (pool.length(0), pool.length(0, "scale")) == (8, 2)
    rows = torch.tensor([[[1, 6]] * 2])
    keys, values, scales = pool.fetch(0, parts={"keys": rows, "values": rows, "scale": None}).wait()
    assert torch.equal(keys, k[:, :, [1, 6]]) and torch.equal(values, -keys) and torch.equal(scales, scale)
    pool.drain()
    assert pool.counters.copies == 1
    assert pool.counters.bytes_h2d == (2 * 2 * 2 * 4 + 2 * 2) * 4
    assert pool.counters.peak_bytes == 2 * 2 * 2 * 4 * 4
    assert pool.nbytes() == (2 * k.numel() + scale.numel()) * 4
    pool.close()
    keys, _ = pool.fetch(0).wait()  # after close (statistics read after a run): on the calling thread
    assert torch.equal(keys, k)
    pool.drain()


@pytest.fixture
def free_cores(monkeypatch):
    """Set how many cores the decode thread's torch threads leave free, whatever the machine has."""

    def leave(free: int) -> None:
        monkeypatch.setattr(copiers, "USABLE_CORES", torch.get_num_threads() + free)

    return leave


@pytest.mark.parametrize(("overlap", "order"), [("thread", ["ahead", "own"]), ("none", ["own", "ahead"])])
def test_the_copier_orders_a_layer_and_the_look_ahead(overlap, order, free_cores):
    """A worker gets the next layer's look-ahead first, to run beside the layer's own choice; without one
    the layer's own copy goes first, so it does not queue behind the next layer's."""
    free_cores(1)
    pool, ran = KVPool(1, torch.device("cpu"), overlap=overlap), []
    pool.ahead(lambda: None).wait()  # layer 0's look-ahead: the pool now has work for a worker
    pool.copier.in_order(lambda: ran.append("own"), lambda: ran.append("ahead"))
    assert ran == order
    pool.close()


def test_pools_share_the_workers_of_the_free_cores(free_cores):
    """The decode thread's torch threads take their cores first; the pools that queue work share the
    process's workers, one per free core, given in turn, each pool keeping the one it was given (its work
    stays in order). A pool closed, or without a free core, runs its work at once, after what it queued
    before."""
    first, second, third, fourth = (KVPool(1, torch.device("cpu"), overlap="thread") for _ in range(4))

    def worker_of(pool: KVPool) -> str | None:
        return pool.ahead(lambda: threading.current_thread().name if copiers.on_worker() else None).wait()

    free_cores(1)
    assert worker_of(first) is not None and worker_of(first) == worker_of(second)
    first.close()
    assert worker_of(first) is None
    ran = []
    second.ahead(lambda: (time.sleep(0.2), ran.append("queued")))
    free_cores(0)
    second.ahead(lambda: ran.append("at once"))
    assert ran == ["queued", "at once"] and worker_of(second) is None
    free_cores(2)
    ran.clear()
    third.copier.in_order(lambda: ran.append("own"), lambda: ran.append("ahead"))
    assert ran == ["ahead", "own"]
    workers = {worker_of(third), worker_of(fourth)}  # two free cores: one worker each, in turn
    assert None not in workers and len(workers) == 2
    for pool in (second, third, fourth):
        pool.close()


def test_a_step_that_copies_little_keeps_its_work_on_the_decode_thread(free_cores, monkeypatch):
    """A decode step whose rows copied less a layer in their step before than ``WORKER_FROM_BYTES`` runs its
    look-aheads and copies at once, after what was queued before (order kept); a step that copied that much
    queues them again. A step's pools are sized by what they copied together since the step before, a
    prompt chunk's copy of the past left out."""
    free_cores(1)
    monkeypatch.setattr(copiers, "WORKER_FROM_BYTES", 1000)
    pool, other = (KVPool(2, torch.device("cpu"), overlap="thread") for _ in range(2))
    ran = []
    k = torch.randn(1, 2, 25, 5)  # 1,000 bytes of keys, as many of values

    def on_worker() -> bool:
        return pool.ahead(copiers.on_worker).wait()

    for layer in range(2):
        pool.append(layer, k, k)
        other.append(layer, k, k)
    pool.extend(0, k, k)  # a prompt chunk: copies the 2,000 bytes before it
    KVPool.size_step([pool])
    assert not on_worker()
    pool.fetch(1).wait()
    KVPool.size_step([pool])  # 2,000 bytes over 2 layers
    assert on_worker()
    pool.ahead(lambda: (time.sleep(0.2), ran.append("queued")))
    KVPool.size_step([pool])  # nothing copied since
    pool.ahead(lambda: ran.append("at once"))
    assert ran == ["queued", "at once"] and not on_worker()
    ran.clear()
    pool.copier.in_order(lambda: ran.append("own"), lambda: ran.append("ahead"))
    assert ran == ["own", "ahead"]
    pool.fetch(0, torch.zeros(1, 2, 13, dtype=torch.long)).wait()  # 1,040 bytes: 520 a layer
    other.fetch(1, torch.zeros(1, 2, 12, dtype=torch.long)).wait()  # 960 bytes
    KVPool.size_step([pool, other])  # 2,000 bytes together
    assert on_worker()
    for each in (pool, other):
        each.close()


def test_a_batch_s_decode_steps_are_sized_once_each_and_its_prompt_not(tiny, monkeypatch):
    """A left-padded batch through one cache (``Driver``) sizes each decode step's pool once, at its start;
    its prompt's forward passes size nothing."""
    told: list[list[KVPool]] = []
    monkeypatch.setattr(KVPool, "size_step", staticmethod(told.append))
    cache = InfinikvCache(tiny.model, "offload")
    with Driver(tiny, cache) as driver:
        driver.prefill(torch.tensor([tiny.tokenizer("a prompt of a few tokens")["input_ids"]]), chunk=4)
        assert told == []
        for token in (1, 2):
            driver.step(torch.tensor([token]))
        assert told == [[cache.policy.pool()]] * 2


def test_rows_stop_at_their_own_limits(tiny):
    """Requests that differ only in their limit share a batch: each row equals its own run alone."""
    prompts, limits = PROMPTS[:2], [3, 7]
    generator = Generator(tiny, "dense")
    config = GenerationConfig(max_new_tokens=max(limits))
    batched = generator.generate(prompts, config, row_max_new_tokens=limits)
    for prompt, limit, together in zip(prompts, limits, batched, strict=True):
        alone = generator.generate([prompt], GenerationConfig(max_new_tokens=limit))[0]
        assert together.token_ids == alone.token_ids and len(together.token_ids) <= limit
    with pytest.raises(InputError, match="one limit per prompt"):
        generator.generate(prompts, config, row_max_new_tokens=[3, 8])


def test_rows_of_any_lengths_share_steps_and_keep_their_numbering(tiny):
    """KIVI's key groups follow token slots; with a cache per row (no left padding) rows of any lengths
    share the engine's steps. Rows keep their numbering for streaming, limits and cancellation, and each
    equals its run alone."""
    knobs = dict(bits=4, scheme="kivi", group_size=4, residual=4)
    generator = Generator(tiny, "quant", **knobs)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2] + " ok"]
    lengths = [len(tiny.tokenizer(prompt)["input_ids"]) for prompt in prompts]
    assert len({n % 4 for n in lengths}) > 1
    pieces: dict[int, str] = {}
    limits = [6, 4, 5]
    config = GenerationConfig(max_new_tokens=6)
    batched = generator.generate(
        prompts,
        config,
        on_text=lambda row, piece: pieces.update({row: pieces.get(row, "") + piece}),
        cancelled=lambda row: row == 2,
        row_max_new_tokens=limits,
    )
    for row, (prompt, limit, result) in enumerate(zip(prompts, limits, batched, strict=True)):
        if row == 2:
            assert result.finish_reason == "cancelled" and result.token_ids == []
            continue
        assert result.stats["batch_size"] > 1  # rows 0 and 1 decode together
        alone = generator.generate([prompt], GenerationConfig(max_new_tokens=limit))[0]
        assert result.token_ids == alone.token_ids and pieces.get(row, "") == result.text
    # a seeded row draws from a generator of its own: alone and batched, the same tokens
    sampled = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=5)
    together = [r.token_ids for r in generator.generate(prompts[:2], sampled)]
    assert together == [generator.generate([prompt], sampled)[0].token_ids for prompt in prompts[:2]]


def test_a_bad_prompt_fails_before_any_row_runs(tiny, monkeypatch):
    generator = Generator(tiny, "quant", bits=4, scheme="kivi", group_size=4, residual=4)
    started = []
    monkeypatch.setattr(generator.engine, "add", lambda *args: started.append(args))
    prompts = [PROMPTS[0], PROMPTS[1], "word " * tiny.max_context]
    with pytest.raises(InputError, match="exceeds the model's context"):
        generator.generate(prompts, GenerationConfig(max_new_tokens=4))
    assert started == []


def test_prefill_chunks_are_cut_back_from_the_end():
    """Every chunk but the first is whole, so a left-padded row's tokens fall in the chunks they fall in
    alone; the chunks cover the prompt once, in order."""
    for total, chunk in ((1, 4), (4, 4), (5, 4), (9, 4), (2060, 2048), (3584, 2048)):
        bounds = chunk_bounds(total, chunk)
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(end == begin for (_, end), (begin, _) in zip(bounds[:-1], bounds[1:], strict=True))
        assert all(end - begin == chunk for begin, end in bounds[1:]) and 0 < bounds[0][1] <= chunk
    row = chunk_bounds(2040, 2048)  # alone: one chunk; beside a 2060-token row its padding is 20
    padded = [(max(0, b - 20), e - 20) for b, e in chunk_bounds(2060, 2048) if e > 20]
    assert padded == row
