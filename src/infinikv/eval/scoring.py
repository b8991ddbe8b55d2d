"""Scoring as RULER defines it (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654), plus passkey.

* ``string_match_all``: per sample, the fraction of reference strings found (case-insensitive substring) in
  the prediction; averaged over samples, times 100.
* ``string_match_part``: per sample, 1 if any reference string is found, else 0; averaged, times 100.
* ``passkey_exact``: per sample, 1 if the first number in the prediction equals the passkey; averaged, x100.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    scores = [
        sum(ref.lower() in pred.lower() for ref in refs) / len(refs)
        for pred, refs in zip(predictions, references, strict=True)
    ]
    return 100 * sum(scores) / len(scores)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    scores = [
        max(float(ref.lower() in pred.lower()) for ref in refs)
        for pred, refs in zip(predictions, references, strict=True)
    ]
    return 100 * sum(scores) / len(scores)


def passkey_exact(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    scores = []
    for pred, refs in zip(predictions, references, strict=True):
        number = re.search(r"\d+", pred)
        scores.append(float(number is not None and number.group() == refs[0]))
    return 100 * sum(scores) / len(scores)


METRICS = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "passkey_exact": passkey_exact,
}


def score(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Score ``predictions`` against ``references`` (one tuple of strings per sample) with ``metric``."""
    if not predictions:
        raise ValueError("no predictions to score")
    return METRICS[metric](predictions, references)
