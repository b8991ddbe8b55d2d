"""Generation: batching with left padding, chunked prefill, sampling, stopping, streaming, statistics.

Read top to bottom, one request batch goes like this:

1. ``_encode`` tokenises the prompts (a prompt may come as token ids already), left-pads them, and checks
   they fit the model's context.
2. A :class:`~infinikv.forward.Driver` prefills the prompts in chunks; the ``InfinikvCache`` hands each
   layer's K/V to the policy, which stores it (host pool, device, side structures).
3. ``generate``'s loop samples a token per sequence, streams its text, and feeds it back through
   ``Driver.step``; in each step every layer asks the policy which K/V to attend to.
4. Each finished sequence becomes a :class:`RequestResult` with its text, token ids and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import InfinikvCache
from .clock import now
from .errors import InputError
from .forward import Driver, PrefillMemo
from .models import LoadedModel
from .policies import PolicyConfig, make_config, prepare

Tensor = torch.Tensor
Prompt = str | Sequence[int]  # text, or token ids as the model's tokenizer makes them


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    prefill_chunk: int = 2048  # prompt tokens per prefill forward pass

    def __post_init__(self):
        # Every sampling parameter is checked here, once, before any model work: a NaN or an infinity
        # would otherwise surface mid-generation (NaN) or silently sample uniformly (inf).
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("prefill_chunk", self.prefill_chunk, low=2)
        if self.seed is not None:
            # torch's generator takes 64 unsigned bits, the OpenAI API's seed a signed 64-bit integer
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        temperature = _check_finite("temperature", self.temperature)
        if temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        top_p = _check_finite("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise InputError(f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise InputError("stop strings must not be empty (an empty string would stop before any text)")
        for stop in self.stop:
            check_text("a stop string", stop)


def check_text(what: str, text: str) -> None:
    """An InputError naming ``what`` when ``text`` cannot be encoded as UTF-8: it holds lone surrogates, which
    is what undecodable bytes of a command-line argument become (and what a JSON escape such as ``\\udcff``
    gives). The tokenizer would fail on them with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"{what} is not valid UTF-8: undecodable byte or lone surrogate at character {exc.start + 1}"
        ) from None


