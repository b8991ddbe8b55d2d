"""``infinikv serve --ray``: the server's app on Ray Serve, N replicas with a model and a scheduler each.

Two deployments make one Serve application (:func:`application`):

* ``InfinikvServer``: the replicas. Each loads the model and runs :func:`~infinikv.serve.app.create_app` in
  its own process (the same routes, request checks, answers and metrics as ``infinikv serve``), and plays
  each HTTP request through the app itself, sending the answer back message by message, so streams stream.
* ``InfinikvIngress``: what Serve's HTTP proxy calls. It reads a request's body, takes the KV configuration
  it asks for (``kv_policy`` and its ``kv_<knob>`` fields, resolved as the replica will resolve them) as
  the key of Serve's model-multiplexing router, and hands the request to a replica through it. Serve sends
  a key to a replica that already served it, so requests of one configuration keep batching together; a
  replica takes at most ``max_batch`` requests at once, and when those that know the key are full, Serve
  falls back to the replica with the fewest keys. Requests without a body (``/health``, ``/metrics``,
  ``/v1/models``) and bodies naming no valid configuration go to any replica, by queue length.

``GET /metrics`` is per replica: it answers with the metrics of the replica it reached.

:func:`build` is the application builder that ``serve run infinikv.serve.replicas:build key=value ...`` and a
Serve config file (``configs/serve-ray.yaml``) name. This module imports ray at its top: it is loaded only
when asked to serve on Ray (the [ray] extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..cliargs import DTYPE_NAMES
from ..engine import EngineConfig
from ..errors import InputError, ModelError, PolicyError
from ..policies import make_config
from . import DEFAULT_REQUEST_TIMEOUT
from .app import ServerSettings, create_app
from .kv_policy import PolicyDefaults, requested_config

# The scope keys a replica's app needs; the proxy's scope carries more, not all of it picklable.
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string")
SCOPE_KEYS += ("headers", "server", "client")
INGRESS_MAX_ONGOING = 1024  # the ingress only relays; the replicas bound the work
MAX_KEYS_PER_REPLICA = 64  # KV configurations a replica is known for (Serve forgets the least recent)
# Serve's controller gives its HTTP proxy three 5-second checks to come up, and a loaded machine (replicas
# loading their models beside it) can miss them all; a minute each is room enough. The replicas' own
# health check gets as long, for the same reason. Variables already set win.
PROXY_CHECK_SECONDS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}
REPLICA_HEALTH_CHECK_TIMEOUT_S = 60


@dataclass(frozen=True)
class ReplicaOptions:
    """One replica's model and server settings, and how many replicas, with what resources."""

    model: str
    device: str | None = None
    dtype: str | None = None  # models.load's
    policy: str = "dense"
    knobs: dict[str, Any] = field(default_factory=dict)
    max_batch: int = 8
    max_queue: int = 64
    default_max_tokens: int = 256
    served_name: str | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    replicas: int = 1
    cpus: float = 1.0
    gpus: float = 0.0
    scheduler: str = "continuous"  # ServerSettings.scheduler
    engine: EngineConfig = field(default_factory=EngineConfig)  # each replica's engine (its own pool)

    def __post_init__(self):
        if self.replicas < 1 or self.cpus <= 0 or self.gpus < 0:
            raise InputError("--replicas must be >= 1, --cpus-per-task > 0 and --gpus-per-task >= 0")
        make_config(self.policy, **self.knobs)  # a bad default policy or knob fails before any replica
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise InputError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_NAMES)}")

    @property
    def defaults(self) -> PolicyDefaults:
        return PolicyDefaults(self.policy, tuple(sorted(self.knobs.items())))

    def settings(self) -> ServerSettings:
        return ServerSettings(
            max_batch=self.max_batch,
            max_queue=self.max_queue,
            default_max_tokens=self.default_max_tokens,
            request_timeout=self.request_timeout,
            served_name=self.served_name,
            scheduler=self.scheduler,
            engine=self.engine,
        )


def routing_key(body: bytes, defaults: PolicyDefaults) -> str:
    """The KV configuration a request body asks for, as text ("" for no body, or one that names no valid
    configuration: the replica will answer it with its error)."""
    if not body:
        return ""
    try:
        request = json.loads(body)
        if not isinstance(request, dict):
            return ""
        extra = {k: v for k, v in request.items() if k != "kv_policy"}  # the knobs, as the schema leaves them
        name, config = requested_config(request.get("kv_policy"), extra, defaults)
    except (ValueError, RecursionError, TypeError, PolicyError):
        return ""
    return f"{name} {json.dumps(config.knobs(), sort_keys=True, default=str)}"


