"""The user cache folder where fetched models, converted weights, skew files and corpora live.

``INFINIKV_CACHE`` moves it; otherwise it is ``$XDG_CACHE_HOME/infinikv`` (``~/.cache/infinikv``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder, created if missing."""
    root = os.environ.get("INFINIKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "infinikv"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
