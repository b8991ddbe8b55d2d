"""When InfiniGen's layers choose, and what they read at the steps between choices.

Two knobs make a layer's reads depend on the step before: ``select_every`` N (steps 1, N + 1, 2N + 1, …
rehearse and choose; the others read again what the layer read at the step before, the token it stored
then, and the token after each of the best-scored tokens it read at the last choice) and
``own_query_prefetch`` (an own-query layer copies ahead what it chose at the step before). The
:class:`Schedule` answers the questions these raise; the policy makes the copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..base import pick_top, resolve_budget
from .config import FOLLOWED_SHARE, InfiniGenConfig
from .layer import LayerState

Tensor = torch.Tensor


@dataclass(frozen=True)
class Schedule:
    select_every: int  # a choice at steps 1, N + 1, ...; the steps between read again
    own_query_prefetch: bool  # an own-query layer copies ahead the slots it chose at the step before
    budget: float  # the policy's budget (a share of the real tokens, or a count)
    min_tokens: int  # the budget's floor

    @classmethod
    def of(cls, config: InfiniGenConfig) -> Schedule:
        return cls(config.select_every, config.own_query_prefetch, config.budget, config.min_tokens)

    def reads_again(self, state: LayerState, step: int) -> bool:
        """Whether a managed layer reads again at decode step ``step`` (:meth:`with_newest`) instead of
        choosing."""
        between = (step - 1) % self.select_every != 0
        return between and state.managed and state.chosen is not None

    def keeps_choice(self, state: LayerState, own_query: bool) -> bool:
        """Whether a layer keeps what it chose for the next step: to read again (``select_every`` > 1) or
        for an own-query layer's prefetch."""
        return (self.select_every > 1 and state.managed) or (self.own_query_prefetch and own_query)

    @property
    def follows(self) -> bool:
        """Whether the steps between choices read the tokens after those a choice scored best."""
        return self.select_every > 1

    def choice_budget(self, real: int) -> tuple[int, int]:
        """A choosing step's budget for a sequence of ``real`` tokens, and how many of the tokens it reads
        the steps until the next choice follow (``select_every`` N > 1: :data:`FOLLOWED_SHARE` of its
        budget; 0 when the budget holds every token, or N is 1). The budget is the sequence's, less the room
        for what those N - 1 steps add to what it reads (per step the tokens followed and the one stored)."""
        budget = resolve_budget(self.budget, max(real, 1), floor=self.min_tokens)
        if budget >= real or self.select_every == 1:
            return budget, 0
        follow = math.ceil(budget * FOLLOWED_SHARE)
        # The budget grows by at most a token a step and each step between adds follow + 1 to the reads, so
        # the room the last step before the next choice needs is the least a choice may take.
        between = self.select_every - 1
        last = resolve_budget(self.budget, real + between, floor=self.min_tokens)
        return last - between * (follow + 1), follow

    @staticmethod
    def with_newest(state: LayerState) -> tuple[Tensor, Tensor | None]:
        """What a layer reads at a step between choices: what it read at the step before, the slot of the
        token it stored then and, where nothing was evicted (slot i holds position i), the token after each
        of the tokens it follows (its best read at the last choice, one further at each step: ``state`` is
        moved on). Slots [batch, kv_heads, m] ascending per row, and which of them each row reads (None:
        all); a slot listed twice is read once (the repeat hidden)."""
        parts = [(state.chosen, state.chosen_valid), (state.newest, None)]
        if state.slots.n == state.seen and state.followed is not None:
            followed, valid = state.followed
            state.followed = ((followed + 1).clamp(max=state.slots.n - 1), valid)
            parts.append(state.followed)
        index = torch.cat([slots for slots, _ in parts], dim=2)
        valid = torch.cat([torch.ones_like(s, dtype=torch.bool) if v is None else v for s, v in parts], dim=2)
        # in slot order, a read copy of a slot before a hidden one; then each slot's first copy is read
        keyed, _ = (index * 2 + (~valid).long()).sort(dim=-1)
        index, valid = keyed // 2, keyed % 2 == 0
        valid[..., 1:] &= index[..., 1:] != index[..., :-1]
        return index, None if bool(valid.all()) else valid

    @staticmethod
    def best_read(
        scores: Tensor, index: Tensor, valid: Tensor | None, takes: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """Of the slots ``index`` a choice reads (``valid``: None = all), each row's ``takes`` best by
        ``scores`` ([batch, kv_heads, max(takes)]): the tokens the steps until the next choice follow, and
        which of them hold a token read (None: all)."""
        picked = scores.gather(2, index)
        picked = picked if valid is None else picked.masked_fill(~valid, -math.inf)
        read = torch.full_like(scores, -math.inf).scatter_reduce(2, index, picked, "amax")
        best, shown = pick_top(read, takes)
        held = read.gather(2, best) > -math.inf  # a token read (not padding, nor a row's hidden extra)
        held = held if shown is None else held & shown
        return best, None if bool(held.all()) else held
