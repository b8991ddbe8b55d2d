"""Fan work out over a Ray cluster: the one place besides ``serve.replicas`` that imports ray.

``--ray`` on ``infinikv eval sweep`` and ``infinikv bench`` (and ``--ray`` of the GPU check) builds a
:class:`Spread` from the command line; :meth:`Spread.run` sends one Ray task per item and yields each
:class:`Finished` item as its task ends, in the order they end, with the node and GPUs it ran on. A task
whose worker dies is retried by Ray (``retries``); a task that raises is reported with its error, and the
others go on. ray is imported only when a Spread connects, so the rest of infinikv runs without it.

Workers run the driver's own infinikv: the package travels to the cluster in the job's runtime
environment (``py_modules``), so a worker never imports another installed copy. Each task sets torch's
CPU threads to the CPUs it holds. Where :func:`connect` starts or joins the cluster (``--ray``, and
``infinikv serve --replicas``), the job's workers and Serve replicas compute an engine step's rows alone as
the driver does (``invariant.rows_alone_choice``, pinned in their environment, over a pin a node sets), so a
spread sweep's cells are the serial sweep's bit for bit on nodes of the driver's CPU model, however loaded a
worker is when it starts; a process that was connected to Ray already pins nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .invariant import ROWS_ALONE_ENV, rows_alone_choice

INSTALL_HINT = "ray is not installed; pip install 'infinikv[ray]'"
_ADDRESS = re.compile(r"^(ray://)?[A-Za-z0-9.\-\[\]:]+:(\d{1,5})$")


def check_address(address: str | None) -> None:
    """``None`` (start a local cluster), ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``; else one line."""
    if address is None or address == "auto":
        return
    match = _ADDRESS.match(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise InputError(f"--address: expected auto, HOST:PORT or ray://HOST:PORT, got '{address}'")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None, temp_dir: Path | None = None) -> bool:
    """Join the cluster at ``address`` (None: start a local one with ``num_cpus`` CPUs, its files under
    ``temp_dir``). Returns whether this call connected (False: this process was connected already)."""
    check_address(address)
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address not in (None, "auto"):
        _check_reachable(address)
    local = (
        {"num_cpus": num_cpus, "_temp_dir": str(temp_dir) if temp_dir else None} if address is None else {}
    )
    # the workers compute rows alone as this process does, whatever they would time under their neighbours'
    # load (a pin of this process's own is passed on; a bad one is its own error, before ray is reached)
    rows_alone = rows_alone_choice()
    try:
        ray.init(
            address=address,
            runtime_env={
                "py_modules": [str(Path(__file__).resolve().parent)],  # this infinikv
                "env_vars": {ROWS_ALONE_ENV: rows_alone},
            },
            include_dashboard=False,
            logging_level=logging.WARNING,
            **{k: v for k, v in local.items() if v is not None},
        )
    except Exception as exc:  # ray says why in many types (ConnectionError, ValueError, RuntimeError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"cannot reach a Ray cluster at {address or 'a new local cluster'}: {first}"
        ) from None
    if threading.current_thread() is threading.main_thread():
        # terminated like interrupted, so the caller's cleanup runs: a local cluster's processes end with it
        signal.signal(signal.SIGTERM, _interrupt)
    return True


def _check_reachable(address: str) -> None:
    """One line at once when nothing answers at ``address`` (Ray itself keeps retrying for minutes)."""
    host, port = address.removeprefix("ray://").rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise InputError(f"cannot reach a Ray cluster at {address}: {exc.strerror or exc}") from None


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def disconnect() -> None:
    import_ray().shutdown()


@dataclass(frozen=True)
class Finished:
    """One item's task, ended: its value, or the one-line error it ended with; and where it ran."""

    item: Any
    value: Any = None
    error: str | None = None
    where: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """How each task is placed: the cluster's address (None: a new local cluster), CPUs and GPUs per task,
    and how often Ray retries a task whose worker died."""

    address: str | None = None
    cpus: float = 1.0
    gpus: float = 0.0
    retries: int = 3

    def __post_init__(self):
        check_address(self.address)
        if self.cpus <= 0 or self.gpus < 0:
            raise InputError(
                f"--cpus-per-task must be > 0 and --gpus-per-task >= 0, got {self.cpus}, {self.gpus}"
            )

    def run(self, work: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Finished]:
        """``work(item)`` for every item, one Ray task each, yielded as they end. Connects first (and
        disconnects after, when it connected)."""
        owned = connect(self.address)
        ray = import_ray()
        try:
            task = ray.remote(
                num_cpus=self.cpus, num_gpus=self.gpus, max_retries=self.retries, retry_exceptions=False
            )(_located)
            threads = max(1, int(self.cpus))
            pending = {task.remote(work, item, threads): item for item in items}
            try:
                while pending:
                    [ref], _ = ray.wait(list(pending), num_returns=1)
                    item = pending.pop(ref)
                    try:
                        value, where = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:  # work raised: its own error, one line
                        cause = exc.cause if exc.cause is not None else exc
                        yield Finished(item, error=_one_line(cause))
                        continue
                    except ray.exceptions.RayError as exc:  # the worker died more often than retried
                        yield Finished(item, error=_one_line(exc))
                        continue
                    yield Finished(item, value, where=where)
            finally:
                for ref in pending:  # interrupted: stop what is still queued or running
                    ray.cancel(ref, force=True)
        finally:
            if owned:
                disconnect()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _located(work: Callable[[Any], Any], item: Any, threads: int) -> tuple[Any, dict[str, Any]]:
    """Run in the worker: ``work(item)`` with torch on ``threads`` threads; returns it and where it ran."""
    import ray
    import torch

    torch.set_num_threads(threads)
    context = ray.get_runtime_context()
    where = {
        "host": socket.gethostname(),
        "node": context.get_node_id()[:12],
        "pid": os.getpid(),
        "gpus": [str(g) for g in ray.get_gpu_ids()],
    }
    return work(item), where


def add_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ray`` (help: ``what``) and its placement options."""
    group = parser.add_argument_group("Ray (pip install 'infinikv[ray]'; docs/scale-out.md)")
    group.add_argument("--ray", action="store_true", help=what)
    group.add_argument(
        "--address", default=None, help="auto, HOST:PORT or ray://HOST:PORT (default: start a local cluster)"
    )
    group.add_argument("--cpus-per-task", type=float, default=None, help="CPUs each task holds (default 1)")
    group.add_argument("--gpus-per-task", type=float, default=None, help="GPUs each task holds (default 0)")


def spread_from_args(args: argparse.Namespace) -> Spread | None:
    """The Spread ``--ray`` asks for (ray importable and the cluster answering, checked now, before any
    work), or None without ``--ray``, where a placement option alone is a mistake."""
    placement = {"address": args.address, "cpus": args.cpus_per_task, "gpus": args.gpus_per_task}
    given = {name: value for name, value in placement.items() if value is not None}
    if not args.ray:
        if given:
            flags = {"address": "--address", "cpus": "--cpus-per-task", "gpus": "--gpus-per-task"}
            raise InputError(f"{', '.join(flags[name] for name in given)} needs --ray")
        return None
    spread = Spread(**given)
    import_ray()
    if spread.address not in (None, "auto"):
        _check_reachable(spread.address)
    return spread
