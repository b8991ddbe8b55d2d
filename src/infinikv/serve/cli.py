"""``infinikv serve`` (the OpenAI-compatible server) and ``infinikv bench-serve`` (its load generator)."""

from __future__ import annotations

import argparse
import logging
import math
import socket

from ..cliargs import COMPILE_HELP, add_dtype_argument
from ..errors import InputError, ModelError
from ..models import DEFAULT_MODEL
from . import DEFAULT_REQUEST_TIMEOUT


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got '{text}'") from None
    if not math.isfinite(value) or value * 2**30 < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB (a byte at least), got '{text}'")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{text}'") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got '{text}'")
    return value


def _check_listen(host: str, port: int) -> None:
    """One line, before the model loads, when ``host:port`` cannot be listened on (taken, not an address of
    this machine, no permission), instead of the web server's own log lines."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket
            probe.bind(address)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from ..cluster import spread_from_args
    from ..engine import EngineConfig
    from ..models import load
    from ..policies import make_config
    from ..policy_flags import policy_knobs
    from .app import GracefulServer, ServerSettings, create_app

    knobs = policy_knobs(args)
    make_config(args.policy, **knobs)  # a bad policy or knob fails before the model loads
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    spread = spread_from_args(args)
    if spread is None and args.replicas is not None:
        raise InputError("--replicas needs --ray")
    if spread is None:
        _check_listen(args.host, args.port)
    engine = EngineConfig(
        block_tokens=args.block_tokens,
        chunk_tokens=args.chunk_tokens,
        step_tokens=args.step_tokens,
        kv_memory=None if args.kv_memory is None else int(args.kv_memory * 2**30),
        prefix_cache=not args.no_prefix_cache,
        compile=args.compile,
    )
    if spread is not None:
        from .replicas import ReplicaOptions, serve_forever

        options = ReplicaOptions(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            policy=args.policy,
            knobs=knobs,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            default_max_tokens=args.default_max_tokens,
            served_name=args.served_model_name,
            request_timeout=args.request_timeout or None,
            replicas=args.replicas or 1,
            cpus=spread.cpus,
            gpus=spread.gpus,
            scheduler=args.scheduler,
            engine=engine,
        )
        serve_forever(options, spread.address, args.host, args.port)
        return 0
    settings = ServerSettings(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        scheduler=args.scheduler,
        engine=engine,
        default_max_tokens=args.default_max_tokens,
        served_name=args.served_model_name,
        request_timeout=args.request_timeout or None,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    server: GracefulServer | None = None
    load_error: list[str] = []

    def stop_on_load_error(message: str) -> None:
        load_error.append(message)
        server.should_exit = True

    app = create_app(
        lambda: load(args.model, device=args.device, dtype=args.dtype),
        policy=args.policy,
        knobs=knobs,
        settings=settings,
        on_load_error=stop_on_load_error,
    )
    server = GracefulServer(
        app, args.graceful_timeout, host=args.host, port=args.port, log_level=args.log_level
    )
    server.run()
    if load_error:
        raise ModelError(load_error[0])
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from .loadgen import run_from_args

    return run_from_args(args)


def register_cli(subparsers) -> None:
    from ..policy_flags import add_policy_arguments

    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server; each request picks its KV policy"
    )
    serve.add_argument(
        "--model", default=DEFAULT_MODEL, help="registered name, .gguf file, HF directory or hub id"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: --model's name)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it; see docs)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--max-batch", type=_positive, default=8, help="requests decoded together (static: per generate call)"
    )
    serve.add_argument(
        "--scheduler",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: requests join and leave the running batch at every step (docs/serving.md); "
        "static: one batch of requests with equal policy and sampling at a time, each waiting for the last",
    )
    serve.add_argument(
        "--block-tokens", type=_positive, default=128, help="tokens per block of the KV pool and prefix cache"
    )
    serve.add_argument(
        "--chunk-tokens", type=_positive, default=128, help="prompt tokens per prefill pass (divides a block)"
    )
    serve.add_argument(
        "--step-tokens",
        type=_positive,
        default=256,
        help="tokens one engine step feeds: one per running request, the rest to prompt chunks",
    )
    serve.add_argument(
        "--kv-memory",
        type=_gib,
        default=None,
        help="GiB the KV pool may hold (default: half the memory free at start); requests wait beyond it",
    )
    serve.add_argument(
        "--no-prefix-cache", action="store_true", help="prefill every prompt in full (no prefix sharing)"
    )
    serve.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    serve.add_argument("--max-queue", type=_positive, default=64, help="waiting requests before 429")
    serve.add_argument(
        "--default-max-tokens", type=_positive, default=256, help="chat requests without max_tokens"
    )
    serve.add_argument(
        "--request-timeout",
        type=_seconds,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds from a request's arrival until it is cancelled and answered 504 (0 = no deadline; "
        f"default {DEFAULT_REQUEST_TIMEOUT:g})",
    )
    serve.add_argument(
        "--graceful-timeout", type=_seconds, default=30.0, help="seconds in-flight requests get on shutdown"
    )
    serve.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_dtype_argument(serve)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_policy_arguments(serve)
    from ..cluster import add_arguments as add_ray_arguments

    add_ray_arguments(serve, "serve on Ray Serve: --replicas copies of the app, each with its model")
    serve.add_argument(
        "--replicas", type=_positive, default=None, help="with --ray: Serve replicas (default 1)"
    )
    serve.set_defaults(func=cmd_serve)

    from .loadgen import add_arguments

    bench = subparsers.add_parser(
        "bench-serve", help="load test of a server: concurrent streaming clients, TTFT and per-token latency"
    )
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench_serve)
