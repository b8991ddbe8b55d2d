"""``infinikv bench-serve``: a load test of a running server (or one it starts), on loopback.

For each KV policy (sent per request as ``kv_policy``), ``--requests`` streaming completions go out with at
most ``--concurrency`` in flight, split over ``--rounds`` rounds that take the policies in turn (so a change
in the machine's load falls on all of them alike). Each client records when its request left, when the
first text arrived (time to first token, TTFT) and when the stream ended; per-token latency is the time
after the first token divided by the tokens after it. Per policy it reports requests/s, generated
tokens/s, TTFT and per-token latency p50/p90/p99, errors, and the server's mean batch size (from
``/metrics``, before and after each round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..models import DEFAULT_MODEL

REPORT_BEGIN = "<!-- bench-serve:begin -->"
REPORT_END = "<!-- bench-serve:end -->"
# Prompt vocabulary: plain words, so every prompt tokenises like ordinary text.
WORDS = ("river", "lantern", "harbour", "meadow", "copper", "violin", "orchard", "glacier", "thunder")
WORDS += ("amber", "falcon", "ledger", "canyon", "velvet", "compass", "willow", "signal", "garden")


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    per_token_s: float | None = None  # None when fewer than two tokens came back
    tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_s: dict[str, float]
    per_token_s: dict[str, float]
    mean_batch: float | None
    first_error: str = ""
    samples: list[Sample] = field(default_factory=list, repr=False)


def prompts(count: int, mean_words: int, seed: int) -> list[str]:
    """Distinct prompts of different lengths (0.5x to 1.5x ``mean_words``), the same for every policy."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = max(4, int(mean_words * rng.uniform(0.5, 1.5)))
        words = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(f"Note {i}: {words}.\nSummarise the note above in one sentence:")
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


