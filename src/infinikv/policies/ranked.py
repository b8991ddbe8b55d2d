"""The host kernel of :func:`base.pick_top` and :func:`base.pick_each`: each (row, KV head)'s best entries
in one compiled loop (``ranked_kernel.py``).

Both picks follow one rule. Order a head's entries best first, an entry tied with another after it when it
sits in a later slot; a row takes the first ``count`` of that order and reads them in ascending slot order.
On tensors this costs a top-k and some twenty whole-width operations (``base._earliest_at_cut`` and
``base._slots_of``): at batch 1 each of them is a dispatch of a few microseconds, and at batch 8 over 8k
tokens each is a pass over the scores. Here a (row, head) is a radix selection of its cut (the count-th best
value, as an order-keeping integer, a digit at a time: four bytes, or from 2,048 entries on three digits of
11, 11 and 10 bits, counting passes that also say how many of the entries tied at the cut are taken) and one
pass in slot order that takes the entries above the cut and the earliest of those tied at it, writing their
slots in ascending order. It runs without the interpreter lock, so a look-ahead's pick on the pool's worker
thread leaves the decode thread alone.

The result is the tensor path's by construction, entry for entry (``tests/test_ranked.py`` checks both on
ties, ``-inf``, ``+inf``, values that differ only in their last bits, ragged and zero counts, and heads short
and long, which take the cut's two digit schedules). Scores are compared as float32, which holds bfloat16 and
float16 exactly; float64 scores are not picked here. Scores hold no NaN (a NaN would rank above +inf here,
where the tensor path never takes it). Only host tensors come here, where numba is installed
(:func:`available`); CUDA's picks stay on the device (``base.pick_with_tensor_ops``).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import numpy as np
import torch

Tensor = torch.Tensor


@cache
def available() -> bool:
    """Whether numba is installed (a dependency of the package; the GPU check runs from a source tree on a
    machine that may lack it, where host picks take the tensor path: the same entries, more slowly)."""
    return importlib.util.find_spec("numba") is not None


def pick_on_host(
    scores: Tensor, takes: list[int], width: int, each: bool, lifted: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Each (row, head)'s best of ``scores`` [rows, heads, n] (a host tensor) by the rule above; where
    ``lifted`` (bool, broadcastable to ``scores``; None: nowhere) holds, a score above -inf counts as +inf
    (``base.pick_top``'s reserved entries, lifted in the loop instead of in a copy of the scores).

    ``each`` False (:func:`base.pick_top`): index [rows, heads, width], the ``width`` best of every row in
    ascending slots, and valid (same shape), True where an entry is among its row's ``takes[row]`` best
    (None when every row takes ``width``). ``each`` True (:func:`base.pick_each`): row r's ``takes[r]`` best
    in the first entries of its row of the index, ascending, the rest 0; valid None.
    """
    values = scores.detach().to(torch.float32).contiguous().numpy()
    counts, index, valid, lifted_mask = pick_arguments(scores.shape, takes, width, each, lifted)
    _kernel()(values, counts, width, each, index, valid, lifted_mask)
    return picked(index, valid)


PickArguments = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def pick_arguments(
    shape: tuple[int, ...], takes: list[int], width: int, each: bool, lifted: Tensor | None
) -> PickArguments:
    """What the kernel takes besides the scores of :func:`pick_on_host` (its arguments, for scores of
    ``shape``), once they are checked: the counts, the index and valid to fill, and ``lifted`` as an
    array."""
    rows, heads, n = shape
    if width > n:
        raise ValueError(f"cannot pick {width} entries of {n}")
    if len(takes) != rows or min(takes) < 0 or max(takes) > width:
        raise ValueError(f"takes {takes} do not fit {rows} rows of at most {width} entries")
    counts = np.asarray(takes, dtype=np.int64)
    index = np.zeros((rows, heads, width), dtype=np.int64)
    ragged = not each and min(takes) < width
    valid = np.ones((rows, heads, width), dtype=np.bool_) if ragged else None
    mask = None if lifted is None else lifted.detach().to("cpu", torch.bool).expand(rows, heads, n).numpy()
    return counts, index, valid, mask


def picked(index: np.ndarray, valid: np.ndarray | None) -> tuple[Tensor, Tensor | None]:
    """The kernel's index and valid (:func:`pick_arguments`) as tensors."""
    return torch.from_numpy(index), None if valid is None else torch.from_numpy(valid)


@cache
def _kernel():
    """The compiled loop; a run on CUDA alone never imports numba. The first process compiles it (seconds),
    later ones load it from numba's disk cache."""
    from .ranked_kernel import pick

    return pick
