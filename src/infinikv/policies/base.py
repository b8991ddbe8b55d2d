"""The policy seam: what every KV policy implements, and the pieces they share.

A policy owns the KV cache of one generation run. The cache (``infinikv.cache``) calls it, per layer:

* ``prefill(layer, k, v)`` with each prompt chunk's K/V; it stores them and returns the K/V the chunk
  attends to (prefill attention is dense, over everything stored so far);
* ``plan(layer, x, position_ids, queries)``, only for policies that declare ``prefetches = True``: once per
  decode step, from the previous layer's pre-attention hook (layer 0: its own), decide what ``layer`` will
  read and start copying it from the host pool, so the copy overlaps the previous layer's compute (where
  nothing would overlap it, an engine step runs it at the start of ``layer``'s own hook instead, before
  that layer's ``before_attention``: ``engine/ragged.py``). ``x`` is the normalised input of the previous
  layer (layer 0: its own; InfiniGen rehearses ``layer``'s attention from it);
  ``queries``, where not None, gives a layer's query of ``x`` (``spec.QueryOf``), projected once for every
  row of an engine step;
* ``before_attention(layer, x, position_ids, queries)`` with ``layer``'s own normalised input, before its
  q/k/v projections and before the look-ahead's ``plan`` of the next layer;
* ``decode(layer, k_new, v_new)`` with the new token's K/V; it stores them and returns a :class:`Selection`,
  the K/V the layer attends to this step. A layer that chooses with its real query
  (``chooses_with_query``: Quest and the oracle, through :class:`ScoredPolicy`) is decoded from the
  attention function instead, once ``take_query`` has handed it the query the model computed;
* ``attend(layer, q, k, v, mask, scaling)``, the attention itself (SDPA unless the policy needs the
  attention weights, as H2O does).

An engine step (``engine/ragged.py``) runs many sequences, each with its own policy instance, and hands a
policy class all its rows of a layer at once: ``plan_rows``, ``before_attention_rows`` and ``decode_rows``
(class methods; by default each row alone). A class may do its rows' work together in fewer, larger
operations, as long as each row gets what it gets alone (InfiniGen does).

:class:`HostPoolPolicy` is the base of every policy whose KV lives in the host pool: it owns the pool, the
prompt storage and the prefetch bookkeeping, so a policy only says what to copy (``start_fetch``) and what
to attend to. :class:`ScoredPolicy` goes further for a policy that chooses tokens: it says only how it
scores them (``score``), and the base applies the shared rules of choosing (:func:`pick_top`). Configs
(``config.py``) are frozen dataclasses whose fields are declared with ``knob``: a docstring per knob and
its valid range, checked once for every policy. A new policy is one file with ``@register("name")``
(``registry.py``), in this package or in another distribution's ``infinikv.policies`` entry point.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from ..copiers import Transfer, on_worker
from ..errors import PolicyError
from ..kvpool import KVPool
from ..spec import ModelSpec, QueryOf
from .config import PolicyConfig
from .ranked import available as ranked_available
from .ranked import pick_on_host

Tensor = torch.Tensor


@dataclass
class Selection:
    """What a layer attends to in a decode step.

    ``keys``/``values``: [batch, kv_heads, n, head_dim] on the compute device. ``positions``: None when they
    are all cached tokens in position order (then the model's mask applies as is); otherwise the token
    positions [batch, kv_heads, n] of each row, used to pick the matching mask entries. ``valid``: None, or
    bool [batch, kv_heads, n] where False hides an entry (a batch's gather is as wide as its widest row; a
    narrower row's extra entries are hidden, so its result does not depend on its batchmates).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor | None = None
    valid: Tensor | None = None


class RowAttention(NamedTuple):
    """One row's attention inputs in an engine step (``Policy.attend_rows``), as ``Policy.attend`` takes
    them: its query [1, heads, 1, head_dim], the K/V it attends to [1, kv_heads, n, head_dim] and its mask
    [1, 1 or kv_heads, 1, n] (None: all)."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None


def group_relative_max(scores: Tensor, group: int) -> Tensor:
    """[batch, heads, n] logits -> [batch, kv_heads, n]: each query head's logits minus its own best (so
    <= 0), then the max over the ``group`` query heads that share a KV head. -inf stays -inf."""
    batch, heads, n = scores.shape
    grouped = scores.reshape(batch, heads // group, group, n)
    best = grouped.amax(dim=-1, keepdim=True)
    return (grouped - best.masked_fill(best == -math.inf, 0)).amax(dim=2)


def reserved_first(scores: Tensor, reserved: Tensor) -> Tensor:
    """``scores`` [..., n] with the ``reserved`` entries lifted above all others, each keeping its own order
    (so which reserved entries a short count takes does not depend on ties, hence not on the batch's slot
    layout); -inf stays -inf."""
    finite = scores > -math.inf
    low = scores.masked_fill(~finite, 0).amin(dim=-1, keepdim=True)
    high = scores.masked_fill(~finite, 0).amax(dim=-1, keepdim=True)
    return torch.where(reserved & finite, scores + (high - low + 1), scores)


def pick_top(
    scores: Tensor, takes: list[int], reserved: Tensor | None = None, most_reserved: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """Each row's best entries by ``scores`` [batch, kv_heads, n]: ``takes[row]`` of them per KV head,
    ``reserved`` (bool, broadcastable to ``scores``) first; among entries tied at a row's cut, the earlier
    slots (ties are common: each query head's best is exactly 0 after ``group_relative_max``, and which of
    them a top-k keeps would otherwise depend on the gather's width, hence on the batch). ``most_reserved``:
    the most entries ``reserved`` can hold in a head, known on the host (None: not known).

    Returns (index [batch, kv_heads, max(takes)], valid): each row's entries in ascending order, so a row
    reads its tokens in the same order alone and batched. The gather is as wide as the widest row; a
    narrower row's extra entries (its next best) are hidden by ``valid`` (bool, same shape; None when no row
    is narrower). Nothing is read back to the host: the shapes follow from ``takes`` alone.
    """
    batch, heads, _ = scores.shape
    width = max(takes, default=0)
    if width == 0:
        return torch.zeros(batch, heads, 0, dtype=torch.long, device=scores.device), None
    return _ranked(scores, takes, width, False, reserved, most_reserved)


def pick_each(scores: Tensor, takes: list[int], reserved: Tensor | None, most_reserved: int) -> Tensor:
    """:func:`pick_top` for rows that are separate sequences, their slots padded at the end with -inf: row
    r's choice, ``pick_top(scores[r:r+1, :, :n_r], [takes[r]], ...)``, in the first ``takes[r]`` entries of
    its row of the index [batch, kv_heads, max(takes)] (ascending; the entries after it are 0). Every row
    takes at least one entry. ``reserved`` entries are lifted as :func:`pick_top` lifts them
    (``most_reserved``: the most a head holds); where a row takes them all, in one pass or in their own
    order, it takes the same entries."""
    return _ranked(scores, takes, max(takes), True, reserved, most_reserved)[0]


def pick_with_tensor_ops(
    scores: Tensor, takes: list[int], width: int, each: bool
) -> tuple[Tensor, Tensor | None]:
    """The pick of :func:`ranked.pick_on_host` (its arguments but ``lifted``, and its result) as tensor
    operations, for the scores :func:`_on_host` leaves out (on CUDA, in a compiled graph, float64, or without
    numba): a top-k for each row's cut, then the entries above it and the earliest of those tied at it, in
    ascending slots. Nothing is read back to the host."""
    batch, heads, _ = scores.shape
    if min(takes) == width:  # one cut for every row: the width-th best, which needs no order
        cut = scores.topk(width, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        return _slots_of(_earliest_at_cut(scores, cut, width), width), None
    values = scores.topk(width, dim=-1).values  # sorted: each row's cut is at its own count
    count = torch.tensor(takes, device=scores.device)[:, None, None]
    cut = values.gather(-1, (count - 1).clamp(min=0).expand(batch, heads, 1))
    own = _earliest_at_cut(scores, cut, count)
    if each:
        return _slots_of(own, width), None
    index = _slots_of(_earliest_at_cut(scores, values[..., -1:], width), width)
    return index, own.gather(-1, index)


def _ranked(
    scores: Tensor,
    takes: list[int],
    width: int,
    each: bool,
    reserved: Tensor | None,
    most_reserved: int | None,
) -> tuple[Tensor, Tensor | None]:
    """The pick itself, ``reserved`` entries first (:func:`_lift_reserved`): by the host kernel where
    :func:`_on_host`, which lifts them itself where a lift to +inf takes them all, else by tensor
    operations."""
    on_host = _on_host(scores)
    if reserved is not None and not (on_host and lifts_in_one_pass(takes, most_reserved)):
        scores, reserved = _lift_reserved(scores, reserved, takes, most_reserved), None
    if on_host:
        return pick_on_host(scores, takes, width, each, reserved)
    return pick_with_tensor_ops(scores, takes, width, each)


def _on_host(scores: Tensor) -> bool:
    """Whether a pick runs the host kernel (``ranked.py``): scores in a dtype float32 holds, where
    :func:`runs_on_host`."""
    return scores.dtype in (torch.float32, torch.bfloat16, torch.float16) and runs_on_host(scores)


def runs_on_host(tensor: Tensor) -> bool:
    """Whether work on ``tensor`` may run a compiled host loop (numba) instead of tensor operations: a host
    tensor, outside a compiled graph, where numba is installed."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling() and ranked_available()


def _lift_reserved(scores: Tensor, reserved: Tensor, takes: list[int], most: int | None) -> Tensor:
    """``scores`` with the ``reserved`` entries first, for :func:`pick_top`. When every row takes at least
    the ``most`` entries a head can have reserved, all of them are taken whatever their order, so +inf lifts
    them in one pass; otherwise :func:`reserved_first` orders them among themselves."""
    if lifts_in_one_pass(takes, most):
        return scores.masked_fill(reserved & (scores > -math.inf), math.inf)
    return reserved_first(scores, reserved)


def lifts_in_one_pass(takes: list[int], most: int | None) -> bool:
    """Whether every row takes at least the ``most`` entries a head can have reserved (None: not known), so
    that lifting them to +inf takes all of them (:func:`_lift_reserved`)."""
    return most is not None and min(takes, default=0) >= most


def _slots_of(chosen: Tensor, width: int) -> Tensor:
    """LongTensor [..., width]: the slots of ``chosen``, which holds at most ``width`` True entries along its
    last axis, ascending, the rest 0 (:func:`first_slots` without the cut to the first ``width``)."""
    n = chosen.shape[-1]
    at = torch.where(chosen, chosen.cumsum(dim=-1, dtype=torch.int32) - 1, width).long()
    index = torch.zeros(*chosen.shape[:-1], width + 1, dtype=torch.long, device=chosen.device)
    return index.scatter_(-1, at, torch.arange(n, device=chosen.device).expand_as(chosen))[..., :width]


def _earliest_at_cut(scores: Tensor, cut: Tensor, count: Tensor | int) -> Tensor:
    """bool, as ``scores``: each row's ``count`` best entries (``cut``: the count-th best value), those tied
    at its cut taken from the earliest slot on."""
    above = scores > cut
    tied = scores == cut
    room = count - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    return above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))


