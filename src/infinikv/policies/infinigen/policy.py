"""``infinigen``: speculative KV selection and prefetch (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707).

The full K/V of every layer live in the host pool. Each layer that InfiniGen manages keeps, on the compute
device, a *partial key cache*: its post-RoPE keys times the skewing matrix A (``calibration.py``), restricted
to a few columns. In a decode step, from layer i's pre-attention hook (the cache calls ``plan(i+1)``; an
engine step whose copier runs everything at once calls it from layer i+1's hook, before that layer's own
work, ``engine/ragged.py``), the policy rehearses layer i+1:

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
   CPU the whole look-ahead (steps 1-4) runs on the pool's worker thread (``KVPool.ahead``) where a core is
   free for it and the step copies enough to gain from it (``copiers.ThreadCopier``), else on the decode
   thread, where it overlaps nothing (an engine step then runs it at the start of layer i+1, projecting
   step 1's query in one product with that layer's own); on CUDA its kernels queue on the compute stream.

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
  (``fetches.py``).
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
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...errors import PolicyError
from ...spec import ModelSpec, QueryOf
from ..base import HostPoolPolicy, RowOf, Selection, StepRows
from ..registry import register
from . import skewfile, together
from .calibration import ensure_skew
from .config import PAPER_ALPHA, PAPER_PARTIAL_RATIO, PARTIAL_KEYS, InfiniGenConfig
from .eviction import eviction_keys, pool_limit
from .fetches import Fetch, corrected
from .layer import LayerState
from .plan import DecodePlan, layer_alpha, own_query_layers, settle
from .rehearsal import Rehearsal, quantize
from .schedule import Schedule
from .selector import Choice, Selector
from .skewfile import Skew
from .slots import SlotTable

Tensor = torch.Tensor


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
        # fetch counts and last uses are kept where a full pool evicts by them: not at capacity 1 (nothing
        # is evicted), nor under fifo or on a sliding layer (both evict by position)
        by_use = config.capacity != 1 and config.eviction != "fifo"
        self.layers = [
            LayerState(
                config.selects(spec, layer), SlotTable(tracks_use=by_use and not spec.is_sliding(layer))
            )
            for layer in range(spec.num_layers)
        ]
        self.schedule = Schedule.of(config)
        # what the first decode step settles (plan.py): columns, count rules, alphas, own-query layers
        self.decoding: DecodePlan | None = None
        # how the partial keys are stored and their bits, settled with the first prompt chunk's dtype
        self._stored_keys = config.partial_keys
        self.key_bits = PARTIAL_KEYS[config.partial_keys]
        # columns allocated per layer, per calibration window (empty: uniform), set with the first partial
        # keys
        self._allocations: dict[int, dict[int, float]] | None = None
        # which slots hold real tokens (left padding aside), and the choice itself (selector.py); it reaches
        # this policy by a weak reference, so that a finished sequence's pool is freed as it is dropped, not
        # when the interpreter's cycle collector runs
        me = weakref.proxy(self)
        self.selector = Selector(config, self.layers, me, me)
        self._step = 0
        # (most partial columns within the device budget, head_dim), set by the first prompt chunk's dtype
        self._cap: tuple[int, int] | None = None
        # statistics
        self._decode_h2d = 0
        self._offload_h2d = 0  # what full offload would have moved in the same decode steps
        self._evicted = 0

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
        """Most tokens the pool may hold for ``layer`` after ``seen`` tokens (``eviction.pool_limit``)."""
        return pool_limit(self.config.capacity, self.spec.sliding_window[layer], seen)

    def appends(self, layer: int) -> bool:
        """Whether ``layer``'s next token takes a new slot of the pool (else it overwrites one: eviction)."""
        state = self.layers[layer]
        return state.slots.n < self.limit(layer, state.seen + 1)

    def _eviction_keys(self, layer: int) -> Tensor:
        """``layer``'s slots in the order they are overwritten (``eviction.eviction_keys``)."""
        rule = "fifo" if self.spec.is_sliding(layer) else self.config.eviction
        return eviction_keys(self.layers[layer].slots, self.real_slots(layer), rule)

    # -- prefill ---------------------------------------------------------------------------------------------
    def seq_length(self, layer: int) -> int:
        return self.layers[layer].seen

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._step:
            raise PolicyError("infinigen: a prompt chunk after decoding started is not supported")
        start, count = self.layers[layer].seen, k.shape[2]
        pos = torch.arange(start, start + count, device=k.device).expand(k.shape[0], k.shape[1], -1)
        self._settle_projection(layer, k)
        partial, scale = self._partial_keys(layer, k)
        self.layers[layer].slots.append(pos, partial, 0, scale)
        self.layers[layer].seen = start + count
        if self.config.block_size > 1 and self.managed(layer):
            real_at = functools.partial(self.real_slots, layer)
            padding = self.row_padding(k.shape[0])
            self.layers[layer].slots.bound_chunk(start, count, self.config.block_size, padding, real_at)
        return self.host_pool.extend(layer, k, v)

    def _partial_keys(self, layer: int, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The partial skewed keys of ``k`` [batch, kv_heads, tokens, k'] in the columns the store keeps, and
        their per-token scales [batch, kv_heads, tokens, 1] (None: not quantized). The scale is taken over
        the widest calibrated columns, whatever the batch keeps, so a row's integers are those it gets
        alone. The layer's projection is settled by its first prompt chunk (:meth:`_settle_projection`)."""
        state = self.layers[layer]
        if not state.managed:
            return None, None
        partial, scale = quantize(torch.matmul(k, state.projection), self.key_bits)
        return state.in_store(partial), scale

    def _settle_projection(self, layer: int, k: Tensor) -> None:
        """At a managed layer's first prompt chunk: its projection to the widest calibrated columns the
        device budget holds (with the storage, at the first layer's)."""
        state = self.layers[layer]
        if not state.managed or state.projection is not None:
            return
        if self._cap is None:
            self._settle_storage(k.element_size())
        skew = self.skew()
        if self._allocations is None:
            self._allocations = self.config.allocations(skew, self._cap)
        widest = self.config.widest_ratio(skew, self._cap, layer, self._allocations)
        state.projection = skew.projection(layer, widest, self.config.skew, k.device, k.dtype)

    def _settle_storage(self, element_size: int) -> None:
        """At the first prompt chunk: how the partial keys are stored (``InfiniGenConfig.stored_keys``;
        4-bit ones two to a byte) and the most columns the device budget holds in that form."""
        self._stored_keys = self.config.stored_keys(self.skew(), self.spec, element_size)
        self.key_bits = PARTIAL_KEYS[self._stored_keys]
        for state in self.layers:
            state.slots.packed = self.key_bits == 4
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
    def before_attention(
        self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None
    ) -> None:
        self._begin_layer(layer)
        if layer in self.decoding.own_query:
            self._choose_own(layer, x, position_ids, queries)

    @classmethod
    def before_attention_rows(cls, policies: list[InfiniGenPolicy], layer: int, rows: StepRows) -> None:
        """An own-query layer's choice, for an engine step's sequences: those that choose plainly
        (``together.py``) in one product per partial-key form, on the decode thread, the others alone."""
        for policy in policies:
            policy._begin_layer(layer)
        own = [r for r, policy in enumerate(policies) if layer in policy.decoding.own_query]
        alone, grouped = together.groups([policies[r] for r in own], layer, own_query=True)
        for r in alone:
            policies[own[r]]._choose_own(layer, *rows.of(own[r]))
        for members in grouped:
            group = [policies[own[r]] for r in members]
            for policy in group:  # its look-ahead's rows if one ran (own_query_prefetch)
                policy.layers[layer].prefetched = policy.take_planned(layer)
            picked = rows.pick([own[r] for r in members])
            fetches = together.start_fetches_together(group, layer, picked, on_demand=True)
            for policy, fetch in zip(group, fetches, strict=True):
                policy.hold(layer, fetch)

    def _begin_layer(self, layer: int) -> None:
        """Count the decode step at its layer 0 (the cache calls it before anything else of a step), and
        settle the run's plan at the first."""
        if layer == 0:
            self._step += 1
            if self._step == 1:
                self.begin_decoding()

    def _choose_own(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None) -> None:
        """An own-query layer's choice by its own input ``x``, on the decode thread, on demand."""
        if self.schedule.reads_again(self.layers[layer], self._step):
            # nothing to choose: its copy started ahead (or now)
            if not self.planned(layer):
                with self.host_pool.on_demand():
                    self._fetch_reused(layer, self._step)
            return
        # its look-ahead's rows if one ran (own_query_prefetch): its own choice copies what they missed
        self.layers[layer].prefetched = self.take_planned(layer)
        self.fetch_own(layer, x, position_ids, queries)

    def plan(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None) -> None:
        self._plan_layer(layer, x, position_ids, queries)
        self._plan_next_first(layer)

    @classmethod
    def plan_rows(cls, policies: list[InfiniGenPolicy], layer: int, rows: StepRows) -> None:
        """The look-ahead for ``layer``, for an engine step's sequences: those that rehearse it plainly
        (``together.py``) in one job on the worker per partial-key form, the others alone."""
        alone, grouped = together.groups(policies, layer, own_query=False)
        for r in alone:
            policies[r]._plan_layer(layer, *rows.of(r))
        for members in grouped:
            group = [policies[r] for r in members]
            choose = together.start_fetches_together
            started = group[0].host_pool.ahead(choose, group, layer, rows.pick(members))
            for row, policy in enumerate(group):
                policy.hold_planned(layer, RowOf(started, row))
        for policy in policies:
            policy._plan_next_first(layer)

    def _plan_layer(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None) -> None:
        """This step's look-ahead for ``layer`` alone: a read again, a choice one layer ahead, or an
        own-query layer's prefetch."""
        schedule, own_query = self.schedule, self.decoding.own_query
        if schedule.reads_again(self.layers[layer], self._step):
            if not self.planned(layer):  # layer 0's was started at the step before
                self._fetch_reused(layer, self._step)
        elif layer not in own_query:
            super().plan(layer, x, position_ids, queries)
        elif layer > 0 and schedule.own_query_prefetch:
            self._prefetch_previous(layer)

    def _plan_next_first(self, layer: int) -> None:
        """From the last layer, the next step's layer 0, beside this step's last layers (planned from layer 1
        on: layer 0 has taken its own fetch of this step)."""
        schedule, own_query = self.schedule, self.decoding.own_query
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
        state.slots.count_use(index, step)
        self._count_offload(layer)
        widths = torch.full((), float(index.shape[2])) if valid is None else valid.sum(dim=-1).float().mean()
        state.selected.append(widths)
        positions = state.positions(index)
        self.hold(layer, Fetch(self.host_pool.fetch(layer, index, extra=1), index, positions, valid))

    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> Fetch:
        """Decide what ``layer`` reads this step and start copying it from the pool. Without an input ``x`` a
        managed layer loads everything; ``queries``: its query of ``x`` projected for an engine step's rows
        at once (None: projected here). An own-query layer whose look-ahead prefetched rows this step
        (``own_query_prefetch``) copies only the rows of its own choice that the prefetch missed."""
        state = self.layers[layer]
        slots, window = state.slots, self.spec.sliding_window[layer]
        valid = None
        if self.managed(layer) and x is not None:
            index, valid = self._select(layer, x, position_ids, queries)
        elif window is not None:
            index = slots.view("pos").topk(min(window - 1, slots.n), dim=-1).indices
        else:
            index = None
        return self.fetch_chosen(layer, index, valid)

    def fetch_chosen(self, layer: int, index: Tensor | None, valid: Tensor | None) -> Fetch:
        """Start copying ``layer``'s slots ``index`` (None: every slot) from the pool and count them
        (``valid``: which of them each row attends to; None: all)."""
        state = self.layers[layer]
        prefetched, state.prefetched = state.prefetched, None
        if index is not None and prefetched is not None and prefetched.index is not None:
            fetch = functools.partial(self.host_pool.fetch, layer)
            transfer, copied = corrected(index, prefetched, state.slots.n, fetch)
        else:
            transfer, copied = self.host_pool.fetch(layer, index, extra=1), index
        self._count_bytes(layer, copied)
        state.slots.count_use(index, self._step)
        if index is not None and self.schedule.keeps_choice(state, layer in self.decoding.own_query):
            state.chosen, state.chosen_valid = index, valid  # what the next step prefetches or reads again
        self._count_offload(layer)
        positions = state.positions().clone() if index is None else state.positions(index)
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
        positions = self.layers[layer].positions(index)
        self.hold(layer, Fetch(self.host_pool.fetch(layer, index, extra=1), index, positions, None))

    def _count_bytes(self, layer: int, index: Tensor | None) -> None:
        """Bytes moved by a fetch of ``layer``'s slots ``index`` (None: every slot)."""
        slots = self.layers[layer].slots
        batch, heads = slots.pos.shape[:2]
        rows = batch * heads * slots.n if index is None else index.numel()
        with self.counting:
            self._decode_h2d += self._row_bytes(layer) * rows

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
        real_tokens = self.seen_real_tokens(self.layers[stored[0]]) if stored else []
        storage = (self._stored_keys, self._cap, self._allocations)
        self.decoding = settle(self.config, self.spec, self.skew(), self.layers, real_tokens, storage)
        for layer, state in enumerate(self.layers):
            slots, cap = state.slots, self.limit(layer, state.seen + 1)
            if slots.n > cap:
                keep = self._eviction_keys(layer).topk(cap, dim=-1).indices.sort(dim=-1).values
                self._evicted += (slots.n - cap) * keep.shape[0] * keep.shape[1]
                self.host_pool.keep(layer, keep)
                slots.keep(keep)

    def _select(
        self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None
    ) -> tuple[Tensor, Tensor | None]:
        """Rehearse ``layer`` from input x: slot indices [batch, kv_heads, max n'] to fetch, ascending per
        row, and which of them each row attends to (None: all) (``selector.Selector``); kept for stats and
        shown to the observer."""
        state = self.layers[layer]
        with self.selecting():
            query = self.rehearsal_query(layer, x, position_ids, queries)
            real_tokens = self.seen_real_tokens(state)
            budgets, follows = zip(*(self.schedule.choice_budget(n) for n in real_tokens), strict=True)
            slot_scores = self.observer is not None or self.schedule.follows  # both read scores by slot
            choice = self.selector.choose(
                layer, query, self.decoding, real_tokens, budgets, self.spec.group_size, slot_scores
            )
        return self.keep_choice(layer, choice, real_tokens, follows)

    def keep_choice(
        self, layer: int, choice: Choice, real_tokens: list[int], follows: tuple[int, ...]
    ) -> tuple[Tensor, Tensor | None]:
        """``choice``'s slots and which of them each row attends to, once its statistics are kept, what the
        steps until the next choice follow is settled (``follows``: per sequence, how many) and the
        observer has seen it."""
        state = self.layers[layer]
        index, valid, counts, widths = choice.index, choice.valid, choice.counts, choice.widths
        state.selected.append(counts.float().mean() if counts is not None else sum(widths) / len(widths))
        if counts is None and self.observer is not None:
            counts = torch.tensor(widths, device=index.device)
        if self.schedule.follows:  # the steps between read the tokens after these
            widths = counts.tolist() if widths is None else widths
            takes = [min(follow, count) for follow, count in zip(follows, widths, strict=True)]
            state.followed = Schedule.best_read(choice.scores, index, valid, takes)
        if self.observer is not None:
            self.observer(
                Rehearsal(
                    layer=layer,
                    step=self._step,
                    scores=choice.scores,
                    reserved=choice.reserved,
                    counts=counts,
                    real_tokens=tuple(real_tokens),
                    index=index,
                    valid=valid,
                    real_slots=self.real_slots(layer),
                    partial_keys=state.slots.unpacked(state.slots.view("partial")),
                    scale=self.selector.scales(layer),
                    to_partial=functools.partial(self.partial_query, layer),
                )
            )
        return index, valid

    def rehearsal_query(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None) -> Tensor:
        """``layer``'s partial query [batch, kv_heads, group, k] from the look-ahead input ``x`` (its query
        from ``queries`` where given), times the attention scale."""
        spec = self.spec
        # [batch, heads, 1, d]
        query = spec.query(layer, x, position_ids) if queries is None else queries(layer)
        grouped = query.reshape(query.shape[0], spec.num_kv_heads, spec.group_size, spec.head_dim)
        # a look-ahead reads the query projection's weights (an own-query layer's query is the layer's
        # own, which it computes anyway)
        if layer not in self.decoding.own_query:
            self.selector_read(spec.attention[layer].q_proj.weight)
        return self.partial_query(layer, grouped) * spec.scaling(layer)

    def partial_query(self, layer: int, query: Tensor) -> Tensor:
        """``query`` [batch, kv_heads, group, d] in ``layer``'s partial columns, as its store keeps them."""
        state = self.layers[layer]
        return state.in_store(torch.matmul(query, state.projection.to(query.dtype)))

    def seen_real_tokens(self, state: LayerState) -> list[int]:
        """Real (not left padding) tokens each sequence has seen on a layer: its budget's context."""
        return self.real_tokens(state.seen, state.slots.pos.shape[0])

    def real_slots(self, layer: int, index: Tensor | None = None) -> Tensor:
        """[batch, kv_heads, slots] (or as ``index``, for those slots): True where a slot of ``layer`` holds a
        real token, not left padding (``Selector.real_at``)."""
        return self.selector.real_at(self.layers[layer], index)

    # -- decode: attend and store ----------------------------------------------------------------------------
    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        return self._decode(layer, k_new, v_new, self._fetched(layer), None, in_pool=False)

    @classmethod
    def decode_rows(
        cls, policies: list[InfiniGenPolicy], layer: int, k_new: list[Tensor], v_new: list[Tensor]
    ) -> list[Selection]:
        """:meth:`decode` for an engine step's sequences; the partial keys of the new tokens of those whose
        layer stores them with one projection are taken in one product (where ``base.stacks_rows_exactly``
        holds), and the K/V of those that take a new slot written in one copy (``together.py``). Every
        row's copy is waited for first: a look-ahead still queued on a worker must not see a pool that
        already holds the new token."""
        fetched = [policy._fetched(layer) for policy in policies]
        partial_keys = together.partial_keys_together(policies, layer, k_new)
        stored = together.store_together(policies, layer, k_new, v_new)
        return [
            policy._decode(layer, *row, in_pool=in_pool)
            for policy, *row, in_pool in zip(
                policies, k_new, v_new, fetched, partial_keys, stored, strict=True
            )
        ]

    def _fetched(self, layer: int) -> tuple[Fetch, tuple[Tensor, Tensor]]:
        """This step's fetch of ``layer`` and, once copied, its keys and values: the selected rows plus a
        spare last slot for the new token."""
        fetch = self.take_fetch(layer)
        return fetch, fetch.transfer.wait()

    def _decode(
        self,
        layer: int,
        k_new: Tensor,
        v_new: Tensor,
        fetched: tuple[Fetch, tuple[Tensor, Tensor]],
        partial_keys: tuple[Tensor, Tensor | None] | None,
        in_pool: bool,
    ) -> Selection:
        """:meth:`decode` with the layer's copy ``fetched`` (:meth:`_fetched`); ``partial_keys``: the new
        token's (its partial keys and scale, as :meth:`_partial_keys` gives them), taken with other
        sequences', or None; ``in_pool``: its K/V are in the pool already (written with other
        sequences')."""
        fetch, (keys, values) = fetched
        positions, valid = fetch.positions, fetch.valid
        keys[:, :, -1:], values[:, :, -1:] = k_new, v_new
        position = self.layers[layer].seen
        self._store(layer, k_new, v_new, position, partial_keys, in_pool)
        self.layers[layer].seen = position + 1
        attended = positions.shape[2] if valid is None else valid.sum(dim=-1).float().mean()
        self.record_attended(layer, attended + 1)
        newest = torch.full_like(positions[:, :, :1], position)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(valid[:, :, :1])], dim=2)
        return Selection(keys, values, torch.cat([positions, newest], dim=2), valid)

    def _store(
        self,
        layer: int,
        k: Tensor,
        v: Tensor,
        position: int,
        partial_keys: tuple[Tensor, Tensor | None] | None,
        in_pool: bool,
    ) -> None:
        state = self.layers[layer]
        slots = state.slots
        partial, scale = self._partial_keys(layer, k) if partial_keys is None else partial_keys
        if self.appends(layer):
            if not in_pool:
                self.host_pool.append(layer, k, v)
            slots.store(position, partial, self._step, scale)
            if self.schedule.follows:
                state.newest = torch.full_like(k[:, :, :, 0], slots.n - 1, dtype=torch.long)
            return
        victims = self._eviction_keys(layer).argmin(dim=-1)  # [batch, kv_heads]
        if self.schedule.follows:
            state.newest = victims[..., None]
        self.host_pool.write_slots(layer, victims, k, v)
        real_at = functools.partial(self.real_slots, layer)
        slots.write(victims, position, partial, self._step, scale, real_at)
        self._evicted += victims.numel()

    def reserve(self, tokens: int) -> None:
        super().reserve(tokens)
        for state in self.layers:
            state.slots.reserve(tokens)

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
            block_steps=self.selector.block_steps,
            block_recounts=self.selector.block_recounts,
            # the most partial columns the device budget allows (of head_dim), for calibrated ratios
            partial_columns_cap=None if self._cap is None else self._cap[0],
            partial_keys_stored=self._stored_keys,
            skew_source=None if self._skew is None else f"{self._skew.source} ({self._skew.tokens} tokens)",
        )
        if self.decoding is not None:  # else no decode step yet: nothing settled
            out.update(self.decoding.report(self.config.dense_layers, self.spec.num_layers))
        return out
