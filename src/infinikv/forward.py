"""The one place that runs the model over a KV cache: a chunked prefill, then one decode step at a time.

:class:`Driver` holds one cache (an :class:`~infinikv.cache.InfinikvCache`, or a transformers cache for the
benchmark's peers), the attention mask and the next positions. ``prefill`` feeds a prompt batch in chunks
(:func:`chunk_bounds`) with positions taken from its padding mask, as transformers' own generate does;
``step`` feeds one token per row, growing the mask by one column. Both return the last position's logits.
That left-padded batch is the benchmark's. One sequence alone is read as the engine reads it: ``extend``
takes one prompt chunk, ``read_prompt`` a whole prompt in chunks from its start (:func:`prompt_chunks`), and
:func:`decode_rows` is the engine's decode step over rows of different lengths. Everything around it
stays with its user: sampling, stop strings and streaming in ``generate.Generator``, teacher forcing in
``eval.runner.DecodeRun`` and ``lm_eval.loglik``, timing in the benchmark.

A long prompt's prefill costs as much as hundreds of decode steps, and most policies build the same state
from a prompt (``Policy.prefill_family``: plain dense attention for most; H2O's prompt scores do not depend
on its budget). A :class:`PrefillMemo` shared between drivers records the first prefill of a prompt in each
family (every K/V the cache was handed, in order, plus ``Policy.prefill_state``) and replays it into the
next caches of that family through the same ``Cache.update`` calls the model makes, so the replayed cache
holds exactly what its own prefill would have built. A recording can also be replayed repeated over the
rows of a transformers cache's batch (``repeat``), which is how the benchmark fills a peer's batch from
one prompt.

A decode step can run compiled (``compile=True``, :func:`decode_call`): transformers' forward under
``torch.compile`` (inductor; on CUDA with CUDA graphs, as ``mode="reduce-overhead"``), the policy's three
calls per layer (``hooks.py``: before attention, store and select, attend) run eagerly: on the CPU as
opaque operators inside the step's one graph, on CUDA as graph breaks between the graphs of the model's
own work. That work (embedding, norms, projections, RoPE, MLPs, the last logits) is fused and, on CUDA,
replayed from graphs; what a policy does stays Python. The prefill is not compiled (its shapes change).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers.cache_utils import Cache

from .cache import InfinikvCache
from .clock import now
from .hooks import stepping
from .invariant import install, rows_alone
from .models import LoadedModel

Tensor = torch.Tensor


def chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    """(begin, end) of each prefill chunk of at most ``chunk`` tokens, cut back from the end: the first one
    takes the remainder. A left-padded row's tokens then fall in the chunks they fall in alone (its padding
    only lengthens the first), so a policy whose later chunks attend to a lossy copy of the earlier ones
    (quant) gives a row what it gives it alone. A short first chunk is still a prefill (the cache is empty);
    every later one is whole, so none looks like a decode step."""
    bounds = [0] + list(range(total % chunk or chunk, total + 1, chunk))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def prompt_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """(begin, end) of each prefill chunk of a ``length``-token prompt: ``chunk`` tokens each from the start,
    the last one shorter; a one-token tail joins the chunk before it (a lone token after others would be a
    decode step)."""
    bounds = list(range(0, length, chunk)) + [length]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class RecordedPrefill:
    """One prompt's prefill as the cache saw it: (layer, K, V, key_valid) per call, what else the policy
    kept (``Policy.prefill_state``), the last position's logits and how long the forward passes took."""

    calls: list[tuple[int, Tensor, Tensor, Tensor | None]]
    state: Any
    logits: Tensor | None  # None: a prefix restored by the engine, which keeps its own
    forward_s: float


