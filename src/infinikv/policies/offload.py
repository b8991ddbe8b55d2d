"""``offload``: FlexGen-style full offload (Sheng et al., 2023, https://arxiv.org/abs/2303.06865).

The whole KV cache lives in the host pool. Every decode step copies each layer's full KV to the compute
device; the copy for layer i+1 starts before layer i computes, so it overlaps with layer i's attention and
MLP (CUDA: a copy stream and events; CPU: a worker thread). Bytes moved per step are
layers x 2 x kv_heads x head_dim x cached tokens x bytes per element x batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvpool import KVPool, Transfer
from .base import ModelSpec, Policy, PolicyConfig, Selection

Tensor = torch.Tensor


@dataclass(frozen=True)
class OffloadConfig(PolicyConfig):
    """overlap: "thread" copies on a worker thread on CPU (CUDA always uses a copy stream); "none" copies
    when the layer needs its KV."""

    overlap: str = "thread"


class OffloadPolicy(Policy):
    name = "offload"
    config_class = OffloadConfig
    prefill_family = "dense"
    prefetches = True

    def __init__(self, config: OffloadConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self.host_pool = KVPool(spec.num_layers, device, host=True, overlap=config.overlap)
        self._in_flight: dict[int, Transfer] = {}

    def seq_length(self, layer: int) -> int:
        return self.host_pool.length(layer)

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.host_pool.extend(layer, k, v)

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        # One spare slot per fetch: the new token's K/V goes there, no concatenation on the device.
        if layer == 0:
            self._in_flight[0] = self.host_pool.fetch(0, extra=1)
        if layer + 1 < self.spec.num_layers:
            self._in_flight[layer + 1] = self.host_pool.fetch(layer + 1, extra=1)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        transfer = self._in_flight.pop(layer, None) or self.host_pool.fetch(layer, extra=1)
        keys, values = transfer.wait()
        keys[:, :, -1:].copy_(k_new)
        values[:, :, -1:].copy_(v_new)
        self.host_pool.append(layer, k_new, v_new)
        self.record_attended(layer, keys.shape[2])
        return Selection(keys, values)

    def kv_bytes(self) -> dict[str, int]:
        return {"host": self.host_pool.nbytes(), "device": 0}

    def pool(self) -> KVPool:
        return self.host_pool