class InfinikvServer:
    """A replica: the model, the app, and the app's lifespan (its scheduler), started on the first call."""

    def __init__(self, options: ReplicaOptions):
        import torch

        from ..models import load

        torch.set_num_threads(max(1, int(options.cpus)))
        loaded = load(options.model, device=options.device, dtype=options.dtype)
        self.app = create_app(loaded, options.policy, options.knobs, options.settings())
        self._lifespan: AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    async def _started(self) -> None:
        async with self._starting:
            if self._lifespan is None:
                stack = AsyncExitStack()
                await stack.enter_async_context(self.app.router.lifespan_context(self.app))
                self._lifespan = stack

    @serve.multiplexed(max_num_models_per_replica=MAX_KEYS_PER_REPLICA)
    async def serve_key(self, key: str) -> str:
        """Marks this replica as serving ``key``: nothing to load, the policy is prepared on first use."""
        return key

    async def relay(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
        """Play one HTTP request through the app; yields the ASGI messages of its answer as they are sent.
        When the caller stops reading (the client left), the app sees the client disconnect."""
        await self._started()
        key = serve.get_multiplexed_model_id()
        if key:
            await self.serve_key(key)
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        unread = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if unread:
                return unread.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        call = asyncio.create_task(self.app(dict(scope, root_path="", state={}), receive, messages.put))
        call.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            await call  # an error the app let out is the caller's error
        finally:
            gone.set()


class Relayed(Response):
    """The replica's answer, sent on as its messages arrive; the replica's call is cancelled if the client
    leaves first."""

    def __init__(self, start: dict[str, Any], rest: DeploymentResponseGenerator):
        self.start, self.rest = start, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send(self.start)
            async for message in self.rest:
                await send(message)
            finished = True
        finally:
            if not finished:
                self.rest.cancel()


class InfinikvIngress:
    """The HTTP entry: each request to a replica, routed by its KV configuration."""

    def __init__(self, server: DeploymentHandle, defaults: PolicyDefaults):
        self.server, self.defaults = server, defaults

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
        key = routing_key(body, self.defaults)
        answer = self.server.options(stream=True, multiplexed_model_id=key).relay.remote(scope, body)
        return Relayed(await answer.__anext__(), answer)


def application(options: ReplicaOptions) -> serve.Application:
    """The Serve application: the ingress bound to ``options.replicas`` server replicas."""
    server = serve.deployment(
        InfinikvServer,
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_batch,  # beyond one batch, Serve routes to another replica
        ray_actor_options={"num_cpus": options.cpus, "num_gpus": options.gpus},
        health_check_timeout_s=REPLICA_HEALTH_CHECK_TIMEOUT_S,
    )
    ingress = serve.deployment(
        InfinikvIngress, max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(server.bind(options), options.defaults)


def build(args: dict[str, Any]) -> serve.Application:
    """The application builder of ``serve run`` (``options_from``)."""
    return application(options_from(args))


def options_from(args: dict[str, Any]) -> ReplicaOptions:
    """:class:`ReplicaOptions` from ``serve run``'s ``args``: its fields as strings from the command line, or
    typed values from a config file; ``knobs`` and ``engine`` (``EngineConfig`` fields) as JSON objects."""
    known = {f.name: f.type for f in fields(ReplicaOptions)}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise InputError(f"unknown arguments {', '.join(unknown)}; known: {', '.join(known)}")
    typed: dict[str, Any] = {}
    for name, value in args.items():
        if name in ("knobs", "engine") and isinstance(value, str):
            value = json.loads(value)
        if name == "engine":
            unknown = sorted(set(value) - {f.name for f in fields(EngineConfig)})
            if unknown:
                raise InputError(f"engine: unknown fields {', '.join(unknown)}")
            value = EngineConfig(**value)
        elif name in ("max_batch", "max_queue", "default_max_tokens", "replicas"):
            value = int(value)
        elif name in ("cpus", "gpus", "request_timeout"):
            value = float(value)
        typed[name] = value
    return ReplicaOptions(**typed)


def start_serve(host: str, port: int) -> None:
    """Start Serve on the connected cluster with its HTTP proxy on ``host:port`` and the proxy's checks of
    :data:`PROXY_CHECK_SECONDS`; ``ModelError`` (one line) when its controller or proxy dies coming up."""
    checks = {name: os.environ.get(name, seconds) for name, seconds in PROXY_CHECK_SECONDS.items()}
    try:
        serve.start(
            http_options={"host": host, "port": port},
            controller_options={"runtime_env": {"env_vars": checks}},
        )
    except RayError as exc:
        raise ModelError(f"Ray Serve did not start: {_last_line(exc)}") from None


def serve_forever(options: ReplicaOptions, address: str | None, host: str, port: int) -> None:
    """Deploy on the cluster at ``address`` (None: a new local one) with Serve's HTTP proxy on
    ``host:port``, and serve until interrupted."""
    from ..cluster import connect, disconnect

    owned = connect(address)
    try:
        start_serve(host, port)
        try:
            serve.run(application(options), name="infinikv", route_prefix="/")
        except RuntimeError as exc:  # a replica failed to start (its model did not load): Serve says why
            raise ModelError(f"the replicas did not start: {_last_line(exc)}") from None
        print(
            f"infinikv: serving {options.model} on http://{host}:{port} with {options.replicas} Ray Serve "
            f"replica(s): {json.dumps(asdict(options))}",
            flush=True,
        )
        while True:
            time.sleep(3600)
    finally:
        if owned:  # the cluster is this command's: Serve and Ray go with it
            serve.shutdown()
            disconnect()
        else:  # a cluster others may use: remove only this application
            serve.delete("infinikv")


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
