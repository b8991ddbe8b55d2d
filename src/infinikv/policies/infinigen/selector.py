"""InfiniGen's choice for one managed layer in one decode step, from the rehearsal's partial query.

:class:`Selector` scores every slot of the layer (``rehearsal.speculative_scores``), counts n' per sequence
(``rehearsal.count_within``, or on the host where every row counts by its budget over a pool that evicted
nothing) and takes each head's top n' with ``base.pick_top``, the reserved slots (the first ``n_sink`` real
tokens and the last ``window``) first; where the host loop scores and every count is known on the host, it
scores and picks in one call of that loop (``rehearsal.scores_and_pick_on_host``, the same entries). With
``block_size`` above 0 it chooses coarse to fine: blocks ranked
by the bounds of their partial keys (``blocks.py``), then tokens scored, counted and picked among the best
blocks alone. Which slots hold real tokens (not a left-padded batch's padding) comes from the policy's base
(:class:`Rows`), through the positions the slots hold (``LayerState.positions``). The policy
decides when a layer chooses and copies what it chose (``policy.py``).
"""

from __future__ import annotations

import functools
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from ..base import group_relative_max, lifts_in_one_pass, pick_each, pick_top
from ..bounds import BlockBounds
from .blocks import block_scores, gather_slots
from .config import InfiniGenConfig
from .layer import LayerState
from .plan import DecodePlan
from .rehearsal import (
    count_rule,
    count_within,
    host_scores_of_rows,
    product_dtype,
    scores_and_pick_on_host,
    scores_on_host,
    speculative_scores,
    wanted_per_head,
)

Tensor = torch.Tensor


class Meter(Protocol):
    """Where the selector's work is counted (the policy's statistics)."""

    counting: AbstractContextManager

    def selector_read(self, *tensors: Tensor) -> None: ...


class Rows(Protocol):
    """Which positions of a left-padded batch hold real tokens, and which are sinks or recent, as the
    policy's base tracks and rules them (``base.Policy``: ``padded``, ``real_at``, ``row_padding``,
    ``sinks_and_recent``)."""

    @property
    def padded(self) -> bool: ...

    def real_at(self, positions: Tensor) -> Tensor: ...

    def row_padding(self, batch: int) -> list[int]: ...

    def sinks_and_recent(self, positions: Tensor, seen: int, n_sink: int, recent: int) -> Tensor: ...


@dataclass
class Choice:
    """What a layer reads: slots [batch, kv_heads, max n'] ascending per row and which of them each row
    attends to (None: all); the scores they were picked by, n' per sequence (None where the host knows it:
    ``widths``) and the reserved slots."""

    index: Tensor
    valid: Tensor | None
    scores: Tensor
    counts: Tensor | None
    widths: list[int] | None
    reserved: Tensor | None


