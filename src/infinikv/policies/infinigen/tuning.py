"""InfiniGen's knobs calibrated per model: the share of key columns it rehearses with and its threshold.

InfiniGen fetches, per layer and step, the tokens whose speculated score is within ``alpha`` of each head's
best (the count averaged over the KV heads, capped by the budget); the score is computed from a share
``partial_ratio`` of the skewed key columns. The paper fixes both per model family (alpha 4 for OPT, 5 for
Llama; 20 % of the columns). What they cost depends on the model:

* columns: a narrow share of a narrow head (SmolLM2-135M's are 64 wide, so 20 % is 13 columns) misses
  tokens a needle needs (docs/results-infinigen.md). Calibration picks the smallest ratio of
  :data:`RATIOS` whose speculated top-k (k = the budget cap) holds :data:`RATIO_TARGET` of what full-width
  speculation holds, averaged over the managed layers (:data:`RATIO_RULE`);
* threshold: on sink-dominated layers few tokens come within a fixed alpha of the sink while the long tail
  together carries a large share, and how few differs from layer to layer, so one alpha cannot serve them
  all. Calibration measures, at the chosen ratio, the attention each managed layer's count rule keeps at each
  alpha of a grid and picks, per layer, the smallest alpha that keeps ``TARGET`` of that layer's attention
  (:data:`LAYER_RULE`). Each layer is measured twice, with its own query and rehearsed
  from the previous layer's input, and a run takes the alpha for how the layer chooses there (at the
  defaults: its own query on the first ``dense_layers``, ``first_layers`` own, and on the own-query layers
  below; else rehearsed). One alpha for all layers, the smallest keeping ``TARGET`` on average over the
  layers as they choose at the defaults (:data:`RULE`), is stored beside them as a summary;
* own-query layers: on a layer whose input changes much from the previous layer's, the rehearsal misses
  what the layer's own query (through the same partial columns) finds. Such a layer
  does better choosing once its own query exists, at the price of a copy that is not prefetched:
  calibration names the layers whose
  rehearsal keeps less than :data:`OWN_TARGET` of their own query's recall, averaged over the calibration
  windows, the lowest first and at most :data:`OWN_MAX_SHARE` of the rehearsed layers, so that most copies
  still overlap (:data:`OWN_QUERY_RULE`).

The columns a rehearsal needs grow with the context: among more past tokens, more are mistaken for the
real top-k. The ratio is therefore picked again, by the same rule, at the end of longer windows of the text
(:data:`LENGTHS`, within the model's context), and a prompt takes the widest ratio of its window and the
longer ones (a short prompt's own ratio meets the rule on average, but the longer windows' columns find
what fewer miss). Each rehearsed layer's own curve is kept too (an own-query layer's by its own query), from
which :func:`allocate_ratios` spreads the same total columns over the layers where ``column_allocation`` is
per_layer. The alphas are calibrated at the calibration text's ratio only, and only sequences that rehearse
at that ratio are counted with them (the policy's module docstring says why the others fetch their budget).

The measurement is the decode path on the dense trajectory, computed from the dense passes calibration
already makes: query position t of the text plays a decode step whose past is tokens 0..t-1 and whose new
token is t; layer i's speculation comes from layer i-1's normalised input, as in decoding. The attention
kept is the real softmax weight (over tokens 0..t, averaged over the query heads of a KV group) on the
fetched tokens plus the new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..base import resolve_budget
from .rehearsal import dequantized, quantize

Tensor = torch.Tensor
ALPHAS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0)
TARGET = 0.9  # share of the dense attention a calibrated alpha keeps (per layer, or averaged over layers)
POSITIONS = 256  # query positions (the last ones of the calibration text) that play decode steps
SLACK = 0.001  # when the budget cap keeps less than the target: alphas this close to the cap's share tie
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
RATIO_TARGET = 0.9  # share of full-width speculation's recall of the real top-k the calibrated ratio keeps
LENGTHS = (4096, 8192)  # window ends, beyond the calibration text's, at which the ratio is calibrated again
OWN_TARGET = 0.9  # share of its own query's recall below which a layer's rehearsal gives way to that query
OWN_MAX_SHARE = 0.125  # most own-query layers, as a share of the rehearsed ones (their copies wait)
RATIO_RULE = (
    "smallest partial ratio of {ratios} whose speculated top-k holds >= {target:.0%} of the real top-k "
    "tokens that full-width speculation holds (k = the budget cap {budget}), averaged over the managed "
    "layers (dense_layers {dense_layers}) and the last {positions} positions of the calibration text"
)
LAYER_RULE = (
    "per managed layer, the smallest alpha of {alphas} whose count rule keeps >= {target:.0%} of that "
    "layer's dense attention (or, when its budget cap keeps less, within 0.1 point of what the cap keeps), "
    "scored with the query it chooses with (its own on the first dense_layers {dense_layers} and the "
    "own-query layers, else rehearsed), over the last {positions} positions of the calibration text "
    "(budget {budget})"
)
RULE = (
    "smallest alpha of {alphas} whose count rule keeps >= {target:.0%} of the dense attention (or, when the "
    "budget cap keeps less, within 0.1 point of what the cap keeps), averaged over the managed layers "
    "(dense_layers {dense_layers}, budget {budget}), each scored with the query it chooses with, and the "
    "last {positions} positions of the calibration text"
)
OWN_QUERY_RULE = (
    "per rehearsed layer (from dense_layers {dense_layers}), the share of its own query's recall of the real "
    "top-k that the rehearsal from the previous layer's input keeps (partial columns at each window's "
    "calibrated ratio, k = the budget cap {budget}), averaged over the windows ending at {ends} tokens; the "
    "layers keeping < {target:.0%} choose with their own query, the lowest first, at most {share:.1%} of "
    "the {count} rehearsed layers"
)


def coverage_by_alpha(
    speculated: Tensor, mass: Tensor, new_mass: Tensor, budget: Tensor, alphas: tuple[float, ...]
) -> tuple[Tensor, Tensor]:
    """What InfiniGen's count rule keeps at each alpha: per leading index (a step, a sequence, a query
    position), the attention share [..., alphas] of its fetched set plus the new token, and the count
    [..., alphas].

    ``speculated`` [..., kv_heads, n]: speculated scores, group-relative (-inf: never fetched); ``mass``
    [..., kv_heads, n]: real attention weight of each past token (mean over the group's query heads);
    ``new_mass`` [..., kv_heads]: the new token's; ``budget`` [...]: the cap on the count. The count is
    InfiniGen's: tokens within alpha of each head's best, averaged over the KV heads, rounded up, capped."""
    order = speculated.sort(dim=-1, descending=True)
    kept = torch.cumsum(torch.gather(mass, -1, order.indices), dim=-1)  # best-speculated first
    best = order.values[..., :1]
    shares, counts = [], []
    for alpha in alphas:
        within = (speculated > best - alpha).sum(-1).float().mean(-1).ceil().long()
        count = torch.minimum(within.clamp(min=1), budget)
        index = (count - 1)[..., None, None].expand(*kept.shape[:-1], 1)
        shares.append((torch.gather(kept, -1, index)[..., 0] + new_mass).mean(-1))
        counts.append(count)
    return torch.stack(shares, dim=-1), torch.stack(counts, dim=-1)


def _decode_steps(k: Tensor, positions: int) -> tuple[Tensor, Tensor]:
    """The last ``positions`` query positions of a prompt whose keys are ``k`` [kv_heads, n, d], each playing
    a decode step: their positions t [P] and which slots are in each step's past [P, n]."""
    n = k.shape[1]
    t = torch.arange(n - positions, n, device=k.device)
    return t, torch.arange(n, device=k.device)[None, :] < t[:, None]


def _group_scores(queries: Tensor, keys: Tensor, scaling: float, past: Tensor) -> Tensor:
    """[P, kv_heads, n]: logits of ``queries`` [heads, P, c] against ``keys`` [kv_heads, n, c], each query
    head relative to its own best, then the max over the heads of a KV group (InfiniGen's combination, as
    ``base.group_relative_max``, here in place on the one logits tensor: calibration makes hundreds of
    these at 8k tokens); -inf outside each step's ``past``."""
    kv_heads = keys.shape[0]
    heads, positions = queries.shape[0], queries.shape[1]
    grouped = queries.reshape(kv_heads, heads // kv_heads, positions, -1) * scaling
    logits = torch.matmul(grouped, keys[:, None].transpose(-1, -2)).masked_fill_(~past, -math.inf)
    best = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(best.masked_fill_(best == -math.inf, 0)).amax(dim=1).transpose(0, 1)


def _speculated(
    q_speculative: Tensor, k: Tensor, projection: Tensor, scaling: float, past: Tensor, bits: int | None
) -> Tensor:
    """:func:`_group_scores` of the rehearsed queries against the keys, both in the partial skewed columns
    ``projection`` [kv_heads, d, c], the keys stored as the policy stores them (``bits``: integers with a
    per-token scale, None: as they are)."""
    kv_heads, heads = k.shape[0], q_speculative.shape[0]
    proj = projection.float()
    grouped = q_speculative.float().reshape(kv_heads, heads // kv_heads, q_speculative.shape[1], -1)
    partial_q = torch.matmul(grouped, proj[:, None]).reshape(heads, q_speculative.shape[1], -1)
    partial_k = dequantized(*quantize(torch.matmul(k.float(), proj), bits))
    return _group_scores(partial_q, partial_k, scaling, past)


def prompt_coverage(
    q: Tensor,
    k: Tensor,
    q_speculative: Tensor,
    projection: Tensor,
    scaling: float,
    budget: float,
    bits: int | None,
    alphas: tuple[float, ...] = ALPHAS,
) -> tuple[Tensor, Tensor]:
    """:func:`coverage_by_alpha` of one layer over the last P positions of a prompt of n tokens, each as a
    decode step on the dense trajectory. Returns the attention kept [alphas] and the share of past tokens
    fetched [alphas], averaged over those positions.

    ``q`` [heads, P, d]: the layer's real post-RoPE queries at those positions; ``k`` [kv_heads, n, d]: its
    post-RoPE keys; ``q_speculative`` [heads, P, d]: its query projection of the previous layer's input;
    ``projection`` [kv_heads, d, c]: its partial skewed columns; ``bits``: how the partial keys are stored
    (:func:`_speculated`)."""
    kv_heads, n = k.shape[0], k.shape[1]
    group, positions = q.shape[0] // kv_heads, q.shape[1]
    t, past = _decode_steps(k, positions)
    slot = torch.arange(n, device=k.device)
    keys = k.float()[:, None]  # [kv, 1, n, d]
    logits = torch.matmul(q.float().reshape(kv_heads, group, positions, -1), keys.transpose(-1, -2)) * scaling
    mass = torch.softmax(logits.masked_fill(slot[None, :] > t[:, None], -math.inf), dim=-1).mean(dim=1)
    new_mass = mass.gather(-1, t[None, :, None].expand(kv_heads, -1, 1))[..., 0]  # [kv, P]
    speculated = _speculated(q_speculative, k, projection, scaling, past, bits)
    budgets = torch.tensor([resolve_budget(budget, int(p)) for p in t.tolist()], device=k.device)
    kept, counts = coverage_by_alpha(
        speculated, (mass * past).transpose(0, 1), new_mass.transpose(0, 1), budgets, alphas
    )
    return kept.mean(0), (counts.float() / t[:, None].float()).mean(0)


def _top_k_steps(
    k: Tensor, positions: int, budget: float
) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """For the last ``positions`` steps of a prompt whose keys are ``k``: their past [P, n], the budget cap k
    of each [P], and a function from scores [P, kv_heads, n] to each step's top-k (bool, same shape)."""
    t, past = _decode_steps(k, positions)
    counts = torch.tensor([resolve_budget(budget, int(p)) for p in t.tolist()], device=k.device)
    width = int(counts.max())
    within = torch.arange(width, device=k.device)[None, :] < counts[:, None]

    def chosen(scores: Tensor) -> Tensor:
        index = scores.topk(width, dim=-1).indices
        mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        return mask.scatter_(-1, index, within[:, None, :].expand_as(index))

    return past, counts, chosen


def real_top_k(q: Tensor, k: Tensor, scaling: float, budget: float) -> Tensor:
    """bool [P, kv_heads, n]: the real top-k tokens of each of the last P steps (shapes and k as in
    :func:`prompt_recall`), to pass to it as ``truth`` when several calls share them."""
    past, _, chosen = _top_k_steps(k, q.shape[1], budget)
    return chosen(_group_scores(q.float(), k.float(), scaling, past))


def prompt_recall(
    q: Tensor,
    k: Tensor,
    q_speculative: Tensor,
    projections: list[Tensor],
    scaling: float,
    budget: float,
    bits: int | None,
    truth: Tensor | None = None,
) -> list[float]:
    """Per projection (one per candidate partial ratio), the share of the real top-k tokens that the
    speculated top-k holds, per KV head, averaged over the last P positions of a prompt of n tokens, each
    playing a decode step on the dense trajectory (k = the ``budget`` cap of that step). Real and speculated
    scores are combined over a group's query heads the same way (each relative to its own best, max).

    Shapes and ``bits`` as in :func:`prompt_coverage`; ``projections``: [kv_heads, d, c] each; ``truth``:
    :func:`real_top_k` of the same ``q``, ``k`` and ``budget`` (None: computed here)."""
    past, counts, chosen = _top_k_steps(k, q.shape[1], budget)
    if truth is None:
        truth = real_top_k(q, k, scaling, budget)
    recalls = []
    for projection in projections:
        speculated = _speculated(q_speculative, k, projection, scaling, past, bits)
        hits = (chosen(speculated) & truth).sum(-1).float()
        recalls.append(float((hits / counts[:, None]).mean()))
    return recalls


def pick_alpha(kept: list[float], alphas: tuple[float, ...] = ALPHAS, target: float = TARGET) -> float:
    """The smallest alpha keeping ``target`` (``kept``: the attention kept per alpha, of one layer or the
    mean over layers); when no alpha does (the budget cap binds first), the smallest within ``SLACK`` of the
    most any alpha keeps."""
    reachable = min(target, max(kept) - SLACK)
    return next(alpha for alpha, share in zip(alphas, kept, strict=True) if share >= reachable)


def pick_ratio(
    recalls: list[float], ratios: tuple[float, ...] = RATIOS, target: float = RATIO_TARGET
) -> float:
    """The smallest ratio whose recall (mean over managed layers, per ratio; the last ratio is full width)
    reaches ``target`` of the full-width recall."""
    full = recalls[-1]
    return next(ratio for ratio, recall in zip(ratios, recalls, strict=True) if recall >= target * full)


def allocate_ratios(
    curves: dict[int, tuple[float, ...]],
    total: int,
    head_dim: int,
    ratios: tuple[float, ...] = RATIOS,
    most: dict[int, float] | None = None,
) -> dict[int, float]:
    """Columns allocated per layer within a total: per layer of ``curves`` (its recall per ratio of
    ``ratios``), a ratio such that the layers' columns (⌈ratio·``head_dim``⌉ each) add up to at most
    ``total``, for a large summed recall (greedy, so not always the largest): every layer starts at the
    narrowest ratio, then the widening that buys the most recall per added column and still fits is taken,
    until none does (a widening that loses recall is never taken; every layer keeps at least the narrowest
    ratio).
    ``most``: per layer, the widest ratio it may take (another allocation's, so that this one's columns are
    among that one's)."""
    width = [max(1, math.ceil(round(r * head_dim, 6))) for r in ratios]
    widest = {layer: len(ratios) - 1 if most is None else ratios.index(most[layer]) for layer in curves}
    at = dict.fromkeys(curves, 0)
    used = width[0] * len(curves)
    while True:
        best, best_gain = None, 0.0
        for layer, step in at.items():
            for nxt in range(step + 1, widest[layer] + 1):  # the next wider ratio, or one past a flat part
                added = width[nxt] - width[step]
                gain = (curves[layer][nxt] - curves[layer][step]) / added
                if used + added <= total and gain > best_gain:
                    best, best_gain = (layer, nxt), gain
        if best is None:
            return {layer: ratios[step] for layer, step in at.items()}
        layer, nxt = best
        used += width[nxt] - width[at[layer]]
        at[layer] = nxt


def pick_own_query(
    kept: dict[int, float], target: float = OWN_TARGET, most_share: float = OWN_MAX_SHARE
) -> list[int]:
    """The layers that choose with their own query: of ``kept`` (per rehearsed layer, the share of its own
    query's recall that its rehearsal keeps), those below ``target``, the lowest first, at most
    ``most_share`` of them all (rounded down); in layer order."""
    most = int(most_share * len(kept))
    below = sorted((share, layer) for layer, share in kept.items() if share < target)
    return sorted(layer for _, layer in below[:most])
