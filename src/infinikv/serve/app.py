"""The HTTP layer: OpenAI-compatible endpoints, request validation, and the per-request KV policy.

``create_app(model, ...)`` returns a FastAPI app serving

* ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` in the shapes the OpenAI API
  (and vLLM) use, with ``stream: true`` as server-sent events ending in ``data: [DONE]``;
* ``GET /health`` (503 while the model loads, 200 when ready) and ``GET /metrics`` (Prometheus text).

A request picks its KV policy with the extra body fields ``kv_policy`` and ``kv_<knob>`` (``extra_body`` in
the openai client); without them it gets the server's policy and knobs. Every response carries a ``kv``
field with the policy, its knobs and the statistics of the batch the request ran in. Every mistake in a
request is a 4xx with an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import InfinikvError, PolicyError
from ..generate import GenerationConfig, RequestResult
from ..models import LoadedModel
from ..policies import POLICIES, PolicyConfig, make_config
from .metrics import NO_POLICY, ServerMetrics
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("infinikv.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
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
    "response_format": (None, {"type": "text"}),
}


# -- errors --------------------------------------------------------------------------------------------------
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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- request schemas -----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # Strict: "0.5" is not a number and 5.0 is not an integer; NaN and infinities are refused.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    # Drop the union-branch names pydantic puts in the location (e.g. "str", "list[str]").
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(loc) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


async def _parse(request: Request, schema: type[_Strict]) -> _Strict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise ApiError(message, param=param) from None


# -- the per-request KV policy -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyDefaults:
    """The server's policy and the knobs it was started with (they apply when a request names no policy,
    or names the same one)."""

    name: str = "dense"
    knobs: tuple[tuple[str, Any], ...] = ()


def resolve_policy(extra: dict[str, Any], defaults: PolicyDefaults) -> tuple[str, PolicyConfig]:
    """The request's policy name and config from its ``kv_policy`` and ``kv_<knob>`` fields; 400 on any
    mistake."""
    name = extra.get("kv_policy", defaults.name)
    if not isinstance(name, str) or name not in POLICIES:
        raise ApiError(
            f"unknown kv_policy {name!r}; available: {', '.join(POLICIES)}",
            param="kv_policy",
            code="kv_policy",
        )
    knobs = dict(defaults.knobs) if name == defaults.name else {}
    for key, value in extra.items():
        if not key.startswith("kv_") or key == "kv_policy":
            continue
        knob = key[3:]
        own = [f.name for f in fields(POLICIES[name].config_class)]
        if knob not in own:
            raise ApiError(
                f"policy '{name}' has no knob '{knob}'; its knobs: {', '.join(own) or 'none'}",
                param=key,
                code="kv_knob",
            )
        knobs[knob] = value  # types and ranges are checked once, by the policy's config
    try:
        return name, make_config(name, **knobs)
    except PolicyError as exc:
        bad = exc.knob  # the knob the policy's config rejected, if one was
        raise ApiError(str(exc), param=f"kv_{bad}" if bad else "kv_policy", code="kv_knob") from None


def _is_figure(value: Any) -> bool:
    """A number, or a per-layer list of numbers (None for layers it does not apply to)."""
    if isinstance(value, list):
        return any(v is not None for v in value) and all(v is None or _is_figure(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def kv_report(result: RequestResult) -> dict[str, Any]:
    """The ``kv`` field: policy, knobs, and the numeric statistics of the batch the request ran in (numbers
    and per-layer lists of numbers, such as InfiniGen's ``alpha_used``)."""
    stats = dict(result.stats)
    name = stats.pop("policy")
    knobs = {f.name: stats.pop(f.name) for f in fields(POLICIES[name].config_class) if f.name in stats}
    figures = {k: v for k, v in stats.items() if _is_figure(v)}
    figures.pop("prompt_tokens", None)
    figures.pop("new_tokens", None)
    return {"policy": name, "knobs": knobs, "stats": figures}


# -- the app -------------------------------------------------------------------------------------------------
@dataclass
class ServerSettings:
    max_batch: int = 8
    max_queue: int = 64
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context left)
    served_name: str | None = None  # the model id clients send; default: the loaded model's name