class Selector:
    """Chooses what a managed layer reads (module docstring); counts its work on ``meter``."""

    def __init__(self, config: InfiniGenConfig, layers: list[LayerState], rows: Rows, meter: Meter) -> None:
        self.config, self.layers, self.rows, self.meter = config, layers, rows, meter
        self.block_steps = 0  # layer-steps chosen coarse to fine
        self.block_recounts = 0  # of those, counted again over every token (a head wanted all candidates)
        self._reserved_memo: tuple[tuple, Tensor] | None = None  # _unpadded_reserved's last answer

    def choose(
        self,
        layer: int,
        query: Tensor,
        plan: DecodePlan,
        real_tokens: list[int],
        budgets: tuple[int, ...],
        group_size: int,
        slot_scores: bool,
    ) -> Choice:
        """``layer``'s choice for the partial ``query`` [batch, kv_heads, group, k] (scaled), each sequence
        within its budget of ``budgets`` (of its ``real_tokens``). ``slot_scores``: a coarse-to-fine choice
        returns every slot's scores, not only its candidates' (an observer, and the steps between choices
        of ``select_every`` > 1, read them by slot)."""
        whole = [n <= self.config.min_tokens for n in real_tokens]  # within the floor: everything
        alpha = plan.row_alphas[layer]
        takes = self._candidate_blocks(layer, budgets, whole)
        if takes is not None:
            return self._coarse_to_fine(
                layer, query, plan, takes, alpha, budgets, whole, group_size, slot_scores
            )
        reserved = self.reserved(layer)
        most_reserved = self._most_reserved(layer)
        widths = self._budget_counts(layer, real_tokens, budgets, alpha)
        keys, scale, real = self._score_inputs(layer)
        self._count_read(layer, scale)
        columns = plan.row_columns[layer]
        if (
            widths is not None
            and max(widths) > 0
            and lifts_in_one_pass(widths, most_reserved)
            and scores_on_host(query, keys, columns, scale)
        ):  # every count known on the host: the host loop scores and picks in one call
            scores, index, valid = scores_and_pick_on_host(query, keys, real, scale, widths, reserved)
            return Choice(index, valid, scores, None, widths, reserved)
        scores = speculative_scores(query, keys, columns, real, scale)
        if widths is None:  # an alpha counts: the gather's width is read back (one host sync)
            counts = count_within(scores, alpha, budgets, reserved, whole)
            widths = counts.tolist()
        else:  # what count_within would give is known on the host: ``widths``
            counts = None
        index, valid = pick_top(scores, widths, reserved, most_reserved)
        return Choice(index, valid, scores, counts, widths, reserved)

    def _budget_counts(
        self, layer: int, real_tokens: list[int], budgets: tuple[int, ...], alpha: float | Tensor
    ) -> list[int] | None:
        """n' per sequence where the host knows it without a read: every row counts by its budget (alpha
        inf) over a pool that evicted nothing, so each wants all its real tokens and ``count_within`` gives
        the smaller of those and its budget. None where an alpha counts or slots were evicted."""
        state = self.layers[layer]
        if not (isinstance(alpha, float) and alpha == math.inf) or state.slots.n != state.seen:
            return None
        return [max(0, min(real, budget)) for real, budget in zip(real_tokens, budgets, strict=True)]

    def token_scores(self, layer: int, query: Tensor, plan: DecodePlan) -> Tensor:
        """Speculative logits [batch, kv_heads, slots] of every token of ``layer`` for the partial ``query``
        (:func:`~.rehearsal.speculative_scores`, -inf on left padding)."""
        keys, scale, real = self._score_inputs(layer)
        self._count_read(layer, scale)
        return speculative_scores(query, keys, plan.row_columns[layer], real, scale)

    def _score_inputs(self, layer: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``layer``'s partial keys (unpacked), their scales (or None) and which slots are real (None: all,
        no left padding)."""
        state = self.layers[layer]
        real = self.real_at(state) if self.rows.padded else None
        return state.slots.unpacked(state.slots.view("partial")), self.scales(layer), real

    def _count_read(self, layer: int, scale: Tensor | None) -> None:
        """Count ``layer``'s partial keys as stored (4-bit ones packed) and their ``scale`` as read."""
        self.meter.selector_read(
            self.layers[layer].slots.view("partial"), *([] if scale is None else [scale])
        )

    def scales(self, layer: int) -> Tensor | None:
        """[batch, kv_heads, 1, slots]: per-token scales of ``layer``'s quantized partial keys (or None)."""
        slots = self.layers[layer].slots
        return None if slots.scale is None else slots.view("scale")

    def _candidate_blocks(self, layer: int, budgets: tuple[int, ...], whole: list[bool]) -> list[int] | None:
        """Per sequence, the candidate blocks coarse-to-fine speculation keeps (all its blocks for a row
        within the floor), or None when token speculation decides: blocks are off, or every row's
        candidates would cover all of its tokens anyway."""
        size = self.config.block_size
        if not size:
            return None
        blocks = (self.layers[layer].slots.n + size - 1) // size + 1  # BlockBounds.count
        # the reserved slots' blocks come first: room for them, and for a window that straddles a block edge
        reserve = math.ceil((self.config.window + self.config.n_sink) / size) + 2
        takes = [
            blocks if full else min(math.ceil(self.config.block_candidates * budget / size) + reserve, blocks)
            for budget, full in zip(budgets, whole, strict=True)
        ]
        return None if min(takes) >= blocks else takes

    def _coarse_to_fine(
        self,
        layer: int,
        query: Tensor,
        plan: DecodePlan,
        takes: list[int],
        alpha: float | Tensor,
        budgets: tuple[int, ...],
        whole: list[bool],
        group_size: int,
        slot_scores: bool,
    ) -> Choice:
        """Block speculation (``blocks.py``): rank blocks by their bounds, keep each row's ``takes`` best
        (the blocks of reserved slots first), then score, count and pick tokens among them alone. The
        choice's scores are the candidates' own or, with an observer or ``select_every`` > 1 (both read
        them by slot: ``slot_scores``), every slot's as token speculation gives them, -inf off the
        candidates.

        With blocks of one token the bounds are the tokens' own scores, and it selects exactly what token
        speculation selects: candidates are the best tokens by the same order, and a head whose candidates
        all come within alpha (it may want more than them) is counted again over every token."""
        state = self.layers[layer]
        slots, n = state.slots, state.slots.n
        bounds = self.bounds(layer)
        batch, heads = slots.pos.shape[:2]
        blocks = bounds.count(n)
        block_reserved = self._reserved_blocks(layer, bounds, blocks)
        tokens = None
        if bounds.size == 1:  # a block of one token: its bound is its score (block 0 holds nothing)
            tokens = self.token_scores(layer, query, plan)
            coarse = torch.nn.functional.pad(tokens, (1, 0), value=-math.inf)
        else:
            self.meter.selector_read(bounds.bounds[:, :, :blocks])
            upper = block_scores(query, bounds, blocks, plan.row_columns[layer])
            coarse = group_relative_max(upper.flatten(1, 2), group_size)
        chosen, chosen_valid = pick_top(coarse, takes, block_reserved)
        candidates = bounds.slots_of(chosen)  # ascending
        present = (candidates >= 0) & (candidates < n)
        if chosen_valid is not None:
            present &= chosen_valid.repeat_interleave(bounds.size, dim=-1)
        candidates = candidates.clamp(0, n - 1)
        present &= self.real_at(state, candidates)
        if tokens is not None:
            fine = torch.gather(tokens, 2, candidates).masked_fill(~present, -math.inf)
        else:
            keys, scale = gather_slots(slots.partial, slots.scale, candidates)
            self.meter.selector_read(keys, *([] if scale is None else [scale]))
            fine = speculative_scores(query, slots.unpacked(keys), plan.row_columns[layer], present, scale)
        fine_reserved = self.reserved(layer, candidates)
        if fine_reserved is not None:
            fine_reserved &= present
        wanted, real = wanted_per_head(fine, alpha, fine_reserved)
        counts = count_rule(wanted, real, budgets, whole)
        with self.meter.counting:
            self.block_steps += 1
        covered = torch.tensor([take >= blocks for take in takes], device=counts.device)
        budget = torch.tensor(budgets, device=counts.device)
        recount = ((wanted >= real) & (real > 0)).any(dim=-1) & (counts < budget) & ~covered
        if bool(recount.any()):
            with self.meter.counting:
                self.block_recounts += 1
            if tokens is None:
                tokens = self.token_scores(layer, query, plan)
            every = count_within(tokens, alpha, budgets, self.reserved(layer), whole)
            counts = torch.where(recount, every, counts)
        index, valid = pick_top(fine, counts.tolist(), fine_reserved)
        index = torch.gather(candidates, 2, index)
        if not slot_scores:
            return Choice(index, valid, fine, counts, None, fine_reserved)
        # as token speculation's, for the observer and for what the steps between choices follow (both go by
        # slot): the candidates' scores in their slots, -inf elsewhere
        spread = fine.new_full((batch, heads, n + 1), -math.inf)
        scores = spread.scatter_(2, torch.where(present, candidates, n), fine)[..., :n]
        return Choice(index, valid, scores, counts, None, self.reserved(layer))

    def bounds(self, layer: int) -> BlockBounds:
        """``layer``'s block bounds (``SlotTable.block_bounds``)."""
        state = self.layers[layer]
        padding = self.rows.row_padding(state.slots.pos.shape[0])
        real_at = functools.partial(self.real_at, state)
        return state.slots.block_bounds(self.config.block_size, padding, real_at)

    def real_at(self, state: LayerState, index: Tensor | None = None) -> Tensor:
        """bool, as ``index`` [batch, kv_heads, m] (None: every slot in use): whether each of ``state``'s
        slots holds a real token (not left padding)."""
        return self.rows.real_at(state.positions(index))

    def reserved(self, layer: int, index: Tensor | None = None) -> Tensor | None:
        """bool [batch, kv_heads, slots] (or as ``index`` [batch, kv_heads, m], for those slots): the slots
        of the first ``n_sink`` real tokens and of the last ``window`` past tokens (None when both are 0), by
        the base's rule (``Rows.sinks_and_recent``) over the positions the slots hold."""
        n_sink, window = self.config.n_sink, self.config.window
        if not (n_sink or window):
            return None
        state = self.layers[layer]
        batch, heads = state.slots.pos.shape[:2]
        shared = index is None and state.slots.n == state.seen
        if shared and not self.rows.padded:
            return self._unpadded_reserved(state.seen, batch, heads, state.slots.pos.device)
        if shared:  # nothing evicted: slot i holds position i in every head, so one head's answer serves all
            index = torch.arange(state.seen, device=state.slots.pos.device).expand(batch, 1, -1)
        near = self.rows.sinks_and_recent(state.positions(index), state.seen, n_sink, window)
        return near.expand(-1, heads, -1) if shared else near

    def _unpadded_reserved(self, seen: int, batch: int, heads: int, device: torch.device) -> Tensor:
        """:meth:`reserved` of a layer that evicted nothing in a batch without padding: slot i holds
        position i in every row and head, so the answer depends on ``seen`` alone; kept for the next layer
        that asks with the same ``seen`` (a read-only view: readers never write to it)."""
        key = (seen, batch, heads, device)
        memo = self._reserved_memo  # read once: the worker's look-ahead and the decode thread both ask
        if memo is None or memo[0] != key:
            positions = torch.arange(seen, device=device).expand(batch, 1, -1)
            near = self.rows.sinks_and_recent(positions, seen, self.config.n_sink, self.config.window)
            memo = self._reserved_memo = (key, near.expand(-1, heads, -1))
        return memo[1]

    def _most_reserved(self, layer: int) -> int | None:
        """The most slots :meth:`reserved` can hold in one head, where the host knows it: nothing evicted,
        so they are at most the sinks and the window (``pick_top`` then lifts them in one pass)."""
        state = self.layers[layer]
        return self.config.n_sink + self.config.window if state.slots.n == state.seen else None

    def _reserved_blocks(self, layer: int, bounds: BlockBounds, blocks: int) -> Tensor | None:
        """bool [batch, kv_heads, blocks]: the blocks that hold a reserved slot (None: none reserved)."""
        n_sink, window = self.config.n_sink, self.config.window
        if not (n_sink or window):
            return None
        state = self.layers[layer]
        n, device = state.slots.n, state.slots.pos.device
        batch, heads = state.slots.pos.shape[:2]
        if n == state.seen:  # nothing evicted: slot i holds position i, so the reserved slots are known
            padding = torch.tensor(self.rows.row_padding(batch), device=device)[:, None, None]
            sinks = padding + torch.arange(n_sink, device=device)
            recent = torch.arange(n - window, n, device=device).expand(batch, 1, -1)
            near = torch.cat([sinks, recent], dim=2).clamp(0, n - 1).expand(-1, heads, -1)
            real = self.reserved(layer, near)  # out of range or padding: not reserved
            index = torch.where(real, bounds.block_of(near), 0)  # block 0 holds no real token
            hits = torch.zeros(batch, heads, blocks, dtype=torch.bool, device=device)
            hits.scatter_(2, index, True)
            hits[..., 0] = False
            return hits
        slot_blocks = bounds.block_of(torch.arange(n, device=device)).expand(batch, heads, n)
        hits = torch.zeros(batch, heads, blocks, dtype=torch.int32, device=device)
        return hits.scatter_add_(2, slot_blocks, self.reserved(layer).int()) > 0


