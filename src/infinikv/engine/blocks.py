"""The host pool's memory, counted in fixed-size blocks, and the prefix cache that holds whole blocks.

A block is ``block_tokens`` token positions of every layer's K and V at the model's dtype. The
:class:`BlockPool` has a memory budget (``kv_memory`` bytes, by default half of the memory the machine has
free when the engine starts) and hands blocks to sequences as their context grows; a sequence's blocks go
back when it ends or is preempted. The scheduler sees only counts: ``fits``, ``grow`` (False when the pool
is full, so the scheduler preempts) and ``release``.

The policy's own storage lives in each sequence's policy (``kvpool.KVPool`` and its side state: InfiniGen's
partial keys, Quest's page bounds, H2O's scores, quantised codes); the block count is what admission and
preemption go by. A policy's side state is a fraction of its K/V (at most the K/V itself, for full offload's
device copy), so ``kv_memory`` bounds the K/V and the side state follows it.

:class:`PrefixCache` keeps, for each prompt block a sequence prefilled, what the policy was handed for it
(every layer's K/V, through ``Cache.update``), the policy's ``prefill_state`` after it and the logits of its
last token. A block is named by a chained hash of its tokens and everything before it, within one prefill
family (``Policy.prefill_family``, or the exact configuration for a policy of no family) and one block size,
so a hit means the same tokens at the same positions, prefilled the same way. Each entry takes one block of
the pool; a running sequence that matched or wrote an entry holds a reference to it, and entries no sequence
holds are evicted least-recently-used when the pool needs their blocks.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError
from ..spec import ModelSpec

Tensor = torch.Tensor


def free_memory_bytes() -> int:
    """Bytes of memory the machine has available now (Linux ``MemAvailable``; else physical pages free)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def block_bytes(spec: ModelSpec, dtype: torch.dtype, block_tokens: int) -> int:
    """Bytes of one block: ``block_tokens`` positions of K and V in every layer."""
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.finfo(dtype).bits // 8
    return per_token * block_tokens


class BlockPool:
    """A fixed number of blocks, handed out by count to sequences (keyed by id) and to the prefix cache."""

    def __init__(self, total: int, block_tokens: int):
        if total < 1:
            raise InputError(f"the KV memory budget holds no block of {block_tokens} tokens")
        self.total = total
        self.block_tokens = block_tokens
        self.held: dict[int, int] = {}  # sequence id -> blocks
        self.cached = 0  # blocks held by prefix-cache entries
        self.peak = 0

    @property
    def used(self) -> int:
        return sum(self.held.values()) + self.cached

    @property
    def free(self) -> int:
        return self.total - self.used

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def grow(self, seq: int, tokens: int) -> bool:
        """Make ``seq`` hold blocks for ``tokens`` positions; False (nothing taken) when they are not free."""
        need = self.blocks_for(tokens) - self.held.get(seq, 0)
        if need <= 0:
            return True
        if need > self.free:
            return False
        self.held[seq] = self.held.get(seq, 0) + need
        self.peak = max(self.peak, self.used)
        return True

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)


@dataclass
class PrefixEntry:
    """One prompt block as its prefill left it: the ``Cache.update`` calls (layer, K, V, key_valid), the
    policy's ``prefill_state`` after it, and the next-token logits at its last position."""

    digest: bytes
    calls: list[tuple[int, Tensor, Tensor, Tensor | None]]
    state: Any
    logits: Tensor
    holders: set[int] = field(default_factory=set)  # running sequences that hold it


def snapshot(value: Any) -> Any:
    """A copy of ``value`` (tensors, or lists / tuples / dicts of them) that later in-place updates of the
    original do not reach."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


class PrefixCache:
    """Prompt blocks by chained hash, counted in ``pool``; evicted least-recently-used once unheld."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()  # oldest use first
        self.hit_tokens = 0
        self.miss_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def root(model: str, family: Hashable, block_tokens: int) -> bytes:
        return hashlib.sha256(repr((model, family, block_tokens)).encode()).digest()

    @staticmethod
    def chain(parent: bytes, tokens: list[int]) -> bytes:
        """The name of a block of ``tokens`` that follows the block named ``parent``."""
        return hashlib.sha256(parent + torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).digest()

    def match(self, root: bytes, prompt: list[int], seq: int) -> list[PrefixEntry]:
        """The cached blocks ``prompt`` starts with, in order, now held by ``seq``."""
        size, digest, found = self.pool.block_tokens, root, []
        for begin in range(0, len(prompt) - size + 1, size):
            digest = self.chain(digest, prompt[begin : begin + size])
            entry = self._entries.get(digest)
            if entry is None:
                break
            found.append(entry)
        for entry in found:
            self._hold(entry, seq)
        return found

    def add(self, entry: PrefixEntry, seq: int) -> bool:
        """Keep ``entry`` (held by ``seq``) if a block is free or can be freed; False when it cannot."""
        if entry.digest in self._entries:
            self._hold(self._entries[entry.digest], seq)
            return True
        if self.pool.free < 1 and not self.evict(1):
            return False  # every block is held
        self._entries[entry.digest] = entry
        self.pool.cached += 1
        self.pool.peak = max(self.pool.peak, self.pool.used)
        self._hold(entry, seq)
        return True

    def _hold(self, entry: PrefixEntry, seq: int) -> None:
        entry.holders.add(seq)
        self._entries.move_to_end(entry.digest)

    def release(self, seq: int) -> None:
        for entry in self._entries.values():
            entry.holders.discard(seq)

    def evict(self, blocks: int) -> int:
        """Free up to ``blocks`` blocks, least recently used unheld entries first; returns how many."""
        unheld = [digest for digest, entry in self._entries.items() if not entry.holders][:blocks]
        for digest in unheld:
            del self._entries[digest]
        self.pool.cached -= len(unheld)
        return len(unheld)

    def evictable(self) -> int:
        return sum(1 for entry in self._entries.values() if not entry.holders)
