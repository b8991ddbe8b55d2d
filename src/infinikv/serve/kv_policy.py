"""The per-request KV policy: the config a request's ``kv_policy`` and ``kv_<knob>`` fields ask for, and the
``kv`` field of every answer.

The policy registry (``make_config``, and each config's own checks) is the one judge of a policy name, its
knob names and their values, and a config's ``check_spec`` of the values that depend on the
model; its refusal becomes a 400 naming the request field it is about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import PolicyError
from ..generate import RequestResult
from ..policies import ModelSpec, PolicyConfig, make_config
from .openai_shapes import ApiError


@dataclass(frozen=True)
class PolicyDefaults:
    """The server's policy and the knobs it was started with (they apply when a request names no policy,
    or names the same one)."""

    name: str = "dense"
    knobs: tuple[tuple[str, Any], ...] = ()


def requested_config(
    requested: str | None, extra: dict[str, Any], defaults: PolicyDefaults
) -> tuple[str, PolicyConfig]:
    """The policy name and config that a request with ``kv_policy`` = ``requested`` and the extra fields
    ``extra`` (its ``kv_<knob>`` fields are the knobs) asks for, whatever the model; PolicyError on a
    mistake."""
    name = defaults.name if requested is None else requested
    knobs = {key.removeprefix("kv_"): value for key, value in extra.items() if key.startswith("kv_")}
    return name, make_config(name, **(dict(defaults.knobs) | knobs if name == defaults.name else knobs))


def resolve_policy(
    requested: str | None, extra: dict[str, Any], defaults: PolicyDefaults, spec: ModelSpec
) -> tuple[str, PolicyConfig]:
    """:func:`requested_config`, checked against the model of ``spec``; 400 on any mistake, so that none
    reaches the worker, where it would fail the whole batch."""
    try:
        name, config = requested_config(requested, extra, defaults)
        config.check_spec(spec)  # knobs the served model cannot take: refused on arrival
        return name, config
    except PolicyError as exc:
        param = "kv_policy" if exc.knob is None else f"kv_{exc.knob}"
        raise ApiError(
            str(exc), param=param, code="kv_policy" if param == "kv_policy" else "kv_knob"
        ) from None


def _is_figure(value: Any) -> bool:
    """A number, or a per-layer list of numbers (None for layers it does not apply to)."""
    if isinstance(value, list):
        return any(v is not None for v in value) and all(v is None or _is_figure(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_safe(value: Any) -> Any:
    """``value`` with each infinite or NaN float as the string ``"inf"``, ``"-inf"`` or ``"nan"``: JSON has
    no such numbers (``kv_alpha: Infinity`` is a knob value the policy takes), and ``null`` already means
    "not this layer" in the per-layer lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def kv_report(result: RequestResult) -> dict[str, Any]:
    """The ``kv`` field: policy, knobs, and the numeric statistics of the batch the request ran in (numbers
    and per-layer lists of numbers, such as InfiniGen's ``alpha_used``), valid JSON (:func:`_json_safe`)."""
    stats = dict(result.stats)
    name = stats.pop("policy")
    knobs = stats.pop("knobs")
    figures = {k: v for k, v in stats.items() if _is_figure(v)}
    figures.pop("prompt_tokens", None)
    figures.pop("new_tokens", None)
    return {"policy": name, "knobs": _json_safe(knobs), "stats": _json_safe(figures)}