class PrefillMemo:
    """Prefills recorded by one :class:`Driver` and replayed by the next ones on the same prompt.

    A driver records or replays only within its cache's prefill family. A policy of no family runs its own
    prefill, unless ``per_config``: then each exact policy configuration is a family of its own (worth it
    when one configuration runs the same prompt many times, as in the benchmark). Holds every recorded
    prompt's K/V: keep one per group of runs that share prompts and ``clear`` it between groups.
    """

    def __init__(self, per_config: bool = False):
        self.per_config = per_config
        self._recorded: dict[tuple, RecordedPrefill] = {}
        self.replays = 0

    @staticmethod
    def key(model: str, family: Hashable, input_ids: Tensor, chunk: int, from_start: bool = False) -> tuple:
        """A prompt's key: ``from_start``, read as the engine reads it (``Driver.read_prompt``), which is
        not the recording of a left-padded batch's prefill (``Driver.prefill``)."""
        key = model, family, chunk, tuple(input_ids.shape), input_ids.cpu().numpy().tobytes()
        return (*key, "from the start") if from_start else key

    def get(self, key: tuple) -> RecordedPrefill | None:
        return self._recorded.get(key)

    def put(self, key: tuple, recorded: RecordedPrefill) -> None:
        self._recorded[key] = recorded

    def clear(self) -> None:
        self._recorded.clear()


def _repeat_rows(value: Tensor | None, repeat: int) -> Tensor | None:
    """``value`` (batch first) with each row repeated."""
    if repeat == 1 or value is None:
        return value
    return value.repeat_interleave(repeat, dim=0)


def _logits(model: torch.nn.Module, **inputs: Any) -> Tensor:
    """The model's next-token logits [batch, vocab] for ``inputs``."""
    return model(**inputs, use_cache=True, logits_to_keep=1).logits[:, -1]


# Every model, decode path and batch size compiles the same function (_logits) again: the limits on
# recompiles are raised so that none falls back to eager. On CUDA, where each call into the policy breaks
# the step's graph, every decoder layer's attention is its own module with its own layer_idx; read as a
# graph input rather than a constant, the layers share their graphs, and the code resumed after each call
# into the policy, which indexes the cache's layers by it, is compiled once per layer. (On the CPU a step
# is one graph: hooks.py.)
# Each under its name in this torch and the older one (those this torch lacks are left out).
_COMPILE_SETTINGS = {
    "allow_unspec_int_on_nn_module": True,
    "recompile_limit": 4096,
    "cache_size_limit": 4096,
    "accumulated_recompile_limit": 65536,
    "accumulated_cache_size_limit": 65536,
}
# On CUDA, mode="reduce-overhead" (each graph captured and replayed as a CUDA graph), except graphs with a
# symbolic size, which would be captured again for every size: a left-padded batch's growing mask, and the
# batch itself once dynamo has seen a few batch sizes (the engine's rows come and go). Those run as plain
# compiled kernels, so a fixed batch gets CUDA graphs and a changing one mostly does not.
_CUDA_GRAPHS = {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True}


def decode_call(loaded: LoadedModel, compile: bool) -> Callable[..., Tensor]:
    """What a decode step calls with the model's inputs to get its logits: the eager forward or, with
    ``compile``, the model's compiled one (module docstring), made once per model and shared by every
    driver and engine on it."""
    model = loaded.model
    if not compile:
        return functools.partial(_logits, model)
    made = model.__dict__.setdefault("_infinikv_compiled_decode", {})  # per device type
    kind = loaded.device.type
    if kind not in made:
        made[kind] = torch.compile(_logits, options=_CUDA_GRAPHS if kind == "cuda" else None)
    graphed = made[kind]
    settings = {name: on for name, on in _COMPILE_SETTINGS.items() if hasattr(torch._dynamo.config, name)}

    def compiled(**inputs: Any) -> Tensor:
        with torch._dynamo.config.patch(settings), stepping(inputs["cache"]):
            return graphed(model, **inputs)

    return compiled


