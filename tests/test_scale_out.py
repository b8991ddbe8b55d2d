"""Scale-out on Ray (docs/scale-out.md), on one local cluster of 2 CPUs started for the module: a sweep spread
over Ray tasks gives the serial sweep's cells, a group whose worker dies is retried and lands once, two Serve
replicas answer the openai client as a single server does; and the mistakes are one line."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from ray import serve
from ray.exceptions import ActorDiedError

from infinikv.cli import main
from infinikv.cluster import Spread, connect, disconnect
from infinikv.errors import InputError, ModelError
from infinikv.eval import sweep
from infinikv.gpucheck.cli import run_check
from infinikv.gpucheck.plan import TINY
from infinikv.invariant import ROWS_ALONE_ENV, rows_alone_choice
from infinikv.models import load
from infinikv.serve.kv_policy import PolicyDefaults
from infinikv.serve.replicas import ReplicaOptions, application, routing_key, start_serve

from .test_server import serving

MODEL = "dummy:tiny"  # random weights, seeded: the same model in every process


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    connect(None, num_cpus=2, temp_dir=tmp_path_factory.mktemp("ray"))
    yield
    disconnect()


def sweep_config(tmp_path: Path, out: str) -> sweep.SweepConfig:
    """(a text, a task) x dense and two Quest budgets, and a context the model cannot hold (its cells fail,
    and the sweep goes on)."""
    text = tmp_path / "t.txt"
    text.write_text("Some text to score, again and again. " * 60, encoding="utf-8")
    path = tmp_path / f"{out}.json"
    path.write_text(
        json.dumps(
            {
                "name": out,
                "out": str(tmp_path / out),
                "models": [{"name": MODEL, "contexts": [300, 5000]}],
                "policies": {"dense": {}, "quest": {"budget": [0.2, 0.5]}},
                "retrieval": {"tasks": ["passkey"], "samples": 1},
                "ppl": {"texts": [str(text)], "scored": 60, "contexts": [300]},
            }
        )
    )
    return sweep.read_config(path)


def measured(out: Path) -> dict[str, dict]:
    """cells.jsonl by key, each key once, without the figures that are times or shares of time (they differ
    run to run)."""
    records = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)), "a cell landed twice"
    return {r["key"]: untimed(r) for r in records}


def untimed(value):
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if not k.endswith("_s") and "time" not in k}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def failed_keys(out: Path) -> set[str]:
    path = out / "failed.jsonl"
    return {json.loads(line)["key"] for line in path.read_text().splitlines()} if path.exists() else set()


# -- mistakes and routing, before the cluster starts (its log lines would mix with the CLI's) ---------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["eval", "sweep", "--config", "c.toml", "--ray", "--address", "nowhere"],
            "--address: expected auto",
        ),
        (
            ["eval", "sweep", "--config", "c.toml", "--ray", "--address", "ray://h:99999"],
            "--address: expected",
        ),
        (["eval", "sweep", "--config", "c.toml", "--address", "auto"], "--address needs --ray"),
        (["eval", "sweep", "--config", "c.toml", "--ray", "--address", "127.0.0.1:1"], "cannot reach a Ray"),
        (["serve", "--ray", "--address", "ray://127.0.0.1:1"], "cannot reach a Ray cluster at ray://"),
        (["serve", "--replicas", "2"], "--replicas needs --ray"),
        (["serve", "--ray", "--gpus-per-task", "-1"], "--gpus-per-task >= 0"),
    ],
)
def test_cli_mistakes_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(
        'models = [{name = "dummy:tiny", contexts = [300]}]\n[policies]\ndense = {}\n'
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("argv", [["eval", "sweep", "--config", "c.toml", "--ray"], ["serve", "--ray"]])
def test_without_ray_installed_ray_is_one_line(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(
        'models = [{name = "dummy:tiny", contexts = [300]}]\n[policies]\ndense = {}\n'
    )
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as it does where it is not installed
    assert main(argv) == 2
    assert (
        capsys.readouterr().err.strip()
        == "infinikv: error: ray is not installed; pip install 'infinikv[ray]'"
    )


def test_serve_flags_reach_every_replica(monkeypatch):
    """The scheduler and engine flags of `serve --ray` are each replica's, as they are a single server's."""
    from infinikv.engine import EngineConfig
    from infinikv.serve import replicas

    started = []
    monkeypatch.setattr(replicas, "serve_forever", lambda options, *where: started.append(options))
    argv = ["serve", "--ray", "--scheduler", "static", "--block-tokens", "64", "--chunk-tokens", "32"]
    assert main([*argv, "--step-tokens", "96", "--kv-memory", "0.5", "--no-prefix-cache", "--compile"]) == 0
    settings = started[0].settings()
    assert settings.scheduler == "static"
    assert settings.engine == EngineConfig(
        block_tokens=64, chunk_tokens=32, step_tokens=96, kv_memory=2**29, prefix_cache=False, compile=True
    )
    built = replicas.options_from(
        {"model": MODEL, "engine": json.dumps({"block_tokens": 64, "chunk_tokens": 64})}
    )
    assert built.engine == EngineConfig(block_tokens=64, chunk_tokens=64)  # `serve run`'s engine=JSON
    with pytest.raises(InputError, match="unknown fields blocks"):
        replicas.options_from({"model": MODEL, "engine": {"blocks": 64}})


def test_infinikv_runs_without_ray():
    """Every module but the two that scale out imports with ray unimportable."""
    code = (
        "import importlib, pkgutil, sys; sys.modules['ray'] = None; import infinikv\n"
        "for m in pkgutil.walk_packages(infinikv.__path__, 'infinikv.'):\n"
        "    if m.name != 'infinikv.serve.replicas' and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src}, timeout=300)
    assert done.returncode == 0


def test_the_routing_key_is_the_kv_configuration_a_request_asks_for():
    defaults = PolicyDefaults("quest", (("budget", 0.3),))

    def key(**body) -> str:
        return routing_key(json.dumps(body).encode(), defaults)

    # no kv fields, the server's policy named, and its knob at the server's value: one configuration
    assert key(prompt="a") == key(prompt="b", kv_policy="quest") == key(kv_policy="quest", kv_budget=0.3)
    assert key(kv_policy="quest", kv_budget=0.5) != key(prompt="a")
    assert key(kv_policy="dense") != key(prompt="a")
    assert key(kv_policy="magic") == key(kv_budget="lots") == routing_key(b"{not json", defaults) == ""
    assert routing_key(b"", defaults) == ""


# -- sweeps --------------------------------------------------------------------------------------------------
def test_a_sweep_over_ray_tasks_gives_the_serial_cells(cluster, tmp_path, capsys):
    serial = sweep_config(tmp_path, "serial")
    spread = sweep_config(tmp_path, "spread")
    # Each task runs torch on its --cpus-per-task threads (1 here). The serial run uses one as well: a
    # reduction split over another number of threads sums in another order, and moves the last digits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sweep.run_sweep(serial, progress=False)
    finally:
        torch.set_num_threads(threads)
    sweep.run_sweep(spread, progress=False, spread=Spread(cpus=1))
    mine, theirs = measured(serial.out), measured(spread.out)
    assert len(mine) == 2 * 3 and mine.keys() == theirs.keys()
    for key in mine:
        assert theirs[key] == mine[key], key
    # The context of 5000 tokens is beyond the model's 4096: its retrieval cells failed, each recorded once.
    failed = failed_keys(spread.out)
    assert failed == failed_keys(serial.out) and len(failed) == 3
    assert all(json.loads(key)[1] == 5000 for key in failed)
    assert "failed" in capsys.readouterr().err
    # Resumable: a second run measures nothing already measured, only the failed cells again.
    sweep.run_sweep(spread, progress=False, spread=Spread(cpus=1))
    assert measured(spread.out) == theirs and len(failed_keys(spread.out)) == 3
    lines = (spread.out / "failed.jsonl").read_text().splitlines()
    assert len(lines) == 6


def dies_once(marker: Path):
    """A loader whose first call, in whichever worker, kills that worker (the marker file is created
    exclusively, so only one dies); later calls load the model."""

    def loader(name: str):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return load(name)
        os._exit(1)

    return loader


def one_context(tmp_path: Path, out: str) -> sweep.SweepConfig:
    """Two groups (the text and the task) of three cells."""
    config = sweep_config(tmp_path, out)
    return dataclasses.replace(config, models=(sweep.SweepModel(MODEL, (300,)),))


def test_workers_compute_rows_alone_as_the_driver_does(cluster):
    """A worker times nothing to choose how it computes an engine step's rows alone: it is pinned to the
    driver's choice (two tasks on two busy cores could each time it otherwise, and give other last bits)."""
    import ray

    @ray.remote
    def pinned() -> str | None:
        return os.environ.get(ROWS_ALONE_ENV)

    assert ray.get([pinned.remote(), pinned.remote()]) == [rows_alone_choice()] * 2


