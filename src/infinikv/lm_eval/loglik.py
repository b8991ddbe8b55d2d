"""Log-likelihoods of continuations, teacher-forced through the decode path so the policy selects for every
scored token.

For each (context, continuation) pair of token ids, all but the last ``decode_context`` context tokens are
prefilled densely in chunks (at least one token is); every later token, the continuation's included, is fed
through the engine's decode step one at a time, and the log-probability the model gave the token at the step
before is recorded. With ``decode_context >= 1`` the last context token goes through the decode path too, so
even the first continuation token is predicted with the policy choosing what each layer attends to (a
context of one token is the exception: there is nothing to select from). This is the protocol of
``eval.ppl``, with a prompt per row.

Each pair is a row of its own (``engine.forced.ForcedRows``: its own cache, no padding); a row leaves the
decode steps once its last token is scored, so its figures are those it gets alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.forced import ForcedRows
from ..generate import Generator


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
    tokens = [pair.context + pair.continuation for pair in pairs]
    # the position of the token each row's latest logits predict
    position = [prefill_length(pair, decode_context) for pair in pairs]
    logprobs = [0.0] * len(pairs)
    greedy = [True] * len(pairs)
    running = [r for r in range(len(pairs)) if position[r] < len(tokens[r])]  # else nothing to score
    if not running:
        return list(zip(logprobs, greedy, strict=True))
    with ForcedRows(generator.loaded, [generator.policy_config] * len(running)) as rows:
        # row i of ``rows`` is pair running[i]
        logits = torch.cat(
            [
                rows.prefill(i, torch.tensor([tokens[r][: position[r]]]), prefill_chunk, generator.memo)
                for i, r in enumerate(running)
            ]
        )
        row_of = {r: i for i, r in enumerate(running)}
        while running:
            targets = torch.tensor([tokens[r][position[r]] for r in running], device=logits.device)
            logp = torch.log_softmax(logits.float(), dim=-1)
            # one read a step: each row's target's log-probability and whether it is the argmax
            target_logp, best = torch.stack(
                [logp.gather(1, targets[:, None])[:, 0], (logp.argmax(dim=-1) == targets).float()]
            ).tolist()
            for i, r in enumerate(running):
                if position[r] >= len(pairs[r].context):  # a continuation token
                    logprobs[r] += target_logp[i]
                    greedy[r] = greedy[r] and best[i] == 1.0
            running = [r for r in running if position[r] + 1 < len(tokens[r])]
            if running:
                fed = torch.tensor([tokens[r][position[r]] for r in running])
                logits = rows.step([row_of[r] for r in running], fed)
                for r in running:
                    position[r] += 1
    return list(zip(logprobs, greedy, strict=True))
