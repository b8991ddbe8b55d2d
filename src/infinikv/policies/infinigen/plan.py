"""What InfiniGen settles at a run's first decode step, in one immutable record.

A sequence's prompt length is known once its first decode step begins, and with it everything the policy
chooses by (``settle``): the share of partial columns each sequence rehearses with (the widest calibrated at
its prompt's window, ``InfiniGenConfig.resolve``), whether the calibrated alphas count it or its budget does
(``InfiniGenConfig.alpha_holds``), the managed layers that choose with their own query, each layer's alpha,
and per layer which stored columns a narrower sequence scores with. Building the plan also cuts each managed
layer's partial-key store to the widest sequence's columns (the prompt's keys were stored with the widest
calibrated columns, as its length was not known while its chunks arrived). No decode step after changes the
plan, so none checks whether it is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import PolicyError
from ...spec import ModelSpec
from .config import InfiniGenConfig
from .layer import LayerState
from .skewfile import Skew

Tensor = torch.Tensor
RowColumns = tuple[
    tuple[Tensor, Tensor], ...
]  # (rows, their own columns among the stored ones [kv_heads, k])


@dataclass(frozen=True)
class DecodePlan:
    """A run's settled choices (module docstring); per sequence of the batch or per layer, as named."""

    own_query: frozenset[int]  # managed layers that choose with their own query, not one layer ahead
    own_query_source: str
    ratios: tuple[tuple[float, str], ...]  # per sequence: its partial ratio and where it came from
    count_rules: tuple[tuple[bool, str], ...]  # per sequence: whether the alpha counts it, and the rule
    layer_ratios: tuple[dict[int, float], ...]  # per sequence: allocated ratio per layer (empty: uniform)
    alphas: tuple[tuple[float, str] | None, ...]  # per layer (None: not managed): alpha and its source
    # per layer: the alpha of each sequence (inf where its budget counts), one number when the batch
    # agrees, else [batch, 1, 1] float32; and the (rows, columns) of the sequences that score with fewer
    row_alphas: tuple[float | Tensor | None, ...]
    row_columns: tuple[RowColumns, ...]

    def report(self, dense_layers: int, num_layers: int) -> dict[str, Any]:
        """What the plan settled, as ``InfiniGenPolicy.stats`` reports it (``dense_layers``: the config's
        first layers that choose by their own query)."""
        out: dict[str, Any] = {}
        alphas = self.alphas
        if any(alphas):
            sources = dict.fromkeys(alpha[1] for alpha in alphas if alpha is not None)
            out.update(
                # per layer, None for the layers that load their full KV or their window
                alpha_used=[None if alpha is None else alpha[0] for alpha in alphas],
                alpha_source="; ".join(sources),
            )
        out.update(
            # the later layers (the knob's), and every layer whose copy waits on its own query
            own_query_layers_used=sorted(layer for layer in self.own_query if layer >= dense_layers),
            own_query_source=self.own_query_source,
            layers_by_own_query=sorted(self.own_query),
        )
        if self.ratios:
            out.update(
                # per sequence of the batch (by its prompt length)
                partial_ratio_used=[ratio for ratio, _ in self.ratios],
                partial_ratio_source="; ".join(dict.fromkeys(source for _, source in self.ratios)),
                # per sequence: "alpha", or "budget (why)" where the calibrated alphas do not hold
                count_rule_used=[rule for _, rule in self.count_rules],
            )
        if any(self.layer_ratios):
            # per sequence, per layer: its allocated ratio (None where the layer takes the uniform one)
            out["partial_ratio_by_layer"] = [
                [allocated.get(layer) for layer in range(num_layers)] for allocated in self.layer_ratios
            ]
        return out


def own_query_layers(
    config: InfiniGenConfig, skew: Skew, layers: list[LayerState]
) -> tuple[frozenset[int], str]:
    """The managed layers that choose with their own query: the first ``dense_layers`` and the own-query
    layers (:meth:`InfiniGenConfig.resolve_own_query`), and where the latter came from."""
    later, source = config.resolve_own_query(skew)
    chosen = frozenset(
        layer
        for layer, state in enumerate(layers)
        if state.managed and (layer < config.dense_layers or layer in later)
    )
    return chosen, source


def layer_alpha(
    config: InfiniGenConfig, skew: Skew, layer: int, own_query: frozenset[int]
) -> tuple[float, str]:
    """``layer``'s threshold and where it came from (:meth:`InfiniGenConfig.resolve`)."""
    return config.resolve("alpha", skew, layer, own_query=layer in own_query)


