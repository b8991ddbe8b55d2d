"""The block bounds Quest's pages and InfiniGen's block speculation share (``policies/bounds.py``)."""

from __future__ import annotations

import pytest
import torch

from infinikv.policies.bounds import BlockBounds

BATCH, HEADS, SIZE, DIM = 2, 3, 4, 8
PADDING = [0, 6]  # row 1's first real token is slot 6: its blocks start there


def _written(keys: torch.Tensor, dtype: torch.dtype, outward: bool) -> BlockBounds:
    """Bounds of every block of ``keys`` [batch, kv_heads, slots, dim], left padding excluded."""
    bounds = BlockBounds(SIZE, PADDING, keys.device, dtype=dtype, outward=outward)
    n = keys.shape[2]
    blocks = torch.arange(bounds.count(n)).expand(BATCH, HEADS, -1)
    slots = bounds.slots_of(blocks)
    present = (slots >= 0) & (slots < n) & (slots >= torch.tensor(PADDING)[:, None, None])
    at = slots.clamp(0, n - 1)[..., None].expand(-1, -1, -1, DIM)
    bounds.write(blocks, keys.gather(2, at), present)
    return bounds


@pytest.mark.parametrize(("dtype", "outward"), [(torch.bfloat16, True), (torch.float32, False)])
def test_bounds_bound_every_keys_score(dtype, outward):
    """For any query, the bound of a block, Σ_c max(q_c · max_c, q_c · min_c), is at least the score of
    every real key of the block, whether the bounds are rounded outward into bfloat16 or kept exact."""
    torch.manual_seed(0)
    keys = torch.randn(BATCH, HEADS, 29, DIM) * 3
    bounds = _written(keys, dtype, outward)
    query = torch.randn(BATCH, HEADS, 5, DIM)
    table = bounds.bounds.float()
    high, low = table[..., :DIM], -table[..., DIM:]
    bound = torch.maximum(query[:, :, :, None] * high[:, :, None], query[:, :, :, None] * low[:, :, None])
    bound = bound.sum(dim=-1)  # [batch, kv_heads, queries, blocks]
    slots = torch.arange(29).expand(BATCH, HEADS, -1)
    block = bounds.block_of(slots)
    scores = query @ keys.transpose(2, 3)  # [batch, kv_heads, queries, slots]
    for row, first in enumerate(PADDING):
        own = bound[row].gather(2, block[row, :, None].expand(-1, 5, -1))[..., first:]
        assert bool((own >= scores[row, ..., first:] - 1e-4).all())
        assert bool(bounds.filled[row].gather(1, block[row])[:, first:].all())
    assert not bool(bounds.filled[1, :, 0].any())  # block 0: padding alone


def test_exact_bounds_are_each_pages_own_max_and_min():
    """Kept in the keys' dtype with no rounding, a block's bounds are its real keys' amax and amin, the first
    real token of each row starting a block; the byte count covers the blocks holding a real token."""
    torch.manual_seed(1)
    keys = torch.randn(BATCH, HEADS, 30, DIM, dtype=torch.float16)
    bounds = _written(keys, torch.float16, outward=False)
    for row, first in enumerate(PADDING):
        full = (30 - first) // SIZE
        pages = keys[row, :, first : first + full * SIZE].unflatten(1, (full, SIZE))
        start = bounds.block_at(row, first)
        table = bounds.bounds[row, :, start : start + full]
        assert torch.equal(table[..., :DIM], pages.amax(dim=2))
        assert torch.equal(-table[..., DIM:], pages.amin(dim=2))
    filled = sum(len(range(first, 30, SIZE)) for first in PADDING) * HEADS  # a block per started page
    assert bounds.nbytes() == filled * 2 * DIM * keys.element_size()


def test_widening_token_by_token_equals_writing_the_blocks():
    """Exact bounds widened by one token at a time (``extend``) are those written from all the tokens."""
    torch.manual_seed(2)
    keys = torch.randn(BATCH, HEADS, 30, DIM, dtype=torch.float16)
    whole = _written(keys, torch.float16, outward=False)
    grown = _written(keys[:, :, :23], torch.float16, outward=False)
    for slot in range(23, 30):
        grown.extend(slot, keys[:, :, slot : slot + 1])
    blocks = whole.count(30)
    assert torch.equal(grown.bounds[:, :, :blocks], whole.bounds[:, :, :blocks])
    assert torch.equal(grown.filled[:, :, :blocks], whole.filled[:, :, :blocks])
