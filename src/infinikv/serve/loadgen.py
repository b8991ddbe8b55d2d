"""``infinikv bench-serve``: a load test of a running server (or of servers it starts), on loopback.

Workloads (``--workload``; a comma list runs each in turn, each reported on its own rows):

* ``words`` (the default): ``--requests`` distinct prompts of random plain words, 0.5x to 1.5x
  ``--prompt-words`` long, to ``/v1/completions``.
* ``docqa``: questions about Jane Austen passages (the ``austen`` corpus of ``infinikv data pull``),
  ``--docs`` passages of each length in ``--doc-tokens`` (counted in words, at 0.75 words a token; the
  server's own count comes back in the usage and is reported) and ``--questions`` questions about each. A
  request is one user message, a passage followed by one question, to ``/v1/chat/completions`` (the
  instruct model answers a message; a bare completion of the passage often ends at once). The requests take
  the passages
  round-robin, so the questions about one passage are spread over the run and the later ones can find it
  in the server's prefix cache, as a reader's follow-up questions would.
* ``chat``: ``--requests`` chat messages of a few sentences, one user message each, to
  ``/v1/chat/completions``.

Arrivals: by default a closed loop, at most ``--concurrency`` requests in flight, the next leaving when one
ends. With ``--rate R`` an open loop: requests leave at Poisson arrival times, R a second on average (seeded
by ``--seed``), however many are still in flight.

Every request streams. For each KV policy (sent per request as ``kv_policy``) a workload's requests are
split over ``--rounds`` rounds that take the policies in turn, so a change in the machine's load falls on
all of them alike. Each policy's prompts start with a line naming it: policies that prefill alike (dense
and offload) share the server's prefix cache, and one policy must not find another's prompts there.

Each client records when its request left, when the first text arrived (time to first token, TTFT) and
when the stream ended; the time per output token (TPOT) is the time after the first token divided by the
tokens after it. Per (workload, policy) it reports requests/s, output tokens/s, TTFT and TPOT p50/p90/p99,
errors, and from the server's ``/metrics`` (read before and after each round) the mean batch size and the
prefix-cache hit rate (prompt tokens found in the cache over all prompt tokens); for a server it started,
the server's peak resident memory (``VmHWM``, read when the run ends, so over the server's whole run).

``--schedulers continuous,static`` repeats the whole measurement once per scheduler of ``infinikv serve``,
restarting the server for each. ``--peer transformers`` then starts ``transformers serve
--continuous-batching`` on the same model (its converted HF directory) and runs the same workloads against
it as the row ``transformers-cb``: the same prompts and endpoints (it serves ``/v1/completions`` too), no
``kv_policy`` (it refuses fields it does not know), no ``/metrics``. The servers run one after another,
never together, so they never share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import data
from ..cliargs import DTYPE_NAMES
from ..errors import InputError
from ..models import DEFAULT_MODEL, REGISTRY

REPORT_BEGIN = "<!-- bench-serve:begin -->"
REPORT_END = "<!-- bench-serve:end -->"
# Prompt vocabulary: plain words, so every prompt tokenises like ordinary text.
WORDS = ("river", "lantern", "harbour", "meadow", "copper", "violin", "orchard", "glacier", "thunder")
WORDS += ("amber", "falcon", "ledger", "canyon", "velvet", "compass", "willow", "signal", "garden")

WORKLOADS = ("words", "docqa", "chat")
SCHEDULERS = ("continuous", "static")
PEERS = ("transformers",)
PEER_POLICY = "transformers-cb"  # the policy column of the transformers peer's rows
WORDS_PER_TOKEN = 0.75  # English prose, roughly: how docqa sizes its passages without a tokenizer
DOCQA_CORPUS = "austen"

DOCQA_QUESTIONS = (
    "Who is mentioned first in the passage above?",
    "Where does the scene in the passage above take place?",
    "What does the first person named in the passage above want?",
    "Summarise the passage above in one sentence.",
    "Which feeling is strongest in the passage above?",
    "What happens at the end of the passage above?",
    "Name two people who appear in the passage above.",
    "What time of year is it in the passage above?",
)
# A chat message: a situation, a detail, a question. The slots vary the messages further.
CHAT_SITUATIONS = (
    "I have {n} friends coming over for dinner on Saturday and one of them does not eat meat.",
    "My {thing} stopped working this morning after I dropped it on the kitchen floor.",
    "I am visiting {place} for {n} days next month and have never been there before.",
    "My daughter is {n} years old and has just started learning the violin.",
    "I have been running three times a week for {n} months, but my knees hurt lately.",
    "We are moving to a flat in {place} with a balcony that gets the sun all afternoon.",
    "Our team at work has {n} people and we keep missing our deadlines.",
    "I bought a second-hand {thing} for {n} pounds and I am not sure it was a good deal.",
)
CHAT_DETAILS = (
    "I would like to keep it simple.",
    "Money is a bit tight this month.",
    "I only have the evenings free.",
    "The advice I found online contradicts itself.",
    "A friend told me to ask you.",
)
CHAT_QUESTIONS = (
    "What would you suggest?",
    "Can you give me three ideas?",
    "What should I do first?",
    "How would you plan it?",
    "Which mistakes should I avoid?",
)
CHAT_PLACES = ("Lisbon", "Kyoto", "Edinburgh", "Montreal", "Cape Town", "Oslo", "Lima", "Perth")
CHAT_THINGS = ("phone", "kettle", "bicycle", "laptop", "camera", "coffee machine")
WARMUP_TEXT = "Warm-up: say hello."
SENTENCE_END = re.compile(r"[.!?][\"')]*(?=\s|$)")


# -- workloads -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a prompt to /v1/completions, or (``chat``) one user message to
    /v1/chat/completions. ``document``: the passage a docqa request asks about."""

    text: str
    chat: bool = False
    document: int | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    description: str  # for the setup line


