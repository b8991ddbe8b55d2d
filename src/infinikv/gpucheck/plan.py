"""What a check runs: the :class:`Plan`, its full and tiny sizes, what is wrong with one, and the constants
and the log line every step shares."""

from __future__ import annotations

import dataclasses
import sys
import time

LABEL = "dummy weights"
GIB = 1024**3
# Pinned bytes per byte of pool K/V until a run measures it: 2^k blocks, a growth while the old block is
# cached (none expected: the prompt leaves room for the decode steps), transient staging buffers.
HOST_RATIO_PRIOR = 1.5


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    budget: float
    steps: int
    prefill_chunk: int
    calibration_tokens: int
    cell_timeout: float
    deadline: float  # seconds for the whole check
    tests_timeout: float


FULL = Plan(
    model="dummy:llama-3-8b",
    batches=(8, 16),
    contexts=(16384, 32768),
    policies=("dense", "infinigen", "offload", "quest", "h2o"),
    budget=0.1,
    steps=8,
    prefill_chunk=8192,
    calibration_tokens=1024,
    cell_timeout=100.0,
    deadline=470.0,
    tests_timeout=120.0,
)
TINY = dataclasses.replace(
    FULL,
    model="dummy:tiny",
    batches=(1, 2),
    contexts=(96,),
    steps=4,
    prefill_chunk=64,
    calibration_tokens=64,
    cell_timeout=60.0,
    deadline=120.0,
    tests_timeout=60.0,
)


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plan_problem(plan: Plan) -> str | None:
    """What is wrong with ``plan``, in one line, or None."""
    from ..dummy import DUMMIES, PREFIX
    from ..errors import InfinikvError
    from ..policies import make_config

    shape = DUMMIES.get(plan.model.removeprefix(PREFIX)) if plan.model.startswith(PREFIX) else None
    if shape is None:
        return f"--model must be a dummy:<shape> model ({', '.join(PREFIX + k for k in DUMMIES)})"
    if plan.steps < 1:
        return f"--steps must be at least 1, got {plan.steps}"
    limit = shape.config["max_position_embeddings"]
    for context in plan.contexts:
        if not plan.steps + 2 <= context <= limit:
            return f"context {context} must leave room for {plan.steps} steps and fit {plan.model} ({limit})"
    for name in plan.policies:
        try:
            make_config(name)
        except InfinikvError as exc:
            return str(exc)
    return None