async def _one(client: Any, url: str, body: dict[str, Any]) -> Sample:
    sent = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Sample(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(False, error=event["error"]["message"])
                if first is None and any(c.get("text") for c in event.get("choices", [])):
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except Exception as exc:  # a failed request is counted, not fatal
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        first = end
    per_token = (end - first) / (tokens - 1) if tokens > 1 else None
    return Sample(True, ttft_s=first - sent, per_token_s=per_token, tokens=tokens)


def _batch_counts(metrics_text: str, policy: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram for ``policy``."""
    found = {"sum": 0.0, "count": 0.0}
    for kind in found:
        match = re.search(
            rf'^infinikv_batch_size_{kind}{{policy="{re.escape(policy)}"}} (\S+)$', metrics_text, re.M
        )
        if match:
            found[kind] = float(match.group(1))
    return found["sum"], found["count"]


@dataclass
class Round:
    """One policy's requests in one round: what the clients saw, and the server's batch-size histogram
    (sum, count) moved by them."""

    samples: list[Sample]
    wall_s: float
    batch_rows: float
    batches: float


async def run_round(
    url: str, policy: str, texts: list[str], concurrency: int, max_tokens: int, model: str
) -> Round:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        before = _batch_counts((await client.get(f"{url}/metrics")).text, policy)

        async def bounded(text: str) -> Sample:
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "kv_policy": policy,
            }
            async with limit:
                return await _one(client, url, body)

        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(t) for t in texts))
        wall = time.perf_counter() - start
        after = _batch_counts((await client.get(f"{url}/metrics")).text, policy)
    return Round(list(samples), wall, after[0] - before[0], after[1] - before[1])


def summarise(policy: str, rounds: list[Round]) -> PolicyResult:
    samples = [s for r in rounds for s in r.samples]
    good = [s for s in samples if s.ok]
    wall = sum(r.wall_s for r in rounds)
    batches = sum(r.batches for r in rounds)
    return PolicyResult(
        policy=policy,
        requests=len(samples),
        errors=len(samples) - len(good),
        wall_s=wall,
        requests_per_s=len(good) / wall,
        tokens_per_s=sum(s.tokens for s in good) / wall,
        ttft_s=percentiles([s.ttft_s for s in good]),
        per_token_s=percentiles([s.per_token_s for s in good if s.per_token_s is not None]),
        mean_batch=sum(r.batch_rows for r in rounds) / batches if batches else None,
        first_error=next((s.error for s in samples if not s.ok), ""),
        samples=samples,
    )


async def _served_model(url: str) -> str:
    """The model the server at ``url`` serves; one line (InputError) when nothing answers there."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        try:
            answer = await client.get(f"{url}/v1/models")
        except httpx.TransportError as exc:
            raise InputError(f"cannot reach {url}/v1/models: {exc}") from None
        return answer.json()["data"][0]["id"]


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import httpx

    url = f"http://127.0.0.1:{args.port}"
    command = [
        sys.executable, "-m", "infinikv", "serve", "--model", args.model, "--port", str(args.port),
        "--max-batch", str(args.max_batch), "--max-queue", str(max(64, args.concurrency)),
        "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise InputError(f"the server exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise InputError(f"the server was not ready within {args.start_timeout:.0f} s")


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("infinikv", "torch", "transformers", "fastapi", "uvicorn", "httpx")
    return {"python": platform.python_version(), **{n: version(n) for n in names}}


def _table(results: list[PolicyResult]) -> str:
    ms = 1000.0
    lines = [
        "| policy | requests | errors | req/s | gen tok/s | mean batch | TTFT p50 / p90 / p99 (ms) "
        "| per-token p50 / p90 / p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        ttft = " / ".join(f"{r.ttft_s[q] * ms:.0f}" for q in ("p50", "p90", "p99"))
        tpot = " / ".join(f"{r.per_token_s[q] * ms:.1f}" for q in ("p50", "p90", "p99"))
        batch = f"{r.mean_batch:.2f}" if r.mean_batch is not None else "-"
        lines.append(
            f"| {r.policy} | {r.requests} | {r.errors} | {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} "
            f"| {batch} | {ttft} | {tpot} |"
        )
    return "\n".join(lines)


def _plot(results: list[PolicyResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r.policy for r in results]
    quantiles = ("p50", "p90", "p99")
    width = 0.25
    for ax, key, label in (
        (axes[0], "ttft_s", "time to first token (ms)"),
        (axes[1], "per_token_s", "per-token latency (ms)"),
    ):
        for j, q in enumerate(quantiles):
            values = [getattr(r, key)[q] * 1000 for r in results]
            ax.bar([i + (j - 1) * width for i in range(len(results))], values, width, label=q)
        ax.set_xticks(range(len(results)), names)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[2].bar(names, [r.tokens_per_s for r in results], color="tab:green")
    axes[2].set_ylabel("generated tokens/s (all clients)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_report(path: Path, section: str) -> None:
    """Replace the text between the bench-serve markers of ``path`` (appending them if absent)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{REPORT_BEGIN}\n{section}\n{REPORT_END}"
    if REPORT_BEGIN in text and REPORT_END in text:
        head, rest = text.split(REPORT_BEGIN, 1)
        text = head + block + rest.split(REPORT_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text, encoding="utf-8")


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def run_from_args(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise InputError("--policies names no policy")
    if min(args.requests, args.concurrency, args.max_tokens, args.prompt_words, args.rounds) < 1:
        raise InputError(
            "--requests, --rounds, --concurrency, --max-tokens and --prompt-words must be positive"
        )
    if args.requests < args.rounds:
        raise InputError("--requests must be at least --rounds (each round sends requests / rounds)")
    texts = prompts(args.requests, args.prompt_words, args.seed)
    began = time.monotonic()
    process = None
    signal.signal(signal.SIGTERM, _interrupt)  # so the server it started is stopped too
    if args.url:
        url = args.url.rstrip("/")
    else:
        process, url = _start_server(args)
    try:
        model = asyncio.run(_served_model(url))
        if args.warmup:  # first requests pay one-time costs (InfiniGen's skew load, allocator growth)
            for policy in policies:
                asyncio.run(run_round(url, policy, texts[:1], 1, 4, model))
        # Rounds interleave the policies, so a change in the machine's load falls on all of them alike.
        rounds: dict[str, list[Round]] = {policy: [] for policy in policies}
        for index in range(args.rounds):
            chunk = texts[index :: args.rounds]
            for policy in policies:
                rounds[policy].append(
                    asyncio.run(run_round(url, policy, chunk, args.concurrency, args.max_tokens, model))
                )
        results = [summarise(policy, rounds[policy]) for policy in policies]
        for result in results:
            print(
                f"{result.policy}: {result.requests_per_s:.2f} req/s, {result.tokens_per_s:.1f} tok/s, "
                f"TTFT p50 {result.ttft_s['p50'] * 1000:.0f} ms, errors {result.errors}"
                + (f" (first: {result.first_error})" if result.first_error else ""),
                file=sys.stderr,
            )
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    minutes = (time.monotonic() - began) / 60
    table = _table(results)
    print(table)
    setup = (
        f"{args.requests} requests per policy in {args.rounds} interleaved rounds, "
        f"at most {args.concurrency} in flight, prompts of "
        f"{args.prompt_words // 2}-{args.prompt_words * 3 // 2} words, max_tokens {args.max_tokens}, greedy, "
        f"model {model}"
    )
    if args.json:
        payload = {
            "setup": setup,
            "versions": _versions(),
            "cpus": os.cpu_count(),
            "results": [{k: v for k, v in asdict(r).items() if k != "samples"} for r in results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    if args.plot:
        _plot(results, Path(args.plot), setup)
    if args.report:
        versions = ", ".join(f"{k} {v}" for k, v in _versions().items())
        plot_line = (
            f"\n\n![bench-serve]({os.path.relpath(args.plot, Path(args.report).parent)})" if args.plot else ""
        )
        section = (
            f"Setup: {setup}. Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other "
            f"work while measured), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}. "
            f"Versions: {versions}. The whole run (server start included) took {minutes:.1f} min."
            f"\n\n{table}{plot_line}"
        )
        _write_report(Path(args.report), section)
    return 1 if any(r.errors for r in results) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (default: start one on --port)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model of the server it starts")
    parser.add_argument("--port", type=int, default=8011, help="port of the server it starts")
    parser.add_argument("--max-batch", type=int, default=8, help="--max-batch of the server it starts")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument(
        "--policies", default="dense,infinigen,offload", help="comma-separated kv_policy values"
    )
    parser.add_argument("--requests", type=int, default=16, help="requests per policy, over all rounds")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds through the policies")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--prompt-words", type=int, default=200, help="mean prompt length in words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt texts")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up requests")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (e.g. docs/img/serving.png)")
    parser.add_argument("--report", default=None, help="Markdown file whose bench-serve section to rewrite")