def first_slots(mask: Tensor, width: int) -> Tensor:
    """LongTensor [..., width]: the positions of ``mask``'s first ``width`` True entries along its last axis,
    ascending; a row with fewer gets slot 0 for the rest (hidden by its caller)."""
    n = mask.shape[-1]
    taken = mask & (mask.cumsum(dim=-1) <= width)
    at = torch.where(taken, taken.cumsum(dim=-1) - 1, width)  # each taken slot's place; the rest: a spare
    index = torch.zeros(*mask.shape[:-1], width + 1, dtype=torch.long, device=mask.device)
    return index.scatter_(-1, at, torch.arange(n, device=mask.device).expand_as(mask))[..., :width]


def resolve_budget(budget: float, context: int, capped: bool = True, floor: int = 0) -> int:
    """Tokens a ``budget`` stands for: <= 1 is a fraction of ``context`` (1 = all of it, at least one token),
    above 1 a token count; at least ``floor`` (a config's ``min_tokens``). ``capped``: never more than
    ``context`` (False keeps a token count's meaning, and the floor's, while the context grows)."""
    if not budget > 0:
        raise PolicyError(f"budget must be positive, got {budget}")
    tokens = math.ceil(budget * context) if budget <= 1 else int(budget)
    tokens = max(1, min(tokens, context) if capped or budget <= 1 else tokens)
    return min(max(tokens, floor), context) if capped else max(tokens, floor)