class _State:
    """What the endpoints share: the model once loaded, its scheduler, and the metrics."""

    def __init__(self, settings: ServerSettings, defaults: PolicyDefaults):
        self.settings = settings
        self.defaults = defaults
        self.metrics = ServerMetrics()
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer: Any = None  # a copy: the worker thread uses the model's own, and a fast tokenizer
        # must not be used from two threads at once
        self.load_error: str | None = None
        self.created = int(time.time())

    def ready(self, loaded: LoadedModel) -> None:
        scheduler = Scheduler(loaded, self.metrics, self.settings.max_batch, self.settings.max_queue)
        scheduler.prepare(make_config(self.defaults.name, **dict(self.defaults.knobs)))
        scheduler.start()
        self.tokenizer = copy.deepcopy(loaded.tokenizer)
        self.loaded, self.scheduler = loaded, scheduler

    @property
    def model_id(self) -> str:
        return self.settings.served_name or (self.loaded.name if self.loaded else "loading")


def create_app(
    model: LoadedModel | Callable[[], LoadedModel],
    policy: str = "dense",
    knobs: dict[str, Any] | None = None,
    settings: ServerSettings | None = None,
    on_load_error: Callable[[str], None] | None = None,
) -> FastAPI:
    """The server app. ``model``: a loaded model, or a function that loads one (called in a thread when the
    app starts, /health answering 503 until it returns). ``policy``/``knobs``: the default KV policy."""
    make_config(policy, **(knobs or {}))  # a bad default is the operator's mistake: fail now
    defaults = PolicyDefaults(policy, tuple(sorted((knobs or {}).items())))
    state = _State(settings or ServerSettings(), defaults)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if isinstance(model, LoadedModel):
            state.ready(model)
        else:
            loading = threading.Thread(target=_load_in_background, daemon=True)
            loading.start()
        try:
            yield
        finally:
            if state.scheduler is not None:
                await asyncio.to_thread(state.scheduler.stop)  # the loop keeps taking the last events

    def _load_in_background() -> None:
        try:
            state.ready(model())
            log.info("model %s ready", state.model_id)
        except InfinikvError as exc:
            state.load_error = str(exc)
        except Exception as exc:  # anything else while loading is still one line for the operator
            state.load_error = f"{type(exc).__name__}: {exc}"
        if state.load_error is not None and on_load_error is not None:
            on_load_error(state.load_error)

    app = FastAPI(title="infinikv", lifespan=lifespan)
    app.state.infinikv = state

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        state.metrics.record_request(NO_POLICY, exc.status)
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        state.metrics.record_request(NO_POLICY, 500)
        return ApiError(f"internal error: {exc}", 500, type="server_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.load_error is not None:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if state.scheduler is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        _require_ready(state)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_id,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "infinikv",
                    "max_model_len": state.loaded.max_context,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        _require_ready(state)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError("send one prompt per request (a list of exactly one string)", param="prompt")
            prompt = prompt[0]
        return await _generate(state, request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        _require_ready(state)
        if not body.messages:
            raise ApiError("messages must not be empty", param="messages")
        if not getattr(state.tokenizer, "chat_template", None):
            raise ApiError(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None:
                raise ApiError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
            body.max_tokens = body.max_completion_tokens
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template itself can refuse a conversation (e.g. role order)
            raise ApiError(f"the chat template refused these messages: {exc}", param="messages") from None
        return await _generate(state, request, body, prompt, chat=True)

    return app


def _require_ready(state: _State) -> None:
    if state.scheduler is None:
        raise ApiError("the model is still loading", 503, type="server_error", code="loading")


def _sampling(state: _State, body: _Sampling, prompt: str, chat: bool) -> tuple[GenerationConfig, int]:
    """Validated sampling settings and the prompt's token count."""
    if body.model is not None and body.model != state.model_id:
        raise ApiError(
            f"the model '{body.model}' does not exist; this server serves '{state.model_id}'",
            404,
            param="model",
            code="model_not_found",
        )
    for name, neutral in UNSUPPORTED.items():
        if name in body.model_extra and body.model_extra[name] not in neutral:
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    if body.n != 1:
        raise ApiError(f"only n=1 is supported, got {body.n}", param="n")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise ApiError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError("stop takes up to 4 non-empty strings", param="stop")
    if not prompt.strip():
        raise ApiError("the prompt is empty", param="messages" if chat else "prompt")
    prompt_tokens = len(state.tokenizer(prompt)["input_ids"])
    context = state.loaded.max_context
    room = context - prompt_tokens
    if room < 1:
        raise ApiError(
            f"this model's maximum context length is {context} tokens; the prompt has {prompt_tokens}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if body.max_tokens is None:
        max_tokens = min(state.settings.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    else:
        max_tokens = body.max_tokens
        if max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if max_tokens > room:
            raise ApiError(
                f"this model's maximum context length is {context} tokens; you requested "
                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to generate)",
                param="max_tokens",
                code="context_length_exceeded",
            )
    config = GenerationConfig(
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed, stop=tuple(stops)
    )
    return config, prompt_tokens


def _finish_reason(result: RequestResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _usage(prompt_tokens: int, result: RequestResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


async def _generate(state: _State, request: Request, body: _Sampling, prompt: str, chat: bool) -> Response:
    sampling, prompt_tokens = _sampling(state, body, prompt, chat)
    policy_name, policy = resolve_policy(body.model_extra or {}, state.defaults)
    try:
        job = state.scheduler.submit(prompt, policy, sampling, stream=body.stream)
    except QueueFull:
        raise ApiError(
            f"the queue is full ({state.settings.max_queue} requests waiting); retry shortly",
            429,
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except ShuttingDown:
        raise ApiError("the server is shutting down", 503, type="server_error") from None
    meta = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.model_id,
    }
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(state, job, policy_name, meta, chat, prompt_tokens, include_usage)
        return _JobStream(events, job, lambda: state.metrics.record_request(policy_name, 499))
    result = await _wait(state, request, job, policy_name)
    if isinstance(result, Response):
        return result
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(result)}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice.update(text=result.text, logprobs=None)
    state.metrics.record_request(policy_name, 200)
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": _usage(prompt_tokens, result),
            "kv": kv_report(result),
        }
    )


async def _wait(state: _State, request: Request, job: Job, policy_name: str) -> RequestResult | Response:
    """The result of a non-streaming job; cancels it if the client goes away first."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    state.metrics.record_request(policy_name, 499)
                    return Response(status_code=499)
                continue
            if kind == "done":
                return payload
            if kind == "error":
                state.metrics.record_request(policy_name, 500)
                return ApiError(payload, 500, type="server_error").response()
    except asyncio.CancelledError:
        job.cancel()
        raise


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(
    state: _State,
    job: Job,
    policy_name: str,
    meta: dict[str, Any],
    chat: bool,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events of one streaming job."""
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {} if piece is None else {"content": piece}
        else:
            choice.update(text=piece or "", logprobs=None)
        return {**meta, "object": kind_name, "choices": [choice], **extra}

    if chat:
        first = chunk("")
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield _sse(first)
    while True:
        kind, payload = await job.events.get()
        if kind == "text":
            yield _sse(chunk(payload))
            continue
        if kind == "done":
            yield _sse(chunk(None, _finish_reason(payload), kv=kv_report(payload)))
            if include_usage:
                usage = _usage(prompt_tokens, payload)
                yield _sse({**meta, "object": kind_name, "choices": [], "usage": usage})
        else:
            yield _sse(ApiError(payload, 500, type="server_error").body())
        yield _sse("[DONE]")
        job.answered = True
        state.metrics.record_request(policy_name, 200 if kind == "done" else 500)
        return


class _JobStream(StreamingResponse):
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
