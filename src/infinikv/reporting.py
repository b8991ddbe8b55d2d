"""Generated documents: the one number format of their tables, and a hand-written tail that survives
regeneration (everything below ``KEEP_MARKER`` in an existing file: analysis, profiling notes).

A table cell with no value shows ``MISSING``, an en dash, in every generated table."""

from __future__ import annotations

from pathlib import Path

KEEP_MARKER = "<!-- notes below this line are kept when the report is regenerated -->"
MISSING = "–"


def fmt(value: float | None, digits: int = 2, *, scale: float = 1.0) -> str:
    """``value`` x ``scale`` with ``digits`` decimals for a table cell, or ``MISSING`` when there is none."""
    return MISSING if value is None else f"{value * scale:.{digits}f}"


def write_keeping_notes(path: Path, generated: str) -> None:
    kept = "\n"
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if KEEP_MARKER in old:
            kept = old.split(KEEP_MARKER, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated.rstrip("\n") + "\n\n" + KEEP_MARKER + kept, encoding="utf-8")