def choose_together(
    selectors: list[Selector], layer: int, queries: list[Tensor], widths: list[int]
) -> list[Choice]:
    """:meth:`Selector.choose` for several sequences of one unpadded row each, whose partial keys of
    ``layer`` have one form, that count by their budgets over pools that evicted nothing (``widths``: each
    one's n'; at least its reserved slots), with one ``n_sink`` and ``window``: their scores, in one tensor
    (``queries``: each one's partial query, as :meth:`Selector.choose` takes it), and each head's top n'
    picked in one pass (``base.pick_each``). int8 keys on the host are scored row by row in the host loop
    (``rehearsal.scores_on_host``), the padding -inf; other keys are put in one tensor (converted to the
    product's dtype as they are copied where they share a length, else padded with zeros to the longest and
    the padding masked to -inf) and scored in one product. Each gets the choice it makes alone: a batched
    product computes each row as it would alone, and a row's scores over its own slots, its reserved slots
    and its cut are its own."""
    states = [selector.layers[layer] for selector in selectors]
    keys = [state.slots.unpacked(state.slots.view("partial")) for state in states]
    scales = [selector.scales(layer) for selector in selectors]
    for selector, key, scale in zip(selectors, keys, scales, strict=True):
        selector.meter.selector_read(key, *([] if scale is None else [scale]))
    lengths = [key.shape[-1] for key in keys]
    longest, rows, heads = max(lengths), len(keys), keys[0].shape[1]
    device = keys[0].device
    reserved = [selector.reserved(layer) for selector in selectors]
    lifted = _stacked_reserved(reserved, lengths, longest)
    if scores_on_host(queries[0], keys[0], (), scales[0]):  # each row scored alone in the host loop
        scores = host_scores_of_rows(queries, keys, scales)
    elif (
        min(lengths) == longest
    ):  # nothing to pad: each row's keys converted into one tensor as they are copied
        compute = product_dtype(queries[0].dtype, keys[0].dtype, scales[0] is not None)
        padded_keys = keys[0].new_empty((rows, *keys[0].shape[1:]), dtype=compute)
        for row, key in enumerate(keys):
            padded_keys[row].copy_(key[0])
        padded_scale = None if scales[0] is None else torch.cat(scales)
        scores = speculative_scores(torch.cat(queries), padded_keys, (), None, padded_scale)
    else:
        padded_keys = keys[0].new_zeros(rows, heads, keys[0].shape[2], longest)
        padded_scale = None if scales[0] is None else scales[0].new_ones(rows, heads, 1, longest)
        for row, (key, scale, n) in enumerate(zip(keys, scales, lengths, strict=True)):
            padded_keys[row, ..., :n] = key[0]
            if padded_scale is not None:
                padded_scale[row, ..., :n] = scale[0]
        within = torch.arange(longest, device=device) < torch.tensor(lengths, device=device)[:, None]
        real = within[:, None].expand(-1, heads, -1)
        scores = speculative_scores(torch.cat(queries), padded_keys, (), real, padded_scale)
    most_reserved = selectors[0].config.n_sink + selectors[0].config.window
    index = pick_each(scores, widths, lifted, most_reserved)
    return [
        Choice(
            index[row : row + 1, :, :width].contiguous(),
            None,
            scores[row : row + 1, :, :n],
            None,
            [width],
            near,
        )
        for row, (width, n, near) in enumerate(zip(widths, lengths, reserved, strict=True))
    ]


def _stacked_reserved(reserved: list[Tensor | None], lengths: list[int], longest: int) -> Tensor | None:
    """The rows' ``reserved`` slots [1, kv_heads, n] in one tensor [rows, kv_heads, longest], False past a
    row's own slots (None when nothing is reserved)."""
    if reserved[0] is None:
        return None
    if min(lengths) == longest:
        return torch.cat(reserved)
    stacked = reserved[0].new_zeros(len(reserved), reserved[0].shape[1], longest)
    for row, (near, n) in enumerate(zip(reserved, lengths, strict=True)):
        stacked[row, :, :n] = near[0]
    return stacked
