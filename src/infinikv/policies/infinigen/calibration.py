"""InfiniGen calibration: per-KV-head skewing matrices and partial-column scores, cached per model.

InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707) rehearses layer i+1's attention during
layer i with a few columns of its query and key. An orthogonal change of basis ("skewing") first moves most
of the energy of Q and K into few columns, so that those columns approximate QKᵀ well.

Calibration runs the model once over a calibration text (default: the first ``tokens`` tokens of the
``austen`` corpus, see ``infinikv.data``) and captures each layer's normalised input with a forward
pre-hook on its attention module; the layer's post-RoPE queries and keys are recomputed from it
(``ModelSpec.query``/``key``: the same projections, norms and rotary embedding the attention applies). For
each KV head it stacks the post-RoPE queries of the query heads that share it (g·n rows × d) and takes their
SVD, Q = UΣVᵀ; the skewing matrix is A = V (columns by descending singular value). A is orthogonal, so
(QA)(KA)ᵀ = QKᵀ; with grouped-query attention one A per KV head is the only choice that keeps the shared
keys consistent. RoPE does not commute with A, so A is applied only on the speculation path (to post-RoPE
queries and keys); the model's own attention is never changed.

Partial columns follow the paper's rule: the k = ⌈partial_ratio·d⌉ columns with the largest
Σ_tokens |Q̃| + Σ_tokens |K̃| (Q̃ summed over all query heads of the group). The public artifact differs:
its accuracy path takes the union of the top-k columns by |Q̃| and by |K̃| (up to 2k columns), and its
speed path the top-k by |Q̃| of the prompt itself.

The same pass calibrates the share of columns ``partial_ratio`` and the threshold ``alpha`` (``tuning.py``):
the last ``tuning.POSITIONS`` positions of the text play decode steps, layer i rehearsed from layer i-1's
captured input; the smallest ratio whose speculated top-k holds ``tuning.RATIO_TARGET`` of what full-width
speculation holds (averaged over the layers InfiniGen rehearses at its default knobs), the layers whose
rehearsal keeps less than ``tuning.OWN_TARGET`` of what their own query finds (they choose with it), then,
per managed layer, the smallest alpha whose count rule keeps ``tuning.TARGET`` of that layer's dense
attention, are stored with the skew. A second pass over a longer prefix of the same text (up to
``tuning.LENGTHS``, within the model's context) calibrates the ratio again at the end of each longer window:
the narrow rehearsal that serves 2k tokens loses needles among 8k (``ratio_by_length``; each sequence
takes the widest ratio of its prompt's window and the longer ones); the own-query layers are chosen over
every window. The skewing matrices and the alphas come from the first pass alone.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ...errors import InputError
from ...spec import ModelSpec
from ...store import locked
from . import skewfile, tuning
from .config import PAPER_ALPHA, PAPER_PARTIAL_RATIO, PARTIAL_KEYS, InfiniGenConfig
from .skewfile import AlphaPoint, OwnQueryPoint, RatioAtLength, RatioPoint, Skew, Tuned, skew_path

if TYPE_CHECKING:
    from ...models import LoadedModel

Tensor = torch.Tensor
DEFAULT_CORPUS = "austen"
DEFAULT_TOKENS = 2048
# The progress bar counts work in units of one scoring of the tuning steps against 1,024 tokens
# (``tuning.prompt_recall`` per candidate); a layer of the dense pass over 1,024 tokens costs about as much
# as PASS_COST of them (measured on a 2-core CPU), so one bar's ETA holds through the passes and the tuning.
PASS_COST = 6


def ensure_skew(loaded: LoadedModel) -> Skew:
    """The cached calibration of ``loaded``, calibrating (with the defaults) if there is none, or if the
    cached one has no calibrated knobs of this version (:data:`skewfile.TUNED_VERSION`)."""
    found = skewfile.cached_skew(loaded.spec)
    if found is not None and found.tuned is not None:
        return found
    # One process calibrates; another waits, then reads its file. Taking the lock also proves the cache
    # is writable before the work starts.
    with locked(f"skew-{loaded.weights_id[:16]}"):
        found = skewfile.cached_skew(loaded.spec)
        if found is not None and found.tuned is not None:
            return found
        why = "once per model" if found is None else "the cached one has no calibrated knobs of this version"
        print(f"calibrating InfiniGen skew for {loaded.name} ({why})", file=sys.stderr)
        return calibrate(loaded)


# -- calibration ---------------------------------------------------------------------------------------------
class _Capture:
    """Turns each layer's post-RoPE queries and keys into its skewing matrices and column scores."""

    def __init__(
        self, spec: ModelSpec, progress: Callable[[], None], ends: tuple[int, ...], fit: bool = True
    ):
        """``progress``: called once per layer captured; ``ends``: the window ends (in tokens) whose last
        positions play decode steps for ``tune``; ``fit``: whether to compute the skewing matrices (the
        longer pass only needs the windows)."""
        self.spec = spec
        self.ends, self.fit = ends, fit
        d = spec.head_dim
        shape = (spec.num_layers, spec.num_kv_heads)
        self.matrices = torch.zeros(*shape, d, d)
        self.scores = torch.zeros(*shape, d)
        self.identity_scores = torch.zeros(*shape, d)
        self.progress = progress
        # for the calibrated knobs (``tune``), per window end and layer: real queries of the window's last
        # positions, the keys up to its end, and the queries rehearsed from the previous layer's input
        self.tuning_inputs: dict[int, dict[int, tuple[Tensor, Tensor, Tensor]]] = {end: {} for end in ends}
        self._previous: Tensor | None = None

    def hook(self, layer: int):
        """A forward pre-hook for ``layer``'s attention module: its input is the normalised hidden state."""

        def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            positions = torch.arange(x.shape[1], device=x.device)[None]
            q, k = self.spec.query(layer, x, positions), self.spec.key(layer, x, positions)
            if self.fit:
                self.add(layer, q, k)
            self.progress()
            previous = x if self._previous is None else self._previous
            for end in self.ends:
                window = slice(end - min(tuning.POSITIONS, end - 1), end)
                rehearsed = self.spec.query(layer, previous[:, window], positions[:, window])[0]
                # q copied (a CPU view would keep the whole pass's queries alive); k shared across windows
                window_q = q[0, :, window].to("cpu", copy=True)
                self.tuning_inputs[end][layer] = (window_q, k[0, :, :end].cpu(), rehearsed.cpu())
            self._previous = x

        return capture

    def add(self, layer: int, q: Tensor, k: Tensor) -> None:
        group = self.spec.group_size
        for head in range(self.spec.num_kv_heads):
            queries = q[0, head * group : (head + 1) * group].reshape(-1, q.shape[-1]).double()
            keys = k[0, head].double()
            # Right singular vectors of the group's stacked queries, by descending singular value.
            basis = torch.linalg.svd(queries, full_matrices=False).Vh.mT
            self.matrices[layer, head] = basis.float().cpu()
            self.scores[layer, head] = (
                ((queries @ basis).abs().sum(0) + (keys @ basis).abs().sum(0)).float().cpu()
            )
            self.identity_scores[layer, head] = (queries.abs().sum(0) + keys.abs().sum(0)).float().cpu()