def test_a_killed_worker_group_is_retried_and_lands_once(cluster, tmp_path):
    config = one_context(tmp_path, "killed")
    loader = dies_once(tmp_path / "died")
    sweep.run_sweep(config, loader=loader, progress=False, spread=Spread(cpus=1, retries=2))
    assert (tmp_path / "died").exists()
    assert len(measured(config.out)) == 2 * 3 and not failed_keys(config.out)


def test_a_worker_that_dies_beyond_its_retries_fails_its_cells_and_the_sweep_goes_on(cluster, tmp_path):
    config = one_context(tmp_path, "lost")
    loader = dies_once(tmp_path / "died")
    sweep.run_sweep(config, loader=loader, progress=False, spread=Spread(cpus=1, retries=0))
    lost, landed = failed_keys(config.out), measured(config.out)
    assert len(lost) == 3 and len(landed) == 3 and not lost & landed.keys()
    error = json.loads((config.out / "failed.jsonl").read_text().splitlines()[0])["error"]
    assert error.startswith("task failed:")


# -- bench and GPU check -------------------------------------------------------------------------------------
def test_bench_cells_as_ray_tasks_measure_what_a_serial_bench_does(cluster, tmp_path, capsys):
    argv = [
        "bench",
        "--model",
        MODEL,
        "--device",
        "cpu",
        "--policies",
        "dense,offload,quest",
        "--peers",
        "none",
    ]
    argv += ["--batch", "1,2", "--context", "48", "--gen", "4", "--repeats", "1", "--warmup", "0"]
    argv += ["--corpus", "none", "--quiet", "--json"]
    assert main(argv) == 0
    serial = json.loads(capsys.readouterr().out)
    assert main([*argv, "--ray", "--report", str(tmp_path / "bench.md")]) == 0
    spread = json.loads(capsys.readouterr().out)
    assert [(c["batch"], c["context"]) for c in spread["cells"]] == [(1, 48), (2, 48)]
    counted = ("name", "bytes_h2d_per_token", "kv_fraction_moved", "kv_fraction_attended")
    for mine, theirs in zip(serial["cells"], spread["cells"], strict=True):
        assert [[r[k] for k in counted] for r in theirs["rows"]] == [
            [r[k] for k in counted] for r in mine["rows"]
        ]
        assert theirs["ran_on"]["host"] == socket.gethostname() and theirs["ran_on"]["device"] == "cpu"
    assert "Ray: each cell ran as its own task" in (tmp_path / "bench.md").read_text()


