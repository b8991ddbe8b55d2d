"""``offload``: FlexGen-style full offload (Sheng et al., 2023, https://arxiv.org/abs/2303.06865).

The whole KV cache lives in the host pool. Every decode step copies each layer's full KV to the compute
device; the copy for layer i+1 starts before layer i computes, so it overlaps with layer i's attention and
MLP (CUDA: a copy stream and events; CPU: a worker thread where a core is free for it and the step copies
enough to gain from it, ``copiers.WORKER_FROM_BYTES``). Bytes moved per
step are layers x 2 x kv_heads x head_dim x cached tokens x bytes per element x batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..copiers import WORKER_FROM_BYTES, Transfer
from ..spec import ModelSpec
from .base import HostPoolPolicy, QueryOf, Selection
from .config import PolicyConfig, knob
from .registry import register

Tensor = torch.Tensor


@dataclass(frozen=True)
class OffloadConfig(PolicyConfig):
    overlap: str = knob(
        "thread",
        'CPU only: "thread" copies each layer\'s KV one layer ahead on a worker thread, overlapping compute, '
        "where a core is free for it beside torch's threads and the step's rows copied at least "
        f"{WORKER_FROM_BYTES // 2**20} MiB a layer in their step before (else on the decode thread); "
        '"none" always on the decode thread. CUDA always uses a copy stream.',
        choices=("thread", "none"),
    )


@register("offload")
class OffloadPolicy(HostPoolPolicy):
    config_class = OffloadConfig
    prefill_family = "dense"
    prefetches = True

    def __init__(self, config: OffloadConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device, overlap=config.overlap)

    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> Transfer:
        # One spare slot: the new token's K/V goes there, no concatenation on the device.
        return self.host_pool.fetch(layer, extra=1)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        keys, values = self.take_fetch(layer).wait()
        keys[:, :, -1:].copy_(k_new)
        values[:, :, -1:].copy_(v_new)
        self.host_pool.append(layer, k_new, v_new)
        self.record_attended(layer, keys.shape[2])
        return Selection(keys, values)
