"""``streaming``: StreamingLLM (Xiao et al., 2023, https://arxiv.org/abs/2309.17453).

Each decode step a layer attends to ``n_sink`` attention sinks (the first real tokens of the sequence) and
a recent ``window`` of tokens that ends with the new token; everything in between is skipped. The K/V stay
in the host pool and only the sinks and the window are copied to the compute device, so the selection for
layer i+1 is prefetched while layer i runs.

Positions, as the paper does for RoPE models: tokens take their place in the cache as position, so the
sinks sit right before the window instead of far back at their original positions. RoPE scores depend only
on the query-key offset, and the window is contiguous with the query, so this is exactly achieved by
re-rotating the sink keys (stored post-RoPE) by R(delta), delta = number of skipped tokens, while the window
and the query keep their own positions. The mask still uses original positions, so left padding and
sliding windows stay correct.

Prefill is dense over the whole prompt (the shared seam); the window applies from the first decode step on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import ModelSpec, rotate_half
from .base import ScoredPolicy
from .config import PolicyConfig, knob
from .registry import register

Tensor = torch.Tensor


@dataclass(frozen=True)
class StreamingConfig(PolicyConfig):
    n_sink: int = knob(4, "initial tokens always kept (the paper uses 4; more than the context: all)", low=0)
    window: int = knob(
        1020,
        "recent tokens kept, the new token included (the paper's 1,024-token cache = 4 sinks + 1,020 recent; "
        "longer than the context: everything is kept)",
        low=1,
    )


@register("streaming")
class StreamingPolicy(ScoredPolicy):
    """Everything it reads is reserved (the sinks and the window); nothing else is scored."""

    config_class = StreamingConfig
    prefetches = True

    def __init__(self, config: StreamingConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self._skipped: dict[int, list[int]] = {}  # per layer and row: tokens skipped between sinks and window
        # the skipped counts as positions [rows, 1] (one tensor object while the counts stay: a step's layers
        # share it) and zeros as wide (while the rows stay), so the model's rotary memo computes R(delta) and
        # R(0) once, not per layer
        self._delta: tuple[list[int], Tensor] | None = None
        self._zero: Tensor | None = None
        # per rotary kind (keyed by the model's R(delta) cos, kept with it): R(delta) as the keys take it
        self._rotations: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def scored(self, layer: int) -> bool:
        return not self.spec.is_sliding(layer)

    def takes(self, layer: int, real: list[int]) -> list[int]:
        # past tokens; the new token completes the window
        return [min(n, self.config.n_sink + self.config.window - 1) for n in real]

    def reserved(self, layer: int, n_past: int, batch: int) -> Tensor:
        """The first ``n_sink`` real tokens and the last ``window`` - 1 past slots."""
        kept = self.config.n_sink + self.config.window - 1
        self._skipped[layer] = [max(real - kept, 0) for real in self.real_tokens(n_past, batch)]
        past = self.past_positions(n_past, batch)
        return self.sinks_and_recent(past, n_past, self.config.n_sink, self.config.window - 1)

    def score(self, layer: int, n_past: int, batch: int) -> None:
        return None  # the sinks and the window are the whole pick

    def adjust_keys(self, layer: int, index: Tensor, keys: Tensor) -> None:
        skipped = self._skipped.pop(layer, None)
        sinks = min(self.config.n_sink, keys.shape[2])
        if skipped is None or sinks == 0 or not any(skipped):
            return
        if self._delta is None or self._delta[0] != skipped or self._delta[1].device != keys.device:
            self._delta = (skipped, torch.tensor(skipped, device=keys.device)[:, None])
            self._rotations.clear()
        delta = self._delta[1]
        # R(delta) on post-RoPE keys: the same rotation RoPE applies at position delta (scaling divided out),
        # made once per rotary kind while the counts stay
        rope = self.spec.rope
        cos, sin = rope(layer, keys, delta)
        held = self._rotations.get(id(cos))
        if held is None or held[0] is not cos:
            if self._zero is None or self._zero.shape != delta.shape or self._zero.device != delta.device:
                self._zero = torch.zeros_like(delta)
            scale, _ = rope(layer, keys, self._zero)
            held = (cos, (cos / scale[..., :1]).unsqueeze(1), (sin / scale[..., :1]).unsqueeze(1))
            self._rotations[id(cos)] = held
        _, cos, sin = held
        head = keys[:, :, :sinks]
        keys[:, :, :sinks] = head * cos + rotate_half(head) * sin
