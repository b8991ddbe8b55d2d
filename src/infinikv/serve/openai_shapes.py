"""The server's answers in the shapes of the OpenAI API (and vLLM): the error body, the completion and chat
answers, their streamed chunks with the ``usage``, and the server-sent-event framing of a stream.

Nothing here reads a request or a job: the pieces come in ready-made, the ``kv`` field (infinikv's own
addition) among them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from ..generate import RequestResult


class ApiError(Exception):
    """A request the server refuses, with the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with every character past ASCII escaped: an error may quote what the client sent, a lone
    surrogate included, which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def answer_meta(chat: bool, model: str) -> dict[str, Any]:
    """The fields every answer and every chunk of one request shares: a new id, the time, the model."""
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model,
    }


def finish_reason(result: RequestResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, result: RequestResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def completion(
    meta: dict[str, Any], chat: bool, result: RequestResult, prompt_tokens: int, kv: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result)}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice.update(text=result.text, logprobs=None)
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [choice],
        "usage": usage(prompt_tokens, result),
        "kv": kv,
    }


def chunk(
    meta: dict[str, Any], chat: bool, piece: str | None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    """One streamed chunk: a piece of text, or (``piece`` None) the last chunk with its ``finish`` reason."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {} if piece is None else {"content": piece}
    else:
        choice.update(text=piece or "", logprobs=None)
    return {**meta, "object": _chunk_object(chat), "choices": [choice], **extra}


def role_chunk(meta: dict[str, Any]) -> dict[str, Any]:
    """The first chunk of a streamed chat answer, which names the assistant's role."""
    first = chunk(meta, True, "")
    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return first


def usage_chunk(
    meta: dict[str, Any], chat: bool, prompt_tokens: int, result: RequestResult
) -> dict[str, Any]:
    """The chunk after the last one when the client asked for ``stream_options.include_usage``."""
    return {**meta, "object": _chunk_object(chat), "choices": [], "usage": usage(prompt_tokens, result)}


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # the event that ends every stream
