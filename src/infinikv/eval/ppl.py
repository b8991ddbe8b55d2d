"""Perplexity through the decode path (teacher forcing), so a KV policy's selection is what is measured.

Each window of ``context`` tokens is split in two: the first ``prefill`` tokens are fed densely in one pass;
every later token is then fed through the decode path one at a time, and the log-probability the model gave
it at the step before is recorded. Every scored prediction is therefore made with the policy choosing what
attention sees, as in generation. Windows are consecutive, non-overlapping stretches from the start of the
text, each a row of its own (``runner.DecodeRun``). Perplexity is reported overall and per block of
``block`` positions; the dense reference is measured on the same windows.

This is the protocol of InfiniGen's perplexity experiments (Lee et al., OSDI 2024,
https://arxiv.org/abs/2406.19707), driven token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from ..data import load_corpus
from ..errors import InputError
from ..models import LoadedModel
from ..policies import PolicyConfig, make_config
from .runner import COSTS, DecodeRun, PrefillMemo, policy_name

Tensor = torch.Tensor


@dataclass(frozen=True)
class PerplexityConfig:
    """context: tokens per window; prefill: leading tokens fed densely (not scored except the first
    prediction after them); windows: how many windows (a row each); block: positions per reported block."""

    text: str = "austen"
    context: int = 4096
    prefill: int = 512
    windows: int = 1
    block: int = 256

    def __post_init__(self):
        if self.windows < 1:
            raise InputError(f"windows must be at least 1, got {self.windows}")
        if not 2 <= self.prefill < self.context:
            raise InputError(
                f"prefill must be in [2, context), got {self.prefill} with context {self.context}"
            )
        if self.block < 1:
            raise InputError(f"block must be at least 1, got {self.block}")


def make_windows(loaded: LoadedModel, config: PerplexityConfig) -> Tensor:
    """``windows`` consecutive token windows [windows, context] from the start of the text."""
    if config.context > loaded.max_context:
        raise InputError(f"context {config.context} exceeds the model's {loaded.max_context} tokens")
    text = load_corpus(config.text)
    needed = config.windows * config.context
    chars = needed * 6  # tokenise only a prefix: English runs at about 4 characters per token
    while True:
        ids = loaded.tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > needed or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise InputError(f"text '{config.text}' has {len(ids)} tokens; {needed} needed")
    return torch.tensor(ids[:needed]).view(config.windows, config.context)


def token_nll(
    loaded: LoadedModel,
    policy: PolicyConfig,
    windows: Tensor,
    prefill: int,
    progress: bool = False,
    memo: PrefillMemo | None = None,
):
    """Negative log-likelihood [windows, context - prefill] of each token after the prefill, fed through
    the decode path, and the run's statistics."""
    with DecodeRun(loaded, policy, memo=memo) as run:
        logits = run.prefill(windows[:, :prefill])
        steps = windows.shape[1] - prefill
        nll = torch.empty(windows.shape[0], steps)
        for i in tqdm(
            range(steps), desc=f"ppl {policy_name(policy)}", unit="tok", disable=not progress, leave=False
        ):
            target = windows[:, prefill + i]
            nll[:, i] = (
                -torch.log_softmax(logits, dim=-1).gather(1, target[:, None].to(logits.device))[:, 0].cpu()
            )
            if i + 1 < steps:
                logits = run.step(target)
        return nll, run.stats()


def summarise(nll: Tensor, prefill: int, block: int) -> dict[str, Any]:
    """Perplexity overall and per block of absolute positions (the first block may be partial)."""
    out: dict[str, Any] = {"ppl": math.exp(nll.mean().item()), "tokens": nll.numel(), "blocks": []}
    positions = torch.arange(prefill, prefill + nll.shape[1])
    for start in range(prefill - prefill % block, prefill + nll.shape[1], block):
        inside = (positions >= start) & (positions < start + block)
        out["blocks"].append(
            {"start": start, "end": start + block, "ppl": math.exp(nll[:, inside].mean().item())}
        )
    return out


def perplexity(
    loaded: LoadedModel,
    policy: PolicyConfig | str,
    config: PerplexityConfig,
    reference: dict[str, Any] | None = None,
    progress: bool = False,
    memo: PrefillMemo | None = None,
) -> dict[str, Any]:
    """Perplexity of ``policy`` and of ``dense`` on the same windows (``reference``: a dense result of the
    same config to reuse instead of running dense again; ``memo``: prefills shared between runs)."""
    policy = make_config(policy) if isinstance(policy, str) else policy
    windows = make_windows(loaded, config)
    nll, stats = token_nll(loaded, policy, windows, config.prefill, progress, memo)
    result = {
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "policy": policy_name(policy),
        "knobs": policy.knobs(),
        "text": config.text,
        "context": config.context,
        "prefill": config.prefill,
        "windows": config.windows,
        "decode_path": stats["decode_path"],
        **summarise(nll, config.prefill, config.block),
        "kv_fraction": stats["kv_fraction"],
        "kv_fetched_fraction": stats["kv_fetched_fraction"],
        "kv_attended_fraction": stats["kv_attended_fraction"],
        **{cost: stats[cost] for cost in COSTS},
        "stats": stats,
    }
    if policy_name(policy) == "dense":
        result["dense"] = {"ppl": result["ppl"], "blocks": result["blocks"]}
    elif reference is not None:
        result["dense"] = reference["dense"]
    else:
        dense_nll, _ = token_nll(loaded, make_config("dense"), windows, config.prefill, progress, memo)
        result["dense"] = summarise(dense_nll, config.prefill, config.block)
        result["dense"].pop("tokens")
    return result