def prompts(count: int, mean_words: int, seed: int) -> list[str]:
    """Distinct prompts of different lengths (0.5x to 1.5x ``mean_words``), the same for every policy."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = max(4, int(mean_words * rng.uniform(0.5, 1.5)))
        words = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(f"Note {i}: {words}.\nSummarise the note above in one sentence:")
    return out


def words_requests(count: int, mean_words: int, seed: int) -> list[BenchRequest]:
    return [BenchRequest(text) for text in prompts(count, mean_words, seed)]


def passages(corpus: str, word_counts: list[int], seed: int) -> list[str]:
    """One passage of ``corpus`` per entry of ``word_counts``, that many words long, each in its own equal
    slice of the corpus (so no two overlap), starting at a paragraph in the slice's first half (where
    within it is seeded). InputError when the corpus is too short for them."""
    if not word_counts:
        return []
    total_words = len(corpus.split())
    if max(word_counts) * 2 * len(word_counts) > total_words:
        raise InputError(
            f"the corpus has {total_words} words, too few for {len(word_counts)} passages of up to "
            f"{max(word_counts)} words (each takes a slice of twice its length)"
        )
    rng = random.Random(seed)
    word = re.compile(r"\S+")
    slice_chars = len(corpus) // len(word_counts)
    out = []
    for index, count in enumerate(word_counts):
        # A start in the slice's first half leaves the passage, at most half a slice, room to end in it.
        begin = index * slice_chars + rng.randrange(max(1, slice_chars // 4))
        paragraph = corpus.find("\n\n", begin, begin + slice_chars // 4)
        start = begin if paragraph < 0 else paragraph + 2
        found = list(itertools.islice(word.finditer(corpus, start), count))
        if len(found) < count:
            raise InputError(f"the corpus ends before a passage of {count} words")
        passage = corpus[found[0].start() : found[-1].end()]
        # End at a sentence end when one lies in the last tenth: a question after a cut sentence reads oddly.
        ends = [m.end() for m in SENTENCE_END.finditer(passage, len(passage) * 9 // 10)]
        out.append(passage[: ends[-1]] if ends else passage)
    return out


def docqa_question(document: int, question: int) -> str:
    """The text of question ``question`` about passage ``document``: it differs for every pair."""
    base = DOCQA_QUESTIONS[(document + question) % len(DOCQA_QUESTIONS)]
    most_words = 10 + 5 * (question // len(DOCQA_QUESTIONS))  # beyond the list, the same asks, shorter
    return f"{base} Answer in at most {most_words} words."


def docqa_requests(
    corpus: str, doc_tokens: list[int], docs: int, questions: int, seed: int
) -> list[BenchRequest]:
    """``docs`` passages of each length in ``doc_tokens`` with ``questions`` questions each, ordered
    round-robin over the passages: first question of every passage, then the second, and so on."""
    word_counts = [max(1, round(tokens * WORDS_PER_TOKEN)) for tokens in doc_tokens for _ in range(docs)]
    texts = passages(corpus, word_counts, seed)
    return [
        BenchRequest(
            "Read the passage below, then answer the question after it.\n\n"
            f"{texts[document]}\n\nQuestion: {docqa_question(document, question)}",
            chat=True,  # an instruct model answers a user message; a bare completion often ends at once
            document=document,
        )
        for question in range(questions)
        for document in range(len(texts))
    ]


def chat_requests(count: int, seed: int) -> list[BenchRequest]:
    """Short chat messages: a situation, a detail and a question, about 30 to 40 words."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        situation = rng.choice(CHAT_SITUATIONS).format(
            n=rng.randint(2, 12), place=rng.choice(CHAT_PLACES), thing=rng.choice(CHAT_THINGS)
        )
        out.append(
            BenchRequest(f"{situation} {rng.choice(CHAT_DETAILS)} {rng.choice(CHAT_QUESTIONS)}", chat=True)
        )
    return out