def settle(
    config: InfiniGenConfig,
    spec: ModelSpec,
    skew: Skew,
    layers: list[LayerState],
    real_tokens: list[int],
    storage: tuple[str, tuple[int, int] | None, dict[int, dict[int, float]] | None],
) -> DecodePlan:
    """The plan of a batch whose sequences have ``real_tokens`` prompt tokens; ``storage``: how the partial
    keys are stored, the most columns the device budget holds (with head_dim) and the columns allocated
    per layer, as settled with the first prompt chunk. Cuts each managed layer's store (module docstring)."""
    own_query, own_query_source = own_query_layers(config, skew, layers)
    stored_keys, cap, allocations = storage
    # managed layers that hold a prompt (all of them, but where a caller drives one layer alone)
    managed = [layer for layer, state in enumerate(layers) if state.managed and state.projection is not None]
    ratios: list[tuple[float, str]] = []
    count_rules: list[tuple[bool, str]] = []
    layer_ratios: list[dict[int, float]] = []
    if managed:
        ratios = [config.resolve("partial_ratio", skew, tokens=n, cap=cap) for n in real_tokens]
        count_rules = [config.alpha_holds(skew, r, spec.head_dim, stored_keys) for r, _ in ratios]
        layer_ratios = [(allocations or {}).get(config.calibration_window(skew, n), {}) for n in real_tokens]
    alphas: list[tuple[float, str] | None] = [None] * len(layers)
    row_alphas: list[float | Tensor | None] = [None] * len(layers)
    row_columns: list[RowColumns] = [()] * len(layers)
    for layer in managed:
        alphas[layer] = layer_alpha(config, skew, layer, own_query)
        per_row = [alphas[layer][0] if holds else math.inf for holds, _ in count_rules]
        device = layers[layer].projection.device
        if len(set(per_row)) <= 1:
            row_alphas[layer] = per_row[0] if per_row else alphas[layer][0]
        else:
            row_alphas[layer] = torch.tensor(per_row, dtype=torch.float32, device=device)[:, None, None]
        row_ratios = [
            allocated.get(layer, ratio) for allocated, (ratio, _) in zip(layer_ratios, ratios, strict=True)
        ]
        row_columns[layer] = _cut_store(config, skew, layers[layer], layer, row_ratios, cap, allocations)
    return DecodePlan(
        own_query=own_query,
        own_query_source=own_query_source,
        ratios=tuple(ratios),
        count_rules=tuple(count_rules),
        layer_ratios=tuple(layer_ratios),
        alphas=tuple(alphas),
        row_alphas=tuple(row_alphas),
        row_columns=tuple(row_columns),
    )


def _cut_store(
    config: InfiniGenConfig,
    skew: Skew,
    state: LayerState,
    layer: int,
    row_ratios: list[float],
    cap: tuple[int, int] | None,
    allocations: dict[int, dict[int, float]] | None,
) -> RowColumns:
    """Cut ``layer``'s store to the columns of the widest of ``row_ratios`` (each sequence's ratio on this
    layer); returns the (rows, columns within the store) of the sequences that score with fewer."""
    flag, ratios = config.skew, sorted(set(row_ratios))
    device = state.projection.device
    widest = skew.columns(layer, config.widest_ratio(skew, cap, layer, allocations), flag)
    stored = skew.columns(layer, ratios[-1], flag)
    if stored.shape[1] < widest.shape[1]:
        columns = _positions(widest, stored)
        state.stored, state.stored_key = columns.to(device), tuple(columns.flatten().tolist())
        state.slots.keep_columns(state.stored)
    groups = []
    for ratio in ratios[:-1]:  # the widest rows score with every stored column
        rows = torch.tensor([b for b, r in enumerate(row_ratios) if r == ratio], device=device)
        groups.append((rows, _positions(stored, skew.columns(layer, ratio, flag)).to(device)))
    return tuple(groups)


def _positions(columns: Tensor, subset: Tensor) -> Tensor:
    """[kv_heads, k]: where each of ``subset``'s columns sits in ``columns`` [kv_heads, K] (both ascending
    per head); the calibrated column sets are nested (the top-k of one score per head)."""
    at = torch.searchsorted(columns, subset)
    if not torch.equal(torch.gather(columns, 1, at.clamp(max=columns.shape[1] - 1)), subset):
        raise PolicyError("infinigen: the partial columns of a narrower ratio are not among the wider's")
    return at
