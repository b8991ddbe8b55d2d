"""A submitted job's events turned into the HTTP answer: the result of a plain request (the job cancelled if
the client leaves first), or the server-sent-event stream of a streaming one.

``record(status)`` counts the request in the metrics once its fate is known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..generate import RequestResult
from .kv_policy import kv_report
from .openai_shapes import SSE_DONE, ApiError, chunk, finish_reason, role_chunk, sse, usage_chunk
from .scheduler import Job

log = logging.getLogger("infinikv.serve")


async def result(request: Request, job: Job, record: Callable[[int], None]) -> RequestResult | Response:
    """The result of a non-streaming job, or the response to send instead: 499 when the client went away
    (the job cancelled), 500 when generation failed, 503 when the server ended it as it stopped, 504 when it
    ran past its deadline."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    record(499)
                    return Response(status_code=499)
                continue
            if kind == "done":
                return payload
            if kind in ("error", "timeout", "shutdown"):
                error = failure(kind, payload)
                record(error.status)
                return error.response()
    except asyncio.CancelledError:
        job.cancel()
        raise


async def events(
    job: Job,
    meta: dict[str, Any],
    chat: bool,
    prompt_tokens: int,
    include_usage: bool,
    record: Callable[[int], None],
) -> AsyncIterator[str]:
    """Server-sent events of one streaming job."""
    if chat:
        yield sse(role_chunk(meta))
    while True:
        kind, payload = await job.events.get()
        if kind == "text":
            yield sse(chunk(meta, chat, payload))
            continue
        if kind == "done":
            yield sse(chunk(meta, chat, None, finish_reason(payload), kv=kv_report(payload)))
            if include_usage:
                yield sse(usage_chunk(meta, chat, prompt_tokens, payload))
        else:
            error = failure(kind, payload)
            yield sse(error.body())
        yield SSE_DONE
        job.answered = True
        record(200 if kind == "done" else error.status)
        return


def failure(kind: str, message: str) -> ApiError:
    """The error of a job's last event: "timeout" (its deadline passed), "shutdown" (the server ended it as
    it stopped) or "error" (generation failed)."""
    if kind == "timeout":
        return ApiError(message, 504, type="timeout_error", code="request_timeout")
    if kind == "shutdown":
        return ApiError(message, 503, type="server_error")
    return ApiError(message, 500, type="server_error")


class JobStream(StreamingResponse):
    """The event stream of a job, which cancels the job however the response ends before the job's last
    event was sent: the client went away mid-stream, or even before the first event (then the event
    generator never started, so it cannot do this itself). A cancelled row stops at the next decode step."""

    def __init__(self, events: AsyncIterator[str], job: Job, on_cancel: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job, self.on_cancel = job, on_cancel

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels what is still streaming when its graceful shutdown times out: one line in
            # the log, not a traceback; the job is cancelled below.
            log.warning("a stream was cut off by the shutdown")
        finally:
            if not self.job.answered:
                self.job.cancel()
                self.on_cancel()
