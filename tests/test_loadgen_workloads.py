"""bench-serve's workloads and measurements, without a model or a server: the docqa and chat requests, the
Poisson arrivals, the prefix-cache counters read from /metrics, the percentiles and time per output token,
and the arguments checked before anything starts."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import pytest

from infinikv import data
from infinikv.errors import InputError
from infinikv.serve import loadgen
from infinikv.serve.loadgen import (
    BenchRequest,
    Round,
    Sample,
    chat_requests,
    docqa_requests,
    peak_rss_bytes,
    peak_rss_from_status,
    percentiles,
    plan_from_args,
    poisson_arrivals,
    prefix_counts,
    prefix_hit_rate,
    request_body,
    split_rounds,
    summarise,
    tagged,
    time_per_output_token,
)
from infinikv.serve.metrics import ServerMetrics

# A corpus of paragraphs whose every word is unique ("p12w3"), so passages can be told apart and checked
# for overlap; 400 paragraphs of 50 words.
CORPUS = "\n\n".join(" ".join(f"p{p}w{w}" for w in range(50)) + "." for p in range(400))


def _passage(request: BenchRequest) -> str:
    return request.text.split("\n\nQuestion:")[0]


# -- docqa -----------------------------------------------------------------------------------------------
def test_docqa_spreads_each_documents_questions_over_the_run():
    requests = docqa_requests(CORPUS, [40, 80], docs=2, questions=3, seed=1)
    assert len(requests) == 2 * 2 * 3
    documents = [r.document for r in requests]
    assert documents[:4] == [0, 1, 2, 3]  # every passage is asked about once before any is asked again
    for document in range(4):
        positions = [i for i, d in enumerate(documents) if d == document]
        assert len(positions) == 3
        assert all(b - a == 4 for a, b in zip(positions, positions[1:], strict=False))


def test_docqa_requests_share_their_passage_and_vary_the_question():
    requests = docqa_requests(CORPUS, [40, 80], docs=2, questions=3, seed=1)
    assert len({r.text for r in requests}) == len(requests)  # no two requests alike
    by_document: dict[int, set[str]] = {}
    for request in requests:
        assert request.chat  # one user message: the instruct model answers it
        assert "\n\nQuestion: " in request.text
        by_document.setdefault(request.document, set()).add(_passage(request))
    assert all(len(texts) == 1 for texts in by_document.values())  # one passage per document: a prefix
    questions = {r.text.split("Question: ")[1] for r in requests if r.document == 0}
    assert len(questions) == 3


def test_docqa_passages_have_the_asked_length_and_do_not_overlap():
    requests = docqa_requests(CORPUS, [40, 80], docs=2, questions=1, seed=3)
    words = [set(_passage(r).split("\n\n", 1)[1].split()) for r in requests]
    # about 0.75 words a token, a passage ending early at a sentence end in its last tenth
    for passage, tokens in zip(words, (40, 40, 80, 80), strict=True):
        assert 0.9 * tokens * 0.75 <= len(passage) <= tokens * 0.75
    for i, passage in enumerate(words):
        for other in words[i + 1 :]:
            assert not passage & other


def test_docqa_is_the_same_for_the_same_seed():
    assert docqa_requests(CORPUS, [40], 2, 2, seed=5) == docqa_requests(CORPUS, [40], 2, 2, seed=5)


def test_docqa_refuses_passages_the_corpus_cannot_hold():
    with pytest.raises(InputError, match="too few"):
        docqa_requests(CORPUS, [20_000], docs=1, questions=1, seed=0)


def test_requests_tagged_for_a_policy_differ_from_the_first_line_on():
    request = docqa_requests(CORPUS, [40], 1, 1, seed=0)[0]
    dense, offload = tagged(request, "dense"), tagged(request, "offload")
    assert dense.text.split("\n", 1)[1] == offload.text.split("\n", 1)[1] == request.text
    assert dense.text.split("\n", 1)[0] != offload.text.split("\n", 1)[0]
    assert dense.document == request.document


# -- chat ------------------------------------------------------------------------------------------------
def test_chat_messages_are_a_few_sentences_and_vary():
    messages = chat_requests(20, seed=0)
    assert len(messages) == 20
    for message in messages:
        assert message.chat
        assert 15 <= len(message.text.split()) <= 45
        assert message.text.endswith("?")
        assert message.text.count(". ") + message.text.count("? ") >= 2  # three sentences
    assert len({m.text for m in messages}) >= 18
    assert chat_requests(20, seed=0) == messages
    assert chat_requests(20, seed=1) != messages


def test_request_bodies_match_the_endpoint_and_the_peer_gets_no_policy():
    chat = request_body(BenchRequest("Hello?", chat=True), "m", 8, "dense")
    assert chat["messages"] == [{"role": "user", "content": "Hello?"}] and "prompt" not in chat
    assert chat["kv_policy"] == "dense" and chat["stream"] and chat["max_tokens"] == 8
    completion = request_body(BenchRequest("Once upon"), "m", 8, None)
    assert completion["prompt"] == "Once upon" and "messages" not in completion
    assert "kv_policy" not in completion


def test_rounds_are_consecutive_slices_that_keep_the_order():
    requests = [BenchRequest(str(i)) for i in range(10)]
    rounds = split_rounds(requests, 3)
    assert [len(r) for r in rounds] == [3, 3, 4]
    assert [r for chunk in rounds for r in chunk] == requests


# -- arrivals --------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_the_rate():
    rate = 4.0
    times = poisson_arrivals(5000, rate, seed=7)
    assert times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.1)  # exponential: sd = mean
    assert poisson_arrivals(5000, rate, seed=7) == times
    assert poisson_arrivals(5000, rate, seed=8) != times


# -- /metrics --------------------------------------------------------------------------------------------
SAMPLE_METRICS = """\
# HELP infinikv_prefix_cache_tokens_total Prompt tokens found in the prefix cache (hit) and prefilled (miss)
# TYPE infinikv_prefix_cache_tokens_total counter
infinikv_prefix_cache_tokens_total{result="hit"} 1536.0
infinikv_prefix_cache_tokens_total{result="miss"} 4608.0
# HELP infinikv_prefix_cache_tokens_created Prompt tokens found in the prefix cache (hit) and prefilled (miss)
# TYPE infinikv_prefix_cache_tokens_created gauge
infinikv_prefix_cache_tokens_created{result="hit"} 1.7e+09
infinikv_prefix_cache_tokens_created{result="miss"} 1.7e+09
infinikv_kv_blocks{state="total"} 512.0
"""


def test_prefix_counts_from_prometheus_text():
    assert prefix_counts(SAMPLE_METRICS) == (1536.0, 4608.0)
    assert prefix_counts('infinikv_kv_blocks{state="total"} 512.0\n') is None  # no such counter
    assert prefix_counts(None) is None  # no /metrics at all (the transformers peer)


def test_prefix_counts_from_the_servers_own_metrics():
    metrics = ServerMetrics()
    metrics.prefix_tokens.labels(result="hit").inc(256)
    metrics.prefix_tokens.labels(result="miss").inc(1e6)
    assert prefix_counts(metrics.render().decode()) == (256.0, 1e6)


def test_prefix_hit_rate_over_rounds():
    rounds = [Round([], 1.0, 0, 0, (0.0, 1000.0)), Round([], 1.0, 0, 0, (750.0, 250.0))]
    assert prefix_hit_rate(rounds) == pytest.approx(750 / 2000)
    assert prefix_hit_rate([Round([], 1.0, 0, 0, None)] + rounds) is None  # a round without counters
    assert prefix_hit_rate([Round([], 1.0, 0, 0, (0.0, 0.0))]) is None  # no prefix cache counted


def test_peak_rss_from_proc_status():
    assert (
        peak_rss_from_status("Name:\tpython\nVmPeak:\t  900 kB\nVmHWM:\t  2048 kB\nVmRSS: 1 kB\n") == 2 << 20
    )
    assert peak_rss_from_status("Name:\tpython\n") is None
    if Path(f"/proc/{os.getpid()}/status").exists():
        assert peak_rss_bytes(os.getpid()) > 0


# -- latency figures -------------------------------------------------------------------------------------
def test_percentiles_take_the_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_time_per_output_token_counts_the_tokens_after_the_first():
    assert time_per_output_token(first_s=1.0, end_s=3.0, tokens=5) == pytest.approx(0.5)
    assert time_per_output_token(first_s=1.0, end_s=1.0, tokens=1) is None
    assert time_per_output_token(first_s=1.0, end_s=2.0, tokens=0) is None


def test_summarise_reports_the_rows_figures():
    samples = [
        Sample(True, ttft_s=0.2, per_token_s=0.05, tokens=8, prompt_tokens=100),
        Sample(True, ttft_s=0.4, per_token_s=None, tokens=1, prompt_tokens=300),
        Sample(False, error="HTTP 429: full"),
    ]
    result = summarise("dense", [Round(samples, 2.0, 6.0, 3.0, (100.0, 300.0))], "docqa", "dense (static)")
    assert (result.requests, result.errors, result.first_error) == (3, 1, "HTTP 429: full")
    assert result.requests_per_s == pytest.approx(1.0) and result.tokens_per_s == pytest.approx(4.5)
    assert result.per_token_s["p50"] == pytest.approx(0.05)
    assert result.mean_batch == pytest.approx(2.0)
    assert result.mean_prompt_tokens == pytest.approx(200.0)
    assert result.prefix_hit_rate == pytest.approx(0.25)
    assert (result.workload, result.label) == ("docqa", "dense (static)")


# -- arguments -------------------------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "-1"], "--rate must be 0"),
        (["--rate", "inf"], "--rate must be 0"),
        (["--workload", "words,poems"], "unknown value 'poems'"),
        (["--workload", "chat,chat"], "names one value twice"),
        (["--workload", ","], "--workload names nothing"),
        (["--policies", ""], "--policies names nothing"),
        (["--requests", "0"], "must be positive"),
        (["--requests", "1", "--rounds", "2"], "fewer than --rounds"),
        (["--questions", "0"], "must be positive"),
        (["--doc-tokens", "2048,-5"], "--doc-tokens takes positive integers"),
        (["--schedulers", "continuous,eager"], "unknown value 'eager'"),
        (["--schedulers", "static", "--url", "http://127.0.0.1:1"], "--schedulers needs bench-serve"),
        (["--peer", "transformers", "--url", "http://127.0.0.1:1"], "--peer needs bench-serve"),
        (["--peer", "vllm"], "unknown value 'vllm'"),
        (["--peer", "transformers", "--peer-port", "8011"], "--peer-port must differ"),
        (["--peer-model", "/tmp"], "--peer-model needs --peer"),
        (["--port", "70000"], "--port must be in 1..65535"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
        (["--report", "/no/such/folder/report.md"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_input_error_before_any_work(argv, message):
    with pytest.raises(InputError, match=message):
        plan_from_args(_args(*argv))


def test_an_output_path_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(InputError, match="is a folder"):
        plan_from_args(_args("--json", str(tmp_path)))


def test_a_report_that_is_not_text_is_refused(tmp_path):
    report = tmp_path / "report.md"
    report.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(InputError, match="UTF-8"):
        plan_from_args(_args("--report", str(report)))


def test_docqa_without_the_corpus_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(data, "is_pulled", lambda name: False)
    with pytest.raises(InputError, match="infinikv data pull"):
        plan_from_args(_args("--workload", "words,docqa"))


def test_a_peer_model_must_be_a_model_directory(tmp_path):
    with pytest.raises(InputError, match="not a model directory"):
        plan_from_args(_args("--peer", "transformers", "--peer-model", str(tmp_path)))


def test_a_good_plan_keeps_the_workload_order_and_schedulers(tmp_path):
    outputs = ["--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "new" / "plot.png")]
    plan = plan_from_args(
        _args(
            "--workload",
            "chat,words",
            "--requests",
            "4",
            "--schedulers",
            "continuous,static",
            "--rate",
            "2.5",
            *outputs,
        )
    )
    assert [w.name for w in plan.workloads] == ["chat", "words"]
    assert [len(w.requests) for w in plan.workloads] == [4, 4]
    assert plan.schedulers == ["continuous", "static"]
    assert plan.load.rate == 2.5 and plan.peer_model is None
    assert plan_from_args(_args("--url", "http://127.0.0.1:1")).schedulers == [None]


def test_a_peer_plan_finds_the_transformers_command(tmp_path):
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    plan = plan_from_args(_args("--peer", "transformers", "--peer-model", str(tmp_path)))
    assert Path(plan.peer_command).name == "transformers"
    assert plan.peer_model == str(tmp_path)


def test_the_cli_prints_a_bad_argument_as_one_line(capsys):
    from infinikv.cli import main

    assert main(["bench-serve", "--workload", "docqa,poems"]) == 2
    err = capsys.readouterr().err
    assert "unknown value 'poems'" in err and len(err.strip().splitlines()) == 1


def test_docqa_ttft_is_split_by_whether_the_passage_was_asked_about_before():
    samples = [
        loadgen.Sample(ok=True, ttft_s=10.0),
        loadgen.Sample(ok=True, ttft_s=20.0),
        loadgen.Sample(ok=True, ttft_s=1.0, seen_document=True),
        loadgen.Sample(ok=True, ttft_s=2.0, seen_document=True),
        loadgen.Sample(ok=True, ttft_s=3.0, seen_document=True),
    ]
    result = loadgen.summarise("dense", [loadgen.Round(samples, 10.0, 0, 0, None)], workload="docqa")
    assert result.ttft_new_document_p50_s == 10.0 and result.ttft_seen_document_p50_s == 2.0
    assert "| 10000 / 2000 |" in loadgen.results_table([result])
    words = loadgen.summarise("dense", [loadgen.Round(samples, 10.0, 0, 0, None)])
    assert words.ttft_seen_document_p50_s is None and "| - |" in loadgen.results_table([words])
