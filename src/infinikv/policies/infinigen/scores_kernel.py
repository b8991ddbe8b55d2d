"""The compiled loop of :func:`.rehearsal.speculative_scores` for int8 partial keys on the host (numba),
imported at the first such score: module-level functions, the entry point with its signature, so numba
compiles it once and its disk cache serves every later process. :func:`scores_and_pick` (the scores and
``ranked_kernel.pick`` of them in one call) is compiled in each process at its first call (about a second):
numba's disk cache checks only the file that defines a function, so a cached copy would keep running an
older ``pick``.

The sums follow one order on every CPU, that of the bfloat16 product as oneDNN computes it with
AVX512-BF16 (the instruction ``vdpbf16ps``, on a CPU without AMX, as the one this project's figures come
from): float32 sums over the key columns taken in pairs, the odd column of each pair added first, then
rounded to bfloat16 (to nearest, ties to even). Each product of a bfloat16 query value and an int8 key is
exact in float32, so only this order of the sums decides the bits; there the scores are the tensor path's
bit for bit. Where torch's product sums in another order (another CPU, or its plain loop for the smallest
products) a few scores may differ in their last bit from the tensor path's, and are the same as on that CPU.
Values are taken as normal numbers: ``vdpbf16ps`` flushes subnormal ones to zero, which a partial query never
holds.
"""

from __future__ import annotations

import numba
import numpy as np

from ..ranked_kernel import pick

TILE = 1024  # slots per pass: its sums (and, for heads alone, its keys as float32) stay in the core's caches

_KEYS = "int8[:, :, :, :]"  # [batch, kv_heads, columns, slots], any strides (a view of the slot table)
_FLOATS_3D = "float32[:, :, ::1]"  # contiguous


@numba.njit(nogil=True, cache=True, inline="always")
def to_bfloat16(value: float) -> float:
    """``value`` rounded to bfloat16 (to nearest, ties to even), as float32; no NaN comes here."""
    bits = np.float32(value).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint32((bits + rounding) & np.uint32(0xFFFF0000)).view(np.float32)


# Every product here, of a bfloat16 query value and an int8 key, is exact in float32, so a fused multiply-add
# rounds as the product then the sum do: contracting them changes no bit (fastmath "contract" alone).
@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def products(
    query: np.ndarray,
    keys: np.ndarray,
    row: int,
    head: int,
    start: int,
    stop: int,
    sums: np.ndarray,
    converted: np.ndarray,
) -> None:
    """Into ``sums`` [group, :stop - start]: each query head's float32 sums over slots start..stop of
    (``row``, ``head``), in the pair order of the module docstring. Query heads three at a time
    (:func:`three_heads`) read each key once for the three; the rest of a group one at a time, from the
    tile's keys as float32 (``converted``: room for them)."""
    group, columns = query.shape[2], query.shape[3]
    width = stop - start
    alone = group - group % 3  # the first query head taken alone
    for first in range(0, alone, 3):
        three_heads(query, keys, row, head, first, start, stop, sums)
    if alone == group:
        return
    for column in range(columns):
        source, target = keys[row, head, column, start:stop], converted[column]
        for slot in range(width):
            target[slot] = np.float32(source[slot])
    for query_head in range(alone, group):
        total, weights = sums[query_head], query[row, head, query_head]
        total[:width] = 0.0
        column = 0
        while column + 4 <= columns:  # two pairs a pass: the same sums, half the passes over ``total``
            odd, even = weights[column + 1], weights[column]
            odd_next, even_next = weights[column + 3], weights[column + 2]
            keys_odd, keys_even = converted[column + 1], converted[column]
            next_odd, next_even = converted[column + 3], converted[column + 2]
            for slot in range(width):
                pair = (total[slot] + odd * keys_odd[slot]) + even * keys_even[slot]
                total[slot] = (pair + odd_next * next_odd[slot]) + even_next * next_even[slot]
            column += 4
        if column + 2 <= columns:
            odd, even = weights[column + 1], weights[column]
            keys_odd, keys_even = converted[column + 1], converted[column]
            for slot in range(width):
                total[slot] = (total[slot] + odd * keys_odd[slot]) + even * keys_even[slot]
        if columns % 2:  # the last column pairs with a zero, which adds nothing
            last, last_keys = weights[columns - 1], converted[columns - 1]
            for slot in range(width):
                total[slot] = total[slot] + last * last_keys[slot]


