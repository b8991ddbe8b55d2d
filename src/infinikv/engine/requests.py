"""What a request is: its sampling settings (:class:`GenerationConfig`, every value checked once, before any
model work), how its next token is drawn (:func:`sample`) and what it gets back (:class:`RequestResult`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError

Tensor = torch.Tensor
Prompt = str | Sequence[int]  # text, or token ids as the model's tokenizer makes them


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    prefill_chunk: int = 2048  # prompt tokens per prefill forward pass (a Generator's own engine, a Driver)

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
            check_text("stop string", stop)  # "stop …": the request field it names


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
    softmax at ``config.temperature``, cut to the top-p nucleus, with ``generator`` (on the logits' device:
    nothing is read back to the host)."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # Shifted so the best logit is 0: the scaled logits are never above 0, so a tiny temperature
    # cannot overflow them to inf (the best token then gets all the mass). A temperature below float32's
    # smallest normal number is taken as that number: a smaller one rounds (or flushes) to 0 in float32,
    # and 0 / 0 is nan.
    temperature = max(config.temperature, torch.finfo(torch.float32).tiny)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, always the top token (a top_p that rounds
        # to 0 in float32 would drop every token).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p
        outside[..., 0] = False
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class RequestResult:
    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop", "length" or "cancelled"
    stats: dict[str, Any] = field(default_factory=dict)
