"""InfiniGen's rehearsal as pure functions: partial query and partial keys in, scores and counts out.

:func:`quantize` and :func:`dequantized` are how the partial key cache is stored on the device (integers
with a per-token scale) and read back for diagnostics (4-bit integers are stored two to a byte:
``slots.pack_nibbles``).

:func:`speculative_scores` is step 2 of the policy's decode step (``policy.py``): the speculated logits of a
layer, from its partial (skewed, few-column) query against its partial key cache. :func:`count_within` is
step 3, the count rule: per sequence, how many tokens come within ``alpha`` of each KV head's best score,
capped by the budget. The policy then takes each row's top-n' with the shared ``base.pick_top``. Neither
function holds state, so each is tested alone (tests/test_infinigen.py) and the policy's observer sees what
they returned in a :class:`Rehearsal` record.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from ..base import group_relative_max, runs_on_host
from ..ranked import pick_arguments, picked

Tensor = torch.Tensor


def quantize(partial: Tensor, bits: int | None) -> tuple[Tensor, Tensor | None]:
    """``partial`` [..., k] as symmetric ``bits``-bit integers with one float16 scale per row [..., 1] (the
    row's largest magnitude maps to the largest integer); ``partial`` itself and None when ``bits`` is
    None."""
    if bits is None:
        return partial, None
    top = 2 ** (bits - 1) - 1
    values = partial.float()
    magnitude = torch.linalg.vector_norm(values, ord=math.inf, dim=-1, keepdim=True)  # the largest |value|
    scale = (magnitude / top).to(torch.float16)
    scale = scale.clamp_(min=torch.finfo(torch.float16).tiny)  # an all-zero row stays zero, not NaN
    integers = (values / scale.float()).round_().clamp_(-top, top)
    return integers.to(torch.int8 if bits <= 8 else torch.int16), scale


def dequantized(partial_keys: Tensor, scale: Tensor | None) -> Tensor:
    """The values of a partial key cache ``partial_keys`` [..., k, slots] with ``scale`` [..., 1, slots]
    (None: not quantized), as float32."""
    return partial_keys.float() if scale is None else partial_keys.float() * scale.float()


def speculative_scores(
    partial_query: Tensor,
    partial_keys: Tensor,
    row_columns: tuple[tuple[Tensor, Tensor], ...] = (),
    real_slots: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """Speculated logits [batch, kv_heads, slots]: each query head's relative to its own best (so <= 0), then
    the max over the heads of a KV group (the heads of a group differ in logit scale, one may put everything
    on a sink token; a token counts if any head of the group wants it).

    ``partial_query`` [batch, kv_heads, group, k] (scaled) and ``partial_keys`` [batch, kv_heads, k, slots]
    in the same k columns. ``row_columns``: (rows, columns [kv_heads, k']) for sequences that score with
    fewer of the k columns, as they would alone. ``real_slots`` [batch, kv_heads, slots]: False hides a slot
    (left padding) at -inf. ``scale`` [batch, kv_heads, 1, slots]: the per-token scale of integer
    ``partial_keys`` (:func:`quantize`; 4-bit ones unpacked); int8 ones are multiplied in bfloat16, which
    holds them exactly and reads half the bytes of float32, the scores then rounded to bfloat16's 8 bits
    (top-k on low-precision scores); int16 ones in float32 (which holds them exactly); unquantized ones in
    the query's dtype (:func:`product_dtype`); keys given in that dtype already are used as they are.

    int8 keys on the host are scored by one compiled loop (``scores_kernel.py``: the same bits, without
    converting the keys to bfloat16 in memory first) where :func:`scores_on_host` says so."""
    if scores_on_host(partial_query, partial_keys, row_columns, scale):
        return _host_scores(partial_query, partial_keys, real_slots, scale)
    compute = product_dtype(partial_query.dtype, partial_keys.dtype, scale is not None)
    query = partial_query.to(compute)
    scores = torch.matmul(query, partial_keys.to(compute))  # [batch, kv_heads, group, slots]
    for rows, own in row_columns:
        q_rows, k_rows = query[rows], partial_keys[rows]
        q_rows = torch.gather(q_rows, 3, own[None, :, None, :].expand(*q_rows.shape[:3], -1))
        k_rows = torch.gather(k_rows, 2, own[None, :, :, None].expand(len(rows), -1, -1, k_rows.shape[-1]))
        scores[rows] = torch.matmul(q_rows, k_rows.to(compute))
    # float32 scores: bfloat16 or float32 products times float16 scales promote to float32, in one pass
    scores = scores.float() if scale is None else scores * scale
    if real_slots is not None:
        scores = scores.masked_fill(~real_slots[:, :, None], -math.inf)
    return group_relative_max(scores.flatten(1, 2), partial_query.shape[2])


def scores_on_host(
    partial_query: Tensor,
    partial_keys: Tensor,
    row_columns: tuple[tuple[Tensor, Tensor], ...] = (),
    scale: Tensor | None = None,
) -> bool:
    """Whether :func:`speculative_scores` runs its host loop: int8 partial keys with float16 or float32
    scales, every tensor on the host, outside a compiled graph where numba is installed
    (``base.runs_on_host``), every row over all the columns (no ``row_columns``), the shapes the docstring
    there gives (others take the tensor path, which says what does not fit) and slots one after another in
    memory."""
    if partial_keys.dtype != torch.int8 or scale is None or row_columns:
        return False
    batch, heads, columns, n = partial_keys.shape
    return (
        partial_query.dtype.is_floating_point
        and partial_query.dim() == 4
        and partial_query.shape[:2] == (batch, heads)
        and partial_query.shape[3] == columns
        and scale.dtype in (torch.float16, torch.float32)
        and scale.shape == (batch, heads, 1, n)
        and partial_keys.stride(-1) == 1
        and all(tensor.device.type == "cpu" for tensor in (partial_query, scale))
        and runs_on_host(partial_keys)
    )


def _host_scores(
    partial_query: Tensor, partial_keys: Tensor, real_slots: Tensor | None, scale: Tensor
) -> Tensor:
    """:func:`speculative_scores` by ``scores_kernel.speculative_scores`` (where :func:`scores_on_host`)."""
    batch, heads, _, n = partial_keys.shape
    out = np.empty((batch, heads, n), dtype=np.float32)
    _kernel()(_query_values(partial_query), *_host_inputs(partial_keys, real_slots, scale), out)
    return torch.from_numpy(out)


def scores_and_pick_on_host(
    partial_query: Tensor,
    partial_keys: Tensor,
    real_slots: Tensor | None,
    scale: Tensor,
    takes: list[int],
    lifted: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`speculative_scores` and ``base.pick_top(scores, takes, ...)`` of them in one compiled call,
    where :func:`scores_on_host` holds and ``lifted`` (the reserved slots, or None) are taken first by a
    lift to +inf (``base.lifts_in_one_pass``): (scores, index, valid), as the two give them apart. At least
    one row takes an entry."""
    from .scores_kernel import scores_and_pick

    batch, heads, _, n = partial_keys.shape
    out = np.empty((batch, heads, n), dtype=np.float32)
    width = max(takes)
    counts, index, valid, lifted_mask = pick_arguments(out.shape, takes, width, False, lifted)
    inputs = _host_inputs(partial_keys, real_slots, scale)
    scores_and_pick(_query_values(partial_query), *inputs, out, counts, width, index, valid, lifted_mask)
    return (torch.from_numpy(out), *picked(index, valid))


def host_scores_of_rows(queries: list[Tensor], keys: list[Tensor], scales: list[Tensor]) -> Tensor:
    """:func:`speculative_scores` of several sequences of one row each, where :func:`scores_on_host` holds
    for each (``queries[r]`` [1, kv_heads, group, k], ``keys[r]`` [1, kv_heads, k, n_r], ``scales[r]``), side
    by side [rows, kv_heads, longest n_r], -inf past a row's own slots: each row is scored alone, its query
    rounded with the others' in one operation."""
    lengths = [key.shape[-1] for key in keys]
    longest, heads = max(lengths), keys[0].shape[1]
    out = np.empty((len(keys), heads, longest), dtype=np.float32)  # each row written whole below
    values = _query_values(torch.cat(queries))
    for row, (key, scale, n) in enumerate(zip(keys, scales, lengths, strict=True)):
        own = out[row : row + 1] if n == longest else np.empty((1, heads, n), dtype=np.float32)
        _kernel()(values[row : row + 1], *_host_inputs(key, None, scale), own)
        if n < longest:
            out[row, :, :n] = own[0]
            out[row, :, n:] = -np.inf
    return torch.from_numpy(out)


def _query_values(partial_query: Tensor) -> np.ndarray:
    """A partial query's values rounded to bfloat16 (the product's), as float32 the host loop reads."""
    return partial_query.detach().to(torch.bfloat16).float().contiguous().numpy()


def _host_inputs(
    keys: Tensor, real_slots: Tensor | None, scale: Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host loop's keys, scales and real slots, as it reads them, for ``keys`` [batch, kv_heads, k, n]
    with ``scale`` (and ``real_slots``: None, all)."""
    batch, heads, _, n = keys.shape
    scales = scale.detach().reshape(batch, heads, n).float().contiguous()
    real = (
        np.ones((batch, heads, n), dtype=np.bool_)
        if real_slots is None
        else real_slots.to("cpu", torch.bool).expand(batch, heads, n).contiguous().numpy()
    )
    return keys.numpy(), scales.numpy(), real


@cache
def _kernel() -> Callable[..., None]:
    """The host loop; a run on CUDA alone never imports numba. The first process compiles it (seconds),
    later ones load it from numba's disk cache."""
    from .scores_kernel import speculative_scores as host_loop

    return host_loop


def product_dtype(query_dtype: torch.dtype, key_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The dtype :func:`speculative_scores` multiplies a partial query and partial keys in (see there)."""
    if not quantized:
        return query_dtype
    return torch.bfloat16 if key_dtype in (torch.int8, torch.bfloat16) else torch.float32


def count_within(
    scores: Tensor,
    alpha: float | Tensor,
    budgets: list[int],
    reserved: Tensor | None = None,
    whole: list[bool] | None = None,
) -> Tensor:
    """n' per sequence [batch]: the mean over KV heads of the count of ``scores`` [batch, kv_heads, slots]
    within ``alpha`` (one, or [batch, 1, 1]) of the head's best, rounded up, ``reserved`` slots (sinks and
    recent window) counted whatever their score; capped by the row's budget (``budgets``, tokens) and by its
    real (finite) slots. A row marked in ``whole`` (its context within the floor) takes all its slots."""
    return count_rule(*wanted_per_head(scores, alpha, reserved), budgets, whole)


def wanted_per_head(
    scores: Tensor, alpha: float | Tensor, reserved: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per KV head [batch, kv_heads]: the slots of ``scores`` [batch, kv_heads, slots] the count rule counts
    (within ``alpha`` of the head's best, or ``reserved``), and the real (finite) slots."""
    finite = scores > -math.inf
    if isinstance(alpha, float) and alpha == math.inf:  # every real slot is within (the budget decides)
        wanted = finite
    else:
        wanted = scores > scores.amax(dim=-1, keepdim=True) - alpha
    if reserved is not None:
        wanted = wanted | reserved
    return wanted.sum(dim=-1), finite.sum(dim=-1)


def count_rule(wanted: Tensor, real: Tensor, budgets: list[int], whole: list[bool] | None = None) -> Tensor:
    """n' per sequence [batch] from :func:`wanted_per_head`'s counts, as :func:`count_within` says."""
    within = wanted.float().mean(dim=-1).ceil().long()
    available = real.amin(dim=-1)
    if whole is not None and any(whole):
        within = torch.where(torch.tensor(whole, device=within.device), available, within)
    budget = torch.tensor(budgets, device=within.device)
    return torch.minimum(torch.minimum(within, available), budget).clamp(min=0)


@dataclass(frozen=True)
class Rehearsal:
    """What one layer's rehearsal decided in one decode step, for an observer (``InfiniGenPolicy(...,
    observer=)``): the speculation probe (``eval/speculation.py``) and the tests read it instead of the
    policy's state. Tensors are the policy's own: read them, do not change them."""

    layer: int
    step: int  # decode steps so far, this one included
    # [batch, kv_heads, slots]: speculative_scores (-inf on left padding; under block speculation the
    # candidates' scores, relative to the best candidate, and -inf on the other slots)
    scores: Tensor
    reserved: Tensor | None  # [batch, kv_heads, slots]: sinks and recent window, taken first
    counts: Tensor  # [batch]: n', the slots each sequence fetches
    real_tokens: tuple[int, ...]  # per sequence: real tokens seen, the context of its budget
    index: Tensor  # [batch, kv_heads, max n']: the slots fetched, ascending per row
    valid: Tensor | None  # as index: False on a narrower row's extra entries (None: none)
    real_slots: Tensor  # [batch, kv_heads, slots]: True where a slot holds a real token
    partial_keys: Tensor  # [batch, kv_heads, k, slots]: the partial key cache the scores were read from
    scale: Tensor | None  # [batch, kv_heads, 1, slots]: its per-token scales (None: not quantized)
    to_partial: Callable[[Tensor], Tensor]  # a query [batch, kv_heads, group, d] -> its k partial columns
