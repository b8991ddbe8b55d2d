"""What the policies and the calibration need to know about a model, independent of its transformers class.

:class:`ModelSpec` sits below both the loader (``infinikv.models``) and the policies, so neither imports the
other: the loader builds one with :func:`model_spec`, the cache hands it to the policy it creates.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .invariant import project_ahead, project_beside, rows_alone

Tensor = torch.Tensor

# layer -> a row's post-RoPE query of that layer [1, heads, 1, d] from the input a look-ahead was handed
QueryOf = Callable[[int], Tensor]


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's rotation partner of ``x`` along the last axis: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class ModelSpec:
    """A model's attention layers as the policies see them."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: tuple[int | None, ...]  # per layer: window size for sliding-window layers, else None
    attention: tuple[torch.nn.Module, ...] = field(repr=False, default=())  # per layer: the attention module
    # rope(layer, x, position_ids) -> (cos, sin) for that layer's rotary embedding
    rope: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = field(repr=False, default=None)
    # rotation(layer, x, position_ids) -> the same as [batch, 1, q, d], the first half of sin negated
    rotation: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = field(repr=False, default=None)
    name: str = "model"
    weights_id: str = ""  # LoadedModel.weights_id; keys per-model files such as InfiniGen's skew

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window[layer] is not None

    def scaling(self, layer: int) -> float:
        """The factor ``layer``'s attention multiplies q·k by (1/√d unless the model sets its own)."""
        return getattr(self.attention[layer], "scaling", self.head_dim**-0.5)

    def query(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """Post-RoPE query of ``layer`` [batch, heads, q, d] for normalised input x [batch, q, hidden]."""
        return self.rotated_query(layer, self.attention[layer].q_proj(x), x, position_ids)

    def rotated_query(self, layer: int, projected: Tensor, x: Tensor, position_ids: Tensor) -> Tensor:
        """:meth:`query` from ``x``'s query projection ``projected`` [batch, q, heads * d]."""
        attn = self.attention[layer]
        return self._rotated(layer, projected, getattr(attn, "q_norm", None), x, position_ids)

    def key(self, layer: int, x: Tensor, position_ids: Tensor) -> Tensor:
        """Post-RoPE key of ``layer`` [batch, kv_heads, q, d] for normalised input x [batch, q, hidden]."""
        attn = self.attention[layer]
        return self._rotated(layer, attn.k_proj(x), getattr(attn, "k_norm", None), x, position_ids)

    def _rotated(self, layer: int, projected: Tensor, norm, x: Tensor, position_ids: Tensor) -> Tensor:
        heads = projected.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)
        if norm is not None:  # Gemma-3 normalises queries and keys per head before RoPE
            heads = norm(heads)
        cos, signed_sin = self.rotation(layer, x, position_ids)
        # rotate_half(heads) * sin, as the halves swapped times sin with its first half negated: the same
        # products to the last bit (a sign moves from one factor to the other), in fewer operations
        return heads * cos + heads.roll(self.head_dim // 2, dims=-1) * signed_sin


class SharedQueries:
    """The post-RoPE queries of rows' inputs ``x`` [rows, 1, hidden] (``ModelSpec.query``), projected for
    every row at once, per layer asked for, and handed out a row at a time (:meth:`of_row`). An engine
    step's rows each look ahead from their own row of one batched input (``engine/ragged.py``): this way a
    layer's query is projected in one call a step, not once by each row's look-ahead (its weights read once
    where the rows fit one product of a class, ``invariant.py``). ``layer``: the one whose input ``x`` is,
    whose own projection takes its query from here (None: in a compiled step, whose projections are the
    graph's). Look-aheads may ask from their pools' worker threads, so a layer is projected under a lock."""

    def __init__(self, spec: ModelSpec, layer: int | None, x: Tensor, position_ids: Tensor):
        self._spec, self._layer, self._x, self._position_ids = spec, layer, x, position_ids
        self._projected: dict[int, Tensor] = {}
        self._projecting = threading.Lock()
        self._beside: tuple[int, Tensor] | None = None  # (layer, its own input): see beside()

    def beside(self, layer: int, own: Tensor) -> None:
        """Project ``layer``'s queries, if asked for, in one product with ``own``, that layer's own input,
        whose query projection then takes its result from there (``invariant.project_beside``): a look-ahead
        run at the layer it plans, after the model has that layer's input, reads its query weights once."""
        self._beside = (layer, own)

    def of_row(self, row: int) -> QueryOf:
        """Row ``row``'s queries, as a function of the layer."""
        return functools.partial(self._row_query, row)

    def _row_query(self, row: int, layer: int) -> Tensor:
        query = self._projected.get(layer)
        if query is None:
            with self._projecting:
                query = self._projected.get(layer)
                if query is None:
                    with rows_alone():  # each row's as alone (invariant.py), as the step's own projections
                        query = self._query(layer)
                    self._projected[layer] = query
        return query[row : row + 1]

    def _query(self, layer: int) -> Tensor:
        """Every row's post-RoPE query of ``layer``, beside its own input where :meth:`beside` says; the
        layer whose input ``x`` is (a choice by its own query) projects it for itself too
        (``invariant.project_ahead``)."""
        spec, x, position_ids = self._spec, self._x, self._position_ids
        projection = spec.attention[layer].q_proj
        if self._beside is not None and self._beside[0] == layer:
            projected = project_beside(projection, self._beside[1], x)
        elif layer == self._layer:
            projected = project_ahead(projection, x)
        else:
            return spec.query(layer, x, position_ids)
        return spec.rotated_query(layer, projected, x, position_ids)


def model_spec(model: PreTrainedModel) -> ModelSpec:
    """Describe ``model``'s attention for the policies (cached on the model; the loader sets
    ``model._infinikv_weights_id`` so the spec carries the weights id)."""
    weights_id = getattr(model, "_infinikv_weights_id", "")
    spec = getattr(model, "_infinikv_spec", None)
    if spec is not None and spec.weights_id == weights_id:
        return spec
    config = model.config.get_text_config()
    decoder = model.get_decoder()
    attention = tuple(layer.self_attn for layer in decoder.layers)
    layer_types = getattr(config, "layer_types", None)
    rotary = decoder.rotary_emb
    # A signature, not __code__: some transformers versions wrap forward (torch.no_grad) and hide it.
    per_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters

    # (cos, sin) per layer type and positions tensor, and the rotation's form of them once asked for: a
    # step's layers (and their look-aheads) share the positions tensor, so each type's rotation is computed
    # once a step; an engine step asks with one positions tensor per row (engine/ragged.py), so each live
    # one keeps its entry. Held by a weak reference to the positions: an entry whose tensor is gone is
    # dropped at the next miss. The decode thread and the pools' look-ahead threads ask at once: a miss
    # changes the memo under a lock.
    memo: dict[tuple, list] = {}
    missing = threading.Lock()

    def held(layer: int, x: Tensor, position_ids: Tensor) -> list:
        kind = layer_types[layer] if layer_types is not None and per_layer_type else None
        key = (kind, x.dtype, x.device, id(position_ids))
        entry = memo.get(key)
        if entry is not None and entry[0]() is position_ids:
            return entry
        with missing:
            entry = memo.get(key)
            if entry is None or entry[0]() is not position_ids:
                for old in [old for old, (ref, *_) in memo.items() if ref() is None]:
                    del memo[old]
                cos, sin = rotary(x, position_ids) if kind is None else rotary(x, position_ids, kind)
                entry = memo[key] = [weakref.ref(position_ids), cos, sin, None]
            return entry

    def rope(layer: int, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        entry = held(layer, x, position_ids)
        return entry[1], entry[2]

    def rotation(layer: int, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        entry = held(layer, x, position_ids)
        if entry[3] is None:
            cos, sin = entry[1], entry[2]
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            entry[3] = (cos.unsqueeze(1), signed.unsqueeze(1))
        return entry[3]

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    spec = ModelSpec(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        sliding_window=tuple(getattr(a, "sliding_window", None) for a in attention),
        attention=attention,
        rope=rope,
        rotation=rotation,
        name=getattr(config, "_name_or_path", "model") or "model",
        weights_id=weights_id,
    )
    model._infinikv_spec = spec
    return spec
