"""The benchmark's prompts: real token ids cut from a corpus (or from filler text when none is given, or a
registered one cannot be fetched)."""

from __future__ import annotations

import torch

from ..errors import InfinikvError, InputError
from ..models import LoadedModel

Tensor = torch.Tensor


def prompt_ids(loaded: LoadedModel, tokens: int, rows: int, corpus: str | None) -> tuple[Tensor, str]:
    """[rows, tokens] real token ids: consecutive slices of ``corpus`` (a registered name or a UTF-8 file),
    else (None, or a registered corpus that cannot be fetched) of repeated filler text. Also returns where
    they came from (the corpus name or "filler")."""
    tokenizer = loaded.tokenizer
    text, source = None, "filler"
    if corpus is not None:
        from ..data import CORPORA, load_corpus

        try:
            text, source = load_corpus(corpus), corpus
        except InfinikvError:
            if corpus not in CORPORA:  # a file the user named: never replaced by filler
                raise
            text = None
    if text is None:
        text = " ".join(
            f"Line {i}: the {w} river ran past the {v} mill while {u} bells rang twice."
            for i, (w, v, u) in enumerate(
                zip(["slow", "cold", "wide"] * 400, ["old", "red"] * 600, ["six", "ten"] * 600, strict=False)
            )
        )
    needed = tokens * rows
    ids: list[int] = []
    start = 0
    while len(ids) < needed:  # encode only as much text as the grid needs (~6 characters per token)
        piece = text[start : start + max(4096, 8 * (needed - len(ids)))]
        if not piece:  # the whole text read: from its start again, unless it gave no token at all
            if not ids:
                raise InputError(f"corpus {source} has no text to cut prompts from")
            start, piece = 0, text[: 8 * needed]
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        start += len(piece)
    return torch.tensor(ids[:needed]).view(rows, tokens).to(loaded.device), source
