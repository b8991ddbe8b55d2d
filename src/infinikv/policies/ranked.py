"""The host kernel of :func:`base.pick_top` and :func:`base.pick_each`: each (row, KV head)'s best entries
in one compiled loop.

Both picks follow one rule. Order a head's entries best first, an entry tied with another after it when it
sits in a later slot; a row takes the first ``count`` of that order and reads them in ascending slot order.
On tensors this costs a top-k and some twenty whole-width operations (``base._earliest_at_cut`` and
``base._slots_of``): at batch 1 each of them is a dispatch of a few microseconds, and at batch 8 over 8k
tokens each is a pass over the scores. Here a (row, head) is a radix selection of its cut (the count-th
best value, as an order-keeping integer, a byte at a time: four counting passes that also say how many of
the entries tied at the cut are taken) and one pass in slot order that takes the entries above the cut and
the earliest of those tied at it, writing their slots in ascending order. It runs without
the interpreter lock, so a look-ahead's pick on the pool's worker thread leaves the decode thread alone.

The result is the tensor path's by construction, entry for entry (``tests/test_ranked.py`` checks both on
ties, ``-inf`` and ragged counts). Scores are compared as float32, which holds bfloat16 and float16 exactly.
Only host tensors come here, where numba is installed (:func:`available`); CUDA's picks stay on the device
(``base.pick_with_tensor_ops``).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import numpy as np
import torch

Tensor = torch.Tensor


def pick_on_host(scores: Tensor, takes: list[int], width: int, each: bool) -> tuple[Tensor, Tensor | None]:
    """Each (row, head)'s best of ``scores`` [rows, heads, n] (a host tensor) by the rule above.

    ``each`` False (:func:`base.pick_top`): index [rows, heads, width], the ``width`` best of every row in
    ascending slots, and valid (same shape), True where an entry is among its row's ``takes[row]`` best
    (None when every row takes ``width``). ``each`` True (:func:`base.pick_each`): row r's ``takes[r]`` best
    in the first entries of its row of the index, ascending, the rest 0; valid None.
    """
    rows, heads, n = scores.shape
    if width > n:
        raise ValueError(f"cannot pick {width} entries of {n}")
    values = scores.detach().to(torch.float32).contiguous().numpy()
    counts = np.asarray(takes, dtype=np.int64)
    index = np.zeros((rows, heads, width), dtype=np.int64)
    ragged = not each and min(takes) < width
    valid = np.ones((rows, heads, width), dtype=np.bool_) if ragged else None
    _kernel()(values, counts, width, each, index, valid)
    return torch.from_numpy(index), None if valid is None else torch.from_numpy(valid)


@cache
def available() -> bool:
    """Whether numba is installed (a dependency of the package; the GPU check runs from a source tree on a
    machine that may lack it, where host picks take the tensor path: the same entries, more slowly)."""
    return importlib.util.find_spec("numba") is not None


@cache
def _kernel():
    """The compiled loop, built at the first host pick (numba compiles it in seconds, then caches it on
    disk, from where a new process loads it in about a second); a run on CUDA alone never imports numba."""
    import numba

    @numba.njit(nogil=True, cache=True)
    def ordered(value: float) -> int:
        """``value`` as an unsigned integer in the same order (-0.0 as 0.0: they tie as floats)."""
        bits = np.float32(value + np.float32(0.0)).view(np.uint32)
        return ~bits if bits >> np.uint32(31) else bits | np.uint32(0x80000000)

    @numba.njit(nogil=True, cache=True)
    def cut_of(keys: np.ndarray, count: int, counted: np.ndarray, kept: np.ndarray) -> tuple[int, int]:
        """The count-th largest of ``keys`` and how many of the keys equal to it a count takes: a radix
        selection, a byte at a time from the top, each byte counted among the keys whose higher bytes are
        those chosen so far, which are kept apart for the next byte (``counted``: 256 counters, ``kept``:
        room for the keys; both reused)."""
        if count == 0:  # a cut above every key: nothing is taken
            return np.uint32(0xFFFFFFFF), 0
        prefix = np.uint32(0)
        left = count
        among = keys
        for shift in (24, 16, 8, 0):
            counted[:] = 0
            for key in among:
                counted[(key >> np.uint32(shift)) & np.uint32(255)] += 1
            digit = 255
            while counted[digit] < left:
                left -= counted[digit]
                digit -= 1
            prefix |= np.uint32(digit) << np.uint32(shift)
            if shift:
                high = prefix >> np.uint32(shift)
                n_kept = 0
                for key in among:
                    if key >> np.uint32(shift) == high:
                        kept[n_kept] = key
                        n_kept += 1
                among = kept[:n_kept]
        return prefix, left

    @numba.njit(nogil=True, cache=True)
    def pick(values, counts, width, each, index, valid):
        rows, heads, n = values.shape
        keys = np.empty(n, dtype=np.uint32)
        counted = np.zeros(256, dtype=np.int64)
        kept = np.empty(n, dtype=np.uint32)
        for row in range(rows):
            count = counts[row]
            for head in range(heads):
                for slot in range(n):
                    keys[slot] = ordered(values[row, head, slot])
                taken_cut, taken_room = cut_of(keys, count if each else width, counted, kept)
                own_cut, own_room = (taken_cut, 0) if valid is None else cut_of(keys, count, counted, kept)
                at = 0
                for slot in range(n):
                    key = keys[slot]
                    if key == taken_cut:  # tied at the cut: the earliest slots take the room left
                        if taken_room == 0:
                            continue
                        taken_room -= 1
                    elif key < taken_cut:
                        continue
                    if valid is not None:
                        own = key > own_cut or (key == own_cut and own_room > 0)
                        if key == own_cut and own:
                            own_room -= 1
                        valid[row, head, at] = own
                    index[row, head, at] = slot
                    at += 1

    return pick
