"""Policy configs: a frozen dataclass per policy whose fields are its knobs, each declared with :func:`knob`.

A knob carries its default, the text ``infinikv policies`` prints and its valid range; :class:`PolicyConfig`
checks every knob against its declaration once, before any model work, for the command line, the Python
API and the server alike.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..errors import PolicyError

# The largest value of a number knob that declares no ``high`` and cannot be infinite (every integer knob,
# every token-count budget): beyond any model's context, where a count means all of it, and far below where
# arithmetic on it in int64 tensors would overflow.
MAX_COUNT = 10**9
# The default floor under a selective policy's budget (``min_tokens``): docs/reliability.md has the curve it
# was chosen from (greedy answers to short prompts that equal dense's, per floor).
MIN_TOKENS = 64


def knob(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    allow_inf: bool = False,
    choices: tuple[str, ...] | None = None,
    neutral: bool = False,
    examples: tuple[Any, ...] | None = None,
) -> Any:
    """A policy knob: its default, what it means (shown by ``infinikv policies``) and its valid values.

    ``low``/``high`` bound numbers (``open_low``: strictly above ``low``; no ``high``: :data:`MAX_COUNT`,
    unless ``allow_inf``); numbers must be finite unless ``allow_inf``; an ``int`` knob takes only ints;
    ``choices`` lists a string knob's values. ``neutral``: a knob added later whose default is the policy as
    it ran before the knob existed, so a measurement's identity leaves it out at its default
    (:meth:`PolicyConfig.identity_knobs`) and measurements from before still stand. ``examples``: values
    other than the default, for a knob whose valid values its type and range do not say (a free-form
    string, numbers of which only some are valid); the knob-combination tests try them."""
    meta = {"doc": doc, "low": low, "high": high, "open_low": open_low, "allow_inf": allow_inf}
    return field(
        default=default, metadata={**meta, "choices": choices, "neutral": neutral, "examples": examples}
    )


def min_tokens_knob() -> Any:
    """The ``min_tokens`` knob of every policy whose budget is a fraction of the context."""
    return knob(
        MIN_TOKENS,
        "floor under the budget, in tokens: a row attends at least this many past tokens, and all of them "
        "while its context is within the floor (a short prompt keeps dense's answer); 0 = no floor",
        low=0,
    )


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every policy's config. Knobs share names across policies (budget, alpha, partial_ratio,
    capacity, eviction, bits, group_size, n_sink, window, page_size, dense_layers, …) and are checked here,
    from their :func:`knob` declarations, before any model work."""

    def __post_init__(self):
        for f in fields(self):
            try:
                _check_knob(f.name, f.type, getattr(self, f.name), f.metadata)
            except PolicyError as exc:
                exc.knob = f.name
                raise

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def identity_knobs(cls, knobs: dict[str, Any]) -> dict[str, Any]:
        """``knobs`` (as :meth:`knobs` gives them, now or when a measurement was made) without the
        ``neutral`` ones at their default: what tells measurements of this policy apart."""
        neutral = {f.name: f.default for f in fields(cls) if f.metadata.get("neutral")}
        return {name: value for name, value in knobs.items() if neutral.get(name, MISSING) != value}

    @classmethod
    def knob_docs(cls) -> dict[str, str]:
        """Each knob's meaning, as declared."""
        return {f.name: f.metadata.get("doc", "") for f in fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: None if f.default is MISSING else f.default for f in fields(cls)}

    def check_spec(self, spec: Any) -> None:
        """``PolicyError`` for a knob value the model of ``spec`` (a ModelSpec) cannot take, checked before
        the policy is built (the server checks each request with it on arrival); most knobs fit every
        model."""


def _check_knob(name: str, kind: Any, value: Any, meta: Any) -> None:
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    if kind == "bool":
        if not isinstance(value, bool):
            raise PolicyError(f"{name} must be true or false, got {value!r}")
        return
    if kind == "str":
        choices = meta.get("choices")
        if not isinstance(value, str) or (choices and value not in choices):
            allowed = f"one of {', '.join(choices)}" if choices else "a string"
            raise PolicyError(f"{name} must be {allowed}, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{name} must be a number, got {value!r}")
    if kind == "int" and not isinstance(value, int):  # a float would reach tensor shapes and indexing
        raise PolicyError(f"{name} must be a whole number, got {value}")
    if math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf")):
        raise PolicyError(f"{name} must be a finite number, got {value}")
    low, high = meta.get("low"), meta.get("high")
    if high is None and not meta.get("allow_inf"):
        high = MAX_COUNT
    if low is not None and (value <= low if meta.get("open_low") else value < low):
        raise PolicyError(f"{name} must be {'>' if meta.get('open_low') else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise PolicyError(f"{name} must be <= {high}, got {value}")
