"""The HTTP layer: ``create_app`` and its routes.

``create_app(model, ...)`` returns a FastAPI app serving

* ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` in the shapes the OpenAI API
  (and vLLM) use, with ``stream: true`` as server-sent events ending in ``data: [DONE]``;
* ``GET /health`` (503 while the model loads, 200 when ready) and ``GET /metrics`` (Prometheus text).

A request picks its KV policy with the extra body fields ``kv_policy`` and ``kv_<knob>`` (``extra_body`` in
the openai client); without them it gets the server's policy and knobs. Every response carries a ``kv``
field with the policy, its knobs and the statistics of the batch the request ran in. Every mistake in a
request is a 4xx with an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``; an error
the server did not foresee is a 500 of the same shape, after which the connection still serves
(:class:`CompleteErrors`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import EngineConfig
from ..errors import InfinikvError, InputError
from ..models import LoadedModel
from ..policies import make_config
from . import DEFAULT_REQUEST_TIMEOUT, answers
from .kv_policy import PolicyDefaults, kv_report, resolve_policy
from .metrics import NO_POLICY, ServerMetrics
from .openai_shapes import ApiError, answer_meta, completion
from .sampling import prompt_ids, sampling_config
from .scheduler import ContinuousScheduler, QueueFull, ShuttingDown, StaticScheduler
from .schemas import ChatRequest, CompletionRequest, SamplingRequest, parse

log = logging.getLogger("infinikv.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
# Seconds the requests a shutdown ends get to send their 503, after the graceful timeout and before uvicorn
# cancels what is left.
SHUTDOWN_ANSWER_S = 5.0


@dataclass
class ServerSettings:
    max_batch: int = 8  # requests decoded together (static: requests per generate call)
    max_queue: int = 64
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context left)
    served_name: str | None = None  # the model id clients send; default: the loaded model's name
    scheduler: str = "continuous"  # or "static": one batch of compatible requests at a time
    # the continuous scheduler's engine (the static one takes its kv_memory and compile)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # seconds from a request's arrival until it is cancelled and answered 504 (None: no deadline)
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT


class _State:
    """What the endpoints share: the model once loaded, its scheduler, and the metrics."""

    def __init__(self, settings: ServerSettings, defaults: PolicyDefaults):
        self.settings = settings
        self.defaults = defaults
        self.metrics = ServerMetrics()
        self.loaded: LoadedModel | None = None
        self.scheduler: ContinuousScheduler | StaticScheduler | None = None
        self.tokenizer: Any = None  # a copy: the worker thread uses the model's own, and a fast tokenizer
        # must not be used from two threads at once
        self.load_error: str | None = None
        self.created = int(time.time())

    def ready(self, loaded: LoadedModel) -> None:
        default = make_config(self.defaults.name, **dict(self.defaults.knobs))
        default.check_spec(loaded.spec)  # the operator's knob the model cannot take: fail the load
        settings = self.settings
        if settings.scheduler == "static":
            scheduler = StaticScheduler(
                loaded,
                self.metrics,
                settings.max_batch,
                settings.max_queue,
                settings.request_timeout,
                compile=settings.engine.compile,
                kv_memory=settings.engine.kv_memory,
            )
        else:
            engine = dataclasses.replace(settings.engine, max_running=settings.max_batch)
            scheduler = ContinuousScheduler(
                loaded, self.metrics, engine, settings.max_queue, settings.request_timeout
            )
        scheduler.prepare(default)
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

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), in the OpenAI error shape as every other refusal."""
        state.metrics.record_request(NO_POLICY, exc.status_code)
        message = f"{exc.detail} ({request.method} {request.url.path})"
        error = ApiError(message, status=exc.status_code, headers=exc.headers)
        return error.response()

    app.add_middleware(CompleteErrors, on_error=lambda: state.metrics.record_request(NO_POLICY, 500))

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
        body = await parse(request, CompletionRequest)
        _require_ready(state)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError("send one prompt per request (a list of exactly one string)", param="prompt")
            prompt = prompt[0]
        return await _generate(state, request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatRequest)
        _require_ready(state)
        if not body.messages:
            raise ApiError("messages must not be empty", param="messages")
        if not getattr(state.tokenizer, "chat_template", None):
            raise ApiError(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        if body.max_completion_tokens is not None and body.max_tokens is not None:
            raise ApiError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template itself can refuse a conversation (e.g. role order)
            raise ApiError(f"the chat template refused these messages: {exc}", param="messages") from None
        return await _generate(state, request, body, prompt, chat=True)

    return app


class CompleteErrors:
    """Answers an exception no route handled with an OpenAI-shaped 500 and ends it there. (Starlette's
    handler for ``Exception`` sends its answer and then raises again, and uvicorn, seeing an exception
    after the answer began, closes the connection: the client's next request on it was reset.) An
    exception after the answer began still closes the connection, as the answer is then incomplete."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None]):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error")
            self.on_error()
            answer = ApiError(f"internal error: {exc}", 500, type="server_error").response()
            await answer(scope, receive, send)


def _require_ready(state: _State) -> None:
    if state.scheduler is None:
        raise ApiError("the model is still loading", 503, type="server_error", code="loading")


async def _generate(
    state: _State, request: Request, body: SamplingRequest, prompt: str, chat: bool
) -> Response:
    """Check the request, tokenise its prompt, queue it, and answer: the whole result or the stream."""
    if body.model is not None and body.model != state.model_id:
        raise ApiError(
            f"the model '{body.model}' does not exist; this server serves '{state.model_id}'",
            404,
            param="model",
            code="model_not_found",
        )
    body.refuse_unsupported()
    param = "messages" if chat else "prompt"
    ids = prompt_ids(state.tokenizer, prompt, param)
    default_max_tokens = state.settings.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling = sampling_config(body, len(ids), state.loaded.max_context, default_max_tokens, param)
    extra = body.model_extra or {}
    policy_name, policy = resolve_policy(body.kv_policy, extra, state.defaults, state.loaded.spec)
    try:
        job = state.scheduler.submit(ids, policy, sampling, stream=bool(body.stream))
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
    except InputError as exc:  # it could never fit the KV pool
        raise ApiError(str(exc), 400, param=param, code="context_length_exceeded") from None

    def record(status: int) -> None:
        state.metrics.record_request(policy_name, status)

    meta = answer_meta(chat, state.model_id)
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        events = answers.events(job, meta, chat, len(ids), include_usage, record)
        return answers.JobStream(events, job, lambda: record(499))
    result = await answers.result(request, job, record)
    if isinstance(result, Response):
        return result
    record(200)
    return JSONResponse(completion(meta, chat, result, len(ids), kv_report(result)))


class GracefulServer(uvicorn.Server):
    """uvicorn's server for an app of :func:`create_app`. Its graceful shutdown stops taking connections and
    gives the requests in flight ``graceful_timeout`` seconds; then the app's scheduler ends what is still
    waiting or running, each with a 503 its client receives (uvicorn alone would cancel their tasks, and
    the clients got a plain-text 500 and the log a traceback), and uvicorn cancels what is left
    ``SHUTDOWN_ANSWER_S`` seconds later. ``config``: the rest of ``uvicorn.Config``."""

    def __init__(self, app: FastAPI, graceful_timeout: float, **config: Any):
        timeout = graceful_timeout + SHUTDOWN_ANSWER_S
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=timeout, **config))
        self._graceful_timeout = graceful_timeout
        self._state: _State = app.state.infinikv

    async def shutdown(self, sockets: list | None = None) -> None:
        loop = asyncio.get_running_loop()
        ending = loop.call_later(self._graceful_timeout, lambda: loop.run_in_executor(None, self._end_jobs))
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    def _end_jobs(self) -> None:
        if self._state.scheduler is not None:
            self._state.scheduler.stop()
