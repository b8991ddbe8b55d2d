"""Coarse-to-fine speculation: per block of ``block_size`` tokens, bounds of the partial keys.

A rehearsal that scores every past token spends most of its time on the count and the top-k over all of
them, not on the few columns it multiplies. With blocks, it first
scores blocks by an upper bound of what any of their tokens can score (:func:`block_scores`), keeps the
best blocks as candidates, and only then scores, counts and picks tokens, among the candidates alone
(``policy.py``). The bounds are Quest's (Tang et al., ICML 2024, https://arxiv.org/abs/2406.10774), taken
on InfiniGen's skewed partial keys instead of the full keys: per block and column, the largest and the
smallest value, so that q · k ≤ Σ_c max(q_c · max_c, q_c · min_c) for every key k of the block.

The bounds live in the structure Quest's pages use too (``policies/bounds.py``, :class:`BlockBounds`, which
the ``SlotTable`` owns): blocks follow each sequence's own tokens, not the batch's slots (a row's first real
token starts a block whether it is batched or alone, so its candidates are those it gets alone), and block 0
holds only padding. When the pool evicts (``capacity`` below 1), a slot keeps its block and the bounds of
the block it is written to are taken again from its tokens (:func:`partial_values` reads them).

Bounds are stored as bfloat16, rounded outward (the max up, the min down), so they stay bounds; as
[max; −min] over the columns, so that the bound of a query q is one product, [relu(q); relu(−q)] · bounds
(:func:`block_scores`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..bounds import BlockBounds, SlotsTo
from .rehearsal import dequantized

Tensor = torch.Tensor
BOUND_DTYPE = torch.bfloat16
BOUND_BYTES = 2  # per bound value: each block holds a max and a min per column


def bound_bytes_per_token(columns: int, block_size: int) -> float:
    """Device bytes of the bounds, per token and KV head (0 without blocks)."""
    return 0.0 if block_size <= 1 else 2 * columns * BOUND_BYTES / block_size


def gather_slots(keys: Tensor, scale: Tensor | None, slots: Tensor) -> tuple[Tensor, Tensor | None]:
    """The partial keys [batch, kv_heads, k, m] (and scales [..., 1, m]) of ``slots`` [batch, kv_heads, m]
    from the store ``keys`` [batch, kv_heads, k, capacity] (``scale`` [..., 1, capacity]), slots last as
    the store keeps them."""
    picked = torch.gather(keys, 3, slots[:, :, None].expand(-1, -1, keys.shape[2], -1))
    return picked, None if scale is None else torch.gather(scale, 3, slots[:, :, None])


def partial_values(
    keys: Tensor, scale: Tensor | None, unpack: Callable[[Tensor], Tensor] | None = None
) -> SlotsTo:
    """What :meth:`BlockBounds.refresh` reads from the partial key store ``keys`` [batch, kv_heads, k,
    slots] (``scale`` [..., 1, slots]): the values (float32) [batch, kv_heads, m, k] of slots [batch,
    kv_heads, m]. ``unpack``: a packed store's slots as one integer per column (``SlotTable.unpacked``),
    applied to the slots read only (None: one to a column)."""

    def read(slots: Tensor) -> Tensor:
        integers, scales = gather_slots(keys, scale, slots)
        if unpack is not None:
            integers = unpack(integers)
        return dequantized(integers, scales).transpose(2, 3)

    return read


def block_scores(
    partial_query: Tensor,
    bounds: BlockBounds,
    blocks: int,
    row_columns: tuple[tuple[Tensor, Tensor], ...] = (),
) -> Tensor:
    """Per query head, the upper bound of the first ``blocks`` blocks [batch, kv_heads, group, blocks]
    (-inf: no real token): ``partial_query`` [batch, kv_heads, group, k] (scaled) against the bounds, in
    bfloat16 (a ranking of blocks, on low-precision scores). ``row_columns`` as in
    ``rehearsal.speculative_scores``: those rows bound their scores over their own columns, as alone."""
    k = partial_query.shape[-1]
    table = bounds.bounds[:, :, :blocks]
    signed = torch.cat([partial_query.clamp(min=0), (-partial_query).clamp(min=0)], dim=-1)
    signed = signed.to(BOUND_DTYPE)
    # the table on the left, as it is stored: no transposed copy of it
    scores = torch.matmul(table, signed.transpose(2, 3))  # [batch, kv_heads, blocks, group]
    for rows, own in row_columns:
        both = torch.cat([own, own + k], dim=-1)[None, :, None, :]
        q_rows = torch.gather(signed[rows], 3, both.expand(len(rows), -1, signed.shape[2], -1))
        t_rows = torch.gather(table[rows], 3, both.expand(len(rows), -1, table.shape[2], -1))
        scores[rows] = torch.matmul(t_rows, q_rows.transpose(2, 3))
    scores = scores.transpose(2, 3).float()
    return scores.masked_fill(~bounds.filled[:, :, None, :blocks], -math.inf)