def poisson_arrivals(count: int, rate: float, seed: int | str) -> list[float]:
    """Seconds after the start at which ``count`` requests leave: a Poisson process of ``rate`` requests a
    second (exponential gaps), the first at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def split_rounds(requests: list[BenchRequest], rounds: int) -> list[list[BenchRequest]]:
    """Consecutive slices of near-equal size, so a workload's order (docqa's round-robin) survives."""
    n = len(requests)
    return [requests[n * i // rounds : n * (i + 1) // rounds] for i in range(rounds)]


def tagged(request: BenchRequest, tag: str) -> BenchRequest:
    """``request`` with a first line naming ``tag``, so runs under different tags share no cached prefix."""
    return BenchRequest(f"Session: {tag}\n{request.text}", request.chat, request.document)


# -- measuring -----------------------------------------------------------------------------------------------
@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    per_token_s: float | None = None  # None when fewer than two tokens came back
    tokens: int = 0
    error: str = ""
    prompt_tokens: int = 0  # as the server counted them (its usage), 0 when it did not say
    seen_document: bool = False  # docqa: an earlier request of the round asked about the same passage


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float  # output tokens, all clients together
    ttft_s: dict[str, float]
    per_token_s: dict[str, float]  # time per output token
    mean_batch: float | None
    first_error: str = ""
    workload: str = "words"
    scheduler: str | None = None  # of the infinikv server bench-serve started; None: --url or the peer
    label: str = ""  # the row's name: the policy, with the scheduler when several were measured
    mean_prompt_tokens: float | None = None
    prefix_hit_rate: float | None = None  # None: the server does not count prefix-cache hits
    peak_rss_bytes: int | None = None  # the server's, over its whole run; None: not started here
    # docqa: TTFT p50 of the first question about each passage, and of the later ones (its prefix cached)
    ttft_new_document_p50_s: float | None = None
    ttft_seen_document_p50_s: float | None = None
    samples: list[Sample] = field(default_factory=list, repr=False)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank: ceil(q n), the tolerance for q n that floats miss by a hair
        rank = math.ceil(q * len(ordered) - 1e-9)
        return ordered[min(len(ordered), max(1, rank)) - 1]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def time_per_output_token(first_s: float, end_s: float, tokens: int) -> float | None:
    """Seconds per token after the first: (end - first token) / (tokens - 1); None below two tokens."""
    return (end_s - first_s) / (tokens - 1) if tokens > 1 else None


def _event_text(event: dict[str, Any]) -> str:
    """The text a streamed chunk carries: a completion's ``text`` or a chat ``delta``'s content."""
    return "".join(
        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        for choice in event.get("choices", [])
    )


def _event_error(event: dict[str, Any]) -> str | None:
    """The error a streamed chunk reports: infinikv sends OpenAI's object, transformers serve a string."""
    if "error" not in event:
        return None
    error = event["error"]
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