def calibration_ids(loaded: LoadedModel, text: str | None, tokens: int) -> tuple[Tensor, str]:
    """Token ids [1, n] of the calibration text and the source tag that names it."""
    if tokens < 2:
        raise InputError(f"calibration needs at least 2 tokens, got {tokens}")
    tokens = min(tokens, loaded.max_context)
    if text is None:
        from ...data import load_corpus

        text, source = load_corpus(DEFAULT_CORPUS), DEFAULT_CORPUS
    else:
        source = "text:" + hashlib.sha256(text.encode()).hexdigest()[:12]
    # Tokenise only a prefix long enough for ``tokens`` (no tokenizer makes more than 1 token per character).
    ids = loaded.tokenizer(text[: 16 * tokens], return_tensors="pt")["input_ids"][:, :tokens]
    if ids.shape[1] < 2:
        raise InputError("calibration text is too short (fewer than 2 tokens)")
    return ids, source


@torch.inference_mode()
def calibrate(
    loaded: LoadedModel, text: str | None = None, tokens: int = DEFAULT_TOKENS, save: bool = True
) -> Skew:
    """Compute ``loaded``'s skewing matrices and column scores over ``tokens`` tokens of ``text`` (default:
    the austen corpus); write them to the skew cache unless ``save`` is False."""
    ids, source = calibration_ids(loaded, text, tokens)
    spec = loaded.spec
    n = int(ids.shape[1])
    longer = tuple(end for end in tuning.LENGTHS if n < end <= loaded.max_context)
    long_ids = calibration_ids(loaded, text, max(longer))[0] if longer else ids
    ends = tuple(end for end in longer if end <= long_ids.shape[1])  # a short text stops early
    passes = (n, *ends[-1:])
    total = sum(PASS_COST * spec.num_layers * count / 1024 for count in passes) + tune_cost(spec, (n, *ends))
    shape = "{desc}: {percentage:3.0f}% | {elapsed} so far, about {remaining} left"
    with tqdm(
        total=round(total), desc=f"calibrating InfiniGen for {loaded.name}", bar_format=shape, leave=False
    ) as bar:
        capture = _captured(loaded, ids, (n,), True, bar.update)
        windows = {n: capture.tuning_inputs[n]}
        if ends:
            windows.update(_captured(loaded, long_ids[:, : max(ends)], ends, False, bar.update).tuning_inputs)
        skew = Skew(
            weights_id=loaded.weights_id,
            model=loaded.name,
            source=source,
            tokens=n,
            matrices=capture.matrices,
            scores=capture.scores,
            identity_scores=capture.identity_scores,
        )
        skew = replace(skew, tuned=tune(spec, skew, windows, bar.update))
    if save:
        skew.save(skew_path(loaded.weights_id, source, skew.tokens))
    return skew


