"""Generation for a list of prompts, on the engine: streaming, stop strings, cancellation, statistics.

Read top to bottom, one call goes like this:

1. ``_tokenize`` tokenises the prompts (a prompt may come as token ids already) and checks they fit the
   model's context.
2. Each prompt becomes a request of an :class:`~infinikv.engine.Engine` (its own cache and policy
   instance, no padding); the engine prefills prompts in block-sized chunks and decodes every running
   sequence in one forward pass per step, each row attending through its own policy.
3. ``generate``'s loop steps the engine, streams each row's text, asks ``cancelled`` about the rows
   still running and stops when every row is done.
4. Each finished sequence is a :class:`RequestResult` with its text, token ids and statistics.

A row's tokens depend only on its own prompt and settings: batched or alone, with or without a cached
prefix, they are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from typing import Any

import torch
from tqdm import tqdm

from .engine import Engine, EngineConfig
from .engine.requests import GenerationConfig, Prompt, RequestResult, check_text, sample
from .errors import InputError
from .forward import PrefillMemo
from .models import LoadedModel
from .policies import PolicyConfig, make_config

__all__ = ["GenerationConfig", "Generator", "Prompt", "RequestResult", "check_text", "sample"]


class Generator:
    """Runs a loaded model with its KV cache owned by an infinikv policy.

    ``engine``: the engine to run on, shared with other generators (one engine serves any mix of policies;
    give it ``EngineConfig(prefix_cache=True)`` and several questions about one document prefill it once),
    by one caller at a time. None: an engine of this generator's own, without a prefix cache, whose prompt
    chunks are each call's ``GenerationConfig.prefill_chunk``. ``memo``: prefills shared with the drivers
    given the same memo (teacher-forced scoring, ``lm_eval.loglik``; ``forward.PrefillMemo``).
    ``compile``: an own engine's decode steps run compiled (``EngineConfig.compile``); with a shared
    ``engine``, it must be that engine's setting.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        policy: PolicyConfig | str = "dense",
        memo: PrefillMemo | None = None,
        engine: Engine | None = None,
        compile: bool = False,
        **knobs: Any,
    ):
        if not isinstance(loaded, LoadedModel):
            raise InputError(f"loaded must be a model from infinikv.models.load, got {type(loaded).__name__}")
        if not isinstance(compile, bool):
            raise InputError(f"compile must be True or False, got {compile!r}")
        if engine is not None and compile != engine.config.compile:
            raise InputError(
                f"compile={compile} with a shared engine of EngineConfig.compile={engine.config.compile}: "
                "a shared engine's own config says whether its decode steps are compiled"
            )
        self.loaded = loaded
        self.compile = compile
        self.memo = memo
        self.policy_config = make_config(policy, **knobs) if isinstance(policy, str) else policy
        self._shared = engine
        self.engine = engine or self._own_engine(self._chunk(GenerationConfig().prefill_chunk))
        self.engine.prepare(self.policy_config)  # e.g. InfiniGen calibrates once per model

    def _chunk(self, prefill_chunk: int) -> int:
        """The prefill chunk, at most the model's context (no prompt is longer)."""
        return min(prefill_chunk, self.loaded.max_context)

    def _own_engine(self, chunk: int) -> Engine:
        return batch_engine(self.loaded, chunk, self.compile)

    @torch.inference_mode()
    def generate(
        self,
        prompts: str | Sequence[Prompt],
        config: GenerationConfig = GenerationConfig(),
        on_text: Callable[[int, str], None] | None = None,
        progress: bool = False,
        cancelled: Callable[[int], bool] | None = None,
        row_max_new_tokens: Sequence[int] | None = None,
    ) -> list[RequestResult]:
        """Generate for each prompt (text, or token ids as the tokenizer makes them, so a caller that has
        tokenised a prompt need not have it tokenised again); ``on_text(row, piece)`` receives text as it is
        produced.
        ``cancelled(row)`` is asked each step for each unfinished row; True ends that row there.
        ``row_max_new_tokens``: each row's own limit (at most ``config.max_new_tokens``); a row that reaches
        it finishes with "length". A seeded row draws from its own generator, seeded with ``config.seed``.
        ``progress``: a progress bar of the prompt tokens read."""
        if not isinstance(config, GenerationConfig):
            raise InputError(f"config must be a GenerationConfig, got {type(config).__name__}")
        for name, hook in (("on_text", on_text), ("cancelled", cancelled)):
            if hook is not None and not callable(hook):
                raise InputError(f"{name} must be callable, got {type(hook).__name__}")
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, Iterable):
            prompts = list(prompts)
        else:
            kind = type(prompts).__name__
            raise InputError(f"prompts must be a string or an iterable of prompts, got {kind}")
        if row_max_new_tokens is None:
            limits = [config.max_new_tokens] * len(prompts)
        else:
            limits = list(row_max_new_tokens)
        if len(limits) != len(prompts) or not all(1 <= n <= config.max_new_tokens for n in limits):
            raise InputError(
                f"row_max_new_tokens needs one limit per prompt, each in 1..{config.max_new_tokens}"
            )
        ids = self._tokenize(prompts, limits)
        chunk = self._chunk(config.prefill_chunk)
        if self._shared is None and self.engine.config.chunk_tokens != chunk:
            self.engine = self._own_engine(chunk)
            self.engine.prepare(self.policy_config)
        engine = self.engine
        for row_ids, limit in zip(ids, limits, strict=True):
            engine.check(row_ids, dataclasses.replace(config, max_new_tokens=limit))
        bar = tqdm(total=sum(map(len, ids)), desc="prefill", unit="tok", leave=False, disable=not progress)
        rows: dict[int, int] = {}  # engine sequence id -> row
        results: list[RequestResult | None] = [None] * len(prompts)
        try:
            for row, (row_ids, limit) in enumerate(zip(ids, limits, strict=True)):
                sampling = dataclasses.replace(config, max_new_tokens=limit)
                rows[engine.add(row_ids, self.policy_config, sampling)] = row
            while rows:
                if cancelled is not None:
                    for seq, row in list(rows.items()):
                        if cancelled(row):
                            results[row] = engine.abort(seq)
                            del rows[seq]
                outputs = engine.step()
                bar.update(sum(engine.prompt_tokens_read(seq) for seq in rows) - bar.n)
                for out in outputs:
                    row = rows.get(out.seq)
                    if row is None:  # another caller's request on a shared engine
                        continue
                    if out.text and on_text is not None:
                        on_text(row, out.text)
                    if out.result is not None:
                        results[row] = out.result
                        del rows[out.seq]
        finally:
            bar.close()
            for seq in rows:  # an exception (or an interrupt) leaves nothing running
                engine.abort(seq)
        for row, result in enumerate(results):
            result.prompt = prompts[row]
        return results

    def _token_ids(self, i: int, prompt: Prompt) -> list[int]:
        """Prompt ``i`` given as token ids: whole numbers, each a token of the model's vocabulary."""
        if not isinstance(prompt, (list, tuple)):  # bytes, a tensor, a bare number: not what it looks like
            kind = type(prompt).__name__
            raise InputError(f"prompt {i + 1} must be a string or a list of token ids, got a {kind}")
        if not prompt:
            raise InputError(f"prompt {i + 1} is empty")
        vocab = self.loaded.model.get_input_embeddings().num_embeddings
        if not all(isinstance(t, Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise InputError(f"prompt {i + 1}: token ids must be whole numbers in [0, {vocab})")
        return [int(t) for t in prompt]

    def _tokenize(self, prompts: list[Prompt], limits: list[int]) -> list[list[int]]:
        """Each prompt's token ids; none at all, an empty prompt, or one that with its ``limits`` new tokens
        exceeds the model's context is an InputError (every prompt is checked before any runs)."""
        if not prompts:
            raise InputError("no prompts given")
        ids = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise InputError(f"prompt {i + 1} is empty")
                check_text(f"prompt {i + 1}", prompt)
                ids.append(self.loaded.tokenizer(prompt)["input_ids"])
            else:
                ids.append(self._token_ids(i, prompt))
        limit = self.loaded.max_context
        for i, (row_ids, new) in enumerate(zip(ids, limits, strict=True)):
            if len(row_ids) + new > limit:
                raise InputError(
                    f"prompt {i + 1} has {len(row_ids)} tokens; with {new} new tokens it exceeds "
                    f"the model's context of {limit} tokens"
                )
        return ids


def batch_engine(
    loaded: LoadedModel, chunk: int, compile: bool = False, kv_memory: int | None = None
) -> Engine:
    """The engine a :class:`Generator` makes for itself: a call's prompts all arrive at once, so it reads
    them in ``chunk``-token chunks before decoding (no stream to keep going meanwhile), in blocks of a chunk,
    with no prefix cache. ``chunk``: the prefill chunk, at most the model's context; ``kv_memory``: the
    pool's bytes (None: the engine's default, half the memory free)."""
    config = EngineConfig(
        block_tokens=chunk,
        chunk_tokens=chunk,
        step_tokens=64 * chunk,
        kv_memory=kv_memory,
        prefix_cache=False,
        compile=compile,
    )
    return Engine(loaded, config)