@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def three_heads(
    query: np.ndarray,
    keys: np.ndarray,
    row: int,
    head: int,
    first: int,
    start: int,
    stop: int,
    sums: np.ndarray,
) -> None:
    """:func:`products` of query heads ``first`` .. ``first`` + 2 together: a pass over the slots reads
    four columns' keys (int8, converted in registers) once for the three heads' sums, in the same order
    of additions as one head's."""
    columns, width = query.shape[3], stop - start
    weights_a, weights_b, weights_c = (
        query[row, head, first],
        query[row, head, first + 1],
        query[row, head, first + 2],
    )
    total_a, total_b, total_c = sums[first], sums[first + 1], sums[first + 2]
    total_a[:width] = 0.0
    total_b[:width] = 0.0
    total_c[:width] = 0.0
    column = 0
    while column + 4 <= columns:  # two pairs a pass
        a1, a0, a3, a2 = (
            weights_a[column + 1],
            weights_a[column],
            weights_a[column + 3],
            weights_a[column + 2],
        )
        b1, b0, b3, b2 = (
            weights_b[column + 1],
            weights_b[column],
            weights_b[column + 3],
            weights_b[column + 2],
        )
        c1, c0, c3, c2 = (
            weights_c[column + 1],
            weights_c[column],
            weights_c[column + 3],
            weights_c[column + 2],
        )
        keys_1, keys_0 = keys[row, head, column + 1, start:stop], keys[row, head, column, start:stop]
        keys_3, keys_2 = keys[row, head, column + 3, start:stop], keys[row, head, column + 2, start:stop]
        for slot in range(width):
            k1, k0 = np.float32(keys_1[slot]), np.float32(keys_0[slot])
            k3, k2 = np.float32(keys_3[slot]), np.float32(keys_2[slot])
            total_a[slot] = (((total_a[slot] + a1 * k1) + a0 * k0) + a3 * k3) + a2 * k2
            total_b[slot] = (((total_b[slot] + b1 * k1) + b0 * k0) + b3 * k3) + b2 * k2
            total_c[slot] = (((total_c[slot] + c1 * k1) + c0 * k0) + c3 * k3) + c2 * k2
        column += 4
    if column + 2 <= columns:
        a1, a0 = weights_a[column + 1], weights_a[column]
        b1, b0 = weights_b[column + 1], weights_b[column]
        c1, c0 = weights_c[column + 1], weights_c[column]
        keys_1, keys_0 = keys[row, head, column + 1, start:stop], keys[row, head, column, start:stop]
        for slot in range(width):
            k1, k0 = np.float32(keys_1[slot]), np.float32(keys_0[slot])
            total_a[slot] = (total_a[slot] + a1 * k1) + a0 * k0
            total_b[slot] = (total_b[slot] + b1 * k1) + b0 * k0
            total_c[slot] = (total_c[slot] + c1 * k1) + c0 * k0
    if columns % 2:  # the last column pairs with a zero, which adds nothing
        a, b, c = weights_a[columns - 1], weights_b[columns - 1], weights_c[columns - 1]
        keys_last = keys[row, head, columns - 1, start:stop]
        for slot in range(width):
            last = np.float32(keys_last[slot])
            total_a[slot] = total_a[slot] + a * last
            total_b[slot] = total_b[slot] + b * last
            total_c[slot] = total_c[slot] + c * last


