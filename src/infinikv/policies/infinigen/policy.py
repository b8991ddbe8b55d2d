"""``infinigen``: speculative KV selection and prefetch (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707).

The full K/V of every layer live in the host pool. Each layer that InfiniGen manages keeps, on the compute
device, a *partial key cache*: its post-RoPE keys times the skewing matrix A (``calibration.py``), restricted
to a few columns. In a decode step, from layer i's pre-attention hook (the cache calls ``plan(i+1)``), the
policy rehearses layer i+1:

1. speculative query q̂ = (RoPE(x W_q,i+1) A)[cols] from layer i's normalised input x;
2. scores s = q̂ · K̃_i+1[:, cols]ᵀ times the attention scale, per query head, relative to that head's
   best, then combined over the heads of a KV group by max (``rehearsal.speculative_scores``);
3. per KV head the count of tokens with s > max(s) − alpha, averaged over KV heads: n' per sequence, capped
   by ``budget`` (at least ``min_tokens``; a context within ``min_tokens`` takes everything;
   ``rehearsal.count_within``); the rows fetched are each head's top-n' scores in ascending slot order
   (``base.pick_top``), the last ``window`` and the first ``n_sink`` tokens always among them. With
   ``block_size`` above 0 the rehearsal is coarse to fine (``blocks.py``): blocks are ranked by bounds of
   their partial keys first, and tokens are scored, counted and picked among the best blocks alone;
4. the gather and copy of those rows start at once (the pool's worker thread or the CUDA copy stream) and
   overlap the rest of layer i; layer i+1 attends with its real query over [selected; newest token]. On a
   CPU the whole look-ahead (steps 1-4) runs on the pool's worker thread (``KVPool.ahead``); on CUDA its
   kernels queue on the compute stream.

Where it departs from the paper and its artifact (docs/results-infinigen.md measures what each buys):

* **Grouped-query attention**: one skewing matrix per KV head; each query head's scores are taken relative
  to its own best before the group's heads are combined by max (the KV head is fetched once for the whole
  group, so it needs the union of what its query heads want); the count is averaged over the KV heads.
* **Calibrated knobs** (``tuning.py``): ``alpha`` 0 and ``partial_ratio`` 0 (the defaults) take the model's
  calibrated values, stored with its skew: a share of columns per prompt length and an alpha per layer and
  per way of choosing. A sequence takes, at its first decode step, the widest share calibrated at its
  prompt's window (the shortest at least as long, else the longest) or a longer one: a short prompt's own
  share meets the recall rule on average, but the device budget holds the longer windows' columns, and
  with them the rehearsal finds what fewer columns miss (the values of a multi-part answer). A calibrated
  alpha is a threshold on scores over the columns it was calibrated with (the calibration text's), so a
  sequence that rehearses with other columns fetches its budget instead (``InfiniGenConfig.alpha_holds``;
  ``stats()["count_rule_used"]``); at the default columns that is every prompt on SmolLM2-135M and
  Gemma-3-270M. A given ``--alpha`` counts every sequence. The paper's constants: ``--alpha 5
  --partial-ratio 0.2``.
* **A recent window** of ``window`` tokens (32) is always fetched; the paper keeps none (``--window 0``).
* **The first layers** (``dense_layers``, 2), which no layer before rehearses, choose the budget's tokens by
  their own query once it exists (``first_layers`` own); the paper loads them whole (``--first-layers
  dense``). Later layers whose rehearsal misses what their own query finds choose the same way
  (``own_query_layers``, by default the model's calibrated ones, at most an eighth of the rehearsed layers).
  Where calibrated alphas count, each counts with the alpha calibrated for how it chooses. Their copies
  wait on their layer (the pool counts them apart, ``bytes_h2d_on_demand``); with ``own_query_prefetch``
  such a layer copies ahead the slots it chose at the step before and, once its own query has chosen, only
  what that missed, and the rows of both copies are put in the order of its own choice
  (:class:`Corrected`).
* **A device budget**: ``device_budget`` bounds the partial key cache (with any block bounds) as a share of
  the dense KV of the same tokens in the model's dtype. By default the keys are int8 with one float16 scale
  per token and KV head (``partial_keys``; ``rehearsal.quantize``, the scale over the widest calibrated
  columns, so a row's integers do not depend on its batch), scored in bfloat16, which holds them exactly; a
  calibrated ratio is cut to the columns that fit (``InfiniGenConfig.column_cap``). Where int8 keys would be
  cut below the calibrated columns they are stored as int4, two to a byte (``keys_when_cut``,
  ``InfiniGenConfig.stored_keys``, settled with the first prompt chunk's dtype; ``slots.pack_nibbles``). The
  paper stores them in the model's dtype (``--partial-keys model``).
* **Columns per prompt length in one store**: the prompt's partial keys are computed with the widest
  calibrated columns (its length is not known while its chunks arrive), then cut to the widest the batch
  needs when decoding starts. Column sets are nested, so a sequence that needs fewer reads its own from that
  store and gets the scores it would get alone. With ``column_allocation`` per_layer the uniform ratio's
  columns are spread over the layers by calibration's per-layer recall curves (``tuning.allocate_ratios``),
  the same device bytes; every sequence then counts by its budget.
* **Choosing every N-th step** (``select_every``; 1, the paper's, by default): at the steps between, each
  managed layer reads what it read at the step before, the slot of the token it stored then, and the token
  after each of the best-scored tokens it read at the last choice (``FOLLOWED_SHARE`` of its budget), one
  position further at each step (``schedule.py``); nothing is rehearsed and every copy starts a layer ahead.
  A choice leaves room for what the steps until the next add, so every step reads within its budget. Where a
  full pool evicts, the steps between read the step before's slots and the new token, and follow nothing.
* **Batches**: when the sequences of a batch get different n', the gather is as wide as the largest and each
  row's entries past its own n' are hidden (``Selection.valid``), so a sequence attends to exactly what it
  would attend to alone; the bytes counted are those copied, the tokens attended those each row sees.
* **A real host pool** (the artifact simulates eviction with masks). ``capacity`` at most 1 is a fraction,
  above 1 a token count: after t tokens a layer's pool holds at most ⌈capacity·t⌉ (or ``capacity``) tokens
  per sequence and KV head, in slots of the left-padded batch. The prompt is stored whole during prefill and
  the pool is cut to capacity when decoding starts; from then on, when full, one slot per (sequence, KV head)
  is overwritten per new token. Victims: left-padding slots first; never the newest half of the pool; among
  the rest ``fifo`` takes the oldest token, ``lru`` the least recently fetched (storing counts as a use),
  ``counter`` the one fetched the fewest times (the paper's default), ties to the oldest. Evicted tokens
  leave the partial key cache with them (the two share slot numbers).

Sliding-window layers (Gemma-3) attend to their window, fetched from the pool and evicted by FIFO; the
policy rehearses the other global layers, each in the hook of the layer before it whatever that layer's
type. ``stats()`` reports the knob values used and where they came from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...copiers import Transfer
from ...errors import PolicyError
from ...spec import ModelSpec
from ..base import HostPoolPolicy, Selection, first_slots, group_relative_max, pick_top
from ..bounds import BlockBounds
from ..registry import register
from . import skewfile
from .blocks import block_scores, gather_slots
from .calibration import ensure_skew
from .config import PAPER_ALPHA, PAPER_PARTIAL_RATIO, PARTIAL_KEYS, InfiniGenConfig
from .layer import LayerState
from .plan import DecodePlan, layer_alpha, own_query_layers, settle
from .rehearsal import Rehearsal, count_rule, count_within, quantize, speculative_scores, wanted_per_head
from .schedule import Schedule
from .skewfile import Skew

Tensor = torch.Tensor
_SHIFT = 1 << 21  # eviction keys pack (tier, rule value, position), each below 2**21


@register("infinigen")
class InfiniGenPolicy(HostPoolPolicy):
    config_class = InfiniGenConfig
    prefill_family = "dense"
    prefetches = True

    @classmethod
    def prepare(cls, config: InfiniGenConfig, loaded: Any) -> None:
        """Calibrate the model once (skewing matrices and the calibrated knobs), unless a calibration of
        this version is cached."""
        ensure_skew(loaded)

    def __init__(
        self,
        config: InfiniGenConfig,
        spec: ModelSpec,
        device: torch.device,
        skew: Skew | None = None,
        observer: Callable[[Rehearsal], None] | None = None,
    ):
        """``skew``: a calibration (``calibration.calibrate``); by default the cached calibration for
        ``spec.weights_id`` is loaded when the first prompt arrives. ``observer``: called with each layer's
        :class:`~.rehearsal.Rehearsal` record in each decode step (diagnostics; None: nothing recorded)."""
        super().__init__(config, spec, device)
        if skew is not None:
            skew.check(spec)
        self._skew = skew
        config.check_spec(spec)
        self.observer = observer
        self.layers = [LayerState(config.selects(spec, layer)) for layer in range(spec.num_layers)]
        self.schedule = Schedule.of(config)
        # what the first decode step settles (plan.py): columns, count rules, alphas, own-query layers
        self.decoding: DecodePlan | None = None
        # how the partial keys are stored and their bits, settled with the first prompt chunk's dtype
        self._stored_keys = config.partial_keys
        self._bits = PARTIAL_KEYS[config.partial_keys]
        # columns allocated per layer, per calibration window (empty: uniform), set with the first partial
        # keys
        self._allocations: dict[int, dict[int, float]] | None = None
        self._real: Tensor | None = None  # [batch, prompt tokens]: True = real token, False = left padding
        self._step = 0
        # (most partial columns within the device budget, head_dim), set by the first prompt chunk's dtype
        self._cap: tuple[int, int] | None = None
        # statistics
        self._decode_h2d = 0
        self._offload_h2d = 0  # what full offload would have moved in the same decode steps
        self._evicted = 0
        self._block_steps = 0  # layer-steps chosen coarse to fine
        self._block_recounts = 0  # of those, counted again over every token (a head wanted all candidates)

    # -- which layer does what -------------------------------------------------------------------------------
    def managed(self, layer: int) -> bool:
        """Selectively fetched (the others load their full KV or their window)."""
        return self.layers[layer].managed

    def own_query(self) -> frozenset[int]:
        """The managed layers that choose with their own query (``plan.own_query_layers``), as the first
        decode step settles them."""
        if self.decoding is not None:
            return self.decoding.own_query
        return own_query_layers(self.config, self.skew(), self.layers)[0]

    def limit(self, layer: int, seen: int) -> int:
        """Most tokens the pool may hold for ``layer`` after ``seen`` tokens."""
        capacity = self.config.capacity
        tokens = math.ceil(capacity * seen) if capacity <= 1 else min(int(capacity), seen)
        window = self.spec.sliding_window[layer]
        return max(1, tokens if window is None else min(tokens, window))

    # -- prefill ---------------------------------------------------------------------------------------------
    def seq_length(self, layer: int) -> int:
        return self.layers[layer].seen

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._step:
            raise PolicyError("infinigen: a prompt chunk after decoding started is not supported")
        if not self.spec.is_sliding(layer) and self.key_valid is not None:
            self._real = self.key_valid.clone() if any(self.padding) else None  # None: no padding
        start, count = self.layers[layer].seen, k.shape[2]
        pos = torch.arange(start, start + count, device=k.device).expand(k.shape[0], k.shape[1], -1)
        partial, scale = self._partial_keys(layer, k)
        self.layers[layer].slots.append(pos, partial, 0, scale)
        self.layers[layer].seen = start + count
        if self.config.block_size > 1 and self.managed(layer):
            real_at = functools.partial(self._real_at, layer)
            padding = self.padding or [0] * k.shape[0]
            self.layers[layer].slots.bound_chunk(start, count, self.config.block_size, padding, real_at)
        return self.host_pool.extend(layer, k, v)

    def _partial_keys(self, layer: int, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The partial skewed keys of ``k`` [batch, kv_heads, tokens, k'] in the columns the store keeps, and
        their per-token scales [batch, kv_heads, tokens, 1] (None: not quantized). The scale is taken over
        the widest calibrated columns, whatever the batch keeps, so a row's integers are those it gets
        alone."""
        state = self.layers[layer]
        if not state.managed:
            return None, None
        if self._cap is None:
            self._settle_storage(k.element_size())
        if state.projection is None:
            skew = self.skew()
            if self._allocations is None:
                self._allocations = self.config.allocations(skew, self._cap)
            widest = self.config.widest_ratio(skew, self._cap, layer, self._allocations)
            projection = skew.projection(layer, widest, self.config.skew)
            state.projection = projection.to(k.device, k.dtype)
        partial, scale = quantize(torch.matmul(k, state.projection), self._bits)
        return state.in_store(partial), scale

    def _settle_storage(self, element_size: int) -> None:
        """At the first prompt chunk: how the partial keys are stored (``InfiniGenConfig.stored_keys``;
        4-bit ones two to a byte) and the most columns the device budget holds in that form."""
        self._stored_keys = self.config.stored_keys(self.skew(), self.spec, element_size)
        self._bits = PARTIAL_KEYS[self._stored_keys]
        for state in self.layers:
            state.slots.packed = self._bits == 4
        storage = dataclasses.replace(self.config, partial_keys=self._stored_keys)
        self._cap = (storage.column_cap(self.spec, element_size), self.spec.head_dim)

    def skew(self) -> Skew:
        """The calibration in use (loaded from the cache on first use; one without calibrated knobs of this
        version is used with the paper's, and says so)."""
        if self._skew is None:
            self._skew = skewfile.cached_skew(self.spec)
            if self._skew is None:
                raise PolicyError(
                    f"no InfiniGen calibration for these weights ({self.spec.weights_id[:12] or 'unknown'}); "
                    "run `infinikv calibrate --model …` or calibration.calibrate(loaded), "
                    "or pass skew= to InfiniGenPolicy"
                )
            if self._skew.tuned is None:
                print(
                    f"infinikv: the cached InfiniGen calibration of {self._skew.model} has no calibrated "
                    f"knobs of this version (the paper's alpha {PAPER_ALPHA:g} and partial ratio "
                    f"{PAPER_PARTIAL_RATIO:g} apply); run `infinikv calibrate --model …` to recalibrate",
                    file=sys.stderr,
                )
        return self._skew

    def alpha(self, layer: int) -> tuple[float, str]:
        """``layer``'s threshold and where it came from (``plan.layer_alpha``)."""
        settled = None if self.decoding is None else self.decoding.alphas[layer]
        return settled or layer_alpha(self.config, self.skew(), layer, self.own_query())

    # -- decode: rehearsal and prefetch ----------------------------------------------------------------------
    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        if layer == 0:  # the cache calls this before anything else of a decode step
            self._step += 1
            if self._step == 1:
                self.begin_decoding()
        if layer in self.decoding.own_query:
            if self.schedule.reads_again(
                self.layers[layer], self._step
            ):  # nothing to choose: its copy started ahead (or now)
                if not self.planned(layer):
                    with self.host_pool.on_demand():
                        self._fetch_reused(layer, self._step)
                return
            # its look-ahead's rows if one ran (own_query_prefetch): its own choice copies what they missed
            self.layers[layer].prefetched = self.take_planned(layer)
            self.fetch_own(layer, x, position_ids)

    def plan(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        schedule, own_query = self.schedule, self.decoding.own_query
        if schedule.reads_again(self.layers[layer], self._step):
            if not self.planned(layer):  # layer 0's was started at the step before
                self._fetch_reused(layer, self._step)
        elif layer not in own_query:
            super().plan(layer, x, position_ids)
        elif layer > 0 and schedule.own_query_prefetch:
            self._prefetch_previous(layer)
        # the next step's layer 0, beside this step's last layers (planned from layer 1 on: layer 0 has
        # taken its own fetch of this step)
        last = self.spec.num_layers - 1
        if layer == last >= 2 and 0 in own_query:
            if schedule.reads_again(self.layers[0], self._step + 1):
                self._fetch_reused(0, self._step + 1)
            elif schedule.own_query_prefetch:
                self._prefetch_previous(0)

    def _fetch_reused(self, layer: int, step: int) -> None:
        """A step between choices (``select_every``): start copying what ``layer`` reads again
        (``Schedule.with_newest``), on the decode thread (nothing is chosen; the copy itself is queued on the
        pool's worker like any other)."""
        state = self.layers[layer]
        index, valid = self.schedule.with_newest(state)
        state.chosen, state.chosen_valid = index, valid
        self._count_bytes(layer, index)
        self._count_use(layer, index, step)
        self._count_offload(layer)
        widths = torch.full((), float(index.shape[2])) if valid is None else valid.sum(dim=-1).float().mean()
        state.selected.append(widths)
        positions = torch.gather(state.slots.view("pos"), 2, index)
        self.hold(layer, Fetch(self.host_pool.fetch(layer, index, extra=1), index, positions, valid))

    def start_fetch(self, layer: int, x: Tensor | None = None, position_ids: Tensor | None = None) -> Fetch:
        """Decide what ``layer`` reads this step and start copying it from the pool. Without an input ``x`` a
        managed layer loads everything. An own-query layer whose look-ahead prefetched rows this step
        (``own_query_prefetch``) copies only the rows of its own choice that the prefetch missed."""
        state = self.layers[layer]
        slots, window = state.slots, self.spec.sliding_window[layer]
        valid = None
        if self.managed(layer) and x is not None:
            index, valid = self._select(layer, x, position_ids)
        elif window is not None:
            index = slots.view("pos").topk(min(window - 1, slots.n), dim=-1).indices
        else:
            index = None
        prefetched, state.prefetched = state.prefetched, None
        if index is not None and prefetched is not None and prefetched.index is not None:
            transfer, copied = self._corrected(layer, index, prefetched)
        else:
            transfer, copied = self.host_pool.fetch(layer, index, extra=1), index
        self._count_bytes(layer, copied)
        self._count_use(layer, index, self._step)
        if index is not None and self.schedule.keeps_choice(state, layer in self.decoding.own_query):
            state.chosen, state.chosen_valid = index, valid  # what the next step prefetches or reads again
        self._count_offload(layer)
        positions = slots.view("pos").clone() if index is None else torch.gather(slots.view("pos"), 2, index)
        return Fetch(transfer, index, positions, valid)

    def _prefetch_previous(self, layer: int) -> None:
        """An own-query layer's prefetch (``own_query_prefetch``): the slots it chose at the step before,
        copied ahead (nothing at the first decode step); its own choice (``start_fetch``) then takes what it
        needs of them and copies the rest. Queued on the decode thread: nothing is chosen. The bytes count
        as moved, not as uses of the slots (eviction counts what the own choice reads, as without it)."""
        index = self.layers[layer].chosen
        if index is None:
            return
        self._count_bytes(layer, index)
        positions = torch.gather(self.layers[layer].slots.view("pos"), 2, index)
        self.hold(layer, Fetch(self.host_pool.fetch(layer, index, extra=1), index, positions, None))

    def _corrected(self, layer: int, index: Tensor, prefetched: Fetch) -> tuple[Corrected, Tensor]:
        """Own-query prefetch: ``index``'s rows [batch, kv_heads, m] from those ``prefetched`` copied ahead,
        and the correction (the slots it missed, copied now). Returns the rows and the slots copied now (a
        row with fewer misses padded with its first)."""
        ahead = prefetched.index
        batch, heads, width = ahead.shape
        # where each slot sits among the prefetched rows (-1: not there); a repeated slot holds the same row
        where = torch.full((batch, heads, self.layers[layer].slots.n), -1, device=ahead.device)
        where.scatter_(2, ahead, torch.arange(width, device=ahead.device).expand_as(ahead))
        at = where.gather(2, index)
        missed = at < 0
        misses = missed.sum(dim=-1, keepdim=True)
        count = int(misses.max())
        correction = index.gather(2, first_slots(missed, count))  # each row's misses, padded with its first
        # each row's place in [prefetched rows, their spare slot, correction rows], then the spare for the new
        # token (decode writes it)
        source = torch.where(missed, width + missed.long().cumsum(dim=-1), at)
        source = torch.cat([source, source.new_full((batch, heads, 1), width)], dim=2)
        rest = self.host_pool.fetch(layer, correction) if count else None
        return Corrected(prefetched.transfer, rest, source), correction

    def _count_bytes(self, layer: int, index: Tensor | None) -> None:
        """Bytes moved by a fetch of ``layer``'s slots ``index`` (None: every slot)."""
        slots = self.layers[layer].slots
        batch, heads = slots.pos.shape[:2]
        rows = batch * heads * slots.n if index is None else index.numel()
        with self.counting:
            self._decode_h2d += self._row_bytes(layer) * rows

    def _count_use(self, layer: int, index: Tensor | None, step: int) -> None:
        """For eviction, each slot ``layer`` reads at decode step ``step`` (``index``; None: every slot): its
        fetch count and last use. A narrower row's padding repeats a slot it reads. Nothing to count where
        the pool never evicts by them (capacity 1; a sliding layer evicts by position)."""
        if self.config.capacity == 1 or self.spec.is_sliding(layer):
            return
        slots = self.layers[layer].slots
        if index is None:
            slots.view("fetches").add_(1)
            slots.view("last").fill_(step)
            return
        slots.fetches.scatter_add_(2, index, torch.ones_like(index))
        slots.last.scatter_(2, index, torch.full_like(index, step))

    def _count_offload(self, layer: int) -> None:
        """What full offload would move for ``layer`` this step: every slot seen, K and V."""
        state = self.layers[layer]
        batch, heads = state.slots.pos.shape[:2]
        with self.counting:
            self._offload_h2d += self._row_bytes(layer) * batch * heads * state.seen

    def _row_bytes(self, layer: int) -> int:
        """Bytes of one token's K and V in one KV head of ``layer``'s pool."""
        return 2 * self.host_pool.slot_bytes(layer)

    def begin_decoding(self) -> None:
        """The run's plan (``plan.settle``: each sequence's columns and count rule, each layer's alpha) and
        every pool cut to its capacity where the prompt is larger. Called by the first decode step's layer 0,
        on the decode thread before any look-ahead runs beside it (look-aheads touch only their own layer),
        or first by a caller that drives layers alone; once per run."""
        if self.decoding is not None:
            return
        stored = [layer for layer, state in enumerate(self.layers) if state.seen]
        real_tokens = self._real_tokens(stored[0]) if stored else []
        storage = (self._stored_keys, self._cap, self._allocations)
        self.decoding = settle(self.config, self.spec, self.skew(), self.layers, real_tokens, storage)
        for layer, state in enumerate(self.layers):
            slots, cap = state.slots, self.limit(layer, state.seen + 1)
            if slots.n > cap:
                keep = self._eviction_keys(layer).topk(cap, dim=-1).indices.sort(dim=-1).values
                self._evicted += (slots.n - cap) * keep.shape[0] * keep.shape[1]
                self.host_pool.keep(layer, keep)
                slots.keep(keep)

    def _select(self, layer: int, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """Rehearse ``layer`` from input x: slot indices [batch, kv_heads, max n'] to fetch, ascending per
        row, and which of them each row attends to (None: all); kept for stats and shown to the observer."""
        with self.selecting():
            query = self._rehearsal_query(layer, x, position_ids)
            real_tokens = self._real_tokens(layer)
            budgets, follows = zip(*(self.schedule.choice_budget(n) for n in real_tokens), strict=True)
            # within the floor: everything, whatever alpha counts
            whole = [n <= self.config.min_tokens for n in real_tokens]
            alpha = self.decoding.row_alphas[layer]
            takes = self._candidate_blocks(layer, budgets, whole)
            if takes is None:
                reserved = self._reserved(layer)
                scores = self._token_scores(layer, query)
                widths = self._budget_counts(layer, real_tokens, budgets, alpha)
                if widths is None:  # an alpha counts: the gather's width is read back (one host sync)
                    counts = count_within(scores, alpha, budgets, reserved, whole)
                    widths = counts.tolist()
                else:  # what count_within would give is known on the host: ``widths``
                    counts = None
                index, valid = pick_top(scores, widths, reserved, self._most_reserved(layer))
            else:
                scores, counts, index, valid, reserved = self._coarse_to_fine(
                    layer, query, takes, alpha, budgets, whole
                )
                widths = None
        state = self.layers[layer]
        state.selected.append(counts.float().mean() if counts is not None else sum(widths) / len(widths))
        if counts is None and self.observer is not None:
            counts = torch.tensor(widths, device=index.device)
        if self.schedule.follows:  # the steps between read the tokens after these
            widths = counts.tolist() if widths is None else widths
            takes = [min(follow, count) for follow, count in zip(follows, widths, strict=True)]
            state.followed = Schedule.best_read(scores, index, valid, takes)
        if self.observer is not None:
            self.observer(
                Rehearsal(
                    layer=layer,
                    step=self._step,
                    scores=scores,
                    reserved=reserved,
                    counts=counts,
                    real_tokens=tuple(real_tokens),
                    index=index,
                    valid=valid,
                    real_slots=self.real_slots(layer),
                    partial_keys=state.slots.unpacked(state.slots.view("partial")),
                    scale=self._scales(layer),
                    to_partial=functools.partial(self.partial_query, layer),
                )
            )
        return index, valid

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

    def _rehearsal_query(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """``layer``'s partial query [batch, kv_heads, group, k] from the look-ahead input ``x``, times the
        attention scale."""
        spec = self.spec
        query = spec.query(layer, x, position_ids)  # [batch, heads, 1, d]
        grouped = query.reshape(query.shape[0], spec.num_kv_heads, spec.group_size, spec.head_dim)
        # a look-ahead reads the query projection's weights (an own-query layer's query is the layer's
        # own, which it computes anyway)
        if layer not in self.decoding.own_query:
            self.selector_read(spec.attention[layer].q_proj.weight)
        return self.partial_query(layer, grouped) * spec.scaling(layer)

    def _token_scores(self, layer: int, query: Tensor) -> Tensor:
        """Speculative logits [batch, kv_heads, slots] of every token of ``layer`` for the partial ``query``
        (:func:`~.rehearsal.speculative_scores`, -inf on left padding)."""
        state = self.layers[layer]
        real = self.real_slots(layer) if self._has_padding() else None
        slots, scale = state.slots, self._scales(layer)
        partial_keys = slots.view("partial")
        self.selector_read(partial_keys, *([] if scale is None else [scale]))
        row_columns = self.decoding.row_columns[layer]
        return speculative_scores(query, slots.unpacked(partial_keys), row_columns, real, scale)

    def _candidate_blocks(self, layer: int, budgets: list[int], whole: list[bool]) -> list[int] | None:
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
        takes: list[int],
        alpha: float | Tensor,
        budgets: list[int],
        whole: list[bool],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """Block speculation (``blocks.py``): rank blocks by their bounds, keep each row's ``takes`` best
        (the blocks of reserved slots first), then score, count and pick tokens among them alone. Returns
        (scores; counts; index in slots; valid; the reserved slots among the candidates). The scores are
        the candidates' own or, with an observer or ``select_every`` > 1 (both read them by slot), every
        slot's as token speculation gives them, -inf off the candidates.

        With blocks of one token the bounds are the tokens' own scores, and it selects exactly what token
        speculation selects: candidates are the best tokens by the same order, and a head whose candidates
        all come within alpha (it may want more than them) is counted again over every token."""
        state, spec = self.layers[layer], self.spec
        slots, n = state.slots, state.slots.n
        bounds = self._bounds(layer)
        batch, heads = slots.pos.shape[:2]
        blocks = bounds.count(n)
        block_reserved = self._reserved_blocks(layer, bounds, blocks)
        tokens = None
        if bounds.size == 1:  # a block of one token: its bound is its score (block 0 holds nothing)
            tokens = self._token_scores(layer, query)
            coarse = torch.nn.functional.pad(tokens, (1, 0), value=-math.inf)
        else:
            self.selector_read(bounds.bounds[:, :, :blocks])
            upper = block_scores(query, bounds, blocks, self.decoding.row_columns[layer])
            coarse = group_relative_max(upper.flatten(1, 2), spec.group_size)
        chosen, chosen_valid = pick_top(coarse, takes, block_reserved)
        candidates = bounds.slots_of(chosen)  # ascending
        present = (candidates >= 0) & (candidates < n)
        if chosen_valid is not None:
            present &= chosen_valid.repeat_interleave(bounds.size, dim=-1)
        candidates = candidates.clamp(0, n - 1)
        present &= self._real_at(layer, candidates)
        if tokens is not None:
            fine = torch.gather(tokens, 2, candidates).masked_fill(~present, -math.inf)
        else:
            keys, scale = gather_slots(slots.partial, slots.scale, candidates)
            self.selector_read(keys, *([] if scale is None else [scale]))
            row_columns = self.decoding.row_columns[layer]
            fine = speculative_scores(query, slots.unpacked(keys), row_columns, present, scale)
        fine_reserved = self._reserved(layer, candidates)
        if fine_reserved is not None:
            fine_reserved &= present
        wanted, real = wanted_per_head(fine, alpha, fine_reserved)
        counts = count_rule(wanted, real, budgets, whole)
        with self.counting:
            self._block_steps += 1
        covered = torch.tensor([take >= blocks for take in takes], device=counts.device)
        budget = torch.tensor(budgets, device=counts.device)
        recount = ((wanted >= real) & (real > 0)).any(dim=-1) & (counts < budget) & ~covered
        if bool(recount.any()):
            with self.counting:
                self._block_recounts += 1
            if tokens is None:
                tokens = self._token_scores(layer, query)
            every = count_within(tokens, alpha, budgets, self._reserved(layer), whole)
            counts = torch.where(recount, every, counts)
        index, valid = pick_top(fine, counts.tolist(), fine_reserved)
        index = torch.gather(candidates, 2, index)
        if self.observer is None and not self.schedule.follows:
            return fine, counts, index, valid, fine_reserved
        # as token speculation's, for the observer and for what the steps between choices follow (both go by
        # slot): the candidates' scores in their slots, -inf elsewhere
        spread = fine.new_full((batch, heads, n + 1), -math.inf)
        scores = spread.scatter_(2, torch.where(present, candidates, n), fine)[..., :n]
        return scores, counts, index, valid, self._reserved(layer)

    def _bounds(self, layer: int) -> BlockBounds:
        """``layer``'s block bounds (``SlotTable.block_bounds``)."""
        slots = self.layers[layer].slots
        padding = self.padding or [0] * slots.pos.shape[0]
        return slots.block_bounds(self.config.block_size, padding, functools.partial(self._real_at, layer))

    def _scales(self, layer: int) -> Tensor | None:
        """[batch, kv_heads, 1, slots]: per-token scales of ``layer``'s quantized partial keys (or None)."""
        slots = self.layers[layer].slots
        return None if slots.scale is None else slots.view("scale")

    def partial_query(self, layer: int, query: Tensor) -> Tensor:
        """``query`` [batch, kv_heads, group, d] in ``layer``'s partial columns, as its store keeps them."""
        state = self.layers[layer]
        return state.in_store(torch.matmul(query, state.projection.to(query.dtype)))

    def _reserved(self, layer: int, index: Tensor | None = None) -> Tensor | None:
        """bool [batch, kv_heads, slots] (or as ``index`` [batch, kv_heads, m], for those slots): the slots
        of the first ``n_sink`` real tokens and of the last ``window`` past tokens (None when both are 0)."""
        n_sink, window = self.config.n_sink, self.config.window
        if not (n_sink or window):
            return None
        state = self.layers[layer]
        batch, heads = state.slots.pos.shape[:2]
        shared = index is None and state.slots.n == state.seen
        if shared:  # nothing evicted: slot i holds position i in every head, so one head's answer serves all
            index = torch.arange(state.seen, device=state.slots.pos.device).expand(batch, 1, -1)
        pos = self._positions_at(layer, index)
        padding = torch.tensor(self.padding or [0] * batch, device=pos.device)[:, None, None]
        near = (((pos - padding) < n_sink) | (pos >= state.seen - window)) & self._real_at(layer, index)
        return near.expand(-1, heads, -1) if shared else near

    def _most_reserved(self, layer: int) -> int | None:
        """The most slots :meth:`_reserved` can hold in one head, where the host knows it: nothing evicted,
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
            padding = torch.tensor(self.padding or [0] * batch, device=device)[:, None, None]
            sinks = padding + torch.arange(n_sink, device=device)
            recent = torch.arange(n - window, n, device=device).expand(batch, 1, -1)
            near = torch.cat([sinks, recent], dim=2).clamp(0, n - 1).expand(-1, heads, -1)
            real = self._reserved(layer, near)  # out of range or padding: not reserved
            index = torch.where(real, bounds.block_of(near), 0)  # block 0 holds no real token
            hits = torch.zeros(batch, heads, blocks, dtype=torch.bool, device=device)
            hits.scatter_(2, index, True)
            hits[..., 0] = False
            return hits
        slot_blocks = bounds.block_of(torch.arange(n, device=device)).expand(batch, heads, n)
        hits = torch.zeros(batch, heads, blocks, dtype=torch.int32, device=device)
        return hits.scatter_add_(2, slot_blocks, self._reserved(layer).int()) > 0

    def _has_padding(self) -> bool:
        return any(self.padding or ())

    def real_slots(self, layer: int) -> Tensor:
        """[batch, kv_heads, slots]: True where the slot holds a real token (not left padding)."""
        return self._real_at(layer)

    def _positions_at(self, layer: int, index: Tensor | None = None) -> Tensor:
        """The token positions (mask columns) held by the slots ``index`` [batch, kv_heads, m] (None: every
        slot in use)."""
        state = self.layers[layer]
        if index is None:
            return state.slots.view("pos")
        if state.slots.n == state.seen:  # nothing evicted: slot i holds position i
            return index
        return torch.gather(state.slots.view("pos"), 2, index)

    def _real_at(self, layer: int, index: Tensor | None = None) -> Tensor:
        """bool, as ``index`` [batch, kv_heads, m] (None: every slot in use): whether each slot holds a real
        token (not left padding)."""
        pos = self._positions_at(layer, index)
        if self._real is None:
            return torch.ones_like(pos, dtype=torch.bool)
        prompt = self._real.shape[1]
        real = self._real[:, None, :].expand(-1, pos.shape[1], -1)
        in_prompt = torch.gather(real, 2, pos.clamp(max=prompt - 1))
        return torch.where(pos < prompt, in_prompt, True)

    def _real_tokens(self, layer: int) -> list[int]:
        """Real (non-padding) tokens seen per sequence: the context the budget is a fraction of."""
        seen = self.layers[layer].seen
        if self._real is None:
            return [seen] * self.layers[layer].slots.pos.shape[0]
        return [seen - padding for padding in self.padding]

    # -- decode: attend and store ----------------------------------------------------------------------------
    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        fetch = self.take_fetch(layer)
        positions, valid = fetch.positions, fetch.valid
        keys, values = fetch.transfer.wait()  # the selected rows plus a spare last slot for the new token
        keys[:, :, -1:], values[:, :, -1:] = k_new, v_new
        position = self.layers[layer].seen
        self._store(layer, k_new, v_new, position)
        self.layers[layer].seen = position + 1
        attended = positions.shape[2] if valid is None else valid.sum(dim=-1).float().mean()
        self.record_attended(layer, attended + 1)
        newest = torch.full_like(positions[:, :, :1], position)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(valid[:, :, :1])], dim=2)
        return Selection(keys, values, torch.cat([positions, newest], dim=2), valid)

    def _store(self, layer: int, k: Tensor, v: Tensor, position: int) -> None:
        state = self.layers[layer]
        slots = state.slots
        partial, scale = self._partial_keys(layer, k)
        if slots.n < self.limit(layer, position + 1):
            self.host_pool.append(layer, k, v)
            slots.store(position, partial, self._step, scale)
            if self.schedule.follows:
                state.newest = torch.full_like(k[:, :, :, 0], slots.n - 1, dtype=torch.long)
            return
        victims = self._eviction_keys(layer).argmin(dim=-1)  # [batch, kv_heads]
        if self.schedule.follows:
            state.newest = victims[..., None]
        self.host_pool.write_slots(layer, victims, k, v)
        real_at = functools.partial(self._real_at, layer)
        slots.write(victims, position, partial, self._step, scale, real_at)
        self._evicted += victims.numel()

    def _eviction_keys(self, layer: int) -> Tensor:
        """[batch, kv_heads, slots]: lower = evicted first. Tier (padding < older half < newest half), then
        the rule's value, then the position (older first)."""
        slots = self.layers[layer].slots
        pos = slots.view("pos")
        order = pos.argsort(dim=-1)
        rank = torch.empty_like(pos).scatter_(
            2, order, torch.arange(slots.n, device=pos.device).expand_as(pos)
        )
        tier = torch.where(rank >= slots.n - slots.n // 2, 2, 1)
        tier = torch.where(self.real_slots(layer), tier, 0)
        rule = "fifo" if self.spec.is_sliding(layer) else self.config.eviction
        value = {"fifo": pos, "lru": slots.view("last"), "counter": slots.view("fetches")}[rule]
        return (tier * _SHIFT + value.clamp(max=_SHIFT - 1)) * _SHIFT + pos

    # -- reporting -------------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """The partial keys (and block bounds) of every layer, and the slots kept from the step before
        (own_query_prefetch, select_every)."""
        kept = [state.chosen for state in self.layers if state.chosen is not None]
        held = sum(state.slots.nbytes() for state in self.layers)
        return held + sum(index.numel() * index.element_size() for index in kept)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        # per layer, each step's mean tokens selected: a float, or a tensor where the count was the device's
        selected = [[float(mean) for mean in state.selected] for state in self.layers]
        steps = [n for s in selected for n in s]
        out.update(
            selected_tokens_mean=sum(steps) / len(steps) if steps else 0.0,
            selected_tokens_max=max(steps) if steps else 0.0,
            # managed layers only (None for layers that load their full KV or their window)
            selected_tokens_per_layer=[
                {"mean": sum(s) / len(s), "max": max(s)} if s else None for s in selected
            ],
            decode_bytes_h2d=self._decode_h2d,
            offload_equivalent_bytes_h2d=self._offload_h2d,
            kv_fetch_fraction=self._decode_h2d / self._offload_h2d if self._offload_h2d else 0.0,
            evicted_tokens=self._evicted,
            # coarse-to-fine speculation: layer-steps chosen among candidate blocks, and those of them
            # counted again over every token
            block_steps=self._block_steps,
            block_recounts=self._block_recounts,
            # the most partial columns the device budget allows (of head_dim), for calibrated ratios
            partial_columns_cap=None if self._cap is None else self._cap[0],
            partial_keys_stored=self._stored_keys,
            skew_source=None if self._skew is None else f"{self._skew.source} ({self._skew.tokens} tokens)",
        )
        plan = self.decoding
        if plan is None:  # no decode step yet: nothing settled
            return out
        alphas = plan.alphas
        if any(alphas):
            sources = dict.fromkeys(alpha[1] for alpha in alphas if alpha is not None)
            out.update(
                # per layer, None for the layers that load their full KV or their window
                alpha_used=[None if alpha is None else alpha[0] for alpha in alphas],
                alpha_source="; ".join(sources),
            )
        first = self.config.dense_layers
        out.update(
            # the later layers (the knob's), and every layer whose copy waits on its own query
            own_query_layers_used=sorted(layer for layer in plan.own_query if layer >= first),
            own_query_source=plan.own_query_source,
            layers_by_own_query=sorted(plan.own_query),
        )
        if plan.ratios:
            out.update(
                # per sequence of the batch (by its prompt length)
                partial_ratio_used=[ratio for ratio, _ in plan.ratios],
                partial_ratio_source="; ".join(dict.fromkeys(source for _, source in plan.ratios)),
                # per sequence: "alpha", or "budget (why)" where the calibrated alphas do not hold
                count_rule_used=[rule for _, rule in plan.count_rules],
            )
        if any(plan.layer_ratios):
            # per sequence, per layer: its allocated ratio (None where the layer takes the uniform one)
            out["partial_ratio_by_layer"] = [
                [allocated.get(layer) for layer in range(self.spec.num_layers)]
                for allocated in plan.layer_ratios
            ]
        return out


@dataclass(frozen=True)
class Fetch:
    """What a layer reads this step: its copy in flight, the slots it takes (None: every slot), their token
    positions, and which of them each row attends to (None: all)."""

    transfer: Transfer | Corrected
    index: Tensor | None
    positions: Tensor
    valid: Tensor | None


class Corrected:
    """An own-query layer's rows (``own_query_prefetch``): those its prefetch copied and the correction
    copied once its own query chose, put in the order of its own choice. ``wait()`` returns (keys, values)
    with a spare last slot, as a fetch with ``extra=1`` does."""

    def __init__(self, prefetched: Transfer, correction: Transfer | None, source: Tensor):
        self.prefetched, self.correction = prefetched, correction
        self.source = source  # [batch, kv_heads, m + 1]: each row's place in [prefetched + spare; correction]

    def wait(self) -> tuple[Tensor, Tensor]:
        keys, values = self.prefetched.wait()
        if self.correction is not None:
            more_keys, more_values = self.correction.wait()
            keys, values = torch.cat([keys, more_keys], dim=2), torch.cat([values, more_values], dim=2)
        batch, heads, rows, dim = keys.shape
        # whole rows by one index_select over [batch * heads * rows, dim] (a per-element gather is slower)
        starts = torch.arange(batch * heads, device=keys.device).view(batch, heads, 1) * rows
        flat = (self.source + starts).view(-1)
        shape = (batch, heads, self.source.shape[2], dim)
        keys, values = (
            rows_of.reshape(-1, dim).index_select(0, flat).view(shape) for rows_of in (keys, values)
        )
        return keys, values