class Driver:
    """Prefill and decode steps of ``loaded``'s model over one cache. Not thread-safe; :meth:`close` (or use
    it as a context manager) releases the policy's pool.

    ``family``: the prefill family a foreign (transformers) cache may replay; an ``InfinikvCache`` takes
    its policy's ``prefill_family``. ``compile``: decode steps run compiled (:func:`decode_call`).
    """

    def __init__(
        self, loaded: LoadedModel, cache: Cache, family: Hashable | None = None, compile: bool = False
    ):
        self.loaded = loaded
        self.cache = cache
        self._decode = decode_call(loaded, compile)
        self.policy = cache.policy if isinstance(cache, InfinikvCache) else None
        self.family = self.policy.prefill_family if self.policy is not None else family
        self.attention_mask: Tensor | None = None  # [batch, tokens fed so far]
        self.replayed: RecordedPrefill | None = None  # what the last prefill replayed (None: ran the model)
        self._next_positions: Tensor | None = None  # [batch, 1]

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.policy is not None:
            self.cache.close()

    def stats(self) -> dict[str, Any]:
        """The policy's statistics (none for a foreign cache)."""
        return self.cache.stats() if self.policy is not None else {}

    @property
    def length(self) -> int:
        """Tokens fed so far (padding included)."""
        return 0 if self.attention_mask is None else self.attention_mask.shape[1]

    # -- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        chunk: int = 2048,
        memo: PrefillMemo | None = None,
        repeat: int = 1,
        progress: bool = False,
    ) -> Tensor:
        """Feed ``input_ids`` [batch, tokens] (left padding marked by ``attention_mask``; None: no padding),
        each row ``repeat`` times, in chunks of at most ``chunk`` tokens; return the last position's logits
        [batch * repeat, vocab].

        With a ``memo``: replay this prompt's recording of the cache's family if there is one (repeated
        over the rows), else run the model and, when ``repeat`` is 1, record it for the next drivers. A
        recording is repeated over a transformers cache's batch only (the bench's peers): a policy's rows
        are each a sequence of its own (``engine.ForcedRows``)."""
        if repeat > 1 and self.policy is not None:
            raise ValueError("repeat is for a transformers cache's batch: give each policy row its own cache")
        device = self.loaded.device
        input_ids = input_ids.to(device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device)
        if self.policy is not None:
            self.cache.reserve(input_ids.shape[1])
        family = self._memo_family(memo)
        key = None if family is None else memo.key(self.loaded.name, family, input_ids, chunk)
        recorded = None if key is None else memo.get(key)
        self.replayed = recorded
        if recorded is not None:
            self._replay(recorded, repeat)
            memo.replays += 1
            logits = _repeat_rows(recorded.logits, repeat)
        elif key is not None and repeat == 1 and self.policy is not None:
            logits = self._record(key, memo, input_ids, attention_mask, chunk, progress)
        else:
            input_ids = _repeat_rows(input_ids, repeat)
            logits = self._forward_chunks(input_ids, _repeat_rows(attention_mask, repeat), chunk, progress)
        self.attention_mask = _repeat_rows(attention_mask, repeat)
        self._next_positions = self.attention_mask.sum(dim=1, keepdim=True)
        return logits

    def _memo_family(self, memo: PrefillMemo | None) -> Hashable | None:
        if memo is None:
            return None
        if self.family is None and memo.per_config and self.policy is not None:
            return type(self.policy.config).__name__, self.policy.config
        return self.family

    def _record(
        self,
        key: tuple,
        memo: PrefillMemo,
        input_ids: Tensor,
        attention_mask: Tensor,
        chunk: int,
        progress: bool,
    ) -> Tensor:
        self.cache.prefill_log = []
        start = now(self.loaded.device)
        logits = self._forward_chunks(input_ids, attention_mask, chunk, progress)
        forward_s = now(self.loaded.device) - start
        memo.put(key, RecordedPrefill(self.cache.prefill_log, self.policy.prefill_state(), logits, forward_s))
        self.cache.prefill_log = None
        return logits

    def _replay(self, recorded: RecordedPrefill, repeat: int) -> None:
        """Hand the cache every recorded call, as the model's prefill would, without running the model
        (``repeat``: each row that many times, for a transformers cache; a policy's cache takes one row)."""
        for layer, k, v, key_valid in recorded.calls:
            if self.policy is not None:
                self.policy.set_key_valid(key_valid)
            self.cache.update(_repeat_rows(k, repeat), _repeat_rows(v, repeat), layer)
        if self.policy is not None:
            self.policy.restore_prefill_state(recorded.state)

    def _forward_chunks(
        self, input_ids: Tensor, attention_mask: Tensor, chunk: int, progress: bool
    ) -> Tensor:
        total = input_ids.shape[1]
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = None
        bar = tqdm(
            total=total, desc="prefill", unit="tok", disable=not progress or total < 2 * chunk, leave=False
        )
        for begin, end in chunk_bounds(total, chunk):
            logits = self._forward(
                input_ids[:, begin:end], attention_mask[:, :end], position_ids[:, begin:end]
            )
            bar.update(end - begin)
        bar.close()
        return logits

    # -- one sequence, chunk by chunk (the engine) ---------------------------------------------------------
    @torch.inference_mode()
    def read_prompt(self, input_ids: Tensor, chunk: int, memo: PrefillMemo | None = None) -> Tensor:
        """Read one unpadded sequence's whole prompt (``input_ids``: [1, tokens]) as the engine reads it:
        :meth:`extend` over chunks of ``chunk`` tokens from its start (:func:`prompt_chunks`); return its
        last position's logits [1, vocab]. With a ``memo``: replay this prompt's recording of the cache's
        family if there is one (:meth:`restore`), else record it for the next drivers."""
        tokens = input_ids.shape[1]
        self.cache.reserve(tokens)
        family = self._memo_family(memo)
        key = None
        if family is not None:
            key = memo.key(self.loaded.name, family, input_ids, chunk, from_start=True)
        recorded = None if key is None else memo.get(key)
        self.replayed = recorded
        if recorded is not None:
            self.restore(recorded.calls, recorded.state, tokens)
            memo.replays += 1
            return recorded.logits
        calls: list[tuple[int, Tensor, Tensor, Tensor | None]] = []
        start = now(self.loaded.device)
        for begin, end in prompt_chunks(tokens, chunk):
            logits, made = self.extend(input_ids[:, begin:end], record=key is not None)
            calls += made or []
        if key is not None:
            forward_s = now(self.loaded.device) - start
            memo.put(key, RecordedPrefill(calls, self.policy.prefill_state(), logits, forward_s))
        return logits

    @torch.inference_mode()
    def extend(self, input_ids: Tensor, record: bool = False) -> tuple[Tensor, list | None]:
        """Feed the next prompt chunk of one unpadded sequence (``input_ids``: [1, tokens], at least two
        tokens unless the cache is empty, so the chunk is a prefill); return its last position's logits
        [1, vocab] and, when ``record``, every ``Cache.update`` call the chunk made (layer, K, V,
        key_valid), for the engine's prefix cache."""
        start, tokens = self.length, input_ids.shape[1]
        device = self.loaded.device
        self.attention_mask = torch.ones(1, start + tokens, dtype=torch.long, device=device)
        positions = torch.arange(start, start + tokens, device=device)[None]
        self._next_positions = positions[:, -1:] + 1
        self.cache.prefill_log = [] if record else None
        try:
            logits = self._forward(input_ids.to(device), self.attention_mask, positions)
            return logits, self.cache.prefill_log
        finally:
            self.cache.prefill_log = None

    @torch.inference_mode()
    def restore(
        self, calls: list[tuple[int, Tensor, Tensor, Tensor | None]], state: Any, tokens: int
    ) -> None:
        """Hand the cache the recorded calls of the prompt's next tokens and the policy the
        ``prefill_state`` after them, as their prefill would have (``tokens``: the prompt's length read
        after them); the next ``extend`` continues from it."""
        self._replay(RecordedPrefill(calls, state, logits=None, forward_s=0.0), repeat=1)
        self.attention_mask = torch.ones(1, tokens, dtype=torch.long, device=self.loaded.device)
        self._next_positions = self.attention_mask.new_full((1, 1), tokens)

    # -- decode --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row (``tokens``: [batch]) through the decode path; return the next-token
        logits [batch, vocab]."""
        batch = self.attention_mask.shape[0]
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(batch, 1)], dim=1)
        positions = self._next_positions
        self._next_positions = positions + 1
        input_ids = tokens.reshape(batch, 1).to(self.loaded.device)
        return self._decode(
            input_ids=input_ids, attention_mask=self.attention_mask, position_ids=positions, cache=self.cache
        )

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        return _logits(
            self.loaded.model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache,
        )


@torch.inference_mode()
def decode_rows(
    loaded: LoadedModel, cache: Cache, tokens: Tensor, positions: Tensor, compile: bool = False
) -> Tensor:
    """One decode step of rows that need not share a length (the engine's ``RaggedCache``): ``tokens`` and
    ``positions`` [rows], each row's new token and its position; returns the next-token logits [rows, vocab].
    No mask is passed: each row's cache masks its own attention. ``compile``: :func:`decode_call`."""
    device = loaded.device
    input_ids, position_ids = tokens.reshape(-1, 1).to(device), positions.reshape(-1, 1).to(device)
    install(loaded.model)
    with rows_alone():  # each row's projections as alone, whatever the other rows (invariant.py)
        return decode_call(loaded, compile)(input_ids=input_ids, position_ids=position_ids, cache=cache)