def _check_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InputError(f"{name} must be a finite number, got {value}")
    return float(value)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, got {value!r}")
    if value < low:
        raise InputError(f"{name} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise InputError(f"{name} must be at most {high}, got {value}")


def sample(logits: Tensor, config: GenerationConfig, generator: torch.Generator) -> Tensor:
    """One token per row of ``logits`` [batch, vocab]: the argmax at temperature 0, else drawn from the
    softmax at ``config.temperature``, cut to the top-p nucleus, with ``generator``."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # Shifted so the best logit is 0: the scaled logits are never above 0, so a tiny temperature
    # cannot overflow them to inf (the best token then gets all the mass). A temperature below float32's
    # smallest normal number is taken as that number: a smaller one rounds (or flushes) to 0 in float32,
    # and 0 / 0 is nan.
    temperature = max(config.temperature, torch.finfo(torch.float32).tiny)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1).cpu()
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, always the top token (a top_p that rounds
        # to 0 in float32 would drop every token).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p
        outside[..., 0] = False
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


@dataclass
class RequestResult:
    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop", "length" or "cancelled"
    stats: dict[str, Any] = field(default_factory=dict)


class Generator:
    """Runs a loaded model with its KV cache owned by an infinikv policy.

    ``memo``: prefills shared with the other generators (and drivers) given the same memo, replayed where a
    batch of prompts was already prefilled in this policy's prefill family (``forward.PrefillMemo``).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        policy: PolicyConfig | str = "dense",
        memo: PrefillMemo | None = None,
        **knobs: Any,
    ):
        self.loaded = loaded
        self.memo = memo
        self.policy_config = make_config(policy, **knobs) if isinstance(policy, str) else policy
        prepare(self.policy_config, loaded)  # e.g. InfiniGen calibrates once per model
        eos = loaded.model.generation_config.eos_token_id
        if eos is None:
            eos = loaded.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

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
        ``cancelled(row)`` is asked each decode step for each running row; True ends that row there.
        ``row_max_new_tokens``: each row's own limit (at most ``config.max_new_tokens``), so requests that
        differ only in their limit can share a batch; a row that reaches it finishes with "length"."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        limits = list(row_max_new_tokens or [config.max_new_tokens] * len(prompts))
        if len(limits) != len(prompts) or not all(1 <= n <= config.max_new_tokens for n in limits):
            raise InputError(
                f"row_max_new_tokens needs one limit per prompt, each in 1..{config.max_new_tokens}"
            )
        generator = torch.Generator(device="cpu")
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()  # unseeded sampling differs from call to call
        groups = self._padding_groups(prompts, limits)
        if len(groups) == 1:
            return self._generate_batch(prompts, config, on_text, progress, cancelled, limits, generator)
        # one batch per group in turn, rows numbered as in the whole call, one random stream for all
        results: list[RequestResult | None] = [None] * len(prompts)
        for rows in groups:
            if cancelled is not None and all(cancelled(row) for row in rows):
                part = [RequestResult(prompts[row], "", [], "cancelled") for row in rows]
            else:
                part = self._generate_batch(
                    [prompts[row] for row in rows],
                    config,
                    None if on_text is None else lambda i, piece, rows=rows: on_text(rows[i], piece),
                    progress,
                    None if cancelled is None else lambda i, rows=rows: cancelled(rows[i]),
                    [limits[row] for row in rows],
                    generator,
                )
            for row, result in zip(rows, part, strict=True):
                results[row] = result
        return [result for result in results if result is not None]

    def _generate_batch(
        self,
        prompts: list[Prompt],
        config: GenerationConfig,
        on_text: Callable[[int, str], None] | None,
        progress: bool,
        cancelled: Callable[[int], bool] | None,
        limits: list[int],
        generator: torch.Generator,
    ) -> list[RequestResult]:
        """:meth:`generate` for prompts that share one left-padded batch."""
        model = self.loaded.model
        input_ids, attention_mask, prompt_lengths = self._encode(prompts, limits)
        batch = input_ids.shape[0]
        driver = Driver(self.loaded, InfinikvCache(model, self.policy_config, device=self.loaded.device))

        try:
            start = now(self.loaded.device)
            logits = driver.prefill(
                input_ids, attention_mask, config.prefill_chunk, memo=self.memo, progress=progress
            )
            prefill_s = now(self.loaded.device) - start

            generated: list[list[int]] = [[] for _ in range(batch)]
            texts = [""] * batch
            emitted = [0] * batch  # characters of each text already streamed
            finish: list[str | None] = [None] * batch
            decode_forwards = 0
            start = now(self.loaded.device)
            for step in range(config.max_new_tokens):
                next_tokens = sample(logits, config, generator)
                last_step = step == config.max_new_tokens - 1
                for row, token in enumerate(next_tokens.tolist()):
                    if finish[row] is not None:
                        continue
                    if cancelled is not None and cancelled(row):
                        finish[row] = "cancelled"
                        continue
                    finish[row] = self._advance(row, token, generated, texts, config)
                    if finish[row] is None and len(generated[row]) >= limits[row]:
                        finish[row] = "length"
                    if on_text is not None:
                        end = self._stream(
                            texts[row], emitted[row], finish[row] is not None or last_step, config
                        )
                        if end > emitted[row]:
                            on_text(row, texts[row][emitted[row] : end])
                            emitted[row] = end
                if all(reason is not None for reason in finish) or last_step:
                    break
                logits = driver.step(next_tokens)
                decode_forwards += 1
            decode_s = now(self.loaded.device) - start
            policy_stats = driver.stats()
        finally:
            driver.close()

        results = []
        per_s = decode_forwards / decode_s if decode_s > 0 else 0.0
        for row, prompt in enumerate(prompts):
            stats = {
                "prompt_tokens": prompt_lengths[row],
                "new_tokens": len(generated[row]),
                "batch_size": batch,
                "prefill_s": round(prefill_s, 4),
                "decode_s": round(decode_s, 4),
                "decode_steps": decode_forwards,
                "decode_tokens_per_s": round(per_s, 3),
                "batch_decode_tokens_per_s": round(batch * per_s, 3),
                **policy_stats,
            }
            results.append(RequestResult(prompt, texts[row], generated[row], finish[row] or "length", stats))
        return results

    # -- batches the policy cannot share -------------------------------------------------------------------
    def _padding_groups(self, prompts: list[Prompt], limits: list[int]) -> list[list[int]]:
        """The rows that can share a batch, in order: all of them, unless the policy's ``padding_grid``
        needs equal lengths modulo it (then one batch per residue; every prompt checked first, so a bad one
        fails before any batch runs)."""
        grid = self.policy_config.padding_grid()
        if grid == 1 or len(prompts) < 2:
            return [list(range(len(prompts)))]
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(self._lengths(prompts, limits)):
            groups.setdefault(length % grid, []).append(row)
        return list(groups.values())

    # -- the steps ------------------------------------------------------------------------------------------
    def _lengths(self, prompts: list[Prompt], limits: list[int]) -> list[int]:
        """Tokens per prompt; none at all, an empty prompt, or one that with its ``limits`` new tokens
        exceeds the model's context is an InputError."""
        if not prompts:
            raise InputError("no prompts given")
        lengths = []
        for i, prompt in enumerate(prompts):
            if not prompt or (isinstance(prompt, str) and not prompt.strip()):
                raise InputError(f"prompt {i + 1} is empty")
            if isinstance(prompt, str):
                check_text(f"prompt {i + 1}", prompt)
            ids = self.loaded.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
            lengths.append(len(ids))
        limit = self.loaded.max_context
        for i, (n, new) in enumerate(zip(lengths, limits, strict=True)):
            if n + new > limit:
                raise InputError(
                    f"prompt {i + 1} has {n} tokens; with {new} new tokens it exceeds "
                    f"the model's context of {limit} tokens"
                )
        return lengths

    def _encode(self, prompts: list[Prompt], limits: list[int]) -> tuple[Tensor, Tensor, list[int]]:
        lengths = self._lengths(prompts, limits)
        tokenizer = self.loaded.tokenizer
        if all(isinstance(prompt, str) for prompt in prompts):
            encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        else:
            ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
            encoded = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        device = self.loaded.device
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device), lengths

    def _advance(
        self,
        row: int,
        token: int,
        generated: list[list[int]],
        texts: list[str],
        config: GenerationConfig,
    ) -> str | None:
        """Record one token for ``row`` and its text so far; return a finish reason or None."""
        if token in self.eos_ids:
            return "eos"
        generated[row].append(token)
        text = self.loaded.tokenizer.decode(generated[row], skip_special_tokens=True)
        for stop in config.stop:
            cut = text.find(stop)
            if cut != -1:
                texts[row] = text[:cut]
                return "stop"
        texts[row] = text
        return None

    @staticmethod
    def _stream(text: str, emitted: int, finished: bool, config: GenerationConfig) -> int:
        """How far ``text`` can be shown: hold back an incomplete character, and while running, any tail
        that could still become a stop string."""
        if finished:
            return len(text)
        end = len(text) - (max(map(len, config.stop)) - 1 if config.stop else 0)
        while end > emitted and text[end - 1] == "\ufffd":
            end -= 1
        return max(end, emitted)
