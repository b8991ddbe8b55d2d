"""The engine that serves many requests at once: continuous batching over per-sequence caches, chunked
prefill under a per-step token budget, a block-counted pool with preemption, and a prefix cache."""

from .engine import Engine, EngineConfig, StepOutput
from .requests import GenerationConfig, Prompt, RequestResult, check_text, sample

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationConfig",
    "Prompt",
    "RequestResult",
    "StepOutput",
    "check_text",
    "sample",
]