# -- policies ------------------------------------------------------------------------------------------------
class Policy:
    """Base class: the seam, statistics, and no KV storage of its own."""

    name: ClassVar[str]  # set by ``registry.register``
    config_class: ClassVar[type[PolicyConfig]]
    # Policies of one family build the same state from a prompt whatever their knobs, so a prefill recorded
    # under one can be replayed into another (forward.PrefillMemo) instead of running the model
    # over the prompt again. "dense": prompt attention is plain dense attention over the full-precision
    # K/V and the policy keeps what it is handed. None: never shared.
    prefill_family: ClassVar[str | None] = None
    # True when the host pool's keys and values hold each prompt chunk's K/V exactly as handed, in position
    # order, until the first decode step: the engine's prefix cache then shares the pool's blocks.
    keeps_prompt_kv: ClassVar[bool] = False
    # True when plan() starts a copy of a layer's KV before that layer runs (overlapping the previous
    # layer's compute); the cache calls plan() only then, and the bench's link model trusts it.
    prefetches: ClassVar[bool] = False

    @classmethod
    def prepare(cls, config: PolicyConfig, loaded: Any) -> None:
        """Model-level work before the policy first runs on ``loaded`` (a LoadedModel) with ``config``,
        e.g. InfiniGen's calibration; the Generator, the eval and the bench call it through
        ``registry.prepare``. Most policies need nothing."""

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device):
        self.config = config
        self.spec = spec
        self.device = torch.device(device)
        # Which cached positions are real tokens (not left padding): [batch, tokens] (None: all), and each
        # row's left padding on the host; both set by the cache (set_key_valid).
        self.key_valid: Tensor | None = None
        self.padding: list[int] | None = None
        self._attended_tokens = 0.0  # summed over layers and steps, averaged over batch and heads
        self._attended_calls = 0
        # The selector's work, summed over layers and steps: bytes it read on the compute device (partial
        # keys, page summaries, scores, and the keys themselves for the oracle) and the time spent choosing.
        self._selector_bytes = 0
        self._selector_s = 0.0
        self._selector_inline_s = 0.0  # of which on the decode thread (not a pool worker's look-ahead)
        # held while adding to a statistic: a look-ahead on the pool's worker and the decode thread may count
        # at the same time
        self.counting = threading.Lock()

    # -- the seam ------------------------------------------------------------------------------------------
    def set_key_valid(self, key_valid: Tensor | None, decode: bool = False) -> None:
        """Which cached positions are real tokens ([batch, tokens], False on left padding; None: all), from
        the model's mask. Outside a decode step each row's left padding is read back to the host
        (``padding``), so that a decode step, whose new tokens are all real, reads nothing back."""
        self.key_valid = key_valid
        if not decode:
            self.padding = None if key_valid is None else (~key_valid).sum(dim=1).tolist()

    @property
    def padded(self) -> bool:
        """Whether any row has left padding."""
        return any(self.padding or ())

    def real_tokens(self, n_past: int, batch: int) -> list[int]:
        """Real (not left padding) tokens per row among the first ``n_past`` positions, on the host."""
        if not self.padded:
            return [n_past] * batch
        return [max(n_past - padding, 0) for padding in self.padding]

    def row_padding(self, batch: int) -> list[int]:
        """Each row's left padding, on the host (zeros where no mask was seen)."""
        return self.padding or [0] * batch

    def real_at(self, positions: Tensor) -> Tensor:
        """bool, as ``positions`` [batch, ...] (token positions, i.e. mask columns): whether each holds a real
        token, not left padding. A position past the mask last seen is a later decode token: real."""
        if self.key_valid is None or not self.padded:
            return torch.ones_like(positions, dtype=torch.bool)
        valid = self.key_valid.to(positions.device)
        flat = positions.reshape(positions.shape[0], -1)
        seen = valid.shape[1]
        in_mask = valid.gather(1, flat.clamp(max=seen - 1))
        return torch.where(flat < seen, in_mask, True).view_as(positions)

    def sinks_and_recent(self, positions: Tensor, seen: int, n_sink: int, recent: int) -> Tensor:
        """bool, as ``positions`` [batch, ...] (token positions): whether each is one of its row's first
        ``n_sink`` real tokens (attention sinks) or one of the last ``recent`` of the ``seen`` positions (the
        recent window); left padding never is. The one rule of sinks and window, for every policy that
        keeps them, whatever order its slots hold positions in."""
        padding = torch.tensor(self.row_padding(positions.shape[0]), device=positions.device)
        padding = padding.view(-1, *[1] * (positions.dim() - 1))
        near = ((positions - padding) < n_sink) | (positions >= seen - recent)
        return near & self.real_at(positions) if self.padded else near

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def prefill_state(self) -> Any:
        """What prefill left in the policy besides the K/V it was handed (replayed along with them)."""
        return None

    def restore_prefill_state(self, state: Any) -> None:
        """Take the ``prefill_state`` of a policy of the same family, after a replayed prefill."""

    def plan(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None) -> None:
        """Look-ahead for ``layer`` (prefetching policies only): decide what it reads and start the copy."""

    @classmethod
    def plan_rows(cls, policies: list[Policy], layer: int, rows: StepRows) -> None:
        """:meth:`plan` for the rows of an engine step whose policies are of this class
        (``engine/ragged.py``). Each row plans alone here; a class may plan them together, in fewer and
        larger operations, as long as each row reads what it would read alone."""
        for r, policy in enumerate(policies):
            policy.plan(layer, *rows.of(r))

    def before_attention(
        self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None
    ) -> None:
        """``layer``'s own input, before its attention; most policies need nothing here."""

    @classmethod
    def before_attention_rows(cls, policies: list[Policy], layer: int, rows: StepRows) -> None:
        """:meth:`before_attention` for the rows of an engine step whose policies are of this class (as
        :meth:`plan_rows`): each row alone here."""
        for r, policy in enumerate(policies):
            policy.before_attention(layer, *rows.of(r))

    def chooses_with_query(self, layer: int) -> bool:
        """Whether ``layer``'s decode step chooses with the layer's own query: then the cache calls
        :meth:`decode` from the attention function, after :meth:`take_query` hands it the query the model
        computed, instead of from ``Cache.update`` (no second query projection)."""
        return False

    def take_query(self, layer: int, query: Tensor) -> None:
        """``layer``'s real query of this decode step, [batch, heads, head_dim] (:meth:`chooses_with_query`
        layers only)."""

    @classmethod
    def take_query_rows(cls, policies: list[Policy], layer: int, queries: list[Tensor]) -> None:
        """:meth:`take_query` for the rows of an engine step whose policies are of this class and whose
        ``layer`` waits for its query (as :meth:`plan_rows`), before any of them decodes: each row alone
        here."""
        for policy, query in zip(policies, queries, strict=True):
            policy.take_query(layer, query)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        raise NotImplementedError

    @classmethod
    def decode_rows(
        cls, policies: list[Policy], layer: int, k_new: list[Tensor], v_new: list[Tensor]
    ) -> list[Selection]:
        """:meth:`decode` for the rows of an engine step whose policies are of this class (as
        :meth:`plan_rows`): each row alone here."""
        return [policy.decode(layer, k, v) for policy, k, v in zip(policies, k_new, v_new, strict=True)]

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        return attention(q, k, v, mask, scaling)

    @classmethod
    def attend_rows(
        cls, policies: list[Policy], layer: int, rows: list[RowAttention], scaling: float
    ) -> list[Tensor]:
        """:meth:`attend` for the rows of an engine step whose policies are of this class (as
        :meth:`plan_rows`), each [1, 1, heads, head_dim]: each row alone here."""
        return [policy.attend(layer, *row, scaling) for policy, row in zip(policies, rows, strict=True)]

    def seq_length(self, layer: int) -> int:
        """Tokens seen by ``layer`` so far (including evicted ones): positions are 0..seq_length-1."""
        raise NotImplementedError

    def kv_bytes(self) -> dict[str, int]:
        """Bytes of K/V held in the host pool and on the compute device."""
        raise NotImplementedError

    def pool(self) -> KVPool | None:
        """The pool whose counters hold this policy's copies (None: it moves nothing)."""
        return None

    def stats(self) -> dict[str, Any]:
        """What this policy did, for the per-request statistics; the knobs it ran with sit apart, under
        ``knobs``."""
        out: dict[str, Any] = {"policy": self.name, "knobs": self.config.knobs()}
        out.update({f"kv_bytes_{where}": n for where, n in self.kv_bytes().items()})
        pool = self.pool()
        if pool is not None:
            pool.drain()
        counters = pool.counters if pool is not None else None
        out["bytes_h2d"] = counters.bytes_h2d if counters else 0
        out["bytes_d2h"] = counters.bytes_d2h if counters else 0
        out["prefetch_wait_s"] = round(counters.wait_s, 6) if counters else 0.0
        out["fetch_peak_bytes"] = counters.peak_bytes if counters else 0
        out["mean_tokens_attended"] = (
            float(self._attended_tokens) / self._attended_calls if self._attended_calls else 0.0
        )
        out["selector_bytes"] = self._selector_bytes
        out["selector_s"] = round(self._selector_s, 6)
        out["selector_inline_s"] = round(self._selector_inline_s, 6)
        out["bytes_h2d_on_demand"] = counters.bytes_on_demand if counters else 0
        return out

    def reserve(self, tokens: int) -> None:
        """Expect prompts of about ``tokens`` tokens per row, before the first chunk: where the pool's blocks
        go (``KVPool.reserve``) and, in a policy that keeps tables per slot or its K/V on the device (dense),
        their first size."""
        pool = self.pool()
        if pool is not None:
            pool.reserve(tokens)

    def close(self) -> None:
        pool = self.pool()
        if pool is not None:
            pool.close()

    # -- helpers for subclasses ----------------------------------------------------------------------------
    def record_attended(self, layer: int, n_tokens: float | Tensor) -> None:
        """Count how many tokens a layer attended to in a decode step (mean over batch and heads). A
        sliding-window layer sees at most its window, whatever it was handed (the mask hides the rest)."""
        window = self.spec.sliding_window[layer]
        if isinstance(n_tokens, Tensor):  # kept on the device until stats(): no host sync per step
            tokens = n_tokens.float() if window is None else n_tokens.float().clamp(max=window)
        else:
            tokens = float(n_tokens if window is None else min(n_tokens, window))
        self._attended_tokens = self._attended_tokens + tokens
        self._attended_calls += 1

    def selector_read(self, *tensors: Tensor, shared_by: int = 1) -> None:
        """Count ``tensors`` as read by this step's selector: a selector's work is reported beside the bytes
        it saves moving (``stats()["selector_bytes"]``). ``shared_by``: one read served that many sequences
        (an engine step's rows that chose together), each of which counts its share."""
        with self.counting:
            self._selector_bytes += sum(t.numel() * t.element_size() for t in tensors) // shared_by

    @contextmanager
    def selecting(self) -> Iterator[None]:
        """Time the enclosed choosing (``stats()["selector_s"]``; ``selector_inline_s``: the part on the
        decode thread, not a pool worker's look-ahead). Host time without a device sync: on a GPU it is the
        time to queue the work, so the bench reads the selector's share from CPU runs."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.count_selector_time(time.perf_counter() - start)

    def count_selector_time(self, seconds: float) -> None:
        """Count ``seconds`` of this thread's time as the selector's (:meth:`selecting`)."""
        with self.counting:
            self._selector_s += seconds
            self._selector_inline_s += 0.0 if on_worker() else seconds

    def past_positions(self, n_past: int, batch: int) -> Tensor:
        """LongTensor [batch, n_past]: the past positions, where slots hold them in order."""
        return torch.arange(n_past, device=self.device).expand(batch, -1)

    def past_valid(self, n_past: int, batch: int) -> Tensor:
        """bool [batch, n_past]: which past positions hold real tokens (False = left padding)."""
        if self.key_valid is None:
            return torch.ones(batch, n_past, dtype=torch.bool, device=self.device)
        return self.key_valid[:, :n_past].to(self.device)


@dataclass(frozen=True)
class StepRows:
    """A layer's input for rows of an engine step (``Policy.plan_rows`` and ``before_attention_rows``), in
    the order of their policies: each row's normalised input [1, 1, hidden], its positions and its queries
    of the step's shared projections (``spec.SharedQueries``)."""

    x: list[Tensor]
    position_ids: list[Tensor]
    queries: list[QueryOf | None]

    def of(self, row: int) -> tuple[Tensor, Tensor, QueryOf | None]:
        return self.x[row], self.position_ids[row], self.queries[row]

    def pick(self, rows: list[int]) -> StepRows:
        """These rows' inputs, in the order of ``rows``."""
        return StepRows(*([values[r] for r in rows] for values in (self.x, self.position_ids, self.queries)))


