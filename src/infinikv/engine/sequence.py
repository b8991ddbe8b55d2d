"""One request's state inside the engine: its tokens, its cache, its random generator and its text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from ..forward import Driver
from .requests import GenerationConfig

Tensor = torch.Tensor


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted (or preempted): holds no blocks and no cache
    PREFILLING = "prefilling"  # admitted: its prompt goes in chunk by chunk
    DECODING = "decoding"  # has a token to feed at the next decode step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in the engine. ``forced``: tokens it generated before a preemption, fed again (in order,
    through the same decode steps, without sampling) after its prompt is prefilled again, so the state it
    resumes from is the state it had."""

    id: int
    prompt: list[int]
    policy: Any  # PolicyConfig
    sampling: GenerationConfig
    generator: torch.Generator
    family: bytes  # the prefix cache's root for this sequence's prefill family
    digest: bytes = b""  # the name of the last whole prompt block in its cache (the root before any)
    block_calls: list = field(default_factory=list)  # Cache.update calls of the block being read
    phase: Phase = Phase.WAITING
    driver: Driver | None = None
    prefilled: int = 0  # prompt tokens in the cache
    next_input: int | None = None  # the token the next decode step feeds
    generated: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of text already handed out
    finish: str | None = None
    admitted_at: int = 0  # admission order, for choosing whom to preempt
    # what the request's statistics report
    prefix_hit_tokens: int = 0
    prompt_counted: int = 0  # prompt tokens the prefix cache's hit and miss counters have counted
    preemptions: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    rows_in_steps: int = 0  # summed over its decode steps: how many rows each had

    def __post_init__(self):
        self.digest = self.digest or self.family

    @property
    def cached_tokens(self) -> int:
        """Positions in its cache: the prompt so far, plus the tokens fed by decode steps."""
        if self.phase is not Phase.DECODING:
            return self.prefilled
        return len(self.prompt) + len(self.generated) - len(self.forced) - 1

    def advance(self, token: int, eos_ids: set[int], decode) -> None:
        """Take ``token`` as this sequence's next one (``decode``: the tokenizer's decode), or finish."""
        if token in eos_ids:
            self.finish = "eos"
            return
        self.generated.append(token)
        text = decode(self.generated, skip_special_tokens=True)
        cuts = [cut for cut in (text.find(stop) for stop in self.sampling.stop) if cut != -1]
        if cuts:  # the earliest stop string in the text, whichever is listed first
            self.text, self.finish = text[: min(cuts)], "stop"
            return
        self.text = text
        if len(self.generated) >= self.sampling.max_new_tokens:
            self.finish = "length"

    def new_text(self) -> str:
        """Text not yet handed out that can be now: an incomplete character is held back, and while running,
        any tail that could still become a stop string."""
        end = len(self.text)
        if self.finish is None:
            stop = self.sampling.stop
            end -= max(map(len, stop)) - 1 if stop else 0
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.emitted)
        piece, self.emitted = self.text[self.emitted : end], end
        return piece