@numba.njit(nogil=True, cache=True)
def scaled(sums: np.ndarray, scale: np.ndarray, real: np.ndarray, scores: np.ndarray) -> None:
    """Into ``scores``: ``sums`` rounded to bfloat16 times their ``scale`` (exact in float32), -inf where a
    slot is not ``real``."""
    for slot in range(scores.shape[0]):
        score = to_bfloat16(sums[slot]) * scale[slot]
        scores[slot] = score if real[slot] else np.float32(-np.inf)


@numba.njit(nogil=True, cache=True)
def largest(values: np.ndarray) -> float:
    """The max of ``values`` (no NaN), compared as integers in the same order, which the compiler turns
    into vector instructions (a float max with its NaN rules it does not)."""
    bits = values.view(np.int32)
    best = np.int32(-(2**31))
    for slot in range(bits.shape[0]):
        value = bits[slot]
        best = max(best, value ^ ((value >> np.int32(31)) & np.int32(0x7FFFFFFF)))
    best ^= (best >> np.int32(31)) & np.int32(0x7FFFFFFF)
    return np.int32(best).view(np.float32)


@numba.njit(nogil=True, cache=True, fastmath={"nnan"})
def _group_max(per_head: np.ndarray, best: np.ndarray, out: np.ndarray) -> None:
    """Into ``out``: the max over query heads of ``per_head`` less each head's ``best`` (a head with no
    finite score subtracts nothing)."""
    for query_head in range(per_head.shape[0]):
        if best[query_head] == -np.inf:
            best[query_head] = 0.0
    for slot in range(out.shape[0]):
        out[slot] = per_head[0, slot] - best[0]
    for query_head in range(1, per_head.shape[0]):
        scores, own_best = per_head[query_head], best[query_head]
        for slot in range(out.shape[0]):
            out[slot] = max(out[slot], scores[slot] - own_best)


@numba.njit(
    f"void(float32[:, :, :, ::1], {_KEYS}, {_FLOATS_3D}, boolean[:, :, ::1], {_FLOATS_3D})",
    nogil=True,
    cache=True,
)
def speculative_scores(
    query: np.ndarray, keys: np.ndarray, scale: np.ndarray, real: np.ndarray, out: np.ndarray
) -> None:
    """``rehearsal.speculative_scores`` into ``out`` [batch, kv_heads, slots] for ``query`` [batch,
    kv_heads, group, columns] (bfloat16 values as float32), int8 ``keys`` [batch, kv_heads, columns, slots],
    their ``scale`` and ``real`` [batch, kv_heads, slots]: each query head's scores less its best (-inf
    stays -inf), then the max over the group."""
    batch, heads, group, columns = query.shape
    n = keys.shape[3]
    sums = np.empty((group, TILE), dtype=np.float32)
    converted = np.empty((columns if group % 3 else 0, TILE), dtype=np.float32)  # heads taken alone
    per_head = np.empty((group, n), dtype=np.float32)
    best = np.empty(group, dtype=np.float32)
    for row in range(batch):
        for head in range(heads):
            for start in range(0, n, TILE):
                stop = min(start + TILE, n)
                products(query, keys, row, head, start, stop, sums, converted)
                for query_head in range(group):
                    scaled(
                        sums[query_head, : stop - start],
                        scale[row, head, start:stop],
                        real[row, head, start:stop],
                        per_head[query_head, start:stop],
                    )
            for query_head in range(group):
                best[query_head] = largest(per_head[query_head])
            _group_max(per_head, best, out[row, head])


@numba.njit(nogil=True)
def scores_and_pick(
    query: np.ndarray,
    keys: np.ndarray,
    scale: np.ndarray,
    real: np.ndarray,
    out: np.ndarray,
    counts: np.ndarray,
    width: int,
    index: np.ndarray,
    valid: np.ndarray | None,
    lifted: np.ndarray | None,
) -> None:
    """:func:`speculative_scores` into ``out``, then ``ranked_kernel.pick`` of them (not ``each``) into
    ``index`` and ``valid``, ``lifted`` entries first: a layer's choice in one call from the host."""
    speculative_scores(query, keys, scale, real, out)
    pick(out, counts, width, False, index, valid, lifted)
