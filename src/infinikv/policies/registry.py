"""Name -> policy class: ``@register("name")`` on the class, and the ``infinikv.policies`` entry-point group.

A policy in this package registers itself when its module is imported (``policies/__init__.py`` imports
them all). A policy in another distribution is found through the entry-point group ``infinikv.policies``
(``[project.entry-points."infinikv.policies"] mine = "my_package.my_policy:MyPolicy"``): each entry is
loaded when ``infinikv.policies`` is imported and registered under its entry-point name, so it appears in
``infinikv policies``, every command's ``--policy``, the server's ``kv_policy`` and the eval.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import fields
from importlib.metadata import entry_points
from typing import Any

import torch

from ..errors import PolicyError
from ..spec import ModelSpec
from .base import Policy
from .config import PolicyConfig

ENTRY_POINT_GROUP = "infinikv.policies"
POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make the policy ``name`` (its ``config_class`` holds its knobs)."""

    def add(cls: type[Policy]) -> type[Policy]:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise PolicyError(f"policy '{name}': {cls!r} is not a Policy subclass")
        if not (
            isinstance(getattr(cls, "config_class", None), type)
            and issubclass(cls.config_class, PolicyConfig)
        ):
            raise PolicyError(f"policy '{name}': {cls.__name__}.config_class must be a PolicyConfig subclass")
        known = POLICIES.get(name)
        if known is not None and known is not cls:
            raise PolicyError(f"policy '{name}' is already registered ({known.__module__}.{known.__name__})")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


def load_entry_points() -> None:
    """Register the policies other distributions declare; one that fails to load is reported in one line
    and skipped, so a broken plug-in never stops the built-in policies."""
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            if entry.name not in POLICIES or POLICIES[entry.name] is not loaded:
                register(entry.name)(loaded)
        except Exception as exc:  # a third party's import can fail in any way
            print(
                f"infinikv: policy plug-in '{entry.name}' ({entry.value}) not loaded: {exc}", file=sys.stderr
            )


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
            f"its knobs: {', '.join(sorted(allowed)) or 'none'}",
            knob=unknown[0],
        )
    try:
        return config_class(**given)
    except (TypeError, ValueError, PolicyError) as exc:
        raise PolicyError(f"policy '{name}': {exc}", knob=getattr(exc, "knob", None)) from None


def policy_of(config: PolicyConfig) -> type[Policy]:
    """The registered policy whose config class ``config`` is."""
    for cls in POLICIES.values():
        if type(config) is cls.config_class:
            return cls
    raise PolicyError(f"no policy takes a {type(config).__name__}")


def prepare(config: PolicyConfig, loaded: Any) -> None:
    """The policy's model-level work on ``loaded`` (a LoadedModel) before it first runs there
    (:meth:`Policy.prepare`; InfiniGen calibrates once per model)."""
    policy_of(config).prepare(config, loaded)


def make_policy(policy: PolicyConfig | str, spec: ModelSpec, device: torch.device, **knobs: Any) -> Policy:
    if isinstance(policy, str):
        policy = make_config(policy, **knobs)
    return policy_of(policy)(policy, spec, device)
