"""Values of command-line options shared by infinikv's commands, checked where they are parsed."""

from __future__ import annotations

import argparse


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (``"8,16"``; blanks around the commas and empty items are ignored),
    usable as an argparse ``type``; anything else raises ``argparse.ArgumentTypeError`` in one line."""
    try:
        values = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values
