"""Name -> policy class. A new policy adds one line here."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from ..errors import PolicyError
from ..spec import ModelSpec
from .base import Policy, PolicyConfig
from .dense import DensePolicy
from .h2o import H2OPolicy
from .infinigen import InfiniGenPolicy
from .offload import OffloadPolicy
from .oracle import OraclePolicy
from .quant import QuantPolicy
from .quest import QuestPolicy
from .streaming import StreamingPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        OffloadPolicy,
        StreamingPolicy,
        QuestPolicy,
        H2OPolicy,
        QuantPolicy,
        InfiniGenPolicy,
        OraclePolicy,
    )
}


def policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise PolicyError(f"unknown policy '{name}'; available: {', '.join(POLICIES)}")
    return POLICIES[name]


def make_config(name: str, **knobs: Any) -> PolicyConfig:
    """Build a policy's config from knob values; unknown knobs are an error, None means 'default'."""
    config_class = policy_class(name).config_class
    allowed = {f.name for f in fields(config_class)}
    given = {k: v for k, v in knobs.items() if v is not None}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise PolicyError(
            f"policy '{name}' has no knob {', '.join(unknown)}; "
            f"its knobs: {', '.join(sorted(allowed)) or 'none'}"
        )
    try:
        return config_class(**given)
    except (TypeError, ValueError, PolicyError) as exc:
        raise PolicyError(f"policy '{name}': {exc}", knob=getattr(exc, "knob", None)) from None


def make_policy(policy: PolicyConfig | str, spec: ModelSpec, device: torch.device, **knobs: Any) -> Policy:
    if isinstance(policy, str):
        policy = make_config(policy, **knobs)
    for cls in POLICIES.values():
        if type(policy) is cls.config_class:
            return cls(policy, spec, device)
    raise PolicyError(f"no policy takes a {type(policy).__name__}")
