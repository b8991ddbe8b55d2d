"""Shared plumbing of the policies that gather a subset of the host pool (StreamingLLM, Quest, the oracle).

A :class:`GatherPolicy` keeps every layer's K/V in the host pool. Prefill is dense: each prompt chunk attends
to everything stored so far. In a decode step a subclass names, per (batch row, KV head), the past token
slots the layer attends to (``select``); only those rows are gathered and copied to the compute device, and
the new token's K/V is appended to the pool and attended on the device.

Budgets (``resolve_budget(..., capped=False)``) count every token a layer attends to in a step, the new one
included. Gemma-3 sliding-window layers attend to their window only, so that is all they fetch. Left padding
is never chosen over a real token; a row with fewer real tokens than the budget may carry padding slots,
which the model's mask removes.
"""

from __future__ import annotations

import torch

from ..kvpool import Transfer
from .base import HostPoolPolicy, Selection

Tensor = torch.Tensor


class GatherPolicy(HostPoolPolicy):
    """Host pool + per-step gather of the slots ``select`` names. A subclass whose selection for layer i+1
    does not depend on layer i+1's query sets ``prefetches = True``, and the copy starts one layer early."""

    prefill_family = "dense"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Per layer, set by ``select`` when rows take fewer slots than the gather is wide: bool
        # [batch, kv_heads, m], False hides a row's extra slot (as Selection.valid).
        self.selected_valid: dict[int, Tensor] = {}

    def select(self, layer: int, n_past: int, batch: int) -> Tensor:
        """Past slots ``layer`` attends to this step: LongTensor [batch, kv_heads, m], sorted, < n_past. A
        subclass whose rows take different numbers of slots puts which are real in ``selected_valid``."""
        raise NotImplementedError

    def adjust_keys(self, layer: int, index: Tensor, keys: Tensor) -> Tensor:
        """Hook to transform the gathered past keys (StreamingLLM re-rotates its sinks)."""
        return keys

    def start_fetch(
        self, layer: int, x: Tensor | None = None, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None, Transfer]:
        n_past, batch = self.host_pool.length(layer), self.host_pool.keys(layer).shape[0]
        window = self.spec.sliding_window[layer]
        if window is not None:
            # The new token's window holds it and the window - 1 tokens before it.
            index = torch.arange(max(0, n_past - window + 1), n_past, device=self.device)
            index = index.expand(batch, self.spec.num_kv_heads, -1)
        else:
            index = self.select(layer, n_past, batch)
        return index, self.selected_valid.pop(layer, None), self.host_pool.fetch(layer, index)

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        n_past = self.host_pool.length(layer)
        index, valid, transfer = self.take_fetch(layer)
        past_k, past_v = transfer.wait()
        self.host_pool.append(layer, k_new, v_new)
        index = index.to(k_new.device)
        past_k = self.adjust_keys(layer, index, past_k)
        new_position = index.new_full((*index.shape[:2], 1), n_past)
        positions = torch.cat([index, new_position], dim=2)
        keys, values = torch.cat([past_k, k_new], dim=2), torch.cat([past_v, v_new], dim=2)
        if valid is not None:
            valid = torch.cat([valid.to(k_new.device), valid.new_ones(*valid.shape[:2], 1)], dim=2)
        # Tokens attended: what each row really sees (not its left padding, nor slots it hides).
        batch = index.shape[0]
        real = self.past_valid(n_past, batch).to(index.device)
        real = torch.cat([real, real.new_ones(batch, 1)], dim=1)  # the new token is real
        seen = real.gather(1, positions.flatten(1)).view_as(positions)
        seen = seen if valid is None else seen & valid
        self.record_attended(layer, seen.sum(dim=-1).float().mean())
        return Selection(keys, values, positions, valid)
