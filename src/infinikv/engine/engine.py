"""The engine: requests come and go between steps; each step feeds every running sequence one token and
reads new prompts in chunks, under a token budget.

``add`` queues a request (its prompt's token ids, its KV policy, its sampling settings) and returns its id;
``abort`` ends one; ``step`` runs one scheduler step and returns what each sequence produced:

1. **Room for the decode rows.** Every decoding sequence needs its cache to hold one more position; when the
   pool has no block left for it (after evicting cached prefix blocks), the most recently admitted
   sequence is preempted: its cache is dropped, its blocks freed, and it goes back to the front of the queue
   with the tokens it had generated, which are fed again through decode steps after its prompt is prefilled
   again (recompute).
2. **Decode.** One forward pass over all decoding sequences (``ragged.RaggedCache``: batched projections
   and MLPs, each row's attention through its own policy), one token sampled per row, on each row's own
   random generator, with its own sampling settings.
3. **Admission.** Waiting sequences are admitted in order while ``max_running`` allows and the pool has
   blocks for their prompt, plus a block of headroom per decoding sequence. An admitted sequence first
   takes the blocks of its prompt that the prefix cache holds (``blocks.PrefixCache``: adopted by its
   host pool, or copied where the pool keeps something else) and prefills only the rest.
4. **Prefill.** What is left of ``step_tokens`` goes to prompt chunks of ``chunk_tokens`` (at least one
   chunk a step), each to the admitted sequence with the fewest prompt tokens left, so a short prompt does
   not wait behind a long one. When its last chunk is read, a sequence samples its first token.

Chunks start at multiples of ``chunk_tokens``, which divides ``block_tokens`` (a one-token tail joins the
chunk before it, so no chunk looks like a decode step), whatever else runs, so a restored block holds bit
for bit what the sequence's own prefill of it computes. A decode step's projections and MLPs run over all
its rows, each row computed as it is alone (``invariant.py``: a BLAS sums a product's rows in an order
that depends on how many rows it has, so on a CPU whose two-row product is slow each row is its own
matrix-vector product, elsewhere each linear layer takes its rows in groups of one kernel's sizes), so
batching changes no bit of an eager step (a compiled one's kernels are inductor's).

Each sequence has its own cache and policy instance: requests with different policies run in the same
steps, and nothing a policy chooses for a row depends on the other rows.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from ..cache import InfinikvCache
from ..clock import now
from ..errors import InputError
from ..forward import Driver, prompt_chunks
from ..kvpool import KV, KVPool
from ..models import LoadedModel
from ..paged import BlockStore
from ..policies import PolicyConfig, policy_of, prepare
from .blocks import BlockPool, PrefixCache, PrefixEntry, block_bytes, free_memory_bytes, on_device, on_host
from .ragged import decode_step
from .requests import GenerationConfig, RequestResult, sample
from .sequence import Phase, Sequence

Tensor = torch.Tensor


@dataclass(frozen=True)
class EngineConfig:
    block_tokens: int = 128  # tokens per block of the pool and of the prefix cache
    chunk_tokens: int = 128  # prompt tokens per prefill forward pass (divides block_tokens)
    step_tokens: int = 256  # tokens one step feeds at most: one per decode row, the rest to prompt chunks
    max_running: int = 16  # sequences admitted at once
    kv_memory: int | None = None  # the pool's bytes (None: half the memory free when the engine starts)
    prefix_cache: bool = True
    # decode steps run under torch.compile (forward.decode_call), compiled at the engine's first prepare
    compile: bool = False

    def __post_init__(self):
        for name, low in (("block_tokens", 2), ("chunk_tokens", 2), ("step_tokens", 1), ("max_running", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be a whole number of at least {low}, got {value!r}")
        if self.block_tokens % self.chunk_tokens:
            raise InputError(
                f"chunk_tokens ({self.chunk_tokens}) must divide block_tokens ({self.block_tokens}), so that "
                "every block ends where a prompt chunk ends"
            )
        if self.kv_memory is not None and (not isinstance(self.kv_memory, int) or self.kv_memory < 1):
            raise InputError(f"kv_memory must be a positive number of bytes, got {self.kv_memory!r}")
        for name in ("prefix_cache", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class StepOutput:
    """What one sequence produced in a step: its new token, the text that can be shown now, and its result
    once it is finished."""

    seq: int
    token: int
    text: str
    result: RequestResult | None = None


WARM_UP_PROMPT_TOKENS = 8  # a compiled engine's warm-up generations (Engine._warm_up): prompt tokens
WARM_UP_NEW_TOKENS = 4  # and new tokens: the decode mask takes three lengths at each batch size


class Engine:
    """Continuous batching over ``loaded``'s model. Not thread-safe: one thread calls add, abort and step."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig()):
        self.loaded = loaded
        self.config = config
        dtype = loaded.dtype
        per_block = block_bytes(loaded.spec, dtype, config.block_tokens)
        free = free_memory_bytes()
        memory = config.kv_memory if config.kv_memory is not None else free // 2
        if memory > free:  # the pool is an account: admitted beyond this, the machine would run out first
            raise InputError(
                f"kv_memory of {memory / 2**30:.2f} GiB is more than the {free / 2**30:.2f} GiB this machine "
                "has available"
            )
        if memory < per_block:
            raise InputError(
                f"kv_memory of {memory / 2**30:.2f} GiB holds no block of {config.block_tokens} tokens "
                f"({per_block / 2**30:.2f} GiB of K/V for this model)"
            )
        self.pool = BlockPool(memory // per_block, config.block_tokens)
        # Where every sequence's host pool keeps its K/V (and a policy's parts beside them): as many blocks
        # as the account above, which admission and preemption go by.
        pin = torch.device(loaded.device).type == "cuda"
        self.blocks = BlockStore(config.block_tokens, blocks=self.pool.total, pin=pin)
        self.block_bytes = per_block
        self.prefixes = PrefixCache(self.pool) if config.prefix_cache else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        self._sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self._prepared: set[PolicyConfig] = set()
        self._warmed_up = False  # compiled decode steps: compiled before the first request (_warm_up)
        eos = loaded.model.generation_config.eos_token_id
        if eos is None:
            eos = loaded.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.preemptions = 0

    # -- requests ------------------------------------------------------------------------------------------
    def prepare(self, policy: PolicyConfig) -> None:
        """The policy's model-level work (InfiniGen's calibration), once per configuration; with compiled
        decode steps, at the first call, their compilation too (:meth:`_warm_up`)."""
        if policy not in self._prepared:
            prepare(policy, self.loaded)
            self._prepared.add(policy)
        if self.config.compile and not self._warmed_up and not self.has_work:
            self._warmed_up = True
            self._warm_up(policy)

    def _warm_up(self, policy: PolicyConfig) -> None:
        """Compile the decode step before any request, so no running stream waits for it. torch.compile
        compiles a step at its first batch size and again at its second, after which the batch size and the
        decode mask's length are symbolic: a short greedy generation at one row, then at two, covers both.
        The compiled step is the model's, shared by every policy and engine (``forward.decode_call``), so
        ``policy`` is only the one at hand. Nothing of it stays: its prompts are shorter than a block (no
        prefix cache entry), its rows are ended if it fails, and the counters ``stats`` reports are as
        before. A pool too small for one of its rows skips it (the first request compiles)."""
        prompt = list(range(1, min(WARM_UP_PROMPT_TOKENS, self.config.block_tokens - 1) + 1))
        if self.pool.blocks_for(len(prompt) + WARM_UP_NEW_TOKENS) > self.pool.total:
            return
        sampling = GenerationConfig(max_new_tokens=WARM_UP_NEW_TOKENS)
        prefixes = self.prefixes
        looked_up = None if prefixes is None else (prefixes.hit_tokens, prefixes.miss_tokens)
        counted = (self.preemptions, self.pool.peak, looked_up)
        eos_ids, self.eos_ids = self.eos_ids, set()  # every row takes all its steps
        ids: list[int] = []
        try:
            for rows in (1, 2):
                ids = [self.add(prompt, policy, sampling) for _ in range(rows)]
                while any(seq_id in self._sequences for seq_id in ids):  # a finished sequence is forgotten
                    self.step()
        finally:
            for seq_id in ids:  # after a failure, what it left running
                self.abort(seq_id)
            self.eos_ids = eos_ids
            self.preemptions, self.pool.peak, looked_up = counted
            if prefixes is not None:
                prefixes.hit_tokens, prefixes.miss_tokens = looked_up

    def check(self, prompt: list[int], sampling: GenerationConfig) -> None:
        """An InputError when the request can never run: empty, past the model's context, or more blocks
        than the whole pool."""
        if not prompt:
            raise InputError("the prompt is empty")
        total = len(prompt) + sampling.max_new_tokens
        if total > self.loaded.max_context:
            raise InputError(
                f"the prompt has {len(prompt)} tokens; with {sampling.max_new_tokens} new tokens it exceeds "
                f"the model's context of {self.loaded.max_context} tokens"
            )
        if self.pool.blocks_for(total) > self.pool.total:
            raise InputError(
                f"the prompt has {len(prompt)} tokens; with {sampling.max_new_tokens} new tokens it needs "
                f"{self.pool.blocks_for(total)} blocks of {self.pool.block_tokens} tokens, and the KV memory "
                f"budget holds {self.pool.total}"
            )

    def add(self, prompt: list[int], policy: PolicyConfig, sampling: GenerationConfig) -> int:
        """Queue a request; it is admitted at a coming step. Returns its id."""
        self.check(prompt, sampling)
        self.prepare(policy)
        generator = torch.Generator(device=self.loaded.device)  # sampling stays on the device
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        family = policy_of(policy).prefill_family or (type(policy).__name__, policy)
        root = PrefixCache.root(self.loaded.weights_id, family, self.config.block_tokens)
        seq = Sequence(next(self._ids), list(prompt), policy, sampling, generator, root)
        self._sequences[seq.id] = seq
        self.waiting.append(seq)
        return seq.id

    def abort(self, seq_id: int) -> RequestResult | None:
        """End a request that has not finished ("cancelled"); returns its result (None if it had ended)."""
        seq = self._sequences.get(seq_id)
        if seq is None or seq.phase is Phase.FINISHED:
            return None
        seq.finish = "cancelled"
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        return self._finish(seq)

    def prompt_tokens_read(self, seq_id: int) -> int:
        """Prompt tokens of a running or waiting request in its cache so far (for a progress bar)."""
        seq = self._sequences.get(seq_id)
        return 0 if seq is None else min(seq.cached_tokens, len(seq.prompt))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        """The pool and the prefix cache, for the server's metrics."""
        hits = self.prefixes.hit_tokens if self.prefixes is not None else 0
        misses = self.prefixes.miss_tokens if self.prefixes is not None else 0
        return {
            "blocks_total": self.pool.total,
            "blocks_used": self.pool.used,
            "blocks_cached": self.pool.cached,
            "blocks_peak": self.pool.peak,
            "block_bytes": self.block_bytes,
            "prefix_hit_tokens": hits,
            "prefix_miss_tokens": misses,
            "preemptions": self.preemptions,
        }

    # -- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        decoding = self._make_room([s for s in self.running if s.phase is Phase.DECODING])
        if decoding:
            self._decode(decoding, outputs)
        self._admit_waiting(outputs)
        self._prefill(self.config.step_tokens - len(decoding), outputs)
        return outputs

    def _make_room(self, decoding: list[Sequence]) -> list[Sequence]:
        """The decoding sequences whose cache can take one more position, preempting the newest when not."""
        kept = []
        for seq in decoding:
            while seq.phase is Phase.DECODING and not self._grow(seq, seq.cached_tokens + 1):
                self._preempt(max(self.running, key=lambda s: s.admitted_at))
            if seq.phase is Phase.DECODING:
                kept.append(seq)
        return kept

    def _available(self, keep: frozenset[bytes] = frozenset()) -> int:
        """Blocks free now or once cached prefix blocks (but those in ``keep``) are evicted."""
        return self.pool.free + (self.prefixes.evictable(keep) if self.prefixes is not None else 0)

    def _grow(self, seq: Sequence, tokens: int, keep: frozenset[bytes] = frozenset()) -> bool:
        """Give ``seq`` blocks for ``tokens`` positions, evicting cached prefix blocks (not those in
        ``keep``) only when that is enough; False when it is not."""
        short = self.pool.blocks_for(tokens) - self.pool.held.get(seq.id, 0) - self.pool.free
        if short > 0:
            if short > self._available(keep) - self.pool.free:
                return False
            self.prefixes.evict(short, keep)
        return self.pool.grow(seq.id, tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s cache and blocks; it waits at the front, to feed its tokens again (recompute)."""
        self._release(seq)
        seq.phase, seq.prefilled, seq.next_input = Phase.WAITING, 0, None
        seq.forced, seq.digest, seq.block_calls = list(seq.generated), seq.family, []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        driver, seq.driver = seq.driver, None
        try:
            if driver is not None:
                driver.close()
        finally:  # its blocks go back even when closing its cache fails
            self.pool.release(seq.id)
            if seq in self.running:
                self.running.remove(seq)

    def _decode(self, rows: list[Sequence], outputs: list[StepOutput]) -> None:
        caches, past = [seq.driver.cache for seq in rows], [seq.cached_tokens for seq in rows]
        tokens = torch.tensor([seq.next_input for seq in rows])
        start = now(self.loaded.device)
        logits = decode_step(self.loaded, caches, past, tokens, self.config.compile)
        elapsed = now(self.loaded.device) - start
        # each row samples on the device with its own settings; the new tokens then cross to the host in one
        # read, the step's only one (a forced row feeds its next forced token instead)
        drawn = {
            r: sample(logits[r : r + 1], seq.sampling, seq.generator)
            for r, seq in enumerate(rows)
            if not seq.forced
        }
        new = dict(zip(drawn, torch.cat(list(drawn.values())).tolist(), strict=True)) if drawn else {}
        for r, seq in enumerate(rows):
            seq.decode_s += elapsed
            seq.decode_steps += 1
            seq.rows_in_steps += len(rows)
            self._next_token(seq, new.get(r), outputs)

    def _prefill(self, allowance: int, outputs: list[StepOutput]) -> None:
        """Prompt chunks within ``allowance`` tokens (at least one), each to the admitted sequence with the
        fewest prompt tokens left, so a short prompt is not held behind a long one's whole prefill. Before a
        chunk, a sequence takes the blocks another sequence with the same prompt has cached meanwhile (two
        questions about one document, sent together, read it once)."""
        chunks = max(1, allowance // self.config.chunk_tokens)
        while chunks > 0:
            prefilling = [s for s in self.running if s.phase is Phase.PREFILLING]
            if not prefilling:
                return
            seq = min(prefilling, key=lambda s: len(s.prompt) - s.prefilled)
            found = self._cached_prefix(seq)
            if found:
                self._restore(seq, found, outputs)
            else:
                self._prefill_chunk(seq, outputs)
                chunks -= 1

    def _admit_waiting(self, outputs: list[StepOutput]) -> None:
        """Admit waiting sequences in order, while ``max_running`` allows and the pool has blocks for each
        one's prompt (and the tokens it feeds again) plus a block of headroom per decoding sequence, so
        an admission does not force a preemption at the next step. A sequence takes its cached prefix at
        once."""
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            tokens = len(seq.prompt) + len(seq.forced) + 1
            need = self.pool.blocks_for(tokens) + sum(1 for s in self.running if s.phase is Phase.DECODING)
            found = self._cached_prefix(seq)
            keep = frozenset(entry.digest for entry in found)
            if need > self._available(keep):
                found, keep = [], frozenset()  # its own blocks matter more than keeping its prefix cached
                if need > self._available():
                    return
            self._grow(seq, tokens, keep)
            self.waiting.popleft()
            seq.phase, seq.admitted_at = Phase.PREFILLING, next(self._admissions)
            self.running.append(seq)  # before its cache is built: a failure there still releases it
            cache = InfinikvCache(self.loaded.model, seq.policy, device=self.loaded.device)
            cache.draw_from(self.blocks)
            cache.reserve(len(seq.prompt) + len(seq.generated))  # a preempted one feeds its tokens again
            seq.driver = Driver(self.loaded, cache)
            if found:
                self._restore(seq, found, outputs)

    def _cached_prefix(self, seq: Sequence) -> list[PrefixEntry]:
        """The cached blocks that come next in ``seq``'s prompt (from its first token not yet read, when
        that starts a block), cut back to end where one of its chunks ends."""
        block = self.config.block_tokens
        if self.prefixes is None or seq.prefilled % block:
            return []
        chunks = prompt_chunks(len(seq.prompt), self.config.chunk_tokens)
        ends = {end for begin, end in chunks if end - begin == self.config.chunk_tokens}
        found = self.prefixes.match(seq.digest, seq.prompt, seq.prefilled)
        while found and seq.prefilled + len(found) * block not in ends:
            found.pop()
        return found

    def _restore(self, seq: Sequence, found: list[PrefixEntry], outputs: list[StepOutput]) -> None:
        """Take the cached blocks ``found``, the next ones of its prompt, into ``seq``'s cache: adopted by
        its host pool where the pool holds the prompt's K/V as handed, and replayed through the cache (which
        stores nothing twice) so the policy builds its state. Each keeps its last position's logits, so a
        prompt that ends with a cached block samples its first token at once."""
        restored = len(found) * self.config.block_tokens
        device = self.loaded.device
        start = now(device)
        pool = self._lending_pool(seq)
        if pool is not None:
            for entry in found:
                for (layer, name), (arena, block) in entry.blocks.items():
                    pool.adopt(layer, name, arena, block)
        calls = [call for entry in found for call in entry.replayed(device)]
        state = on_device(found[-1].state, device)
        seq.driver.restore(calls, state, seq.prefilled + restored)
        seq.prefill_s += now(device) - start
        hits = self._newly_read(seq, seq.prefilled + restored)
        seq.prefix_hit_tokens += hits
        self.prefixes.hit_tokens += hits
        seq.prefilled, seq.digest = seq.prefilled + restored, found[-1].digest
        if seq.prefilled == len(seq.prompt):
            self._prompt_read(seq, on_device(found[-1].logits, device), outputs)

    @staticmethod
    def _newly_read(seq: Sequence, end: int) -> int:
        """Of ``seq``'s prompt tokens up to ``end``, those read for the first time: a prompt read again after
        a preemption counts once in the prefix cache's hit and miss counters."""
        new = max(0, end - seq.prompt_counted)
        seq.prompt_counted = max(seq.prompt_counted, end)
        return new

    def _prefill_chunk(self, seq: Sequence, outputs: list[StepOutput]) -> None:
        """Feed ``seq``'s next prompt chunk; when it completes a block, hand that block to the prefix cache
        (the calls of the block's chunks, the policy's state and the logits at its end)."""
        chunks = prompt_chunks(len(seq.prompt), self.config.chunk_tokens)
        begin, end = next(chunk for chunk in chunks if chunk[0] == seq.prefilled)
        record = self.prefixes is not None and end - begin == self.config.chunk_tokens
        ids = torch.tensor([seq.prompt[begin:end]])
        start = now(self.loaded.device)
        logits, calls = seq.driver.extend(ids, record=record)
        seq.prefill_s += now(self.loaded.device) - start
        seq.prefilled = end
        if self.prefixes is not None:
            self.prefixes.miss_tokens += self._newly_read(seq, end)
        block = self.config.block_tokens
        if record:
            seq.block_calls += calls
            if end % block == 0:
                parent, seq.digest = seq.digest, PrefixCache.chain(seq.digest, seq.prompt[end - block : end])
                state = on_host(seq.driver.policy.prefill_state())
                entry = PrefixEntry(seq.digest, parent, [], state, on_host(logits))
                self._keep_block(seq, end // block - 1, entry)
                self.prefixes.add(entry)
                seq.block_calls = []
        if end == len(seq.prompt):
            self._prompt_read(seq, logits, outputs)

    def _lending_pool(self, seq: Sequence) -> KVPool | None:
        """``seq``'s host pool where it keeps the prompt's K/V as handed, in the engine's blocks (so a
        cached block can be shared with it both ways); else None."""
        policy = seq.driver.policy
        pool = policy.pool()
        if not policy.keeps_prompt_kv or pool is None or pool.blocks is not self.blocks:
            return None
        return pool

    def _keep_block(self, seq: Sequence, index: int, entry: PrefixEntry) -> None:
        """Give ``entry`` the K/V of ``seq``'s prompt block ``index``, whose calls are ``seq.block_calls``:
        the pool's own blocks, shared, or copies in fresh blocks of the store."""
        offsets: dict[int, int] = {}
        for layer, k, _, key_valid in seq.block_calls:
            first = offsets.get(layer, 0)
            entry.calls.append((layer, first, k.shape[2], on_host(key_valid)))
            offsets[layer] = first + k.shape[2]
        pool = self._lending_pool(seq)
        for layer in offsets:
            if pool is not None and pool.length(layer) >= (index + 1) * self.config.block_tokens:
                for name in KV:
                    block = pool.share(layer, name, index)
                    entry.blocks[layer, name] = (pool.arena(layer, name), block)
                continue
            calls = [call for call in seq.block_calls if call[0] == layer]
            for name, tensors in zip(KV, zip(*(call[1:3] for call in calls), strict=True), strict=True):
                whole = torch.cat(tensors, dim=2)[0]  # [kv_heads, block_tokens, head_dim]
                arena = self.blocks.arena(layer, name, whole.shape[0], whole.shape[2], whole.dtype)
                (block,) = arena.take(1)
                arena.block(block).copy_(whole)
                entry.blocks[layer, name] = (arena, block)

    def _prompt_read(self, seq: Sequence, logits: Tensor, outputs: list[StepOutput]) -> None:
        seq.phase, seq.block_calls = Phase.DECODING, []
        token = None if seq.forced else int(sample(logits, seq.sampling, seq.generator)[0])
        self._next_token(seq, token, outputs)

    def _next_token(self, seq: Sequence, token: int | None, outputs: list[StepOutput]) -> None:
        """After a forward pass over ``seq``: feed its next forced token (``token`` None), or hand out the
        ``token`` it sampled."""
        if token is None:
            seq.next_input = seq.forced.pop(0)
            return
        seq.advance(token, self.eos_ids, self.loaded.tokenizer.decode)
        piece = seq.new_text()
        if seq.finish is None:
            seq.next_input = token
            outputs.append(StepOutput(seq.id, token, piece))
        else:
            outputs.append(StepOutput(seq.id, token, piece, self._finish(seq)))

    def _finish(self, seq: Sequence) -> RequestResult:
        try:
            policy_stats = seq.driver.stats() if seq.driver is not None else {}
        finally:  # a failing policy is still released and forgotten
            self._release(seq)
            seq.phase = Phase.FINISHED
            del self._sequences[seq.id]
        per_s = seq.decode_steps / seq.decode_s if seq.decode_s > 0 else 0.0
        stats = {
            "prompt_tokens": len(seq.prompt),
            "new_tokens": len(seq.generated),
            "batch_size": round(seq.rows_in_steps / seq.decode_steps, 2) if seq.decode_steps else 1,
            "prefill_s": round(seq.prefill_s, 4),
            "decode_s": round(seq.decode_s, 4),
            "decode_steps": seq.decode_steps,
            "decode_tokens_per_s": round(per_s, 3),
            "batch_decode_tokens_per_s": round(seq.rows_in_steps / seq.decode_s if seq.decode_s else 0.0, 3),
            "prefix_hit_tokens": seq.prefix_hit_tokens,
            "preemptions": seq.preemptions,
            **policy_stats,
        }
        return RequestResult(seq.prompt, seq.text, list(seq.generated), seq.finish or "length", stats)
