"""Generated documents with a hand-written tail: everything below ``KEEP_MARKER`` in an existing file
(analysis, profiling notes) survives when the generated part above it is rewritten."""

from __future__ import annotations

from pathlib import Path

KEEP_MARKER = "<!-- notes below this line are kept when the report is regenerated -->"


def write_keeping_notes(path: Path, generated: str) -> None:
    kept = "\n"
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if KEEP_MARKER in old:
            kept = old.split(KEEP_MARKER, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated.rstrip("\n") + "\n\n" + KEEP_MARKER + kept, encoding="utf-8")
