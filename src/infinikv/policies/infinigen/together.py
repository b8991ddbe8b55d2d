"""An engine step's InfiniGen sequences that choose a layer together (the ``_rows`` class methods of
``InfiniGenPolicy``).

Each sequence of an engine step has its own policy instance. Where several of them choose a layer the
plain way (:func:`chooses_together`: counted by the budget, over a pool that evicted nothing, in one set
of columns, without blocks or an observer, at a choosing step), and their partial keys have one form
(``SlotTable.form``), their rehearsals are scored in one product and picked in one pass
(``selector.choose_together``), bit for bit what each sequence's own product gives; each then keeps its
choice and starts its own copy as it does alone. The new tokens' partial keys of sequences with one
projection are projected and quantised in one product too (:func:`partial_keys_together`), and their K/V
written to the pool in one copy (:func:`store_together`). Products are stacked only where that gives each
row its own bits (``base.stacks_rows_exactly``: float32 and bfloat16 on the CPU); elsewhere each sequence
chooses and projects alone.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import torch

from ...kvpool import KVPool
from ..base import StepRows, stacks_rows_exactly
from .fetches import Fetch
from .rehearsal import quantize
from .selector import choose_together

if TYPE_CHECKING:
    from .policy import InfiniGenPolicy

Tensor = torch.Tensor


def chooses_together(policy: InfiniGenPolicy, layer: int, own_query: bool) -> bool:
    """Whether ``policy``'s choice for ``layer`` at this step (``own_query``: an own-query layer's, by its
    own input; else the look-ahead's, one layer ahead) is a plain token rehearsal of one unpadded
    sequence, in a dtype and on a device whose stacked products are exact, which it may make with other
    sequences (module docstring)."""
    plan, state = policy.decoding, policy.layers[layer]
    if not (plan is not None and state.managed and (layer in plan.own_query) == own_query and state.slots.n):
        return False
    if state.projection is None or not stacks_rows_exactly(state.projection):
        return False
    alpha = plan.row_alphas[layer]
    if not (isinstance(alpha, float) and alpha == math.inf) or plan.row_columns[layer]:
        return False
    if policy.padded or state.slots.pos.shape[0] != 1 or policy.observer is not None:
        return False
    return not (policy.schedule.follows or policy.config.block_size or state.slots.n != state.seen)


def groups(policies: list[InfiniGenPolicy], layer: int, own_query: bool) -> tuple[list[int], list[list[int]]]:
    """Which of ``policies`` choose ``layer`` alone, and the groups of two or more that choose it together:
    those that choose plainly (:func:`chooses_together`), by partial-key form, sinks and window."""
    if len(policies) < 2:  # a group needs two
        return list(range(len(policies))), []
    forms: dict[tuple, list[int]] = {}
    alone = []
    for r, policy in enumerate(policies):
        if chooses_together(policy, layer, own_query):
            # the reserved slots (sinks and window) are lifted and counted for every row of a group alike
            key = (policy.layers[layer].slots.form(), policy.config.n_sink, policy.config.window)
            forms.setdefault(key, []).append(r)
        else:
            alone.append(r)
    alone += [rows[0] for rows in forms.values() if len(rows) == 1]
    return sorted(alone), [rows for rows in forms.values() if len(rows) > 1]


def start_fetches_together(
    policies: list[InfiniGenPolicy], layer: int, rows: StepRows, on_demand: bool = False
) -> list[Fetch]:
    """``InfiniGenPolicy.start_fetch`` of ``layer`` for each of ``policies`` (a group of :func:`groups`):
    each chooses what it would alone, in one product over their partial keys; the time it takes counts in
    equal shares as each sequence's selector time. ``on_demand``: the copies are an own-query layer's, made
    now (``KVPool.on_demand``)."""
    start = time.perf_counter()
    rehearsed = rehearsal_queries_together(policies, layer, rows)
    real_tokens = [policy.seen_real_tokens(policy.layers[layer]) for policy in policies]
    budgets = [
        policy.schedule.choice_budget(real[0])[0] for policy, real in zip(policies, real_tokens, strict=True)
    ]
    widths = [min(real[0], budget) for real, budget in zip(real_tokens, budgets, strict=True)]
    choices = choose_together([policy.selector for policy in policies], layer, rehearsed, widths)
    share = (time.perf_counter() - start) / len(policies)
    fetches = []
    for policy, choice, real in zip(policies, choices, real_tokens, strict=True):
        policy.count_selector_time(share)
        index, valid = policy.keep_choice(layer, choice, real, (0,))
        with policy.host_pool.on_demand() if on_demand else contextlib.nullcontext():
            fetches.append(policy.fetch_chosen(layer, index, valid))
    return fetches


def rehearsal_queries_together(policies: list[InfiniGenPolicy], layer: int, rows: StepRows) -> list[Tensor]:
    """Each of ``policies``' ``rehearsal_query`` of ``layer`` for its row of ``rows``: where every row has
    its query from the step's shared projections and the sequences project onto one set of columns (one
    calibration: one projection tensor, the same columns stored), in one product; row by row what each
    takes alone (a batched product computes each row's block with the same kernel)."""
    states = [policy.layers[layer] for policy in policies]
    first = states[0]
    shared = all(query is not None for query in rows.queries) and all(
        state.projection is first.projection and state.stored_key == first.stored_key for state in states
    )
    if not shared:
        return [policy.rehearsal_query(layer, *rows.of(r)) for r, policy in enumerate(policies)]
    spec = policies[0].spec
    query = torch.cat([queries(layer) for queries in rows.queries])  # [rows, heads, 1, d]
    grouped = query.reshape(query.shape[0], spec.num_kv_heads, spec.group_size, spec.head_dim)
    weight = spec.attention[layer].q_proj.weight  # projected once for every row (spec.SharedQueries)
    for policy in policies:  # as rehearsal_query counts it, each row its share
        if layer not in policy.decoding.own_query:
            policy.selector_read(weight, shared_by=len(policies))
    partial = policies[0].partial_query(layer, grouped) * spec.scaling(layer)
    return list(partial.split(1))


def partial_keys_together(
    policies: list[InfiniGenPolicy], layer: int, k_new: list[Tensor]
) -> list[tuple[Tensor, Tensor | None] | None]:
    """Per sequence, the partial keys and scale of its new token ``k_new`` where two or more of them
    project ``layer``'s keys with one projection tensor into the same storage (else None: it takes its
    own), in a dtype and on a device where ``base.stacks_rows_exactly`` holds. The product and the
    per-token scales are row by row those each takes alone."""
    given: list[tuple[Tensor, Tensor | None] | None] = [None] * len(policies)
    if len(policies) < 2:  # a row alone takes its own
        return given
    kinds: dict[tuple, list[int]] = {}
    for r, policy in enumerate(policies):
        projection = policy.layers[layer].projection
        # one calibration: one tensor (Skew.projection)
        if policy.managed(layer) and projection is not None and stacks_rows_exactly(projection):
            kinds.setdefault((id(projection), policy.key_bits), []).append(r)
    for rows in kinds.values():
        if len(rows) < 2:
            continue
        projection = policies[rows[0]].layers[layer].projection
        partial, scale = quantize(
            torch.matmul(torch.cat([k_new[r] for r in rows]), projection), policies[rows[0]].key_bits
        )
        for i, r in enumerate(rows):
            stored = policies[r].layers[layer].in_store(partial[i : i + 1])
            given[r] = (stored, None if scale is None else scale[i : i + 1])
    return given


def store_together(
    policies: list[InfiniGenPolicy], layer: int, k_new: list[Tensor], v_new: list[Tensor]
) -> list[bool]:
    """Per sequence, whether its new token's K/V went into its pool here: those of the sequences whose
    layer takes a new slot for it (no eviction), two or more, in one copy per part
    (``KVPool.append_rows``). The slots each one's tokens take are those it takes alone."""
    rows = [r for r, policy in enumerate(policies) if policy.appends(layer)]
    if len(rows) < 2:
        return [False] * len(policies)
    pools = [policies[r].host_pool for r in rows]
    KVPool.append_rows(pools, layer, [k_new[r] for r in rows], [v_new[r] for r in rows])
    stored = set(rows)
    return [r in stored for r in range(len(policies))]