def _captured(
    loaded: LoadedModel, ids: Tensor, ends: tuple[int, ...], fit: bool, progress: Callable[[float], object]
) -> _Capture:
    """One dense pass over ``ids`` [1, n] with every attention module's input captured (``_Capture``);
    ``progress`` is told each layer's share of the work (units of ``PASS_COST``)."""
    layer_cost = PASS_COST * ids.shape[1] / 1024
    capture = _Capture(loaded.spec, lambda: progress(layer_cost), ends, fit)
    hooks = [
        attention.register_forward_pre_hook(capture.hook(layer), with_kwargs=True)
        for layer, attention in enumerate(loaded.spec.attention)
    ]
    try:
        loaded.model(input_ids=ids.to(loaded.device), use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return capture


def _tuned_layers(spec: ModelSpec, present: Callable[[int], bool]) -> tuple[list[int], list[int]]:
    """The layers :func:`tune` calibrates (global ones with tuning inputs: ``present``) and, of those, the
    ones InfiniGen rehearses at its default ``dense_layers``."""
    calibrated = [layer for layer in range(spec.num_layers) if not spec.is_sliding(layer) and present(layer)]
    return calibrated, [layer for layer in calibrated if layer >= InfiniGenConfig().dense_layers]


def tune_cost(spec: ModelSpec, ends: tuple[int, ...]) -> float:
    """:func:`tune`'s work for windows ending at ``ends`` (the shortest first), in the progress bar's units:
    per rehearsed layer and window, the real top-k, one scoring per candidate ratio and one by its own query,
    and for as many own-query layers as may be named, a scoring per ratio by their own query; per calibrated
    layer, its coverage at each alpha by both queries on the shortest window."""
    calibrated, rehearsed = _tuned_layers(spec, lambda layer: True)
    if not rehearsed:
        return 0.0
    most_own = int(tuning.OWN_MAX_SHARE * len(rehearsed))
    per_window = len(rehearsed) * (len(tuning.RATIOS) + 2) + most_own * len(tuning.RATIOS)
    return sum(per_window * end / 1024 for end in ends) + len(calibrated) * 2 * 2 * ends[0] / 1024


def tune(
    spec: ModelSpec,
    skew: Skew,
    windows: dict[int, dict[int, tuple[Tensor, Tensor, Tensor]]],
    progress: Callable[[float], object] = lambda units: None,
) -> Tuned:
    """InfiniGen's calibrated knobs at its default budget and dense layers, from ``windows`` (per window end,
    the shortest first: per layer, its tuning inputs): first the partial ratio (``tuning.RATIO_RULE``), on
    the shortest window and again at the end of each longer one (``ratio_by_length``); then the layers that
    choose with their own query (``tuning.OWN_QUERY_RULE``); then, at the shortest window's ratio, the
    threshold of each managed layer (``tuning.LAYER_RULE``), scored with its own query and rehearsed, and one
    for every layer (``tuning.RULE``: the mean curve's, a summary beside the per-layer ones); each with its
    rule. ``progress`` is told each step's share of the work (the units of :func:`tune_cost`)."""
    defaults = InfiniGenConfig()
    bits = PARTIAL_KEYS[defaults.partial_keys]  # the rehearsal is measured on keys stored as it stores them
    shortest = min(windows)
    inputs = windows[shortest]
    calibrated, rehearsed = _tuned_layers(spec, lambda layer: layer in inputs)
    if not rehearsed:  # nothing to rehearse at the defaults: the paper's constants
        rule = "paper (no managed layer to calibrate on)"
        none = (None,) * spec.num_layers
        return Tuned(
            partial_ratio=PAPER_PARTIAL_RATIO,
            partial_keys=defaults.partial_keys,
            ratio_rule=rule,
            ratio_curve=(),
            ratio_by_length=(),
            alpha_per_layer=none,
            alpha_per_layer_own=none,
            alpha_per_layer_rehearsed=none,
            layer_rule=rule,
            alpha=PAPER_ALPHA,
            rule=rule,
            curve=(),
            own_query_layers=(),
            own_query_rule=rule,
            own_query_curve=(),
        )
    settings = {
        "dense_layers": defaults.dense_layers,
        "budget": defaults.budget,
        "positions": inputs[rehearsed[0]][0].shape[1],
    }

    # per window and layer: the real top-k, which the rehearsal and the layer's own query both chase
    truths: dict[tuple[int, int], Tensor] = {}

    def recall(end: int, layer: int, query: Tensor, ratios: tuple[float, ...]) -> list[float]:
        q, k, _ = windows[end][layer]
        if (end, layer) not in truths:
            truths[end, layer] = tuning.real_top_k(q, k, spec.scaling(layer), defaults.budget)
            progress(end / 1024)
        projections = [skew.projection(layer, ratio, defaults.skew) for ratio in ratios]
        found = tuning.prompt_recall(
            q, k, query, projections, spec.scaling(layer), defaults.budget, bits, truth=truths[end, layer]
        )
        progress(len(ratios) * end / 1024)
        return found

    def recalls_at(end: int) -> Tensor:  # [rehearsed layers, tuning.RATIOS]
        return torch.tensor(
            [recall(end, layer, windows[end][layer][2], tuning.RATIOS) for layer in rehearsed]
        )

    # The ratio is picked on every rehearsed layer's recall, own-query ones included: which layers choose by
    # their own query is decided at the ratio picked here, so it cannot be known first.
    by_length = {end: recalls_at(end) for end in sorted(windows)}
    ratio_of = {end: tuning.pick_ratio(recalls.mean(0).tolist()) for end, recalls in by_length.items()}

    # per rehearsed layer and window: the share of its own query's recall (same columns) that rehearsal keeps
    shares = []
    for end, recalls in by_length.items():
        column = tuning.RATIOS.index(ratio_of[end])
        own_recall = [recall(end, layer, windows[end][layer][0], (ratio_of[end],))[0] for layer in rehearsed]
        rehearsed_recall = recalls[:, column].tolist()
        shares.append(
            [min(1.0, r / o) if o else 1.0 for r, o in zip(rehearsed_recall, own_recall, strict=True)]
        )
    kept_by_layer = dict(zip(rehearsed, torch.tensor(shares).mean(0).tolist(), strict=True))
    own_query = tuning.pick_own_query(kept_by_layer)

    # Each layer's recall curve as it chooses, for columns allocated per layer: an own-query layer's is its
    # own query's (the ratio above was picked on the rehearsal's, as the own-query layers were not known).
    layer_curves = {end: recalls.clone() for end, recalls in by_length.items()}
    most_own = int(tuning.OWN_MAX_SHARE * len(rehearsed))
    for end, curves in layer_curves.items():
        for layer in own_query:
            curves[rehearsed.index(layer)] = torch.tensor(
                recall(end, layer, windows[end][layer][0], tuning.RATIOS)
            )
        progress((most_own - len(own_query)) * len(tuning.RATIOS) * end / 1024)  # budgeted, not needed

    # Each layer's alpha scored both ways, by its own query and rehearsed: a run whose own-query set differs
    # from the defaults' (a given list, none, another dense_layers) takes the one for how the layer chooses.
    ratio = ratio_of[shortest]
    kept, fetched = [], []
    ways = ("own", "rehearsed", "defaults")  # "defaults": as the layer chooses at the default knobs
    by_query: dict[str, list[float | None]] = {way: [None] * spec.num_layers for way in ways}
    for layer in calibrated:
        q, k, q_rehearsed = inputs[layer]
        projection = skew.projection(layer, ratio, defaults.skew)
        coverage = {
            way: tuning.prompt_coverage(q, k, query, projection, spec.scaling(layer), defaults.budget, bits)
            for way, query in (("own", q), ("rehearsed", q_rehearsed))
        }
        progress(2 * 2 * shortest / 1024)
        for way, (share, _) in coverage.items():
            by_query[way][layer] = tuning.pick_alpha(share.tolist())
        chosen = "own" if layer < defaults.dense_layers or layer in own_query else "rehearsed"
        by_query["defaults"][layer] = by_query[chosen][layer]
        share, fraction = coverage[chosen]
        kept.append(share)
        fetched.append(fraction)
    kept_mean, fetched_mean = torch.stack(kept).mean(0).tolist(), torch.stack(fetched).mean(0).tolist()
    return Tuned(
        partial_ratio=ratio,
        partial_keys=defaults.partial_keys,
        ratio_rule=tuning.RATIO_RULE.format(
            ratios=list(tuning.RATIOS), target=tuning.RATIO_TARGET, **settings
        ),
        ratio_curve=tuple(
            RatioPoint(r, round(m, 4))
            for r, m in zip(tuning.RATIOS, by_length[shortest].mean(0).tolist(), strict=True)
        ),
        # the ratio the same rule picks at the end of each window
        ratio_by_length=tuple(
            RatioAtLength(
                end,
                ratio_of[end],
                tuple(round(m, 4) for m in recalls.mean(0).tolist()),
                tuple(
                    (layer, tuple(round(r, 4) for r in curve))
                    for layer, curve in zip(rehearsed, layer_curves[end].tolist(), strict=True)
                ),
            )
            for end, recalls in by_length.items()
        ),
        alpha_per_layer=tuple(by_query["defaults"]),
        alpha_per_layer_own=tuple(by_query["own"]),
        alpha_per_layer_rehearsed=tuple(by_query["rehearsed"]),
        layer_rule=tuning.LAYER_RULE.format(alphas=list(tuning.ALPHAS), target=tuning.TARGET, **settings),
        alpha=tuning.pick_alpha(kept_mean),
        rule=tuning.RULE.format(alphas=list(tuning.ALPHAS), target=tuning.TARGET, **settings),
        curve=tuple(
            AlphaPoint(a, round(m, 4), round(f, 4))
            for a, m, f in zip(tuning.ALPHAS, kept_mean, fetched_mean, strict=True)
        ),
        own_query_layers=tuple(own_query),
        own_query_rule=tuning.OWN_QUERY_RULE.format(
            target=tuning.OWN_TARGET,
            share=tuning.OWN_MAX_SHARE,
            count=len(rehearsed),
            ends=sorted(windows),
            dense_layers=defaults.dense_layers,
            budget=defaults.budget,
        ),
        own_query_curve=tuple(
            OwnQueryPoint(layer, round(share, 4)) for layer, share in kept_by_layer.items()
        ),
    )


def concentration(skew: Skew, ratio: float, skewed: bool = True) -> float:
    """Share of Σ|Q̃|+Σ|K̃| held by the partial columns, averaged over layers and KV heads.

    This is the paper's column rule, in L1, and skewing need not raise it: the L1 norm is not invariant
    under rotation, and A (from Q alone) does not diagonalise K. What the SVD guarantees (Ky Fan) is the L2
    energy of Q in its leading columns, so judge skewing by the partial QKᵀ, not by this share."""
    scores = skew.scores if skewed else skew.identity_scores
    k = max(1, math.ceil(ratio * scores.shape[-1]))
    return float((scores.topk(k, dim=-1).values.sum(-1) / scores.sum(-1)).mean())
