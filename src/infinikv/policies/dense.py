"""``dense``: the reference. All K/V stay on the compute device; every layer attends to all of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvpool import KVPool
from ..spec import ModelSpec
from .base import Policy, Selection
from .config import PolicyConfig
from .registry import register

Tensor = torch.Tensor


@dataclass(frozen=True)
class DenseConfig(PolicyConfig):
    """No knobs: full attention, nothing moved."""


@register("dense")
class DensePolicy(Policy):
    config_class = DenseConfig
    prefill_family = "dense"

    def __init__(self, config: DenseConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        # The store lives on the compute device itself, so reading it moves nothing.
        self.store = KVPool(spec.num_layers, device, host=False)

    def seq_length(self, layer: int) -> int:
        return self.store.length(layer)

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.store.append(layer, k, v)
        return self.store.keys(layer), self.store.values(layer)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        self.store.append(layer, k_new, v_new)
        self.record_attended(layer, self.store.length(layer))
        return Selection(self.store.keys(layer), self.store.values(layer))

    def kv_bytes(self) -> dict[str, int]:
        return {"host": 0, "device": self.store.nbytes()}

    def pool(self) -> KVPool:
        return self.store
