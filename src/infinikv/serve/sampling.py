"""A request's prompt and sampling settings, ready for the scheduler: the prompt tokenised (once: the token
ids go on to ``Generator.generate``), checked against the model's context, and the ``GenerationConfig``
built from the request's fields.

``GenerationConfig`` is the one judge of the sampling settings' values; its refusal becomes a 400 naming
the request field it is about.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..generate import GenerationConfig, check_text
from .openai_shapes import ApiError
from .schemas import SamplingRequest

# The request field each GenerationConfig field comes from (max_new_tokens: the request says which);
# GenerationConfig's errors begin with the field's name.
REQUEST_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
}


def prompt_ids(tokenizer: Any, prompt: str, param: str) -> list[int]:
    """The prompt's token ids; 400 for an empty prompt, one that is not valid UTF-8 or one the tokenizer
    makes no tokens of (``param``: the field the prompt came from)."""
    if not prompt.strip():
        raise ApiError("the prompt is empty", param=param)
    try:
        check_text("the prompt" if param == "prompt" else "a message", prompt)
    except InputError as exc:
        raise ApiError(str(exc), param=param) from None
    ids = tokenizer(prompt)["input_ids"]
    if not ids:  # text the tokenizer drops entirely (e.g. only characters its normaliser removes)
        raise ApiError("the prompt has no tokens once tokenized", param=param)
    return ids


def sampling_config(
    body: SamplingRequest, prompt_tokens: int, context: int, default_max_tokens: int, param: str
) -> GenerationConfig:
    """The request's sampling settings for a prompt of ``prompt_tokens`` tokens (``param``: the field the
    prompt came from) on a model with a ``context``-token context. Without ``max_tokens`` the request gets
    ``default_max_tokens``, capped by the context left after the prompt."""
    room = context - prompt_tokens
    if room < 1:
        raise ApiError(
            f"this model's maximum context length is {context} tokens; the prompt has {prompt_tokens}",
            param=param,
            code="context_length_exceeded",
        )
    asked, max_tokens_field = body.max_tokens_given()
    max_tokens = min(default_max_tokens, room) if asked is None else asked
    if max_tokens > room:
        raise ApiError(
            f"this model's maximum context length is {context} tokens; you requested "
            f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to generate)",
            param=max_tokens_field,
            code="context_length_exceeded",
        )
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,  # the OpenAI API's default
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        )
    except InputError as exc:
        name, _, rest = str(exc).partition(" ")
        field = max_tokens_field if name == "max_new_tokens" else REQUEST_FIELDS.get(name)
        raise ApiError(f"{field} {rest}" if field else str(exc), param=field) from None
