"""InfiniGen's host loop for int8 partial keys (``infinigen/scores_kernel.py``) gives the speculated scores
of :func:`rehearsal.speculative_scores`' tensor path bit for bit: the pair order of its sums (checked against
that order written as tensor operations, on any CPU, and against the bfloat16 product itself on a CPU
whose product follows it), the rounding to bfloat16, the scales, the hidden slots and the group's max."""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from infinikv.policies.base import group_relative_max
from infinikv.policies.infinigen import rehearsal

pytest.importorskip("numba")


def _draw(generator: torch.Generator, columns: int, least: int = 1) -> tuple[torch.Tensor, ...]:
    """A partial query whose columns span 2^-8..2^8, two of them large products that cancel (so the order
    of the float32 sums shows in the last bits of many scores), int8 keys as a view of a wider table (slots
    not contiguous from one column to the next), their float16 scales, and hidden slots (one head wholly
    hidden in some draws); at least ``least`` slots, a quarter of the draws over more than two of the loop's
    tiles, query heads in a group up to 7 (three at a time, then one at a time), the query in float32 or
    bfloat16, the scales a view of a wider table as well."""
    from infinikv.policies.infinigen.scores_kernel import TILE  # numba's (importorskip below)

    rows, heads = int(torch.randint(1, 4, (1,), generator=generator)), 3
    group = int(torch.randint(min(least, 3), 8, (1,), generator=generator))
    longest = 2 * TILE + 300 if bool(torch.rand(1, generator=generator) < 0.25) else 700
    n = int(torch.randint(least, longest, (1,), generator=generator))
    magnitude = torch.exp2(torch.randint(-8, 9, (rows, heads, group, columns), generator=generator).float())
    query = torch.randn(rows, heads, group, columns, generator=generator) * magnitude
    table = torch.randint(-127, 128, (rows, heads, columns, n + 9), dtype=torch.int8, generator=generator)
    if columns >= 4:  # two large products that cancel, in two pairs: what the sums between them lost shows
        first = int(torch.randint(0, columns - 2, (1,), generator=generator))
        second = int(torch.randint(first // 2 * 2 + 2, columns, (1,), generator=generator))
        query[..., first] *= 2**10
        query[..., second] = -query[..., first]
        table[:, :, second] = table[:, :, first]
    keys = table[..., :n]
    scale = (torch.rand(rows, heads, 1, n + 5, generator=generator) * 0.05).to(torch.float16)[..., :n]
    real = torch.rand(rows, heads, n, generator=generator) > 0.2
    if bool(torch.rand(1, generator=generator) < 0.3):
        real[0, 1] = False
    dtype = (torch.float32, torch.bfloat16)[int(torch.randint(0, 2, (1,), generator=generator))]
    return query.to(dtype), keys, scale, real


def _pair_order(
    query: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """The scores as the module docstring of ``scores_kernel`` defines them, in tensor operations: float32
    sums of exact products, each pair's odd column first, rounded to bfloat16."""
    products = query.bfloat16().float()[..., None] * keys.float()[:, :, None]  # [rows, heads, group, k, n]
    total = torch.zeros_like(products[..., 0, :])
    columns = keys.shape[2]
    for column in range(0, columns - 1, 2):
        total = (total + products[..., column + 1, :]) + products[..., column, :]
    if columns % 2:
        total = total + products[..., columns - 1, :]
    scores = total.bfloat16().float() * scale.float()
    scores = scores.masked_fill(~real[:, :, None], -math.inf)
    return group_relative_max(scores.flatten(1, 2), query.shape[2])


def _tensor_path(*arguments: object) -> torch.Tensor:
    """``speculative_scores`` by tensor operations (the path CUDA and compiled graphs take)."""
    with mock.patch.object(rehearsal, "runs_on_host", lambda tensor: False):
        return rehearsal.speculative_scores(*arguments)


@pytest.mark.parametrize("columns", [1, 2, 3, 6, 7, 16, 48, 64])
def test_the_host_loop_sums_in_the_pair_order(columns: int) -> None:
    generator = torch.Generator().manual_seed(columns)
    for _ in range(8):
        query, keys, scale, real = _draw(generator, columns)
        assert rehearsal.scores_on_host(query, keys, (), scale)
        found = rehearsal.speculative_scores(query, keys, (), real, scale)
        assert torch.equal(found, _pair_order(query, keys, scale, real))
        unmasked = rehearsal.speculative_scores(query, keys, (), None, scale)
        assert torch.equal(unmasked, _pair_order(query, keys, scale, torch.ones_like(real)))


def test_the_pair_order_is_not_the_plain_order() -> None:
    """Draws like those above tell the orders apart: summed column after column, some scores round to
    another bfloat16 (so the test above checks the order, not only the rounding)."""
    generator = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.randint(-8, 9, (4, 3, 3, 48), generator=generator).float())
    query = torch.randn(4, 3, 3, 48, generator=generator) * magnitude
    keys = torch.randint(-127, 128, (4, 3, 48, 8000), dtype=torch.int8, generator=generator)
    scale, real = torch.ones(4, 3, 1, 8000, dtype=torch.float16), torch.ones(4, 3, 8000, dtype=torch.bool)
    products = query.bfloat16().float()[..., None] * keys.float()[:, :, None]
    plain = torch.zeros_like(products[..., 0, :])
    for column in range(48):
        plain = plain + products[..., column, :]
    plain_scores = group_relative_max(plain.bfloat16().float().flatten(1, 2), 3)
    assert not torch.equal(_pair_order(query, keys, scale, real), plain_scores)


def _follows_pairs() -> bool:
    """Whether this CPU's bfloat16 product sums in pairs as the host loop does (AVX512-BF16 without AMX,
    whose tiles sum otherwise)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "avx512_bf16" in flags and "amx_bf16" not in flags


@pytest.mark.skipif(not _follows_pairs(), reason="this CPU's bfloat16 product sums in another order")
def test_the_host_loop_gives_the_bfloat16_products_bits() -> None:
    generator = torch.Generator().manual_seed(1)
    for columns in (3, 30, 48):  # products large enough for oneDNN (torch sums the smallest in a plain loop)
        query, keys, scale, real = _draw(generator, columns, least=300)
        for hidden in (real, None):
            found = rehearsal.speculative_scores(query, keys, (), hidden, scale)
            assert torch.equal(found, _tensor_path(query, keys, (), hidden, scale))


def test_the_host_loop_takes_only_int8_keys_over_every_column() -> None:
    query, keys, scale, _ = _draw(torch.Generator().manual_seed(2), 8)
    assert rehearsal.scores_on_host(query, keys, (), scale)
    assert not rehearsal.scores_on_host(query, keys, (), None)  # unquantized
    assert not rehearsal.scores_on_host(query, keys.short(), (), scale)  # int16: float32 products
    assert not rehearsal.scores_on_host(query, keys.bfloat16(), (), scale)  # converted already
    own = ((torch.tensor([0]), torch.zeros(3, 4, dtype=torch.long)),)
    assert not rehearsal.scores_on_host(query, keys, own, scale)  # a row over fewer columns
    assert not rehearsal.scores_on_host(query, keys.transpose(2, 3).contiguous().transpose(2, 3), (), scale)


@pytest.mark.parametrize("columns", [3, 16, 48])
def test_scores_and_pick_in_one_call_give_what_they_give_apart(columns: int) -> None:
    """``rehearsal.scores_and_pick_on_host`` (a layer's choice in one call of the host loop) gives the
    scores ``speculative_scores`` gives and the entries ``pick_top`` takes of them, reserved slots lifted
    first: rows of one count and of several, hidden slots or none, reserved slots shared by the heads or
    each head's own."""
    from infinikv.policies.base import pick_top

    generator = torch.Generator().manual_seed(10 + columns)
    for draw in range(12):
        query, keys, scale, real = _draw(generator, columns, least=40)
        rows, heads, n = real.shape
        hidden = real if draw % 2 else None
        reserved = torch.zeros(rows, 1 if draw % 3 else heads, n, dtype=torch.bool)
        reserved[..., :2] = True
        reserved[..., -5:] = True
        most = 7  # the reserved slots a head holds at most: every row takes them all (a lift in one pass)
        takes = torch.randint(most, n + 1, (rows,), generator=generator).tolist()
        if draw % 4 == 1:
            takes = [max(takes)] * rows
        elif draw % 4 == 2:
            takes[-1] = most  # a row that takes its reserved slots alone
        scores, index, valid = rehearsal.scores_and_pick_on_host(query, keys, hidden, scale, takes, reserved)
        apart = rehearsal.speculative_scores(query, keys, (), hidden, scale)
        assert torch.equal(scores, apart)
        expected_index, expected_valid = pick_top(apart, takes, reserved, most)
        assert torch.equal(index, expected_index), draw
        assert (valid is None) == (expected_valid is None)
        if valid is not None:
            assert torch.equal(valid, expected_valid), draw
