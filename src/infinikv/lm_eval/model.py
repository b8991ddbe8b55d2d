"""The lm-evaluation-harness model ``infinikv``: any task scored with a KV policy owning the cache.

``generate_until`` runs through :class:`~infinikv.generate.Generator` (batched, stop strings,
``max_gen_toks``, greedy or sampled). ``loglikelihood`` and ``loglikelihood_rolling`` are teacher-forced
through the decode path (:mod:`.loglik`), so the policy selects for every scored token.

``model_args``: ``pretrained`` (a registered name, a GGUF file or an HF directory; default smollm2-135m),
``policy`` and any knob of that policy, ``device``, ``dtype``, ``batch_size``, ``decode_context`` (context
tokens, counted from its end, fed through the decode path before the continuation; at least 1),
``prefill_chunk`` and ``max_gen_toks`` (when a task sets none). Anything else is refused in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from ..errors import InputError
from ..forward import PrefillMemo
from ..generate import GenerationConfig, Generator
from ..models import DEFAULT_MODEL, DTYPES, LoadedModel, load
from ..policies import PolicyConfig, make_config
from ..policy_flags import knob_table
from .loglik import Pair, prefill_length, score

log = logging.getLogger(__name__)

# What generate_until honours from a task's generation_kwargs; anything else is refused, not ignored.
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")


@dataclass(frozen=True)
class Options:
    """The ``model_args`` besides the model and its device, checked: all that can be refused before
    anything loads (the launcher checks them before lm-eval reads its tasks)."""

    policy: str
    config: PolicyConfig
    dtype: str | None  # models.load's (None: the model's own)
    batch_size: int
    decode_context: int
    prefill_chunk: int
    max_gen_toks: int

    @classmethod
    def parse(
        cls,
        policy: str = "dense",
        dtype: str | None = None,
        batch_size: int | str = 1,
        decode_context: int = 1,
        prefill_chunk: int = 2048,
        max_gen_toks: int = 256,
        **knobs: Any,
    ) -> Options:
        if dtype is not None and dtype not in DTYPES:
            raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return cls(
            policy=str(policy),
            config=make_config(str(policy), **_typed_knobs(knobs)),
            dtype=dtype,
            batch_size=_whole("batch_size", batch_size, low=1),
            decode_context=_whole("decode_context", decode_context, low=1),
            prefill_chunk=_whole("prefill_chunk", prefill_chunk, low=2),
            max_gen_toks=_whole("max_gen_toks", max_gen_toks, low=1),
        )


@register_model("infinikv")
class InfinikvLM(LM):
    """An infinikv model and policy as an lm-eval ``LM``."""

    def __init__(
        self,
        pretrained: str | LoadedModel = DEFAULT_MODEL,
        device: str | None = None,
        memo: PrefillMemo | None = None,
        **model_args: Any,
    ):
        """``model_args``: see :meth:`Options.parse` and the module's docstring. ``memo`` (Python only):
        prefills shared with other models built on the same loaded model, so policies evaluated one after
        another on the same task prefill each prompt once per prefill family (``forward.PrefillMemo``: the
        replayed cache holds what the policy's own prefill builds)."""
        super().__init__()
        self.options = Options.parse(**model_args)  # before the slow model load
        if isinstance(pretrained, LoadedModel):
            if device is not None or "dtype" in model_args:
                raise InputError("device and dtype apply to a model loaded by name, not to a loaded one")
            loaded = pretrained
        else:
            loaded = load(str(pretrained), device=device, dtype=self.options.dtype)
        self.generator = Generator(loaded, self.options.config, memo=memo)
        self.loaded = loaded
        self._device = loaded.device

    # -- what lm-eval asks of a model ---------------------------------------------------------------------
    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> InfinikvLM:
        """lm-eval passes its ``--batch_size`` and ``--device`` (default cuda:0) beside ``model_args``;
        a value given in both is taken from ``model_args`` rather than refused as a duplicate argument."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> InfinikvLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def max_length(self) -> int:
        return self.loaded.max_context

    @property
    def tokenizer_name(self) -> str:
        return self.loaded.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.loaded.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not getattr(self.loaded.tokenizer, "chat_template", None):
            raise InputError(
                f"{self.loaded.name}'s tokenizer has no chat template; drop --apply_chat_template"
            )
        return self.loaded.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results: which policy, knobs and decode-path share produced them."""
        return {
            "infinikv_model": self.loaded.name,
            "infinikv_policy": self.options.policy,
            "infinikv_knobs": self.options.config.knobs(),
            "decode_context": self.options.decode_context,
        }

    # -- requests ------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        jobs: dict[GenerationConfig, list[int]] = {}
        prompts = []
        for i, (context, kwargs) in enumerate(r.args for r in requests):
            config = self._generation_config(kwargs)
            prompts.append(self._fit(self._encode(context), self.max_length - config.max_new_tokens))
            jobs.setdefault(config, []).append(i)
        texts: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for config, rows in jobs.items():
            rows = sorted(rows, key=lambda row: -len(prompts[row]))  # similar lengths share a batch
            for batch in _batches(rows, self.options.batch_size):
                results = self.generator.generate([prompts[row] for row in batch], self._seeded(config))
                for row, result in zip(batch, results, strict=True):
                    texts[row] = result.text
                    self.cache_hook.add_partial("generate_until", requests[row].args, result.text)
                bar.update(len(batch))
        bar.close()
        return texts

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair(context, continuation) for context, continuation in (r.args for r in requests)]
        scores = self._score(pairs, "loglikelihood", disable_tqdm)
        for request, result in zip(requests, scores, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return scores

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text in disjoint windows of at most the model's context, every token scored once (lm-eval's
        rolling windows, one token of overlap), all windows of all texts batched together."""
        owners: list[int] = []
        pairs: list[Pair] = []
        for i, (text,) in enumerate(r.args for r in requests):
            ids = self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
            for window in get_rolling_token_windows(ids, self._prefix_token(), self.max_length, 1):
                context, continuation = make_disjoint_window(window)
                pairs.append(Pair(list(context), list(continuation)))
                owners.append(i)
        totals = [0.0] * len(requests)
        scored = self._score(pairs, "loglikelihood_rolling", disable_tqdm)
        for owner, (logprob, _) in zip(owners, scored, strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- helpers -------------------------------------------------------------------------------------------
    def _score(self, pairs: list[Pair], desc: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Score ``pairs`` in batches of similar decode lengths (the longest first: a row leaves the decode
        steps when its tokens are scored, so similar lengths keep the steps full)."""

        def decoded(i: int) -> int:  # tokens pair i feeds through decode steps
            pair, skipped = pairs[i], prefill_length(pairs[i], self.options.decode_context)
            return len(pair.context) + len(pair.continuation) - skipped

        rows = sorted(range(len(pairs)), key=lambda i: -decoded(i))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        bar = tqdm(total=len(pairs), desc=desc, disable=disable_tqdm)
        for batch in _batches(rows, self.options.batch_size):
            chosen = [pairs[i] for i in batch]
            scored = score(self.generator, chosen, self.options.decode_context, self.options.prefill_chunk)
            for i, result in zip(batch, scored, strict=True):
                results[i] = result
            bar.update(len(batch))
        bar.close()
        return results

    def _encode(self, text: str, special: bool = True) -> list[int]:
        return self.loaded.tokenizer(text, add_special_tokens=special)["input_ids"]

    def _prefix_token(self) -> int:
        """What an empty context becomes: BOS, or EOS for a tokenizer without one (as lm-eval's HF model)."""
        tokenizer = self.loaded.tokenizer
        return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

    def _pair(self, context: str, continuation: str) -> Pair:
        """Token ids as lm-eval's HF model splits them: trailing spaces of the context move to the
        continuation, and the continuation is what encoding both adds to the context's tokens."""
        if not context:
            return Pair([self._prefix_token()], self._encode(continuation, special=False))
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        head = self._encode(context)
        if len(whole) - len(head) >= self.max_length:
            raise InputError(
                f"a continuation of {len(whole) - len(head)} tokens does not fit the model's context of "
                f"{self.max_length} tokens"
            )
        # one more than the context: the last token is predicted, never fed
        return Pair(
            self._fit(whole[: len(head)], self.max_length + 1 - (len(whole) - len(head))), whole[len(head) :]
        )

    def _fit(self, ids: list[int], room: int) -> list[int]:
        """``ids`` cut from the left to ``room`` tokens, as lm-eval's HF model truncates a long context."""
        if len(ids) > room:
            log.warning("context of %d tokens cut to its last %d to fit %s", len(ids), room, self.loaded.name)
            return ids[-room:]
        return ids

    def _generation_config(self, kwargs: dict[str, Any]) -> GenerationConfig:
        unknown = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise InputError(
                f"generation argument {', '.join(unknown)} is not supported; "
                f"supported: {', '.join(GENERATION_KEYS)}"
            )
        until = kwargs.get("until") or []
        temperature = kwargs.get("temperature", 0.0)
        sampled = kwargs.get("do_sample", temperature > 0)
        max_new = _whole("max_gen_toks", kwargs.get("max_gen_toks", self.options.max_gen_toks), low=1)
        if max_new >= self.max_length:
            raise InputError(
                f"max_gen_toks {max_new} leaves no room in the model's {self.max_length}-token context"
            )
        return GenerationConfig(
            max_new_tokens=max_new,
            temperature=(temperature or 1.0) if sampled else 0.0,  # do_sample without a temperature: 1
            top_p=kwargs.get("top_p", 1.0) if sampled else 1.0,
            stop=(until,) if isinstance(until, str) else tuple(until),
            prefill_chunk=self.options.prefill_chunk,
        )

    @staticmethod
    def _seeded(config: GenerationConfig) -> GenerationConfig:
        """Sampling seeded from torch's generator, which lm-eval seeds (``--seed``): reproducible runs, and a
        different draw for each batch."""
        if config.temperature == 0:
            return config
        seed = int(torch.randint(0, 2**62, (1,)))
        return GenerationConfig(**{**config.__dict__, "seed": seed})


def _batches(rows: Sequence[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(rows), size):
        yield list(rows[start : start + size])


def _whole(name: str, value: Any, low: int) -> int:
    """A model or generation argument that must be a whole number (lm-eval may pass it as text)."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < low:
        raise InputError(f"{name} must be a whole number of at least {low}, got {value!r}")
    return int(text)


def _typed_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The remaining model_args as policy knobs: a name that is no knob of any policy is refused here with
    the model's own arguments listed (a knob of another policy is left to ``make_config``); a string knob
    given as a number (``own_query_layers=9``) is taken as text."""
    table = knob_table()
    unknown = sorted(set(knobs) - set(table))
    if unknown:
        raise InputError(
            f"unknown model_args {', '.join(unknown)}: neither a model argument (pretrained, policy, device, "
            "dtype, batch_size, decode_context, prefill_chunk, max_gen_toks) nor a policy knob "
            "(infinikv policies lists them)"
        )
    return {k: str(v) if table[k][0] is str and not isinstance(v, str) else v for k, v in knobs.items()}
