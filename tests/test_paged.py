"""The paged host pool: blocks from a store, a block table per row, nothing regrown by copying."""

from __future__ import annotations

import pytest
import torch

from infinikv.kvpool import KVPool
from infinikv.paged import BlockStore, OutOfBlocks


def _gathered(reference: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return reference.gather(2, index[..., None].expand(-1, -1, -1, reference.shape[-1]))


@pytest.mark.parametrize("overlap", ["thread", "none"])
@pytest.mark.parametrize("reserve", [0, 4096], ids=["segments", "one-segment"])
def test_a_paged_pool_holds_what_a_tensor_would_through_appends_overwrites_and_eviction(overlap, reserve):
    """Random appends (prompt chunks and single tokens), overwrites and an eviction, checked against a
    plain tensor after every operation; without a reservation the arena grows in several segments, so a
    row's blocks lie in more than one."""
    generator = torch.Generator().manual_seed(0)
    pool = KVPool(1, torch.device("cpu"), overlap=overlap, block_tokens=8)
    if reserve:
        pool.reserve(reserve)
    batch, heads, dim = 2, 3, 4
    keys = torch.empty(batch, heads, 0, dim)
    for step, count in enumerate([5, 11, 1, 1, 30, 1, 17, 1, 64, 1]):
        k = torch.randn(batch, heads, count, dim, generator=generator)
        pool.append(0, k, -k)
        keys = torch.cat([keys, k], dim=2)
        if step == 5:  # overwrite one slot per (row, head)
            slots = torch.randint(0, keys.shape[2], (batch, heads), generator=generator)
            new = torch.randn(batch, heads, 1, dim, generator=generator)
            pool.write_slots(0, slots, new, -new)
            keys.scatter_(2, slots[..., None, None].expand(-1, -1, 1, dim), new)
        if step == 7:  # evict all but some slots, which become slots 0..m-1
            kept = torch.stack([torch.randperm(keys.shape[2], generator=generator)[:20] for _ in range(6)])
            kept = kept.view(batch, heads, 20).sort(dim=-1).values
            pool.keep(0, kept)
            keys = _gathered(keys, kept)
        assert pool.length(0) == keys.shape[2]
        assert torch.equal(pool.keys(0), keys) and torch.equal(pool.values(0), -keys)
        whole_k, whole_v = pool.fetch(0, extra=1).wait()
        assert torch.equal(whole_k[:, :, :-1], keys) and torch.equal(whole_v[:, :, :-1], -keys)
        index = torch.randint(0, keys.shape[2], (batch, heads, 7), generator=generator)
        some_k, some_v = pool.fetch(0, index).wait()
        assert torch.equal(some_k, _gathered(keys, index)) and torch.equal(some_v, -_gathered(keys, index))
    arena = pool.blocks.arena(0, "keys", heads, dim, keys.dtype)
    assert (len(arena.segments) > 1) == (not reserve)
    pool.close()


def test_growth_adds_segments_and_never_moves_a_block():
    pool = KVPool(1, torch.device("cpu"), overlap="none", block_tokens=4)
    pool.append(0, torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
    arena = pool.blocks.arena(0, "keys", 1, 2, torch.float32)
    first = arena.segments[0].tensor
    for _ in range(50):
        pool.append(0, torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    assert arena.segments[0].tensor is first and len(arena.segments) > 1
    pool.close()


def test_pools_drawing_from_one_bounded_store_reuse_each_others_blocks():
    """The engine's store: blocks handed back by one pool go to the next; past its count, an error rather
    than more memory."""
    store = BlockStore(block_tokens=4, blocks=3)
    first = KVPool(2, torch.device("cpu"), overlap="none")
    first.draw_from(store)
    first.append(1, torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4))  # 3 blocks of each part of layer 1
    assert store.blocks_in_use() == 3
    arena = store.arena(1, "keys", 2, 4, torch.float32)
    assert arena.free == 0 and len(arena.segments) == 1 and arena.segments[0].count == 3 + 1  # and a spare
    with pytest.raises(OutOfBlocks):
        first.append(1, torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    first.close()
    assert store.blocks_in_use() == 0
    second = KVPool(2, torch.device("cpu"), overlap="none")
    second.draw_from(store)
    k = torch.randn(1, 2, 12, 4)
    second.append(1, k, -k)
    assert torch.equal(second.keys(1), k) and len(arena.segments) == 1
    with pytest.raises(RuntimeError, match="before it stores anything"):
        second.draw_from(BlockStore())
    second.close()


def test_new_tokens_of_pools_sharing_a_store_are_written_together_as_each_alone():
    """``KVPool.append_rows`` (an engine step's rows): each pool ends as if it had appended its own token,
    across block boundaries, with its own length and counted bytes; a pool of its own store is written
    apart from the others."""
    store = BlockStore(block_tokens=4, blocks=32)
    pools = [KVPool(2, torch.device("cpu"), overlap="none") for _ in range(3)]
    for pool in pools[:2]:
        pool.draw_from(store)
    expected_k, expected_v = [], []
    for length, pool in zip((3, 5, 2), pools, strict=True):
        k, v = torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4)
        pool.append(0, k, v)
        expected_k.append(k)
        expected_v.append(v)
    for _ in range(6):  # the first two pools cross block boundaries at different steps
        new_k = [torch.randn(1, 2, 1, 4) for _ in pools]
        new_v = [torch.randn(1, 2, 1, 4) for _ in pools]
        before = [pool.counters.bytes_d2h for pool in pools]
        KVPool.append_rows(pools, 0, new_k, new_v)
        for r, pool in enumerate(pools):
            expected_k[r] = torch.cat([expected_k[r], new_k[r]], dim=2)
            expected_v[r] = torch.cat([expected_v[r], new_v[r]], dim=2)
            assert torch.equal(pool.keys(0), expected_k[r]) and torch.equal(pool.values(0), expected_v[r])
            assert pool.counters.bytes_d2h - before[r] == 2 * new_k[r].numel() * 4


def test_a_shared_block_is_adopted_without_a_copy_and_copied_before_a_slot_of_it_is_overwritten():
    """The prefix cache's way: one pool lends its blocks, another adopts them (the replayed appends write
    nothing), and an overwrite in the adopter copies the block first, leaving the lender's tokens as they
    were; a block goes back to the store only when its last holder gives it back."""
    store = BlockStore(block_tokens=4, blocks=16)
    lender, adopter = (KVPool(1, torch.device("cpu"), overlap="none") for _ in range(2))
    lender.draw_from(store)
    adopter.draw_from(store)
    k = torch.randn(1, 2, 8, 3)
    lender.append(0, k, -k)
    held = {(name, i): lender.share(0, name, i) for name in ("keys", "values") for i in range(2)}
    for (name, _), block in sorted(held.items(), key=lambda item: item[0][1]):
        adopter.adopt(0, name, lender.arena(0, name), block)
    written = adopter.counters.bytes_d2h
    adopter.append(0, k[:, :, :4], -k[:, :, :4])  # the replayed calls, a chunk at a time
    adopter.append(0, k[:, :, 4:], -k[:, :, 4:])
    assert adopter.counters.bytes_d2h == written and store.blocks_in_use() == 2  # nothing new stored
    new = torch.randn(1, 2, 1, 3)
    adopter.append(0, new, -new)  # past the adopted blocks: a block of its own
    assert torch.equal(adopter.keys(0), torch.cat([k, new], dim=2))
    adopter.write_slots(0, torch.tensor([[1, 6]]), new, -new)
    assert torch.equal(lender.keys(0), k) and torch.equal(lender.values(0), -k)
    expected = torch.cat([k, new], dim=2)
    expected[0, 0, 1], expected[0, 1, 6] = new[0, 0, 0], new[0, 1, 0]
    assert torch.equal(adopter.keys(0), expected) and torch.equal(adopter.values(0), -expected)
    # an eviction down to fewer slots than were adopted: later tokens are stored, not taken as adopted
    kept = torch.tensor([[[0, 2, 8], [1, 3, 8]]])
    adopter.keep(0, kept)
    after = torch.randn(1, 2, 2, 3)
    adopter.append(0, after, -after)
    expected = torch.cat([expected.gather(2, kept[..., None].expand(-1, -1, -1, 3)), after], dim=2)
    assert torch.equal(adopter.keys(0), expected) and torch.equal(adopter.values(0), -expected)
    lender.close()
    adopter.close()
    assert store.blocks_in_use() == 2  # the cache's hold
    for (name, _), block in held.items():
        lender.arena(0, name).give_back([block])
    assert store.blocks_in_use() == 0


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_an_engine_gives_every_block_back_when_its_requests_end(tiny, prefix_cache):
    """Sequences draw their blocks from the engine's store and give them back when they end; what stays is
    the prefix cache's entries, one block per (layer, part) each, until they are evicted."""
    from infinikv.engine import Engine, EngineConfig, GenerationConfig
    from infinikv.policies import make_config

    config = EngineConfig(block_tokens=16, chunk_tokens=8, kv_memory=1 << 24, prefix_cache=prefix_cache)
    engine = Engine(tiny, config)
    prompt = tiny.tokenizer("the pool gives its blocks back " * 6)["input_ids"]
    for name in ("offload", "quest", "h2o", "infinigen", "dense", "quant"):
        engine.add(prompt, make_config(name), GenerationConfig(max_new_tokens=4))
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, engine.blocks.blocks_in_use())
        assert engine.blocks.blocks_in_use() <= engine.pool.used  # never more than the engine counts
    assert most > 0
    cached = len(engine.prefixes) if prefix_cache else 0
    assert engine.blocks.blocks_in_use() == engine.pool.cached == cached
    if prefix_cache:
        engine.prefixes.evict(engine.pool.cached)
        assert engine.blocks.blocks_in_use() == 0


@pytest.mark.parametrize(
    "knobs",
    [
        {"policy": "infinigen", "capacity": 170},  # overwrites slots of adopted blocks as it grows
        {"policy": "infinigen", "capacity": 0.5},  # evicts adopted blocks at its first step, then appends
        {"policy": "h2o"},  # evicts the prompt into fresh blocks at its first step
        {"policy": "quest"},
        {"policy": "dense"},  # no host pool: copies the cached blocks
        {"policy": "quant", "bits": 4},
    ],
    ids=lambda knobs: "-".join(str(v) for v in knobs.values()),
)
def test_requests_sharing_cached_blocks_get_their_tokens_alone_and_leave_the_blocks_as_they_were(tiny, knobs):
    """Three requests on one document, one after another: the second and third start from the first's
    cached blocks (adopted or copied), and each gets the tokens it gets alone; the third's equal the first's,
    so nothing the second did (eviction included) changed a shared block."""
    from infinikv.engine import Engine, EngineConfig, GenerationConfig
    from infinikv.policies import make_config

    knobs = dict(knobs)
    config = make_config(knobs.pop("policy"), **knobs)
    document = tiny.tokenizer("The lantern over the copper river glowed all night. " * 3)["input_ids"]
    prompts = [document + tiny.tokenizer(q)["input_ids"] for q in ("Who watched?", "Why?", "Who watched?")]
    sampling = GenerationConfig(max_new_tokens=16)
    engine = Engine(tiny, EngineConfig(block_tokens=16, chunk_tokens=8, kv_memory=1 << 26))
    results = []
    for prompt in prompts:
        engine.add(prompt, config, sampling)
        while engine.has_work:
            results += [out.result for out in engine.step() if out.result is not None]
    for prompt, result in zip(prompts, results, strict=True):
        single = Engine(tiny, EngineConfig(block_tokens=16, chunk_tokens=8, prefix_cache=False))
        single.add(prompt, config, sampling)
        while single.has_work:
            alone = [out.result for out in single.step() if out.result is not None]
        assert result.token_ids == alone[0].token_ids
    assert results[1].stats["prefix_hit_tokens"] >= 32 and results[2].stats["prefix_hit_tokens"] >= 32
    assert results[2].token_ids == results[0].token_ids
