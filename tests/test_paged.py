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
    assert arena.free == 0 and len(arena.segments) == 1 and arena.segments[0].count == 3
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


def test_an_engine_gives_every_block_back_when_its_requests_end(tiny):
    from infinikv.engine import Engine, EngineConfig, GenerationConfig
    from infinikv.policies import make_config

    engine = Engine(tiny, EngineConfig(block_tokens=16, chunk_tokens=8, kv_memory=1 << 24))
    prompt = tiny.tokenizer("the pool gives its blocks back " * 6)["input_ids"]
    for name in ("offload", "quest", "h2o", "infinigen"):
        engine.add(prompt, make_config(name), GenerationConfig(max_new_tokens=4))
    most = 0
    while engine.has_work:
        engine.step()
        # positions a sequence stores never exceed the blocks the engine counts for it
        most = max(most, engine.blocks.blocks_in_use())
        assert engine.blocks.blocks_in_use() <= engine.pool.used
    assert most > 0 and engine.blocks.blocks_in_use() == 0
