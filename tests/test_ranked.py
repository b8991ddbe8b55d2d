"""The host kernel of the shared pick (``policies/ranked.py``) takes, entry for entry, what the tensor path
takes (``base.pick_with_tensor_ops``, which runs on CUDA, in compiled graphs and without numba): on ties,
-inf and +inf, reserved entries it lifts itself, -0.0, values that differ only in their last bits, ragged
counts, zero counts, heads short and long (a byte at a time, and the wide digits), and every score dtype a
policy scores in."""

from __future__ import annotations

import math

import pytest
import torch

from infinikv.policies import base
from infinikv.policies.base import pick_each, pick_top, pick_with_tensor_ops
from infinikv.policies.ranked import pick_on_host

pytest.importorskip("numba")


def _scores(generator: torch.Generator, rows: int, heads: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Scores with many ties, some -inf, some +inf, some -0.0. Half the draws take a few levels (as
    low-precision scores have); the other half values that share their high bytes and differ in the low
    ones (float32 only: 1 + k ulp, k up to about 2^20, and their negatives), which only the radix
    selection's later passes tell apart."""
    if dtype == torch.float32 and bool(torch.rand(1, generator=generator) < 0.5):
        # ulp steps in the low 10 bits, or (a step scaled by up to 2^11) in the 11 above them as well
        spread = 2 ** int(torch.randint(0, 12, (1,), generator=generator))
        steps = torch.randint(0, 600, (rows, heads, n), generator=generator).float() * spread * 2**-23
        sign = torch.randint(0, 2, (rows, heads, n), generator=generator).float() * 2 - 1
        scores = sign * (1 + steps)
    else:
        scores = torch.randint(-6, 3, (rows, heads, n), generator=generator).float() / 4
    draw = torch.rand(rows, heads, n, generator=generator)
    scores[draw < 0.1] = -math.inf
    scores[draw > 0.97] = math.inf
    scores[(draw > 0.5) & (draw < 0.55)] = -0.0
    return scores.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("each", [False, True])
def test_the_host_kernel_picks_what_the_tensor_ops_pick(dtype: torch.dtype, each: bool) -> None:
    from infinikv.policies.ranked_kernel import WIDE_FROM  # numba's (importorskip above)

    generator = torch.Generator().manual_seed(0)
    for draw in range(80):
        rows = 1 + draw % 4
        # every tenth draw's heads long enough for the kernel's wide digits (ranked_kernel.WIDE_FROM)
        low_n, high_n = (WIDE_FROM, WIDE_FROM + 3000) if draw % 10 == 9 else (1, 300)
        n = int(torch.randint(low_n, high_n, (1,), generator=generator))
        scores = _scores(generator, rows, 3, n, dtype)
        low = 1 if each else 0  # pick_each: every row takes at least one entry
        takes = torch.randint(low, n + 1, (rows,), generator=generator).tolist()
        if draw % 4 == 0:
            takes = [max(takes)] * rows  # one count for every row
        elif draw % 4 == 1:
            takes[0] = n  # a row that takes everything
        elif draw % 4 == 2 and rows > 1:
            takes[-1] = low  # a row that takes nothing (pick_top) or one entry (pick_each)
        width = max(takes)
        if width == 0:
            continue  # pick_top answers an empty pick itself
        # reserved entries lifted by the kernel (half the draws; one mask for every head in some), as a
        # lift to +inf in a copy of the scores gives them to the tensor path
        lifted = None
        if bool(torch.rand(1, generator=generator) < 0.5):
            lifted = torch.rand(rows, 1 if draw % 3 else 3, n, generator=generator) < 0.05
        host_index, host_valid = pick_on_host(scores, takes, width, each, lifted)
        if lifted is not None:
            scores = scores.masked_fill(lifted & (scores > -math.inf), math.inf)
        index, valid = pick_with_tensor_ops(scores, takes, width, each)
        assert torch.equal(host_index, index), (draw, takes)
        assert (host_valid is None) == (valid is None)
        if valid is not None:
            assert torch.equal(host_valid, valid), (draw, takes)


def test_each_row_takes_its_own_best_in_slot_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worked case: the earliest of the entries tied at a cut, read in ascending slots; the same without
    numba (the tensor path)."""
    first = [0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -math.inf]
    scores = torch.tensor([[first], [[5.0, 1.0, 1.0, 1.0, 1.0, 0.0, 9.0]]])
    for numba_installed in (True, False):
        monkeypatch.setattr(base, "ranked_available", lambda installed=numba_installed: installed)
        index, valid = pick_top(scores, [4, 2])
        assert index.tolist() == [[[1, 2, 3, 4]], [[0, 1, 2, 6]]]
        assert valid.tolist() == [[[True, True, True, True]], [[True, False, False, True]]]
        assert pick_each(scores, [4, 2], None, 0).tolist() == [[[1, 2, 3, 4]], [[0, 6, 0, 0]]]


def test_a_pick_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot pick 4 entries of 3"):
        pick_on_host(torch.zeros(1, 1, 3), [4], 4, each=False)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        pick_on_host(torch.zeros(2, 1, 3), [2], 2, each=False)
    with pytest.raises(ValueError, match="do not fit 1 rows of at most 2"):
        pick_on_host(torch.zeros(1, 1, 3), [3], 2, each=True)
