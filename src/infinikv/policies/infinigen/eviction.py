"""How full InfiniGen's host pool may get, and which slot it overwrites when it is full (``capacity``).

After t tokens a layer's pool holds at most ⌈capacity·t⌉ tokens per sequence and KV head (``capacity`` at
most 1, a fraction) or ``capacity`` of them (above 1, a count); a sliding-window layer at most its window.
Victims, lowest :func:`eviction_keys` first: left-padding slots; then, never among the newest half of the
pool, the slot the rule picks (``fifo`` the oldest token, ``lru`` the least recently fetched, ``counter`` the
one fetched the fewest times, the paper's default), ties to the oldest.
"""

from __future__ import annotations

import math

import torch

from .slots import SlotTable

Tensor = torch.Tensor
_SHIFT = 1 << 21  # eviction keys pack (tier, rule value, position), each below 2**21


def pool_limit(capacity: float, window: int | None, seen: int) -> int:
    """Most tokens a layer's pool may hold after ``seen`` tokens (``window``: a sliding layer's)."""
    tokens = math.ceil(capacity * seen) if capacity <= 1 else min(int(capacity), seen)
    return max(1, tokens if window is None else min(tokens, window))


def eviction_keys(slots: SlotTable, real: Tensor, rule: str) -> Tensor:
    """[batch, kv_heads, slots]: lower = evicted first. Tier (padding < older half < newest half), then the
    ``rule``'s value, then the position (older first). ``real``: [batch, kv_heads, slots], False on left
    padding."""
    pos = slots.view("pos")
    order = pos.argsort(dim=-1)
    rank = torch.empty_like(pos).scatter_(2, order, torch.arange(slots.n, device=pos.device).expand_as(pos))
    tier = torch.where(rank >= slots.n - slots.n // 2, 2, 1)
    tier = torch.where(real, tier, 0)
    value = pos if rule == "fifo" else slots.view({"lru": "last", "counter": "fetches"}[rule])
    return (tier * _SHIFT + value.clamp(max=_SHIFT - 1)) * _SHIFT + pos
