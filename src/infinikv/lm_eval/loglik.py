"""Log-likelihoods of continuations, teacher-forced through the decode path so the policy selects for every
scored token.

For each (context, continuation) pair of token ids, all but the last ``decode_context`` context tokens are
prefilled densely in chunks (at least one token is); every later token, the continuation's included, is fed
through ``Driver.step`` one at a time, and the log-probability the model gave the token at the step before is
recorded. With ``decode_context >= 1`` the last context token goes through the decode path too, so even the
first continuation token is predicted with the policy choosing what each layer attends to (a context of one
token is the exception: there is nothing to select from). This is the protocol of ``eval.ppl``, with a
prompt per row.

The rows of a batch are left-padded for the prefill; a row whose tokens run out before the longest row's is
fed padding, which it never scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import InfinikvCache
from ..forward import Driver
from ..generate import Generator

Tensor = torch.Tensor


@dataclass(frozen=True)
class Pair:
    """A context and the continuation to score after it, as token ids (the context is never empty)."""

    context: list[int]
    continuation: list[int]


def prefill_length(pair: Pair, decode_context: int) -> int:
    """Tokens of ``pair`` prefilled densely: the context less its last ``decode_context`` tokens, at least
    one."""
    return max(1, len(pair.context) - decode_context)


def score(
    generator: Generator, pairs: Sequence[Pair], decode_context: int, prefill_chunk: int
) -> list[tuple[float, bool]]:
    """(log-probability of the continuation, whether greedy decoding gives it) for each pair of one batch,
    under ``generator``'s model and policy (and with its prefill memo)."""
    loaded = generator.loaded
    tokens = [pair.context + pair.continuation for pair in pairs]
    splits = [prefill_length(pair, decode_context) for pair in pairs]
    ids, mask = _left_padded(
        [t[:s] for t, s in zip(tokens, splits, strict=True)], loaded.tokenizer.pad_token_id
    )
    pad = loaded.tokenizer.pad_token_id
    logprobs = [0.0] * len(pairs)
    greedy = [True] * len(pairs)
    steps = max(len(t) - s for t, s in zip(tokens, splits, strict=True))
    cache = InfinikvCache(loaded.model, generator.policy_config, device=loaded.device)
    with Driver(loaded, cache) as driver:
        logits = driver.prefill(ids, mask, prefill_chunk, memo=generator.memo)
        for step in range(steps):
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            best = logp.argmax(dim=-1).tolist()
            fed = []
            for row, (pair, row_tokens) in enumerate(zip(pairs, tokens, strict=True)):
                position = splits[row] + step  # the token these logits predict
                if len(pair.context) <= position < len(row_tokens):
                    target = row_tokens[position]
                    logprobs[row] += float(logp[row, target])
                    greedy[row] = greedy[row] and best[row] == target
                fed.append(row_tokens[position] if position < len(row_tokens) else pad)
            if step + 1 < steps:
                logits = driver.step(torch.tensor(fed))
    return list(zip(logprobs, greedy, strict=True))


def _left_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask
