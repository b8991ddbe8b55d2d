"""The request bodies of the generation endpoints as pydantic models, and reading a request into one.

The models check types (strictly: ``"0.5"`` is not a number, ``4.5`` not an integer, NaN and infinities are
refused) and the limits that are the OpenAI API's own (``temperature`` up to 2, at most 4 ``stop``
strings, ``n`` = 1, the options this server does not implement). The ranges of the sampling settings are
checked once, by ``GenerationConfig``, and the KV policy's knobs by the policy registry. A body nested
deeper than ``MAX_DEPTH`` is refused before it is parsed.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .openai_shapes import ApiError

# Request fields the server does not implement, with the values that mean "not used".
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    # vLLM's sampling extensions, each at the value that turns it off
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "response_format": (None, {"type": "text"}),
}


# The JSON nesting a request body may have. The deepest thing the server reads (a chat message's content
# part) is 5 levels down; Python's JSON parser recurses once per level, so a body nested thousands deep is
# refused before it is parsed.
MAX_DEPTH = 32
# The tokens that matter for nesting: a string (skipped whole, brackets inside it do not count) or a bracket.
# A string left open runs to the end of the body, so no match is tried again from every quote inside it
# (which took time quadratic in the body's length); json.loads then refuses the body.
_NESTING_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


Body = TypeVar("Body", bound=_Strict)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class SamplingRequest(_Strict):
    """The fields both generation endpoints take; ``kv_<knob>`` fields arrive as extra fields."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Annotated[float, Field(le=2)] | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Annotated[list[str], Field(max_length=4)] | str | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    kv_policy: str | None = None

    def refuse_unsupported(self) -> None:
        """400 for an option this server does not implement, given a value other than "not used"."""
        for name, neutral in UNSUPPORTED.items():
            if name in self.model_extra and self.model_extra[name] not in neutral:
                raise ApiError(f"'{name}' is not supported by this server", param=name)
        if self.n not in (None, 1):
            raise ApiError(f"only n=1 is supported, got {self.n}", param="n")

    def max_tokens_given(self) -> tuple[int | None, str]:
        """The tokens to generate the client asked for (None: not said), and the field it said it in."""
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def max_tokens_given(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is None:
            return self.max_tokens, "max_tokens"
        return self.max_completion_tokens, "max_completion_tokens"


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    # Drop the union-branch names pydantic puts in the location (e.g. "str", "list[str]").
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(loc) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


def _refuse_deep_nesting(raw: bytes) -> None:
    """400 for a body nested deeper than ``MAX_DEPTH``, naming the top-level field the nesting is in."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return  # the common case, without a scan
    depth, key = 0, None
    for token in _NESTING_TOKEN.finditer(raw):
        text = token[0]
        if text.startswith(b'"'):
            if depth == 1:
                key = text  # in the top-level object, a key comes before its value
        elif text in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                param = _field_name(key) if raw.lstrip().startswith(b"{") else None
                where = f"{param}:" if param else "the request body is"
                raise ApiError(f"{where} nested deeper than {MAX_DEPTH} levels", param=param)
        else:
            depth -= 1


def _field_name(key: bytes | None) -> str | None:
    try:
        return json.loads(key) if key is not None else None
    except ValueError:  # a malformed key: the message names no field
        return None


async def parse(request: Request, schema: type[Body]) -> Body:
    """The request's JSON body as ``schema``; 400 naming the field on any mistake."""
    raw = await request.body()
    _refuse_deep_nesting(raw)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # json.loads refuses an integer literal past Python's digit limit
        raise ApiError(
            f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise ApiError(message, param=param) from None