class RowOf:
    """One sequence's part of a look-ahead run for several sequences at once (``Policy.plan_rows``): row
    ``row`` of what ``started`` returns."""

    def __init__(self, started: Transfer, row: int):
        self._started, self._row = started, row

    def wait(self) -> Any:
        return self._started.wait()[self._row]


class HostPoolPolicy(Policy):
    """KV in the host pool, copied to the compute device as each layer needs it.

    Owns the pool and what every such policy repeats: prompt chunks are appended to the pool (and attend
    densely to everything stored so far); ``plan`` (called by the cache for prefetching policies) starts a
    subclass's ``start_fetch`` one layer ahead; ``take_fetch`` in ``decode`` picks it up, or starts it then.
    """

    keeps_prompt_kv = True

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device, overlap: str = "thread"):
        super().__init__(config, spec, device)
        self.host_pool = KVPool(spec.num_layers, device, overlap=overlap)
        self._in_flight: dict[int, Any] = {}

    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> Any:
        """Begin copying what ``layer`` reads this step; returns what ``decode`` needs to finish it. ``x``
        is the look-ahead input when called from ``plan`` (``queries``: its shared projections, or None),
        None when called late from ``decode``."""
        raise NotImplementedError

    def plan(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None) -> None:
        self.prefetch(layer, self.start_fetch, layer, x, position_ids, queries)

    def prefetch(self, layer: int, work: Callable[..., Any], *args: Any) -> None:
        """Queue ``work(*args)`` (it chooses what ``layer`` reads and starts the copy: ``start_fetch``, unless
        a subclass looks ahead otherwise) on the pool's worker, beside the current layer's compute
        (``KVPool.ahead``; at once on CUDA), for ``take_fetch`` to pick up."""
        self._in_flight[layer] = self.host_pool.ahead(work, *args)

    def fetch_own(
        self, layer: int, x: Tensor | None, position_ids: Tensor | None, queries: QueryOf | None = None
    ) -> None:
        """Start ``layer``'s fetch now, on the decode thread, from its own input ``x`` (a layer that chooses
        with its own query; None: as ``start_fetch`` without one), for ``decode`` to pick up: on demand, as
        nothing overlaps it."""
        self.hold(layer, self._fetch_on_demand(layer, x, position_ids, queries))

    def hold_planned(self, layer: int, started: RowOf) -> None:
        """Keep this sequence's row of a look-ahead planned for several sequences at once (``plan_rows``) for
        ``take_fetch`` to pick up."""
        self._in_flight[layer] = started

    def hold(self, layer: int, started: Any) -> None:
        """Keep what was started for ``layer`` on the decode thread (``start_fetch``'s kind of result) for
        ``take_fetch`` to pick up."""
        self._in_flight[layer] = Transfer(started, self.host_pool.counters)

    def take_fetch(self, layer: int) -> Any:
        """What ``plan`` or ``fetch_own`` started for ``layer`` (waiting for its choice, not its copy), or a
        fetch started now."""
        started = self.take_planned(layer)
        return started if started is not None else self._fetch_on_demand(layer)

    def planned(self, layer: int) -> bool:
        """Whether ``plan`` or ``fetch_own`` started something for ``layer`` that is not yet taken."""
        return layer in self._in_flight

    def take_planned(self, layer: int) -> Any | None:
        """What ``plan`` or ``fetch_own`` started for ``layer``, waited for (its choice, not its copy); None
        when nothing was started."""
        started = self._in_flight.pop(layer, None)
        return None if started is None else started.wait()

    def _fetch_on_demand(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> Any:
        with self.host_pool.on_demand():
            return self.start_fetch(layer, x, position_ids, queries)

    def seq_length(self, layer: int) -> int:
        return self.host_pool.length(layer)

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.host_pool.extend(layer, k, v)

    def device_bytes(self) -> int:
        """Bytes a subclass keeps on the compute device besides what it copies each step (metadata)."""
        return 0

    def kv_bytes(self) -> dict[str, int]:
        return {"host": self.host_pool.nbytes(), "device": self.device_bytes()}

    def pool(self) -> KVPool:
        return self.host_pool


class ScoredPolicy(HostPoolPolicy):
    """Host pool + a per-step gather of each row's best-scored past tokens: a policy says only how it scores.

    A subclass implements :meth:`score` and, where its rules differ from the shared ones, :meth:`takes`
    (how many units a row takes), :meth:`reserved` (units always taken) and :meth:`expand` (the slots of the
    chosen units, for a policy that scores blocks of tokens). The base does the rest, the same way for every
    policy: the budget per row (of its own real tokens, not the batch's padded length), reserved units first
    and counted in the budget, each query head's scores relative to its best and the max over a KV group,
    left padding never chosen, a narrower row's extra gather entries hidden (``Selection.valid``) and each
    row's tokens in ascending order, so a row attends to what it attends to alone. Sliding-window layers
    read their window. Prefill is dense: each prompt chunk attends to everything stored so far.

    A policy whose choice for layer i+1 does not need layer i+1's query sets ``prefetches = True`` and the
    copy starts one layer early; one that needs the layer's own query sets ``query_aware = True`` and reads
    it in :meth:`score` from ``self.query(layer)``: the model's own query, which the cache hands over
    (``take_query``) before it calls ``decode`` from the attention function. Such a policy may still set
    ``prefetches``: the layers it does not score (leading dense layers, sliding windows) are then copied
    one layer early, the others on demand (:meth:`plan`).
    """

    prefill_family = "dense"
    # True: score() reads the layer's real query of this step (self.query(layer)), so its scored layers are
    # copied on demand, once that query exists
    query_aware: ClassVar[bool] = False
    # True: a unit is a token slot, and the base hides left padding from the scores itself.
    scores_slots: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self._query: dict[int, Tensor] = {}

    # -- what a subclass says ------------------------------------------------------------------------------
    def scored(self, layer: int) -> bool:
        """Whether ``layer`` chooses its tokens (else it reads every past token, or its window)."""
        return not self.spec.is_sliding(layer) and layer >= getattr(self.config, "dense_layers", 0)

    def score(self, layer: int, n_past: int, batch: int) -> Tensor | None:
        """``layer``'s scores of its past units this step, higher first: [batch, kv_heads, units], or one per
        query head [batch, heads, units] (the base compares each head with its own best and keeps the max
        over the heads of a KV group). -inf: never taken (a unit the row does not have). A unit is a token
        slot, whose left padding the base hides, unless ``scores_slots`` is False (:meth:`expand`). None:
        nothing to score, the reserved units are the whole pick (StreamingLLM)."""
        raise NotImplementedError

    def takes(self, layer: int, real: list[int]) -> list[int]:
        """Units each row takes this step, from its ``real`` past tokens (left padding excluded): the budget
        (``config.budget``: <= 1 a fraction of them, else a token count; at least ``config.min_tokens`` where
        the config has one), at most all of them."""
        floor = getattr(self.config, "min_tokens", 0)
        return [min(resolve_budget(self.config.budget, max(n, 1), floor=floor), n) for n in real]

    def real_past(self, layer: int, n_past: int, batch: int) -> list[int]:
        """Real (not left padding) past tokens per row."""
        return self.real_tokens(n_past, batch)

    def units(self, layer: int, real: list[int]) -> list[int]:
        """Units each row has (a row taking as many reads everything): its real past tokens."""
        return real

    def reserved(self, layer: int, n_past: int, batch: int) -> Tensor | None:
        """bool [batch, units] taken first and counted in the budget, or None: the first ``config.n_sink``
        real tokens and the last ``config.window`` past slots, for a policy whose config has them."""
        n_sink, window = getattr(self.config, "n_sink", 0), getattr(self.config, "window", 0)
        if not (n_sink or window):
            return None
        return self.sinks_and_recent(self.past_positions(n_past, batch), n_past, n_sink, window)

    def most_reserved(self, layer: int) -> int | None:
        """The most units :meth:`reserved` marks in a row, known on the host (None: not known)."""
        return getattr(self.config, "n_sink", 0) + getattr(self.config, "window", 0)

    def expand(self, layer: int, index: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The slots of the chosen units ``index`` [batch, kv_heads, m] (ascending), and which are real:
        units are slots unless a subclass scores blocks."""
        return index, valid

    def adjust_keys(self, layer: int, index: Tensor, keys: Tensor) -> None:
        """Hook to rewrite the gathered past keys in place, a copy of the pool's own (StreamingLLM re-rotates
        its sinks)."""

    def query(self, layer: int) -> Tensor:
        """``layer``'s real query of this step, [batch, heads, head_dim] (``query_aware`` policies)."""
        return self._query.pop(layer)

    # -- the shared rules ------------------------------------------------------------------------------------
    def chooses_with_query(self, layer: int) -> bool:
        return self.query_aware and self.scored(layer)

    def plan(self, layer: int, x: Tensor, position_ids: Tensor, queries: QueryOf | None = None) -> None:
        """The look-ahead's copy of ``layer``, unless it waits for the layer's own query (then on demand)."""
        if not self.chooses_with_query(layer):
            super().plan(layer, x, position_ids, queries)

    def take_query(self, layer: int, query: Tensor) -> None:
        self._query[layer] = query

    @classmethod
    def take_query_rows(cls, policies: list[Policy], layer: int, queries: list[Tensor]) -> None:
        """Each row takes its query; rows that may choose ``layer`` together (the same
        :meth:`together_key`), two or more, then choose in one pass (:meth:`score_rows`, one pick) and start
        their copies now, each from its own pool, on demand as alone. Each row's scores and pick are those it
        makes alone."""
        super().take_query_rows(policies, layer, queries)
        groups: dict[Hashable, list[ScoredPolicy]] = {}
        for policy in policies:
            key = policy.together_key(layer)
            if key is not None:
                groups.setdefault(key, []).append(policy)
        for group in groups.values():
            if len(group) > 1:
                cls._choose_together(group, layer)

    def together_key(self, layer: int) -> Hashable | None:
        """Sequences of one class whose choice of ``layer`` this step has the same key choose it together
        (:meth:`score_rows`); None: this one chooses alone. The base: always alone. A class that can score
        several sequences' units side by side gives a key only where :meth:`select` would pick by scores:
        one unpadded row that leaves something out but takes at least one unit, with no reserved units
        (:meth:`reserved` None) and :meth:`score` not None; the key holds what else its rows must share."""
        return None

    @classmethod
    def score_rows(cls, policies: list[ScoredPolicy], layer: int) -> Tensor:
        """:meth:`score` of sequences with one :meth:`together_key`, one row each, side by side: [rows,
        kv_heads or heads, the most units of a row], -inf after a row's own units. Here each row's own
        :meth:`score` (the pick is what the rows share); a class may score them in one product where that
        saves more than gathering the rows' inputs costs, row by row what each scores alone."""
        scores = [policy.score(layer, policy.host_pool.length(layer), 1) for policy in policies]
        most = max(score.shape[-1] for score in scores)
        return torch.cat([F.pad(score, (0, most - score.shape[-1]), value=-math.inf) for score in scores])

    @staticmethod
    def _choose_together(group: list[ScoredPolicy], layer: int) -> None:
        """:meth:`select` and :meth:`start_fetch` of ``layer`` for ``group`` (one row each, one
        :meth:`together_key`): the scores side by side, the picks in one pass (``pick_each``: each row's
        is the one ``pick_top`` makes for it alone), each row's units expanded and copied as alone; the time
        it takes counts in equal shares as each one's selector time."""
        first, start = group[0], time.perf_counter()
        takes = []
        for policy in group:
            real = policy.real_past(layer, policy.host_pool.length(layer), 1)
            takes.append(min(policy.takes(layer, real)[0], policy.units(layer, real)[0]))
        scores = type(first).score_rows(group, layer)
        if scores.shape[1] != first.spec.num_kv_heads:
            scores = group_relative_max(scores, scores.shape[1] // first.spec.num_kv_heads)
        index = pick_each(scores, takes, None, 0).to(first.device)  # no reserved units (together_key)
        share = (time.perf_counter() - start) / len(group)
        for r, policy in enumerate(group):
            policy.count_selector_time(share)
            with policy.selecting():
                slots, valid = policy.expand(layer, index[r : r + 1, :, : takes[r]], None)
            with policy.host_pool.on_demand():
                transfer = policy.host_pool.fetch(layer, slots, extra=1)
            policy.hold(layer, (slots, valid, transfer))

    def select(self, layer: int, n_past: int, batch: int) -> tuple[Tensor, Tensor | None]:
        """Past slots ``layer`` reads this step: (index [batch, kv_heads, m], each row's ascending, and
        which entries each row attends to, or None for all)."""
        everything = torch.arange(n_past, device=self.device).expand(batch, self.spec.num_kv_heads, -1)
        if not self.scored(layer):
            return everything, None
        real = self.real_past(layer, n_past, batch)
        units = self.units(layer, real)
        takes = [min(take, have) for take, have in zip(self.takes(layer, real), units, strict=True)]
        if takes == units:  # every row reads all it has
            self._query.pop(layer, None)
            return everything, None
        with self.selecting():
            return self._pick(layer, n_past, batch, takes)

    def _pick(self, layer: int, n_past: int, batch: int, takes: list[int]) -> tuple[Tensor, Tensor | None]:
        """:meth:`select`'s choice when a row leaves something out: score, then each row's ``takes``."""
        scores = self.score(layer, n_past, batch)
        reserved = self.reserved(layer, n_past, batch)
        if scores is None:  # the reserved slots are the pick: each row's first takes[row], ascending
            width, heads = max(takes, default=0), self.spec.num_kv_heads
            index = first_slots(reserved, width)[:, None].expand(-1, heads, -1)
            count = torch.tensor(takes, device=index.device)[:, None, None]
            own = (torch.arange(width, device=index.device) < count).expand(-1, heads, -1)
            return self.expand(layer, index, None if min(takes, default=0) == width else own)
        if self.scores_slots:
            padding = ~self.past_valid(n_past, batch).to(scores.device)
            scores = scores.masked_fill(padding[:, None], -math.inf)
        if scores.shape[1] != self.spec.num_kv_heads:
            scores = group_relative_max(scores, scores.shape[1] // self.spec.num_kv_heads)
        index, valid = pick_top(
            scores,
            takes,
            None if reserved is None else reserved[:, None].to(scores.device),
            self.most_reserved(layer),
        )
        return self.expand(layer, index.to(self.device), valid)

    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> tuple[Tensor, Tensor | None, Transfer]:
        n_past, batch = self.host_pool.length(layer), self.host_pool.rows
        window = self.spec.sliding_window[layer]
        if window is not None:
            # The new token's window holds it and the window - 1 tokens before it.
            index = torch.arange(max(0, n_past - window + 1), n_past, device=self.device)
            index, valid = index.expand(batch, self.spec.num_kv_heads, -1), None
        else:
            index, valid = self.select(layer, n_past, batch)
        # one spare slot after the selected ones: decode writes the new token there, with no concatenation
        return index, valid, self.host_pool.fetch(layer, index, extra=1)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        n_past = self.host_pool.length(layer)
        index, valid, transfer = self.take_fetch(layer)
        keys, values = transfer.wait()  # the selected rows, then the spare slot
        self.host_pool.append(layer, k_new, v_new)
        index = index.to(k_new.device)
        if self.adjust_keys(layer, index, keys[:, :, :-1]) is not None:
            raise TypeError(f"{type(self).__name__}.adjust_keys rewrites the keys in place and returns None")
        keys[:, :, -1:], values[:, :, -1:] = k_new, v_new
        new_position = index.new_full((*index.shape[:2], 1), n_past)
        positions = torch.cat([index, new_position], dim=2)
        if valid is not None:
            valid = torch.cat([valid.to(k_new.device), valid.new_ones(*valid.shape[:2], 1)], dim=2)
        self.record_attended(layer, self._attended(n_past, positions, valid))
        return Selection(keys, values, positions, valid)

    def _attended(self, n_past: int, positions: Tensor, valid: Tensor | None) -> int | Tensor:
        """Tokens attended: what each row really sees (not its left padding, nor slots it hides)."""
        if not self.padded:  # every position is real
            return positions.shape[2] if valid is None else valid.sum(dim=-1).float().mean()
        batch = positions.shape[0]
        real = self.past_valid(n_past, batch).to(positions.device)
        real = torch.cat([real, real.new_ones(batch, 1)], dim=1)  # the new token is real
        seen = real.gather(1, positions.flatten(1)).view_as(positions)
        seen = seen if valid is None else seen & valid
        return seen.sum(dim=-1).float().mean()


# -- attention -----------------------------------------------------------------------------------------------
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q: [batch, heads, q_len, d]; k, v: [batch, kv_heads, n, d]; mask: bool, True = attend, broadcastable to
    [batch, kv_heads or 1, q_len, n], or None for plain causal attention (q_len == n) or no mask (q_len == 1).
    Returns [batch, q_len, heads, d] (the layout transformers' attention modules expect).
    """
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if q_len == 1:
        # One query per head: fold each group's heads into the query axis so every KV head is read once.
        grouped = q.reshape(batch, kv_heads, group, dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2)
    is_causal = mask is None and q_len > 1
    if mask is not None and mask.shape[1] not in (1, heads):
        mask = mask.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=group > 1
    )
    return out.transpose(1, 2)


def per_kv_head(a: Tensor, b: Tensor) -> Tensor:
    """``a`` [batch, heads, m, x] times ``b`` [batch, kv_heads, x, y]: [batch, heads, m, y], query head h
    against KV head h // group. One matmul per head of a group instead of ``b`` repeated for every query
    head, so nothing is copied. On the CPU each head's product is the one the repeated ``b`` gives, bit
    for bit (tested in float32, bfloat16 and float16); a GPU library may order its sums otherwise."""
    batch, heads, m, x = a.shape
    kv_heads = b.shape[1]
    group = heads // kv_heads
    if group == 1:
        return torch.matmul(a, b)
    grouped = a.reshape(batch, kv_heads, group, m, x)
    products = [torch.matmul(grouped[:, :, member], b) for member in range(group)]
    return torch.stack(products, dim=2).view(batch, heads, m, b.shape[-1])


def stacks_rows_exactly(tensor: Tensor) -> bool:
    """Whether products and softmaxes over rows stacked one above the other give each row the bits its own
    gives, for ``tensor``'s dtype and device: float32 and bfloat16 on the CPU, where a batch's kernels ran
    each matrix alike on the machine this project is measured on (tests/test_baselines.py holds it);
    float16's CPU kernels change with the number of matrices, and a GPU library's choice is not checked,
    so rows there are computed apart."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.bfloat16)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """Softmax attention probabilities [batch, heads, q_len, n] (explicit, for policies that need them)."""
    group = q.shape[1] // k.shape[1]
    scores = per_kv_head(q, k.transpose(-1, -2)) * scaling
    if mask is None and q.shape[2] > 1:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(
            k.shape[2] - q.shape[2]
        )
    if mask is not None:
        if mask.dim() == 4 and mask.shape[1] not in (1, q.shape[1]):
            mask = mask.repeat_interleave(group, dim=1)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).nan_to_num(0.0)
