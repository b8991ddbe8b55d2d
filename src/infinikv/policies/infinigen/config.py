"""InfiniGen's knobs (:class:`InfiniGenConfig`) and how the calibrated ones resolve against a model's skew.

``alpha``, ``partial_ratio`` and ``own_query_layers`` default to the values calibrated for the model and
stored with its skew (a ``skewfile.Tuned`` record, ``calibration.tune``); :meth:`InfiniGenConfig.resolve`,
:meth:`~InfiniGenConfig.resolve_own_query` and :meth:`~InfiniGenConfig.alpha_holds` say which value a layer
or a sequence takes and where it came from, and :meth:`~InfiniGenConfig.check_spec` refuses layer numbers
the model does not have. A calibration without calibrated knobs (none of this version) falls back to the
paper's constants (:data:`PAPER_ALPHA`, :data:`PAPER_PARTIAL_RATIO`) and rehearses every layer. The
policy's module docstring (``policy.py``) says why each knob is what it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...errors import PolicyError
from ...spec import ModelSpec
from ..config import PolicyConfig, knob, min_tokens_knob
from . import tuning
from .blocks import bound_bytes_per_token
from .skewfile import RatioAtLength, Skew, Tuned

EVICTIONS = ("fifo", "lru", "counter")
FIRST_LAYERS = ("dense", "own")
COLUMN_ALLOCATIONS = ("uniform", "per_layer")
# How the partial key cache is stored on the device, and its bits per value: integers with one 16-bit float
# scale per token and KV head (4-bit ones two to a byte), or the model's own dtype (the paper's; its bits
# depend on the model).
PARTIAL_KEYS = {"int4": 4, "int8": 8, "int16": 16, "model": None}
KEYS_WHEN_CUT = ("int4", "cut")
SCALE_BYTES = 2  # the per-token scale of integer partial keys (float16)
PAPER_ALPHA = 5.0  # the paper's and artifact's threshold for Llama-family models
PAPER_PARTIAL_RATIO = 0.2  # the paper's share of key columns
# select_every: the share of a choice's budget whose next tokens the steps between read (its best read
# tokens; on SmolLM2-135M at 4k, following 3 per KV head lost the needle, 16 found it)
FOLLOWED_SHARE = 1 / 32
# Each of the N - 1 steps between two choices adds more than FOLLOWED_SHARE of the budget to what a layer
# reads, and a choice leaves room for all of them: past this N a choice keeps under half of its budget.
MAX_SELECT_EVERY = round(0.5 / FOLLOWED_SHARE)


@dataclass(frozen=True)
class InfiniGenConfig(PolicyConfig):
    """InfiniGen's knobs. ``alpha`` and ``partial_ratio`` 0 and ``own_query_layers`` "calibrated" take the
    model's calibrated values (:meth:`resolve`, :meth:`resolve_own_query`)."""

    alpha: float = knob(
        0.0,
        "threshold in logit units: tokens within alpha of a head's best speculative score are counted "
        "(inf = all, then the budget alone decides); 0 = the model's calibrated alpha per layer (infinikv "
        "calibrate; it counts sequences that rehearse at the calibration text's partial_ratio, the others "
        "fetch their budget: at the default columns, every prompt on SmolLM2-135M and Gemma-3-270M); the "
        "paper's constant for Llama-family models is 5",
        low=0,
        allow_inf=True,
    )
    partial_ratio: float = knob(
        0.0,
        "share of head_dim columns used for speculation; 0 = the widest share the model was calibrated to at "
        "the prompt's length or a longer one (infinikv calibrate: 2k, 4k and 8k windows); the paper's is 0.2 "
        "(with calibrated alphas, a ratio other than the calibration text's fetches the budget: see alpha)",
        low=0,
        high=1,
    )
    partial_keys: str = knob(
        "int8",
        "how the partial key cache is stored on the device: int4, int8 or int16 with one scale per token "
        "and KV head (symmetric, the scale's max; int4 two to a byte, so the device budget holds twice "
        "int8's columns, each coarser), or model = the model's dtype (the paper)",
        choices=tuple(PARTIAL_KEYS),
    )
    keys_when_cut: str = knob(
        "int4",
        "where the device budget cannot hold a calibrated ratio's columns as int8 partial keys (a 16-bit "
        "model at 4k and 8k: 30 of SmolLM2-135M's 48), store them as int4 instead, twice the columns in the "
        "same bytes, if that holds more of them; cut = keep int8 and cut the columns. A float32 model at "
        "the default budget holds every calibrated column as int8, so there it never acts",
        choices=KEYS_WHEN_CUT,
        neutral=True,
    )
    column_allocation: str = knob(
        "uniform",
        "how a calibrated partial_ratio's columns are spread over the rehearsed layers: uniform = each takes "
        "the ratio; per_layer = the same total columns, allocated to the layers whose recall of the real "
        "top-k gains most per column (calibration's per-layer curves at the prompt's length; the budget then "
        "counts every sequence); a given partial_ratio is uniform",
        choices=COLUMN_ALLOCATIONS,
        neutral=True,
    )
    device_budget: float = knob(
        0.125,
        "most device memory the partial key cache may hold, as a fraction of the dense KV cache of the same "
        "tokens in the model's dtype; a calibrated partial_ratio is cut to the widest that fits, after "
        "keys_when_cut (a given one is kept, and stats report what it holds and how it was stored)",
        low=0,
        high=1,
        open_low=True,
    )
    block_size: int = knob(
        0,
        "0 = score every token (the paper); else coarse-to-fine speculation: tokens per block whose "
        "partial-key bounds (max and min per column, held on the device within device_budget) rank the "
        "blocks first, then tokens are scored, counted and picked among the best blocks alone (blocks.py; "
        "1 = blocks of one token, whose bounds are their scores; docs/results-infinigen.md has what it "
        "costs and keeps); at most 4096 (each candidate block's slots are gathered whole, so a larger "
        "block would size the gather by itself, not by the context)",
        low=0,
        high=4096,
    )
    block_candidates: float = knob(
        1.25,
        "with block_size: the candidate blocks hold this many times the budget's tokens (plus the blocks of "
        "the sinks and the recent window); more finds more of the real top tokens, at more selector work",
        low=1,
    )
    budget: float = knob(
        0.2,
        "cap on tokens fetched per layer (<= 1: fraction of the context; a count above it fetches all)",
        low=0,
        open_low=True,
    )
    min_tokens: int = min_tokens_knob()
    capacity: float = knob(
        1.0,
        "host pool size (<= 1: fraction of the tokens seen, else tokens; 1 = no eviction)",
        low=0,
        open_low=True,
    )
    eviction: str = knob("counter", "which slot a full pool overwrites", choices=EVICTIONS)
    dense_layers: int = knob(2, "the first layers, which no layer before rehearses (see first_layers)", low=0)
    first_layers: str = knob(
        "own",
        "how the first dense_layers layers read their KV: dense = whole (the paper); own = the budget's top "
        "tokens by the layer's own partial query, chosen once that query exists (their copy is not "
        "prefetched: it waits on the layer; calibrated alpha: the layer's own, scored with its own query)",
        choices=FIRST_LAYERS,
    )
    own_query_layers: str = knob(
        "calibrated",
        "later layers that also choose with their own query once it exists (their copy not prefetched), for "
        "a layer whose rehearsal from the layer before misses: calibrated = the model's (infinikv calibrate: "
        "those whose rehearsal keeps < 90 % of their own query's recall, at most 1/8 of the rehearsed "
        "layers; SmolLM2-135M: 9, 12, 20), none (or empty), or comma-separated layer numbers",
        examples=("none", "1", "1,3"),
    )
    own_query_prefetch: bool = knob(
        False,
        "own-query layers (the first layers under first_layers own, and own_query_layers) copy ahead the "
        "slots they chose at the step before (layer 0's copy starts beside the step before's last layers, "
        "the others' one layer ahead); once their own query has chosen, only the rows that prefetch missed "
        "are copied (on demand) and the layer attends to exactly its own choice: fewer bytes copied without "
        "prefetch, more bytes moved (the prefetch's misses); false: their whole copy waits on their query",
        neutral=True,
    )
    select_every: int = knob(
        1,
        "decode steps per choice: 1 = every layer chooses at every step (the paper); N > 1 = a layer chooses "
        "at every N-th step and, at the steps between, reads what it read at the step before, the token it "
        "stored then and the token after each of its best read tokens (a 32nd of its budget, one further per "
        "step): 1/N of the selector's work, and own-query layers copy ahead at those steps; a choice leaves "
        "room for what the steps until the next add, so the budget holds at every step (at most "
        f"{MAX_SELECT_EVERY}: beyond, a choice would keep under half of its budget)",
        low=1,
        high=MAX_SELECT_EVERY,
        neutral=True,
    )
    skew: bool = knob(
        True, "false: the identity instead of the skewing matrices (partial columns by the same rule)"
    )
    n_sink: int = knob(
        0,
        "first real tokens always fetched on managed layers (attention sinks; more than there are: all, "
        "the budget still caps)",
        low=0,
    )
    window: int = knob(
        32,
        "most recent past tokens always fetched on managed layers (paper: 0; more than there are: all, the "
        "budget still caps)",
        low=0,
    )

    def __post_init__(self):
        super().__post_init__()
        self.own_query_set()  # a malformed list fails here, before any model work

    def own_query_set(self) -> frozenset[int] | None:
        """The layers of ``own_query_layers``; None for the model's calibrated ones."""
        given = self.own_query_layers.strip().lower()
        if given == "calibrated":
            return None
        parts = [] if given == "none" else [part.strip() for part in given.split(",") if part.strip()]
        if not all(part.isdigit() for part in parts):
            raise PolicyError(
                "own_query_layers must be calibrated, none or comma-separated layer numbers, got "
                f"{self.own_query_layers!r}",
                knob="own_query_layers",
            )
        return frozenset(int(part) for part in parts)

    def check_spec(self, spec: ModelSpec) -> None:
        """Refuse knob values the model cannot take: ``own_query_layers`` naming a layer it does not have.
        The policy checks this when built; the server, when a request arrives, so that one request's bad
        layer number never fails the batch it would have joined."""
        named = self.own_query_set()
        if named is not None and any(layer >= spec.num_layers for layer in named):
            raise PolicyError(
                f"own_query_layers: this model's layers are 0-{spec.num_layers - 1}, got "
                f"{self.own_query_layers!r}",
                knob="own_query_layers",
            )

    def resolve_own_query(self, skew: Skew | None) -> tuple[frozenset[int], str]:
        """The later layers that choose with their own query with ``skew``, and where they came from (as
        :meth:`resolve`)."""
        named = self.own_query_set()
        if named is not None:
            return named, "given"
        tuned = skew.tuned if skew is not None else None
        if tuned is None:
            return frozenset(), "none (this calibration names none; the paper rehearses every layer)"
        return frozenset(tuned.own_query_layers), f"calibrated: {tuned.own_query_rule}"

    def bytes_per_token(self, columns: int, element_size: int) -> float:
        """Device bytes of one token's partial key, one KV head, at ``columns`` columns (``element_size``:
        the model dtype's, for ``partial_keys`` model), its share of its block's bounds included."""
        bits = PARTIAL_KEYS[self.partial_keys]
        key = columns * element_size if bits is None else math.ceil(columns * bits / 8) + SCALE_BYTES
        return key + bound_bytes_per_token(columns, self.block_size)

    def column_cap(self, spec: ModelSpec, element_size: int) -> int:
        """The most partial columns whose cache, over the managed layers, fits ``device_budget`` of the dense
        KV (``2 · head_dim · element_size`` bytes per token and KV head on every layer); at least 1."""
        managed = sum(self.selects(spec, layer) for layer in range(spec.num_layers))
        if not managed:
            return spec.head_dim
        allowed = self.device_budget * 2 * spec.head_dim * element_size * spec.num_layers / managed
        fits = [c for c in range(1, spec.head_dim + 1) if self.bytes_per_token(c, element_size) <= allowed]
        return max(fits, default=1)

    def stored_keys(self, skew: Skew | None, spec: ModelSpec, element_size: int) -> str:
        """How the partial keys are stored: ``partial_keys``, or int4 where ``keys_when_cut`` says so (int8
        keys, calibrated ratios, and the budget holds fewer of the widest's columns than int4 would)."""
        if self.keys_when_cut == "cut" or self.partial_keys != "int8" or self.partial_ratio:
            return self.partial_keys
        wanted = math.ceil(self.widest_ratio(skew) * spec.head_dim)
        cap = self.column_cap(spec, element_size)
        narrow = replace(self, partial_keys="int4").column_cap(spec, element_size)
        return "int4" if cap < wanted and narrow > cap else self.partial_keys

    def selects(self, spec: ModelSpec, layer: int) -> bool:
        """Whether ``layer`` fetches selected tokens (the others load their full KV or their window)."""
        return not spec.is_sliding(layer) and (layer >= self.dense_layers or self.first_layers == "own")

    def resolve(
        self,
        name: str,
        skew: Skew | None,
        layer: int | None = None,
        tokens: int | None = None,
        own_query: bool | None = None,
        cap: tuple[int, int] | None = None,
    ) -> tuple[float, str]:
        """The value of the calibrated knob ``name`` ("alpha" or "partial_ratio") with ``skew``, and where it
        came from: this config's when set, else the model's calibrated one (alpha: ``layer``'s own when it
        was calibrated, scored as the layer chooses, by its own query or rehearsed (``own_query``; None: as
        at the default knobs), else the one for all layers; partial_ratio: the one for a prompt of
        ``tokens`` when given and calibrated per length, else the calibration text's, cut to ``cap`` = (most
        columns, head_dim) when given: the device budget's), else (a calibration without it) the paper's."""
        given = getattr(self, name)
        if given:
            return float(given), "given"
        tuned = skew.tuned if skew is not None else None
        if tuned is None:
            paper = {"alpha": PAPER_ALPHA, "partial_ratio": PAPER_PARTIAL_RATIO}[name]
            return paper, "paper (this calibration has none)"
        if name == "partial_ratio":
            entry = _length_entry(tuned, tokens) if tokens is not None else None
            if entry is not None:
                # Uniform columns: the widest ratio calibrated at the prompt's window or a longer one. A
                # short prompt's own ratio meets the recall rule on average, but the device budget holds the
                # longer windows' columns, and with them rehearsal finds the values of a multi-part answer
                # that fewer columns miss (docs/results-infinigen.md).
                later = tuned.ratio_by_length[tuned.ratio_by_length.index(entry) :]
                widest = entry if self.allocates_columns() else max(later, key=lambda e: e.partial_ratio)
                ratio, source = (
                    widest.partial_ratio,
                    f"calibrated at {widest.tokens} tokens (the widest from {entry.tokens} on): "
                    f"{tuned.ratio_rule}",
                )
            else:
                ratio, source = tuned.partial_ratio, f"calibrated: {tuned.ratio_rule}"
            if cap is not None and math.ceil(ratio * cap[1]) > cap[0]:
                return cap[0] / cap[1], f"the device budget's {cap[0]} of {cap[1]} columns ({source})"
            return ratio, source
        per_layer = {
            None: tuned.alpha_per_layer,
            True: tuned.alpha_per_layer_own,
            False: tuned.alpha_per_layer_rehearsed,
        }[own_query]
        if layer is not None and layer < len(per_layer) and per_layer[layer] is not None:
            return per_layer[layer], f"calibrated: {tuned.layer_rule}"
        return tuned.alpha, f"calibrated: {tuned.rule}"

    def alpha_holds(
        self, skew: Skew | None, ratio: float, head_dim: int, stored_keys: str | None = None
    ) -> tuple[bool, str]:
        """Whether the alpha in use counts a sequence that rehearses with ``ratio`` of the columns, and why:
        a given alpha, or the paper's, always; calibrated alphas only at as many columns, stored as they
        were calibrated with (``stored_keys``: how they are stored, :meth:`stored_keys`; None:
        ``partial_keys``)."""
        tuned = skew.tuned if skew is not None else None
        if self.alpha or tuned is None:
            return True, "alpha"
        if self.allocates_columns():
            return False, "budget (columns allocated per layer)"
        calibrated_at = tuned.partial_ratio
        if tuned.partial_keys != (stored_keys or self.partial_keys):
            return False, f"budget (alphas calibrated with {tuned.partial_keys} partial keys)"
        if math.ceil(ratio * head_dim) == math.ceil(calibrated_at * head_dim):
            return True, "alpha"
        return False, f"budget (alphas calibrated at partial ratio {calibrated_at:g}, this one's {ratio:g})"

    def widest_ratio(
        self,
        skew: Skew | None,
        cap: tuple[int, int] | None = None,
        layer: int | None = None,
        allocations: dict[int, dict[int, float]] | None = None,
    ) -> float:
        """The widest partial ratio any prompt length resolves to (``cap`` as in :meth:`resolve`), on
        ``layer`` where columns are allocated per layer (``allocations``, :meth:`allocations`'): the prompt's
        partial keys are computed with it before its length is known."""
        ratio = self.resolve("partial_ratio", skew, cap=cap)[0]
        tuned = skew.tuned if skew is not None and not self.partial_ratio else None
        by_length = tuned.ratio_by_length if tuned is not None else ()
        calibrated = max([entry.partial_ratio for entry in by_length], default=0.0)
        widest = max(ratio, calibrated if cap is None else min(calibrated, cap[0] / cap[1]))
        if layer is None or not allocations:
            return widest
        return allocations[by_length[-1].tokens].get(layer, widest)  # the longest window holds the others

    def allocates_columns(self) -> bool:
        """Whether calibrated columns are allocated per layer (``column_allocation``; a given
        ``partial_ratio`` is uniform)."""
        return self.column_allocation == "per_layer" and not self.partial_ratio

    def calibration_window(self, skew: Skew | None, tokens: int) -> int | None:
        """The calibration window (its tokens) a prompt of ``tokens`` takes, or None without ratios per
        length."""
        entry = _length_entry(skew.tuned if skew is not None else None, tokens)
        return None if entry is None else entry.tokens

    def allocations(
        self, skew: Skew | None, cap: tuple[int, int] | None = None
    ) -> dict[int, dict[int, float]]:
        """Columns allocated per layer, per calibration window (by its tokens): per rehearsed layer this run
        manages, of the calibration's curves at that window (``RatioAtLength.layer_curves``), its ratio, the
        layers' columns adding up to at most what the ratio :meth:`resolve` gives (``cap`` as there) gives
        each of them (``tuning.allocate_ratios``). The windows are allocated from the longest down, each
        layer no wider than at the window after it, so the longest's allocation holds every window's
        columns: the prompt's partial keys, computed before its length is known, are kept in those
        (:meth:`widest_ratio`), within the device budget. Empty where columns are uniform (every layer
        takes :meth:`resolve`'s ratio), nothing was calibrated, or the budget leaves a layer fewer columns
        than the narrowest ratio gives (the allocation starts there)."""
        tuned = skew.tuned if skew is not None else None
        if not self.allocates_columns() or tuned is None or not tuned.ratio_by_length:
            return {}
        if not all(window.layer_curves for window in tuned.ratio_by_length):
            raise PolicyError(
                "infinigen: column_allocation per_layer needs the per-layer recall curves that this "
                "calibration predates; run `infinikv calibrate --model …` again"
            )
        head_dim = skew.matrices.shape[-1]
        narrowest = max(1, math.ceil(round(tuning.RATIOS[0] * head_dim, 6)))
        allocated: dict[int, dict[int, float]] = {}
        most = None
        for window in reversed(tuned.ratio_by_length):  # the longest first
            ratio = self.resolve("partial_ratio", skew, tokens=window.tokens, cap=cap)[0]
            columns = max(1, math.ceil(round(ratio * head_dim, 6)))  # as Skew.columns counts them
            if columns < narrowest:
                return {}
            # the curves' layers are the global ones from the calibration's dense_layers; of those, the
            # ones this run manages (as selects()), so that their columns stay within its device budget
            curves = {
                layer: curve
                for layer, curve in window.layer_curves
                if layer >= self.dense_layers or self.first_layers == "own"
            }
            most = allocated[window.tokens] = tuning.allocate_ratios(
                curves, columns * len(curves), head_dim, most=most
            )
        return allocated


def _length_entry(tuned: Tuned | None, tokens: int | None) -> RatioAtLength | None:
    """The calibration window a prompt of ``tokens`` takes (the shortest at least as long, else the longest;
    None: the calibration text's, the first), or None without ratios per length."""
    by_length = tuned.ratio_by_length if tuned is not None else ()
    if not by_length:
        return None
    if tokens is None:
        return by_length[0]
    return next((e for e in by_length if e.tokens >= tokens), by_length[-1])