async def _one(client: Any, url: str, body: dict[str, Any], chat: bool) -> Sample:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    sent = time.perf_counter()
    first = None
    tokens = prompt_tokens = text_chunks = 0
    try:
        async with client.stream("POST", f"{url}{endpoint}", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Sample(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                error = _event_error(event)
                if error is not None:
                    return Sample(False, error=error)
                if _event_text(event):
                    text_chunks += 1
                    if first is None:
                        first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    prompt_tokens = event["usage"].get("prompt_tokens", 0)
    except Exception as exc:  # a failed request is counted, not fatal
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        first = end
    tokens = tokens or text_chunks  # a server that sends no usage: one token per chunk, near enough
    return Sample(
        True,
        ttft_s=first - sent,
        per_token_s=time_per_output_token(first, end, tokens),
        tokens=tokens,
        prompt_tokens=prompt_tokens,
    )


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


def prefix_counts(metrics_text: str | None) -> tuple[float, float] | None:
    """(hit, miss) prompt tokens of ``infinikv_prefix_cache_tokens_total`` in Prometheus text; None when
    the text (or the counter) is absent."""
    if metrics_text is None:
        return None
    found = {}
    for result in ("hit", "miss"):
        match = re.search(
            rf'^infinikv_prefix_cache_tokens_total{{result="{result}"}} (\S+)$', metrics_text, re.M
        )
        if match:
            found[result] = float(match.group(1))
    return (found["hit"], found["miss"]) if len(found) == 2 else None


def peak_rss_from_status(status_text: str) -> int | None:
    """Bytes of ``VmHWM`` (peak resident set) in the text of /proc/<pid>/status."""
    match = re.search(r"^VmHWM:\s+(\d+)\s+kB", status_text, re.M)
    return int(match.group(1)) * 1024 if match else None


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident memory of process ``pid`` (Linux); None where /proc does not say."""
    try:
        return peak_rss_from_status(Path(f"/proc/{pid}/status").read_text(encoding="utf-8"))
    except OSError:
        return None


@dataclass
class Round:
    """One policy's requests in one round: what the clients saw, and what they moved on the server's
    counters: the batch-size histogram (sum, count) and the prefix cache's (hit, miss) tokens (None when
    the server does not expose them)."""

    samples: list[Sample]
    wall_s: float
    batch_rows: float
    batches: float
    prefix: tuple[float, float] | None = None


@dataclass(frozen=True)
class Load:
    """How the requests go out: closed loop (``rate`` 0, at most ``concurrency`` in flight) or open loop
    (each request at its arrival time)."""

    concurrency: int
    rate: float
    max_tokens: int


def request_body(request: BenchRequest, model: str, max_tokens: int, policy: str | None) -> dict[str, Any]:
    """The streaming request for ``request``; ``policy`` None sends no ``kv_policy`` (the peer)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.chat:
        body["messages"] = [{"role": "user", "content": request.text}]
    else:
        body["prompt"] = request.text
    if policy is not None:
        body["kv_policy"] = policy
    return body


async def _scrape(client: Any, url: str) -> str | None:
    """The server's /metrics text, or None where it has none."""
    import httpx

    try:
        answer = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    return answer.text if answer.status_code == 200 else None


async def run_round(
    url: str,
    policy: str | None,
    requests: list[BenchRequest],
    load: Load,
    model: str,
    arrivals: list[float] | None = None,
) -> Round:
    """Send ``requests`` (closed loop, or at ``arrivals`` seconds after the start: open loop) and wait for
    all of them. ``policy`` None: no ``kv_policy`` field (a server that has none)."""
    import httpx

    limit = asyncio.Semaphore(load.concurrency)
    bodies = [(request_body(r, model, load.max_tokens, policy), r.chat) for r in requests]
    # No connection cap: in the open loop every request that is due must go out at once.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = await _scrape(client, url)

        async def bounded(body: dict[str, Any], chat: bool) -> Sample:
            async with limit:
                return await _one(client, url, body, chat)

        async def on_time(offset: float, body: dict[str, Any], chat: bool) -> Sample:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await _one(client, url, body, chat)

        start = time.perf_counter()
        if arrivals is None:
            samples = await asyncio.gather(*(bounded(body, chat) for body, chat in bodies))
        else:
            samples = await asyncio.gather(
                *(on_time(t, b, c) for t, (b, c) in zip(arrivals, bodies, strict=True))
            )
        wall = time.perf_counter() - start
        after = await _scrape(client, url)
    asked: set[int] = set()
    for request, sample in zip(requests, samples, strict=True):
        sample.seen_document = request.document in asked
        if request.document is not None:
            asked.add(request.document)
    batch = (0.0, 0.0)
    if before is not None and after is not None and policy is not None:
        first, last = _batch_counts(before, policy), _batch_counts(after, policy)
        batch = (last[0] - first[0], last[1] - first[1])
    prefix = None
    first_prefix, last_prefix = prefix_counts(before), prefix_counts(after)
    if first_prefix is not None and last_prefix is not None:
        prefix = (last_prefix[0] - first_prefix[0], last_prefix[1] - first_prefix[1])
    return Round(list(samples), wall, batch[0], batch[1], prefix)


def prefix_hit_rate(rounds: list[Round]) -> float | None:
    """Hit tokens over all prompt tokens the prefix cache saw in ``rounds``; None when a round has no
    counts or no prompt token was counted (no prefix cache, or a scheduler without one)."""
    if any(r.prefix is None for r in rounds):
        return None
    hits = sum(r.prefix[0] for r in rounds)
    misses = sum(r.prefix[1] for r in rounds)
    return hits / (hits + misses) if hits + misses > 0 else None


def summarise(policy: str, rounds: list[Round], workload: str = "words", label: str = "") -> PolicyResult:
    samples = [s for r in rounds for s in r.samples]
    good = [s for s in samples if s.ok]
    wall = sum(r.wall_s for r in rounds)
    batches = sum(r.batches for r in rounds)
    prompt_tokens = [s.prompt_tokens for s in good if s.prompt_tokens]
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
        workload=workload,
        label=label or policy,
        mean_prompt_tokens=sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        prefix_hit_rate=prefix_hit_rate(rounds),
        ttft_new_document_p50_s=_p50([s.ttft_s for s in good if workload == "docqa" and not s.seen_document]),
        ttft_seen_document_p50_s=_p50([s.ttft_s for s in good if workload == "docqa" and s.seen_document]),
        samples=samples,
    )


def _p50(values: list[float]) -> float | None:
    return percentiles(values)["p50"] if values else None


# -- the plan: every argument checked before anything starts -------------------------------------------------
@dataclass
class Plan:
    policies: list[str]
    workloads: list[Workload]
    schedulers: list[str | None]  # [None]: the server at --url, whose scheduler is not known here
    rounds: int
    load: Load
    seed: int
    warmup: bool
    peer_model: str | None = None  # the HF directory transformers serve loads; None: no peer
    peer_command: str | None = None  # the transformers executable


