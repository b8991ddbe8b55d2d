"""``dense``: the reference. All K/V stay on the compute device; every layer attends to all of it.

Its store is not the paged host pool: attention reads each layer's K/V in place, as one tensor, which a
paged layout would first have to gather (a copy of the whole cache every step). So each layer's K/V is one
tensor on the compute device, first sized for the tokens reserved (:meth:`DensePolicy.reserve`: the prompt,
before its first chunk) and a quarter more, and grown by a quarter when full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvpool import with_headroom
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
        # Per layer: K and V [batch, kv_heads, capacity, head_dim] on the compute device; slots in use.
        self.kv: list[tuple[Tensor, Tensor] | None] = [None] * spec.num_layers
        self.lengths = [0] * spec.num_layers
        self._reserved = 0  # tokens expected (reserve): each layer's first store holds them

    def reserve(self, tokens: int) -> None:
        """Each layer's store is first made for ``tokens`` and a quarter more (at least 256 slots), as it
        grows, so neither a prompt's chunks nor its first decode steps copy it into a larger one."""
        super().reserve(tokens)
        self._reserved = tokens

    def seq_length(self, layer: int) -> int:
        return self.lengths[layer]

    def _append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new tokens' K/V and return the layer's live K/V (views of the store)."""
        n, q = self.lengths[layer], k.shape[2]
        stored = self.kv[layer]
        if stored is None or stored[0].shape[2] < n + q:
            expected = n if stored is not None else self._reserved  # the first store: n is 0
            capacity = max(n + q, with_headroom(expected))
            grown = tuple(t.new_empty(*t.shape[:2], capacity, t.shape[3]) for t in (k, v))
            if stored is not None:
                for new, old in zip(grown, stored, strict=True):
                    new[:, :, :n].copy_(old[:, :, :n])
            stored = self.kv[layer] = grown
        stored[0][:, :, n : n + q].copy_(k)
        stored[1][:, :, n : n + q].copy_(v)
        self.lengths[layer] = n + q
        return stored[0][:, :, : n + q], stored[1][:, :, : n + q]

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self._append(layer, k, v)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        keys, values = self._append(layer, k_new, v_new)
        self.record_attended(layer, keys.shape[2])
        return Selection(keys, values)

    def kv_bytes(self) -> dict[str, int]:
        held = sum(
            2 * n * stored[0][:, :, :1].numel() * stored[0].element_size()
            for n, stored in zip(self.lengths, self.kv, strict=True)
            if stored is not None
        )
        return {"host": 0, "device": held}
