"""The host kernel of the shared pick (``policies/ranked.py``) takes, entry for entry, what the tensor path
takes (``base.pick_with_tensor_ops``, which runs on CUDA and in compiled graphs): on ties, -inf and +inf
(lifted reserved entries), ragged counts, zero counts, and every score dtype a policy scores in."""

from __future__ import annotations

import math

import pytest
import torch

from infinikv.policies.base import pick_each, pick_top, pick_with_tensor_ops
from infinikv.policies.ranked import pick_on_host


def _scores(generator: torch.Generator, rows: int, heads: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Scores with many ties (a few levels, as low-precision scores have), some -inf, some +inf, some -0.0."""
    scores = torch.randint(-6, 3, (rows, heads, n), generator=generator).float() / 4
    draw = torch.rand(rows, heads, n, generator=generator)
    scores[draw < 0.1] = -math.inf
    scores[draw > 0.97] = math.inf
    scores[(draw > 0.5) & (draw < 0.55)] = -0.0
    return scores.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("each", [False, True])
def test_the_host_kernel_picks_what_the_tensor_ops_pick(dtype: torch.dtype, each: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    for draw in range(60):
        rows = 1 + draw % 4
        n = int(torch.randint(1, 300, (1,), generator=generator))
        scores = _scores(generator, rows, 3, n, dtype)
        low = 1 if each else 0  # pick_each: every row takes at least one entry
        takes = torch.randint(low, n + 1, (rows,), generator=generator).tolist()
        if draw % 3 == 0:
            takes = [max(takes)] * rows  # one count for every row
        width = max(takes)
        if width == 0:
            continue
        host_index, host_valid = pick_on_host(scores, takes, width, each)
        index, valid = pick_with_tensor_ops(scores, takes, width, each)
        assert torch.equal(host_index, index), (draw, takes)
        assert (host_valid is None) == (valid is None)
        if valid is not None:
            assert torch.equal(host_valid, valid), (draw, takes)


def test_each_row_takes_its_own_best_in_slot_order() -> None:
    """A worked case: the earliest of the entries tied at a cut, read in ascending slots."""
    first = [0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -math.inf]
    scores = torch.tensor([[first], [[5.0, 1.0, 1.0, 1.0, 1.0, 0.0, 9.0]]])
    index, valid = pick_top(scores, [4, 2])
    assert index.tolist() == [[[1, 2, 3, 4]], [[0, 1, 2, 6]]]
    assert valid.tolist() == [[[True, True, True, True]], [[True, False, False, True]]]
    assert pick_each(scores, [4, 2], None, 0).tolist() == [[[1, 2, 3, 4]], [[0, 6, 0, 0]]]


def test_a_pick_wider_than_the_scores_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot pick 4 entries of 3"):
        pick_on_host(torch.zeros(1, 1, 3), [4], 4, each=False)