def _names(text: str, flag: str, known: tuple[str, ...] | None = None) -> list[str]:
    """A comma list of distinct names (of ``known`` when given); InputError otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise InputError(f"{flag} names nothing")
    if len(set(names)) < len(names):
        raise InputError(f"{flag} names one value twice: {text}")
    for name in names:
        if known is not None and name not in known:
            raise InputError(f"{flag}: unknown value '{name}' (known: {', '.join(known)})")
    return names


def _positive_ints(text: str, flag: str) -> list[int]:
    values = []
    for item in _names(text, flag):
        try:
            value = int(item)
        except ValueError:
            raise InputError(f"{flag} takes positive integers, got '{item}'") from None
        if value < 1:
            raise InputError(f"{flag} takes positive integers, got '{item}'")
        values.append(value)
    return values


def _check_output(path: str, flag: str, make_parents: bool = False) -> None:
    """InputError now, not after the run, when ``path`` cannot be written: a folder, a missing folder (unless
    ``make_parents``: then the nearest folder that exists must be writable), no permission."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{flag} {path} is a folder")
    folder = target.parent
    if make_parents:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: the folder {folder} does not exist")
    if target.exists() and not os.access(target, os.W_OK):
        raise InputError(f"{flag} {path} is not writable")
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write in {folder}")


def _peer_model(args: argparse.Namespace) -> str:
    """The HF model directory the transformers peer loads: --peer-model, or --model's own (a registered
    model's converted directory, fetched if need be, or --model itself when it is a directory)."""
    if args.peer_model is not None:
        path = Path(args.peer_model).expanduser()
        if not (path / "config.json").is_file():
            raise InputError(f"--peer-model {args.peer_model} is not a model directory (no config.json)")
        return str(path)
    if args.model in REGISTRY:
        from ..models import pull

        return str(pull(args.model, full=False))
    path = Path(args.model).expanduser()
    if path.is_dir():
        return str(path)
    raise InputError(f"--peer needs --peer-model PATH (an HF model directory) for --model {args.model}")


def _workload(name: str, args: argparse.Namespace, doc_tokens: list[int]) -> Workload:
    if name == "words":
        requests = words_requests(args.requests, args.prompt_words, args.seed)
        low, high = args.prompt_words // 2, args.prompt_words * 3 // 2
        return Workload(name, requests, f"words: {len(requests)} prompts of {low}-{high} random words")
    if name == "chat":
        requests = chat_requests(args.requests, args.seed)
        return Workload(name, requests, f"chat: {len(requests)} chat messages of three sentences")
    if not data.is_pulled(DOCQA_CORPUS):
        raise InputError("the docqa workload reads the Austen corpus: run `infinikv data pull` first")
    corpus = data.load_corpus(DOCQA_CORPUS)
    requests = docqa_requests(corpus, doc_tokens, args.docs, args.questions, args.seed)
    lengths = ", ".join(str(t) for t in doc_tokens)
    return Workload(
        name,
        requests,
        f"docqa: {len(requests)} requests, {args.questions} questions about each of {args.docs} Austen "
        f"passages of about {lengths} tokens (sized in words, {WORDS_PER_TOKEN} words a token), "
        "taken round-robin",
    )


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Check every argument and build the workloads, before any server starts; InputError on a mistake."""
    policies = _names(args.policies, "--policies")
    if min(args.requests, args.concurrency, args.max_tokens, args.prompt_words, args.rounds) < 1:
        raise InputError(
            "--requests, --rounds, --concurrency, --max-tokens and --prompt-words must be positive"
        )
    if min(args.docs, args.questions, args.max_batch) < 1:
        raise InputError("--docs, --questions and --max-batch must be positive")
    if not args.start_timeout > 0:
        raise InputError(f"--start-timeout must be a positive number of seconds, got {args.start_timeout}")
    doc_tokens = _positive_ints(args.doc_tokens, "--doc-tokens")
    if not math.isfinite(args.rate) or args.rate < 0:
        raise InputError(
            f"--rate must be 0 (closed loop) or a positive number of requests/s, got {args.rate}"
        )
    names = _names(args.workload, "--workload", WORKLOADS)
    started = args.url is None
    if args.schedulers is not None and not started:
        raise InputError("--schedulers needs bench-serve to start the server (drop --url)")
    schedulers: list[str | None] = [None]  # the server at --url: its scheduler is not known here
    if started:
        schedulers = list(_names(args.schedulers or "continuous", "--schedulers", SCHEDULERS))
    for flag, port in (("--port", args.port), ("--peer-port", args.peer_port)):
        if not 0 < port < 65536:
            raise InputError(f"{flag} must be in 1..65535, got {port}")
    peer_command = None
    if args.peer is not None:
        _names(args.peer, "--peer", PEERS)
        if not started:
            raise InputError("--peer needs bench-serve to start the servers (drop --url)")
        if args.peer_port == args.port:
            raise InputError("--peer-port must differ from --port")
        beside = Path(sys.executable).parent / "transformers"  # the venv's own, when run from one
        peer_command = str(beside) if beside.is_file() else shutil.which("transformers")
        if peer_command is None:
            raise InputError("--peer transformers needs the `transformers` command (transformers[serving])")
    elif args.peer_model is not None:
        raise InputError("--peer-model needs --peer transformers")
    for flag, path, make_parents in (
        ("--json", args.json, False),
        ("--report", args.report, False),
        ("--plot", args.plot, True),
    ):
        if path is not None:
            _check_output(path, flag, make_parents)
    if args.report is not None and Path(args.report).is_file():
        try:
            Path(args.report).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--report {args.report} cannot be read as UTF-8 text: {exc}") from None
    workloads = [_workload(name, args, doc_tokens) for name in names]
    for workload in workloads:
        if len(workload.requests) < args.rounds:
            raise InputError(
                f"the {workload.name} workload has {len(workload.requests)} requests, fewer than --rounds "
                f"{args.rounds} (each round sends requests / rounds)"
            )
    return Plan(
        policies=policies,
        workloads=workloads,
        schedulers=schedulers,
        rounds=args.rounds,
        load=Load(args.concurrency, args.rate, args.max_tokens),
        seed=args.seed,
        warmup=args.warmup,
        peer_model=_peer_model(args) if args.peer is not None else None,
        peer_command=peer_command,
    )


# -- servers -------------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A server under measurement and the rows it gets: its KV policies (None: send no kv_policy)."""

    url: str
    policies: list[str | None]
    scheduler: str | None = None
    peak_rss_bytes: int | None = None  # of a server started here, read just before it is stopped


