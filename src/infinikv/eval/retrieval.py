"""Retrieval accuracy (passkey and RULER-style tasks) with the question fed through the decode path.

For each sample the context (instructions + haystack) is prefilled densely; then the question, the end of
the prompt format and the answer prefix are fed one token at a time through the decode path, with the policy
choosing what each layer attends to; then the answer is generated greedily, still through the policy, until
end of sequence or the task's token budget. So the policy decides both how the question is read and how the
answer is found. Scoring follows RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654); see
:mod:`infinikv.eval.scoring`.

Prompt format: plain text by default (``chat="off"``). With ``chat="on"`` (or ``"auto"``, when the tokenizer
has a chat template) the context and question become one user turn, then the assistant turn opened by the
answer prefix. Plain text is the default because the small models here retrieve from it: wrapped in its
chat template, SmolLM2-135M-Instruct answers the passkey prompt with prose even under dense attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..errors import InputError
from ..models import LoadedModel
from ..policies import PolicyConfig, make_config
from .runner import COSTS, DECODE_PATH, DecodeRun, PrefillMemo, policy_name
from .scoring import score
from .tasks import DEPTH_TASKS, TASKS, Sample, generate

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
_PLACEHOLDER = "\u0000INFINIKV\u0000"


class PromptFormat:
    """Splits a sample into the tokens to prefill and the tokens to feed through the decode path."""

    def __init__(self, loaded: LoadedModel, chat: str = "off"):
        if chat not in ("auto", "on", "off"):
            raise InputError(f"chat must be auto, on or off, got '{chat}'")
        tokenizer = loaded.tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat == "on" and not has_template:
            raise InputError("this model's tokenizer has no chat template; use chat off")
        self.tokenizer = tokenizer
        self.chat = has_template and chat != "off"
        if self.chat:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _PLACEHOLDER}], tokenize=False, add_generation_prompt=True
            )
            self.head, self.tail = rendered.split(_PLACEHOLDER)
        else:
            self.head, self.tail = "", "\n"
        # The template text carries its own special tokens; plain text gets the tokenizer's (BOS, if any).
        self.special = not self.chat
        self.overhead = self._count(self.head, first=True) + self._count(self.tail)

    def _count(self, text: str, first: bool = False) -> int:
        return len(self.tokenizer(text, add_special_tokens=first and self.special)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return self._count(text)

    def encode(self, sample: Sample) -> tuple[list[int], list[int]]:
        """(prefill ids, decode ids): head + context | question + tail + answer prefix."""
        prefill = self.tokenizer(self.head + sample.context, add_special_tokens=self.special)["input_ids"]
        rest = sample.question + self.tail + sample.answer_prefix
        decode = self.tokenizer(rest, add_special_tokens=False)["input_ids"]
        return prefill, decode


def answer(
    loaded: LoadedModel,
    policy: PolicyConfig,
    prompt: PromptFormat,
    sample: Sample,
    memo: PrefillMemo | None = None,
) -> tuple[str, dict[str, Any]]:
    """Prefill the context, decode the question, generate greedily; return the answer text and stats."""
    prefill_ids, question_ids = prompt.encode(sample)
    eos = loaded.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos if eos is not None else loaded.tokenizer.eos_token_id])
    generated: list[int] = []
    with DecodeRun(loaded, policy, memo=memo) as run:
        logits = run.prefill(torch.tensor([prefill_ids]))
        for token in question_ids:
            logits = run.step(torch.tensor([token]))
        for _ in range(sample.max_new_tokens):
            token = int(logits.argmax(dim=-1)[0])
            if token in eos:
                break
            generated.append(token)
            if len(generated) < sample.max_new_tokens:
                logits = run.step(torch.tensor([token]))
        stats = run.stats()
    stats["prompt_tokens"] = len(prefill_ids) + len(question_ids)
    return loaded.tokenizer.decode(generated, skip_special_tokens=True), stats


def samples_for(
    prompt: PromptFormat,
    task: str,
    context: int,
    count: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
) -> list[Sample]:
    """``count`` samples of ``task`` at ``context`` tokens; sample i uses depth depths[i % len] and seed+i."""
    if task not in TASKS:
        raise InputError(f"unknown task '{task}'; available: {', '.join(TASKS)}")
    return [
        generate(
            task,
            context,
            prompt.count_tokens,
            depth=depths[i % len(depths)] if task in DEPTH_TASKS else 0.5,
            seed=seed + i,
            overhead=prompt.overhead,
        )
        for i in range(count)
    ]


def evaluate(
    loaded: LoadedModel,
    policy: PolicyConfig | str,
    task: str,
    context: int,
    samples: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
    chat: str = "off",
    progress: bool = False,
    memo: PrefillMemo | None = None,
) -> dict[str, Any]:
    """Score ``policy`` on ``samples`` samples of ``task`` at ``context`` tokens (``memo``: prefills shared
    between runs)."""
    policy = make_config(policy) if isinstance(policy, str) else policy
    if context > loaded.max_context:
        raise InputError(f"context {context} exceeds the model's {loaded.max_context} tokens")
    if samples < 1:
        raise InputError(f"samples must be at least 1, got {samples}")
    prompt = PromptFormat(loaded, chat)
    batch = samples_for(prompt, task, context, samples, depths, seed)
    rows = []
    fractions = []
    costs: dict[str, list[float | None]] = {cost: [] for cost in ("kv_fetched_fraction", *COSTS)}
    for sample in tqdm(
        batch, desc=f"{policy_name(policy)} {task}@{context}", disable=not progress, leave=False
    ):
        text, stats = answer(loaded, policy, prompt, sample, memo)
        fractions.append(stats["kv_fraction"])
        for cost, values in costs.items():
            values.append(stats[cost])
        rows.append(
            {
                "seed": sample.seed,
                "depth": sample.depth,
                "prompt_tokens": stats["prompt_tokens"],
                "prediction": text,
                "answers": list(sample.answers),
                "score": score(sample.metric, [text], [sample.answers]),
                "kv_fraction": stats["kv_fraction"],
            }
        )
    by_depth: dict[str, list[float]] = {}
    for row in rows:
        by_depth.setdefault(str(row["depth"]), []).append(row["score"])
    return {
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "policy": policy_name(policy),
        "knobs": policy.knobs(),
        "task": task,
        "context": context,
        "samples": samples,
        "chat": prompt.chat,
        "metric": batch[0].metric,
        "decode_path": DECODE_PATH,
        "score": sum(r["score"] for r in rows) / len(rows),
        "by_depth": {d: sum(s) / len(s) for d, s in by_depth.items()},
        "kv_fraction": sum(fractions) / len(fractions) if None not in fractions else None,
        # None: not recorded (a cache kept on the device moves nothing: kv_fetched_fraction None)
        **{cost: sum(v) / len(v) if None not in v else None for cost, v in costs.items()},
        "rows": rows,
    }