def test_gpu_check_contexts_as_ray_tasks(cluster, tmp_path):
    plan = dataclasses.replace(TINY, contexts=(64, 96), batches=(1,), policies=("dense", "offload"))
    assert run_check(tmp_path, plan, tiny=True, run_cuda_tests=False, spread=Spread()) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert sorted(c["context"] for c in report["contexts"]) == [64, 96]
    assert all(c["status"] == "ok" and c["ran_on"]["host"] for c in report["contexts"])
    assert sorted((r["context"], r["name"]) for r in report["rows"]) == [
        (64, "dense"), (64, "offload"), (96, "dense"), (96, "offload"),
    ]  # fmt: skip
    assert (tmp_path / "gpu_check.md").read_text().count("(Ray task on") == 2


# -- serving -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(cluster):
    port = free_port()
    start_serve("127.0.0.1", port)
    app = application(ReplicaOptions(MODEL, replicas=2, max_batch=4))
    serve.run(app, name="test", route_prefix="/", logging_config={"enable_access_log": False})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_two_replicas_answer_the_openai_client_as_one_server_does(replicas):
    prompts = ["hello", "The quick brown fox", "Once upon a time"]
    asks = [{}, {"kv_policy": "quest", "kv_budget": 0.5}, {"kv_policy": "streaming", "kv_window": 8}]
    with serving(load(MODEL)) as (url, _app):
        single = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        spread = openai.OpenAI(base_url=f"{replicas}/v1", api_key="unused", max_retries=0)
        for prompt in prompts:
            for extra in asks:
                ask = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
                one = single.completions.create(**ask)
                two = spread.completions.create(**ask)
                assert two.choices[0].text == one.choices[0].text
                assert two.model_extra["kv"]["knobs"] == one.model_extra["kv"]["knobs"]
                streamed = spread.completions.create(**ask, stream=True)
                assert "".join(c.choices[0].text for c in streamed if c.choices) == one.choices[0].text
        with pytest.raises(openai.BadRequestError, match="unknown policy"):
            spread.completions.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_body={"kv_policy": "magic"}
            )
    assert spread.models.list().data[0].id == MODEL


def test_serve_dying_as_it_starts_is_one_line(monkeypatch):
    """On a loaded machine Serve's proxy can miss its checks and Serve's controller raises (ActorDiedError):
    one line, not a traceback."""

    def died(**_options):
        raise ActorDiedError(cause=None)

    monkeypatch.setattr(serve, "start", died)
    with pytest.raises(ModelError, match="^Ray Serve did not start: ") as raised:
        start_serve("127.0.0.1", free_port())
    assert "\n" not in str(raised.value)


def test_metrics_answer_from_one_replica(replicas):
    import httpx

    text = httpx.get(f"{replicas}/metrics", timeout=30).text
    assert "infinikv_requests_total" in text
