"""The host pool's memory, counted in fixed-size blocks, and the prefix cache that holds whole blocks.

A block is ``block_tokens`` token positions of every layer's K and V at the model's dtype. The
:class:`BlockPool` has a memory budget (``kv_memory`` bytes, by default half of the memory the machine has
free when the engine starts) and hands blocks to sequences as their context grows; a sequence's blocks go
back when it ends or is preempted. The scheduler sees only counts: ``free``, ``blocks_for``, ``grow``
(False when the blocks are not free, so the scheduler evicts or preempts) and ``release``.

The count is backed by storage: the engine's :class:`~infinikv.paged.BlockStore` holds as many blocks in
each (layer, part) arena, and every sequence's host pool (``kvpool.KVPool``) takes its blocks there and
gives them back when the sequence ends or is preempted, so what admission counts is what the sequences
store. What is not paged: a policy's state on the compute device (InfiniGen's partial keys and block bounds,
Quest's page bounds, H2O's scores), which lives and ends with the sequence's policy and is counted with the
K/V it summarises, not apart; and ``dense``, whose K/V stay on the compute device as one tensor per layer
(attention reads them in place).

:class:`PrefixCache` keeps, for each prompt block a sequence prefilled, what the policy was handed for it
(every layer's K/V, through ``Cache.update``), the policy's ``prefill_state`` after it and the logits of its
last token. A block is named by a chained hash of its tokens and everything before it, within one prefill
family (``Policy.prefill_family``, or the exact configuration for a policy of no family) and one block size,
so a hit means the same tokens at the same positions, prefilled the same way. An entry's K/V are blocks of
the engine's store, held by reference: a sequence whose host pool holds the prompt's K/V as handed
(``Policy.keeps_prompt_kv``) lends its own block, and one whose pool does not (dense, quantized KV) has its
K/V copied into a fresh block. A hit of such a policy takes the blocks into its pool without a copy
(``KVPool.adopt``; a block shared this way is copied only if its holder overwrites a slot, which eviction
does), and the other policies copy them into their own storage; either way the prefill's calls are replayed
from the blocks, so the policy rebuilds its state on the device. Each entry counts one block of the
account, also while a sequence holds it too (the count errs on the safe side); when the pool needs blocks,
the least recently used entries go, a block only after the blocks that follow it, and their blocks return
to the store once no sequence holds them.
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
from ..paged import BlockArena
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
    """One prompt block as its prefill left it: each layer's K and V in a block of the engine's store
    (``blocks``, held by the entry until it is evicted), the ``Cache.update`` calls that handed them over
    (layer, first slot in the block, tokens, key_valid, in order), the policy's ``prefill_state`` after it
    and the next-token logits at its last position (both in host memory)."""

    digest: bytes
    parent: bytes  # the digest of the block before it (the root for a prompt's first block)
    calls: list[tuple[int, int, int, Tensor | None]]
    state: Any
    logits: Tensor
    blocks: dict[tuple[int, str], tuple[BlockArena, int]] = field(default_factory=dict)

    def replayed(self, device: torch.device) -> list[tuple[int, Tensor, Tensor, Tensor | None]]:
        """The calls as the cache was handed them, (layer, K, V, key_valid), copied to ``device`` from the
        blocks (the caller may keep or change them)."""
        out = []
        for layer, first, count, key_valid in self.calls:
            kv = [
                arena.block(block)[None, :, first : first + count].to(device, copy=True)
                for arena, block in (self.blocks[layer, "keys"], self.blocks[layer, "values"])
            ]
            out.append((layer, *kv, None if key_valid is None else key_valid.to(device, copy=True)))
        return out

    def release(self) -> None:
        """Give the entry's blocks back to the store (a sequence that adopted one still holds it)."""
        for arena, block in self.blocks.values():
            arena.give_back([block])
        self.blocks = {}


def on_host(value: Any) -> Any:
    """A copy of ``value`` (tensors, or lists / tuples / dicts of them) in host memory, which later in-place
    updates of the original do not reach (a view is copied alone, not the tensor it views)."""
    if isinstance(value, Tensor):
        return value.to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    return value


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` (as :func:`on_host` takes it) copied to ``device``, so the caller may change it freely."""
    if isinstance(value, Tensor):
        return value.to(device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


class PrefixCache:
    """Prompt blocks by chained hash, one block of ``pool`` each, evicted least-recently-used, a block before
    the blocks that follow it (evicting a block first would leave its followers unreachable).

    A match is taken into the sequence's own cache at once (``Driver.restore``, the blocks adopted or
    copied), so no running sequence needs an entry to stay: every entry is evictable, and the pool's free
    blocks plus the cached ones are what admission can use."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()  # oldest use first
        self._followers: dict[bytes, int] = {}  # digest -> cached blocks that follow it
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

    def match(self, digest: bytes, prompt: list[int], start: int = 0) -> list[PrefixEntry]:
        """The cached blocks that follow the block named ``digest`` (a root: none) in ``prompt`` from token
        ``start`` on, in order, each marked used."""
        size, found = self.pool.block_tokens, []
        for begin in range(start, len(prompt) - size + 1, size):
            digest = self.chain(digest, prompt[begin : begin + size])
            entry = self._entries.get(digest)
            if entry is None:
                break
            found.append(entry)
        for entry in found:
            self._entries.move_to_end(entry.digest)
        return found

    def add(self, entry: PrefixEntry) -> None:
        """Keep ``entry`` if a block is free or can be freed (else it is dropped: caching is best effort)."""
        if entry.digest in self._entries:
            self._entries.move_to_end(entry.digest)
            entry.release()
            return
        if self.pool.free < 1 and not self.evict(1):
            entry.release()
            return
        self._entries[entry.digest] = entry
        self._followers[entry.parent] = self._followers.get(entry.parent, 0) + 1
        self.pool.cached += 1
        self.pool.peak = max(self.pool.peak, self.pool.used)

    def evict(self, blocks: int, keep: frozenset[bytes] = frozenset()) -> int:
        """Free up to ``blocks`` blocks, least recently used first among those no cached block follows, never
        one named in ``keep``; returns how many were freed."""
        freed = 0
        while freed < blocks:
            victim = next(
                (
                    digest
                    for digest in self._entries
                    if not self._followers.get(digest) and digest not in keep
                ),
                None,
            )
            if victim is None:
                break
            evicted = self._entries.pop(victim)
            evicted.release()
            parent = evicted.parent
            self._followers[parent] -= 1
            if not self._followers[parent]:
                del self._followers[parent]
            freed += 1
        self.pool.cached -= freed
        return freed

    def evictable(self, keep: frozenset[bytes] = frozenset()) -> int:
        """Blocks :meth:`evict` could free, ``keep`` aside (a kept block's ancestors stay too)."""
        pinned = set(keep)
        for digest in keep:  # ancestors of a kept block cannot go before it
            entry = self._entries.get(digest)
            while entry is not None and entry.parent not in pinned:
                pinned.add(entry.parent)
                entry = self._entries.get(entry.parent)
        return sum(1 for digest in self._entries if digest not in pinned)