def _wait_ready(process: subprocess.Popen, url: str, timeout: float, what: str, log: Path | None) -> None:
    import httpx

    see_log = f" (its log: {log})" if log is not None else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise InputError(f"{what} exited with status {process.returncode} before it was ready{see_log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise InputError(f"{what} was not ready within {timeout:.0f} s{see_log}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _running(
    target: Target, process: subprocess.Popen, timeout: float, what: str, log: Path | None = None
) -> Iterator[Target]:
    """Wait for ``process`` (``target``'s server) to answer /health; on leaving, whether the run ended or
    failed, record its peak memory and stop it."""
    try:
        _wait_ready(process, target.url, timeout, what, log)
        yield target
    finally:
        target.peak_rss_bytes = peak_rss_bytes(process.pid)
        _stop(process)


@contextlib.contextmanager
def _infinikv_server(args: argparse.Namespace, plan: Plan, scheduler: str | None) -> Iterator[Target]:
    if args.url is not None:
        yield Target(args.url.rstrip("/"), list(plan.policies))
        return
    url = f"http://127.0.0.1:{args.port}"
    # In the open loop a whole round can be waiting at once: the queue must hold it, or it answers 429.
    largest_round = max(math.ceil(len(w.requests) / plan.rounds) for w in plan.workloads)
    command = [
        sys.executable, "-m", "infinikv", "serve", "--model", args.model, "--port", str(args.port),
        "--max-batch", str(args.max_batch), "--max-queue", str(max(64, args.concurrency, largest_round)),
        "--scheduler", scheduler or "continuous", "--log-level", "warning",
        *(["--dtype", args.dtype] if args.dtype else []),
    ]  # fmt: skip
    process = subprocess.Popen(command)
    with _running(
        Target(url, list(plan.policies), scheduler), process, args.start_timeout, "the server"
    ) as ready:
        yield ready


@contextlib.contextmanager
def _transformers_server(args: argparse.Namespace, plan: Plan) -> Iterator[Target]:
    """``transformers serve --continuous-batching`` on the model's HF directory, in ``--dtype`` (float32 by
    default, as infinikv serve loads a registered model), its output in a log file (its access log would
    drown the progress lines)."""
    assert plan.peer_command is not None and plan.peer_model is not None
    url = f"http://127.0.0.1:{args.peer_port}"
    log = Path(tempfile.gettempdir()) / f"bench-serve-transformers-{args.peer_port}.log"
    command = [
        plan.peer_command, "serve", plan.peer_model, "--continuous-batching", "--host", "127.0.0.1",
        "--port", str(args.peer_port), "--dtype", args.dtype or "float32", "--log-level", "warning",
    ]  # fmt: skip
    print(f"starting transformers serve on port {args.peer_port} (log: {log})", file=sys.stderr)
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    with _running(Target(url, [None]), process, args.start_timeout, "transformers serve", log) as ready:
        yield ready


async def _served_model(url: str) -> str:
    """The model the server at ``url`` serves; one line (InputError) when nothing answers there."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        try:
            answer = await client.get(f"{url}/v1/models")
        except httpx.TransportError as exc:
            raise InputError(f"cannot reach {url}/v1/models: {exc}") from None
    try:
        return answer.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):  # not JSON, or not the OpenAI list of models
        hint = " (give the server's root, without /v1)" if url.rstrip("/").endswith("/v1") else ""
        raise InputError(
            f"no OpenAI model list at {url}/v1/models (HTTP {answer.status_code}){hint}"
        ) from None


def _measure(target: Target, plan: Plan, model: str) -> list[PolicyResult]:
    """Every workload against ``target`` (serving ``model``): its policies in interleaved rounds, the same
    arrival times for each policy of a round."""
    several = len(plan.schedulers) > 1
    if plan.warmup:  # first requests pay one-time costs (InfiniGen's skew load, allocator growth)
        kinds = sorted({r.chat for w in plan.workloads for r in w.requests})
        warm = Load(1, 0.0, 4)
        for policy in target.policies:
            asyncio.run(
                run_round(target.url, policy, [BenchRequest(WARMUP_TEXT, c) for c in kinds], warm, model)
            )
    results = []
    for workload in plan.workloads:
        rounds: dict[str | None, list[Round]] = {policy: [] for policy in target.policies}
        for index, chunk in enumerate(split_rounds(workload.requests, plan.rounds)):
            arrivals = None
            if plan.load.rate > 0:
                arrivals = poisson_arrivals(
                    len(chunk), plan.load.rate, f"{plan.seed}:{workload.name}:{index}"
                )
            for policy in target.policies:
                own = [tagged(r, policy or PEER_POLICY) for r in chunk]
                rounds[policy].append(
                    asyncio.run(run_round(target.url, policy, own, plan.load, model, arrivals))
                )
        for policy in target.policies:
            name = policy or PEER_POLICY
            label = f"{name} ({target.scheduler})" if several and target.scheduler else name
            result = summarise(name, rounds[policy], workload.name, label)
            result.scheduler = target.scheduler
            results.append(result)
            print(_progress_line(result), file=sys.stderr)
    return results


def _progress_line(result: PolicyResult) -> str:
    hit = "n/a" if result.prefix_hit_rate is None else f"{result.prefix_hit_rate:.0%}"
    return (
        f"{result.workload} / {result.label}: {result.requests_per_s:.2f} req/s, {result.tokens_per_s:.1f} "
        f"tok/s, TTFT p50 {result.ttft_s['p50'] * 1000:.0f} ms, prefix hits {hit}, errors {result.errors}"
        + (f" (first: {result.first_error})" if result.first_error else "")
    )


# -- output --------------------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("infinikv", "torch", "transformers", "fastapi", "uvicorn", "httpx")
    return {"python": platform.python_version(), **{n: version(n) for n in names}}


def results_table(results: list[PolicyResult]) -> str:
    """The Markdown table of ``results``, one row per workload, policy and server."""
    ms = 1000.0
    lines = [
        "| workload | policy | requests | errors | prompt tok (mean) | req/s | out tok/s | mean batch "
        "| prefix hits | TTFT p50 / p90 / p99 (ms) | TTFT p50 new / seen doc (ms) "
        "| TPOT p50 / p90 / p99 (ms) | server peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in results:
        ttft = " / ".join(f"{r.ttft_s[q] * ms:.0f}" for q in ("p50", "p90", "p99"))
        tpot = " / ".join(f"{r.per_token_s[q] * ms:.1f}" for q in ("p50", "p90", "p99"))
        batch = f"{r.mean_batch:.2f}" if r.mean_batch is not None else "-"
        prompt = f"{r.mean_prompt_tokens:.0f}" if r.mean_prompt_tokens is not None else "-"
        hits = f"{r.prefix_hit_rate:.0%}" if r.prefix_hit_rate is not None else "n/a"
        rss = f"{r.peak_rss_bytes / 2**20:.0f}" if r.peak_rss_bytes is not None else "n/a"
        new, seen = r.ttft_new_document_p50_s, r.ttft_seen_document_p50_s
        by_doc = f"{new * ms:.0f} / {seen * ms:.0f}" if new is not None and seen is not None else "-"
        lines.append(
            f"| {r.workload} | {r.label or r.policy} | {r.requests} | {r.errors} | {prompt} "
            f"| {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} | {batch} | {hits} | {ttft} | {by_doc} "
            f"| {tpot} | {rss} |"
        )
    return "\n".join(lines)


def _plot(results: list[PolicyResult], path: Path, title: str) -> None:
    """One row of panels per workload: TTFT and TPOT (p50 and p99) and output tokens/s, per server and
    policy, as horizontal bars (the labels stay readable). ``title``: the setup, its first sentence shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(13, 1.2 + 0.45 * len(results)), squeeze=False)
    for row, workload in zip(axes, workloads, strict=True):
        rows = [r for r in results if r.workload == workload]
        names = [r.label or r.policy for r in rows]
        places = range(len(rows))
        for ax, key, label in ((row[0], "ttft_s", "TTFT (s)"), (row[1], "per_token_s", "TPOT (s)")):
            for shift, q in ((-0.2, "p50"), (0.2, "p99")):
                ax.barh([i + shift for i in places], [getattr(r, key)[q] for r in rows], 0.4, label=q)
            ax.set_yticks(list(places), names, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(f"{workload}: {label}", fontsize=9)
            ax.legend(fontsize=7)
        row[2].barh(list(places), [r.tokens_per_s for r in rows], color="tab:green")
        row[2].set_yticks(list(places), names, fontsize=8)
        row[2].invert_yaxis()
        row[2].set_xlabel(f"{workload}: output tokens/s (all clients)", fontsize=9)
    fig.suptitle(title.split(". ")[0].split("; ")[0][:160], fontsize=9)  # the setup line has the rest
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


def _setup(args: argparse.Namespace, plan: Plan, model: str) -> str:
    if plan.load.rate > 0:
        arrivals = f"Poisson arrivals at {plan.load.rate:g} requests/s (open loop, seed {plan.seed})"
    else:
        arrivals = f"at most {plan.load.concurrency} in flight (closed loop)"
    if args.url is not None:
        servers = f"the server at {args.url}"
    else:
        servers = f"infinikv serve --scheduler {' then '.join(str(s) for s in plan.schedulers)}"
        servers += f" --max-batch {args.max_batch}" + (f" --dtype {args.dtype}" if args.dtype else "")
    if plan.peer_model is not None:
        servers += (
            f", then transformers serve --continuous-batching ({args.dtype or 'float32'}, its default "
            f"batching settings) on {plan.peer_model}, sent the same prompts to the same endpoints without "
            "kv_policy"
        )
    return (
        f"{'; '.join(w.description for w in plan.workloads)}. Prompts to /v1/completions, chat messages to "
        f"/v1/chat/completions, all streaming; each policy's prompts start with a line naming it (no prefix "
        f"shared across policies); requests split over {plan.rounds} round{'s' if plan.rounds > 1 else ''} "
        "that take the policies in turn, "
        f"{arrivals}, max_tokens {plan.load.max_tokens}, greedy, model {model}. Servers: {servers}; peak RSS "
        "is each server's over its whole run"
    )


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def run_from_args(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    began = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # so the servers it started are stopped too
    results: list[PolicyResult] = []
    model = args.model
    servers = [functools.partial(_infinikv_server, args, plan, s) for s in plan.schedulers]
    if plan.peer_model is not None:
        servers.append(functools.partial(_transformers_server, args, plan))
    for index, server in enumerate(servers):  # one after another: they never share the machine
        with server() as target:
            served = asyncio.run(_served_model(target.url))
            model = served if index == 0 else model  # the setup line names infinikv's model id
            rows = _measure(target, plan, served)
        for row in rows:  # known only now: the peak is read as the server stops
            row.peak_rss_bytes = target.peak_rss_bytes
        results += rows
    minutes = (time.monotonic() - began) / 60
    table = results_table(results)
    print(table)
    setup = _setup(args, plan, model)
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
            f"Versions: {versions}. The whole run (server starts included) took {minutes:.1f} min."
            f"\n\n{table}{plot_line}"
        )
        _write_report(Path(args.report), section)
    return 1 if any(r.errors for r in results) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (default: start one on --port)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model of the server it starts")
    parser.add_argument("--port", type=int, default=8011, help="port of the server it starts")
    parser.add_argument("--max-batch", type=int, default=8, help="--max-batch of the server it starts")
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="--dtype of the servers it starts (default: infinikv serve's; transformers serve: float32)",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument(
        "--policies", default="dense,infinigen,offload", help="comma-separated kv_policy values"
    )
    parser.add_argument(
        "--workload",
        default="words",
        help=f"comma-separated workloads, each measured in turn: {', '.join(WORKLOADS)} (see the module doc)",
    )
    parser.add_argument(
        "--requests", type=int, default=16, help="words and chat: requests per policy, over all rounds"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds through the policies")
    parser.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight at most")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open loop: Poisson arrivals, this many requests/s on average (0: closed loop, --concurrency)",
    )
    parser.add_argument("--prompt-words", type=int, default=200, help="words: mean prompt length in words")
    parser.add_argument(
        "--doc-tokens",
        default="2048,4096",
        help="docqa: comma-separated passage lengths, in tokens (approx.)",
    )
    parser.add_argument("--docs", type=int, default=2, help="docqa: passages per length")
    parser.add_argument(
        "--questions",
        type=int,
        default=3,
        help="docqa: questions per passage (requests: lengths x docs x this)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, passages and arrivals")
    parser.add_argument(
        "--schedulers",
        default=None,
        help="comma-separated schedulers of the server it starts, one measurement each (default continuous)",
    )
    parser.add_argument(
        "--peer",
        default=None,
        help="also measure transformers serve --continuous-batching on the same model ('transformers')",
    )
    parser.add_argument(
        "--peer-model", default=None, help="the peer's HF model directory (default: --model's converted one)"
    )
    parser.add_argument("--peer-port", type=int, default=8012, help="port of the peer it starts")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up requests")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (e.g. docs/img/serving.png)")
    parser.add_argument("--report", default=None, help="Markdown file whose bench-serve section to rewrite")
