"""Command-line flags for the policies: ``--policy`` and one flag per knob name across all policies.

Every subcommand that runs a policy (generate, eval, bench, serve) takes its flags from here, so a knob added
to a policy's config is a flag everywhere at once. A knob the chosen policy lacks is rejected by
``policies.make_config``.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from .policies import POLICIES


def knob_table() -> dict[str, tuple[type, list[str]]]:
    """Knob name -> (its type, the policies that have it)."""
    table: dict[str, tuple[type, list[str]]] = {}
    for name, cls in POLICIES.items():
        for f in fields(cls.config_class):
            kind = type(f.default) if f.default is not MISSING else str
            table.setdefault(f.name, (kind, []))[1].append(name)
    return table


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def parse_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None


def add_policy_arguments(parser: argparse.ArgumentParser, multiple: bool = False) -> None:
    """``--policy`` (or ``--policies`` with ``multiple``) plus a flag for every knob of every policy."""
    if multiple:
        parser.add_argument(
            "--policies", default="dense", help=f"comma-separated, from: {', '.join(POLICIES)}"
        )
    else:
        parser.add_argument("--policy", default="dense", help=f"one of: {', '.join(POLICIES)}")
    group = parser.add_argument_group("policy knobs (each applies to the policies named in its help)")
    for knob, (kind, owners) in sorted(knob_table().items()):
        parse = {bool: parse_bool, int: int, float: parse_number}.get(kind, str)
        group.add_argument(f"--{knob.replace('_', '-')}", dest=knob, type=parse, help=", ".join(owners))


def policy_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """Knob values the user set (others stay at each policy's default)."""
    return {k: getattr(args, k) for k in knob_table() if getattr(args, k, None) is not None}
