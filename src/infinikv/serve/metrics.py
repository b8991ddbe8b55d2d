"""Prometheus metrics of one server, in a registry of its own (so several servers can live in one process,
as in the tests). Counters and histograms are labelled by KV policy; ``GET /metrics`` renders them."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

NO_POLICY = "none"  # label of requests rejected before a policy was resolved


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "infinikv_requests",
            "Requests by KV policy and HTTP status (499: the client left, its generation was cancelled)",
            ["policy", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "infinikv_prompt_tokens", "Prompt tokens prefilled", ["policy"], registry=registry
        )
        self.generation_tokens = Counter(
            "infinikv_generation_tokens", "Tokens generated", ["policy"], registry=registry
        )
        self.queue_length = Gauge("infinikv_queue_length", "Requests waiting for a batch", registry=registry)
        self.running = Gauge("infinikv_requests_running", "Requests in the running batch", registry=registry)
        self.batch_size = Histogram(
            "infinikv_batch_size",
            "Rows of the decode steps a finished request took part in, its mean (static scheduler: requests "
            "per generate call)",
            ["policy"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=registry,
        )
        self.decode_tokens_per_s = Gauge(
            "infinikv_decode_tokens_per_second",
            "Tokens per second over all rows of the last finished batch",
            ["policy"],
            registry=registry,
        )
        self.kv_bytes = Gauge(
            "infinikv_kv_bytes",
            "KV bytes held by the last finished batch's cache at its end",
            ["policy", "where"],
            registry=registry,
        )
        self.prefix_tokens = Counter(
            "infinikv_prefix_cache_tokens",
            "Prompt tokens found in the prefix cache (hit) and prefilled (miss), each prompt once",
            ["result"],
            registry=registry,
        )
        self.kv_blocks = Gauge(
            "infinikv_kv_blocks",
            "Blocks of the KV pool: total, used (sequences and cached prefixes), cached (prefixes)",
            ["state"],
            registry=registry,
        )
        self.preemptions = Counter(
            "infinikv_preemptions", "Running requests preempted for blocks (recomputed)", registry=registry
        )
        self.bytes_h2d = Counter(
            "infinikv_bytes_h2d", "KV bytes moved host -> device", ["policy"], registry=registry
        )

    def record_request(self, policy: str, status: int) -> None:
        self.requests.labels(policy=policy, status=str(status)).inc()

    def record_batch(
        self, policy: str, rows: int, prompt_tokens: int, new_tokens: int, stats: dict[str, Any]
    ) -> None:
        """One finished request (static scheduler: one generate call); ``stats``: its statistics."""
        self.batch_size.labels(policy=policy).observe(rows)
        self.prompt_tokens.labels(policy=policy).inc(prompt_tokens)
        self.generation_tokens.labels(policy=policy).inc(new_tokens)
        self.decode_tokens_per_s.labels(policy=policy).set(stats.get("batch_decode_tokens_per_s", 0.0))
        for where in ("host", "device"):
            self.kv_bytes.labels(policy=policy, where=where).set(stats.get(f"kv_bytes_{where}", 0))
        self.bytes_h2d.labels(policy=policy).inc(stats.get("bytes_h2d", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
