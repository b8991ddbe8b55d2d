"""The compiled loop of :mod:`.ranked` (numba), imported at the first pick of host scores: module-level
functions, so numba's disk cache holds them and a new process loads them instead of compiling them again."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def ordered(value: float) -> int:
    """``value`` as an unsigned integer in the same order (-0.0 as 0.0: they tie as floats)."""
    bits = np.float32(value + np.float32(0.0)).view(np.uint32)
    return ~bits if bits >> np.uint32(31) else bits | np.uint32(0x80000000)


# The digits a cut is selected by, from the top, as (shift, bits): bytes for a head of fewer entries than
# WIDE_FROM, where clearing and scanning a digit's counters costs more than the passes it saves; else 11, 11
# and 10 bits, whose first digit (the sign, the exponent and two bits more) leaves far fewer entries to count
# again than a byte does for scores of one sign and a few exponents.
BYTES = np.array([[24, 8], [16, 8], [8, 8], [0, 8]], dtype=np.int64)
WIDE = np.array([[21, 11], [10, 11], [0, 10]], dtype=np.int64)
WIDE_FROM = 2048
COUNTERS = 1 << int(max(BYTES[:, 1].max(), WIDE[:, 1].max()))  # one per value of the widest digit


@numba.njit(nogil=True, cache=True)
def cut_of(keys: np.ndarray, count: int, counted: np.ndarray, kept: np.ndarray) -> tuple[int, int]:
    """The count-th largest of ``keys`` and how many of the keys equal to it a count takes: a radix
    selection, a digit at a time from the top (``BYTES`` or ``WIDE``), each digit counted among the keys
    whose higher digits are those chosen so far, which are kept apart for the next digit (``counted``:
    :data:`COUNTERS` counters, ``kept``: room for the keys; both reused). A count of 0 takes nothing: no key
    is above the largest, and none of its ties."""
    if count == 0:
        return np.uint32(0xFFFFFFFF), 0
    prefix = np.uint32(0)
    left = count
    among = keys
    digits = WIDE if keys.shape[0] >= WIDE_FROM else BYTES
    for shift, bits in digits:
        top = (1 << bits) - 1
        counted[: top + 1] = 0
        for key in among:
            counted[(key >> np.uint32(shift)) & np.uint32(top)] += 1
        digit = top
        while counted[digit] < left:
            left -= counted[digit]
            digit -= 1
        prefix |= np.uint32(digit) << np.uint32(shift)
        if shift:
            high = prefix >> np.uint32(shift)
            n_kept = 0
            # every key is written and a key that does not match is written over (the writes stay behind the
            # reads, so ``among`` may be ``kept``): a branch on whether it matches, as good as random, took a
            # fifth of a pick of 8 rows x 3 heads x 8,064 slots
            for key in among:
                kept[n_kept] = key
                n_kept += key >> np.uint32(shift) == high
            among = kept[:n_kept]
    return prefix, left


@numba.njit(nogil=True, cache=True)
def pick(
    values: np.ndarray,
    counts: np.ndarray,
    width: int,
    each: bool,
    index: np.ndarray,
    valid: np.ndarray | None,
    lifted: np.ndarray | None,
) -> None:
    """``ranked.pick_on_host``'s pick of ``values`` [rows, heads, n] (float32) into ``index`` (and
    ``valid``, or None), which the caller sized and checked: ``counts[row]`` <= ``width`` <= n. Where
    ``lifted`` (bool, as ``values``; None: nowhere) holds, a value above -inf is taken as +inf."""
    rows, heads, n = values.shape
    keys = np.empty(n, dtype=np.uint32)
    counted = np.zeros(COUNTERS, dtype=np.int64)
    kept = np.empty(n, dtype=np.uint32)
    top = ordered(np.inf)
    for row in range(rows):
        count = counts[row]
        for head in range(heads):
            for slot in range(n):
                keys[slot] = ordered(values[row, head, slot])
            if lifted is not None:  # a pass of its own: the one above stays a vector loop
                for slot in range(n):
                    if lifted[row, head, slot] and values[row, head, slot] > -np.inf:
                        keys[slot] = top
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
