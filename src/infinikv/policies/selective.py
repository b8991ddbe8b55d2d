"""Shared plumbing for the selective baselines (StreamingLLM, Quest): KV in the host pool, gather a subset.

A :class:`SelectivePolicy` keeps every layer's K/V in the host pool. Prefill is dense: each prompt chunk
attends to everything stored so far. In a decode step a subclass names, per (batch row, KV head), the past
token slots the layer attends to (``select``); only those rows are gathered and copied to the compute
device, and the new token's K/V is appended to the pool and attended on the device.

Budgets (:func:`budget_tokens`) count every token a layer attends to in a step, the new one included. Gemma-3
sliding-window layers attend to their window only, so that is all they fetch. Left padding is never chosen
over a real token; a row with fewer real tokens than the budget may carry padding slots, which the model's
mask removes.
"""

from __future__ import annotations

import torch

from ..kvpool import KVPool, Transfer
from .base import ModelSpec, Policy, PolicyConfig, Selection, resolve_budget

Tensor = torch.Tensor


def budget_tokens(budget: float, context: int) -> int:
    """``budget`` <= 1: that fraction of ``context`` (at least one token); otherwise a token count, which is
    not capped by the context (it keeps its meaning while the context grows)."""
    return resolve_budget(budget, context) if budget <= 1 else int(budget)


class SelectivePolicy(Policy):
    """Host pool + per-step gather of the slots ``select`` names. Subclasses with ``prefetches = True`` know
    layer i+1's selection before layer i runs (it does not depend on layer i+1's query), so the copy starts
    early."""

    prefill_family = "dense"

    def __init__(self, config: PolicyConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self.host_pool = KVPool(spec.num_layers, device, host=True, overlap="thread")
        self._in_flight: dict[int, tuple[Tensor, Transfer]] = {}

    # -- to be provided by subclasses ----------------------------------------------------------------------
    def select(self, layer: int, n_past: int, batch: int) -> Tensor:
        """Past slots ``layer`` attends to this step: LongTensor [batch, kv_heads, m], sorted, < n_past."""
        raise NotImplementedError

    def adjust_keys(self, layer: int, index: Tensor, keys: Tensor) -> Tensor:
        """Hook to transform the gathered past keys (StreamingLLM re-rotates its sinks)."""
        return keys

    # -- the seam ------------------------------------------------------------------------------------------
    def seq_length(self, layer: int) -> int:
        return self.host_pool.length(layer)

    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.host_pool.extend(layer, k, v)

    def before_attention(self, layer: int, x: Tensor, position_ids: Tensor) -> None:
        if not self.prefetches:
            return
        for target in (layer, layer + 1) if layer == 0 else (layer + 1,):
            if target < self.spec.num_layers:
                index = self._index(target, self.host_pool.length(target), x.shape[0])
                self._in_flight[target] = (index, self.host_pool.fetch(target, index))

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        n_past = self.host_pool.length(layer)
        index, transfer = self._in_flight.pop(layer, (None, None))
        if transfer is None:
            index = self._index(layer, n_past, k_new.shape[0])
            transfer = self.host_pool.fetch(layer, index)
        past_k, past_v = transfer.wait()
        self.host_pool.append(layer, k_new, v_new)
        index = index.to(k_new.device)
        past_k = self.adjust_keys(layer, index, past_k)
        new_position = index.new_full((*index.shape[:2], 1), n_past)
        positions = torch.cat([index, new_position], dim=2)
        self.record_attended(layer, positions.shape[2])
        return Selection(torch.cat([past_k, k_new], dim=2), torch.cat([past_v, v_new], dim=2), positions)

    def kv_bytes(self) -> dict[str, int]:
        return {"host": self.host_pool.nbytes(), "device": 0}

    def pool(self) -> KVPool:
        return self.host_pool

    # -- helpers -------------------------------------------------------------------------------------------
    def _index(self, layer: int, n_past: int, batch: int) -> Tensor:
        window = self.spec.sliding_window[layer]
        if window is not None:
            # The new token's window holds it and the window - 1 tokens before it.
            index = torch.arange(max(0, n_past - window + 1), n_past, device=self.device)
            return index.expand(batch, self.spec.num_kv_heads, -1)
        return self.select(layer, n_past, batch)

    def past_valid(self, n_past: int, batch: int) -> Tensor:
        """bool [batch, n_past]: which past slots hold real tokens (False = left padding)."""
        if self.key_valid is None:
            return torch.ones(batch, n_past, dtype=torch.bool, device=self.device)
        return self.key_valid[:, :n_past].to(self.device)
