"""The benchmark harness on the tiny model: fields, ratios, link-model arithmetic. No timing assertions."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers.cache_utils import Cache

from infinikv.bench import BenchConfig, StepTraffic, run_bench
from infinikv.bench.linkmodel import DEVICES, LINKS, Device, Link, crossover_bandwidth, project
from infinikv.bench.measure import make_entries, record_shared_prefills
from infinikv.bench.prompts import prompt_ids
from infinikv.bench.summary import add_ratios
from infinikv.cache import InfinikvCache
from infinikv.cli import main
from infinikv.errors import InputError
from infinikv.forward import Driver, PrefillMemo

ROW_FIELDS = {
    "decode_tokens_per_s",
    "ttft_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "bytes_h2d_per_token",
    "kv_fraction_moved",
    "kv_fraction_attended",
    "peak_host_rss_bytes",
    "peak_device_bytes",
    "kv_host_bytes",
    "kv_device_bytes",
    "device_resident_fraction",
    "fetch_buffer_fraction",
    "selector_bytes_per_step",
    "selector_fraction",
    "selector_s_per_step",
    "selector_time_fraction",
    "selector_inline_fraction",
    "on_demand_fraction",
    "prefetch_wait_s_per_step",
    "projected_step_s",
    "speedup_vs_dense",
    "speedup_vs_offload",
    "bytes_vs_offload",
}


@pytest.fixture(scope="module")
def one_cell(tiny):
    config = BenchConfig(
        policies=("dense", "offload"),
        peers=("hf-dynamic", "hf-offloaded"),
        batches=(2,),
        contexts=(24,),
        gen=4,
        repeats=2,
        warmup=1,
        prefill_chunk=16,
        corpus=None,
    )
    return run_bench(tiny, config, progress=False)


def test_one_cell_has_every_field(one_cell):
    (cell,) = one_cell["cells"]
    assert (cell["batch"], cell["context"]) == (2, 24)
    rows = {r["name"]: r for r in cell["rows"]}
    assert set(rows) == {"dense", "offload", "hf-dynamic"}
    for row in rows.values():
        assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
        assert row["decode_steps"] == 3 and row["repeats"] == 2
        assert row["decode_tokens_per_s"] > 0 and row["tpot_p99_s"] >= row["tpot_p50_s"] > 0
    # On CPU the offloading peer cannot run: it is reported as skipped, with the reason.
    assert [s["name"] for s in cell["skipped"]] == ["hf-offloaded"]
    assert "CUDA" in cell["skipped"][0]["reason"]


def test_bytes_moved_match_the_offload_arithmetic(one_cell, tiny):
    rows = {r["name"]: r for r in one_cell["cells"][0]["rows"]}
    spec = tiny.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # fp32 K and V, all layers
    # Decode steps see 24, 25, 26 cached tokens; offload copies all of them, for 2 rows.
    assert rows["offload"]["bytes_h2d_per_step"] == pytest.approx(per_token * 2 * (24 + 25 + 26) / 3)
    assert rows["offload"]["kv_fraction_moved"] == pytest.approx(1.0)
    assert rows["offload"]["on_demand_fraction"] == 0  # every copy starts a layer ahead, layer 0's too
    assert rows["dense"]["bytes_h2d_per_step"] == 0
    assert rows["dense"]["kv_fraction_attended"] == pytest.approx(1.0)


def test_ratios_are_taken_within_the_run(one_cell):
    rows = {r["name"]: r for r in one_cell["cells"][0]["rows"]}
    dense, offload = rows["dense"], rows["offload"]
    assert dense["speedup_vs_dense"] == pytest.approx(1.0)
    assert offload["speedup_vs_dense"] == pytest.approx(
        offload["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
    )
    assert offload["bytes_vs_offload"] == pytest.approx(1.0) and dense["bytes_vs_offload"] == 0


def test_add_ratios_on_hand_made_rows():
    rows = [
        {"name": "dense", "decode_tokens_per_s": 10.0, "bytes_h2d_per_step": 0.0},
        {"name": "offload", "decode_tokens_per_s": 4.0, "bytes_h2d_per_step": 1000.0},
        {"name": "infinigen", "decode_tokens_per_s": 16.0, "bytes_h2d_per_step": 100.0},
    ]
    add_ratios(rows)
    infinigen = rows[2]
    assert infinigen["speedup_vs_dense"] == pytest.approx(1.6)
    assert infinigen["speedup_vs_offload"] == pytest.approx(4.0)
    assert infinigen["bytes_vs_offload"] == pytest.approx(0.1)
    alone = [{"name": "infinigen", "decode_tokens_per_s": 1.0, "bytes_h2d_per_step": 5.0}]
    add_ratios(alone)
    assert alone[0]["speedup_vs_offload"] is None and alone[0]["bytes_vs_offload"] is None


def test_shared_prefill_keeps_no_autograd_graph(tiny):
    # A graph held by the recorded keys would keep every layer's activations alive: 18 GB at 8k tokens.
    ids = tiny.tokenizer(["a prompt long enough for two chunks"], return_tensors="pt")["input_ids"]
    entries, _ = make_entries(tiny, {"dense": {}}, ())
    memo = PrefillMemo(per_config=True)
    record_shared_prefills(tiny, entries, ids, chunk=8, memo=memo)
    recorded = memo.get(memo.key(tiny.name, "dense", ids, 8, from_start=True))  # as the engine reads it
    tensors = [t for _, k, v, _ in recorded.calls for t in (k, v)]
    assert all(t.grad_fn is None and not t.requires_grad for t in tensors)
    assert sum(k.shape[2] for layer, k, _, _ in recorded.calls if layer == 0) == ids.shape[1]


def test_a_flag_of_no_policy_benchmarked_is_an_error(capsys):
    """``bench --policies dense --budget -1`` ran, the flag unchecked and unused (generate refuses it)."""
    assert main(["bench", "--model", "dummy:tiny", "--policies", "dense,offload", "--budget", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--budget is a knob of none of the policies benchmarked (dense, offload)"), err


def test_a_corpus_with_no_tokens_is_an_error(tiny, tmp_path):
    """A corpus file that gives no token (here an empty one) is one error; it made prompt_ids loop
    forever."""
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    with pytest.raises(InputError, match=f"corpus {corpus} has no text to cut prompts from"):
        prompt_ids(tiny, 16, 2, str(corpus))


def test_shared_prefill_builds_h2o_prompt_scores_as_its_own_prefill_does(tiny):
    # H2O scores the prompt in its attention; a shared prefill that only hands it K/V would leave no scores.
    ids, _ = prompt_ids(tiny, 40, 1, None)
    entries, _ = make_entries(tiny, {"dense": {}, "h2o": {"budget": 0.5}}, ())
    memo = PrefillMemo(per_config=True)
    record_shared_prefills(tiny, entries, ids, chunk=16, memo=memo)
    h2o = entries[1]
    with contextlib.closing(h2o.open(tiny, 2)) as shared:
        shared.prefill(ids, chunk=16, memo=memo)
        assert all(driver.replayed is not None for driver in shared.rows.drivers)  # not a prefill of its own
        scores = [cache.policy.prefill_state() for cache in shared.caches]
    with contextlib.closing(h2o.open(tiny, 2)) as own:
        own.prefill(ids.expand(2, -1), chunk=16, memo=None)
        references = [cache.policy.prefill_state() for cache in own.caches]
    for row, reference in zip(scores, references, strict=True):
        assert len(row) == tiny.spec.num_layers and all(s is not None for s in row)
        for layer, (score, expected) in enumerate(zip(row, reference, strict=True)):
            torch.testing.assert_close(score, expected, msg=f"layer {layer}")


def test_a_policy_is_timed_on_the_engines_decode_step(tiny):
    """A policy's batch runs as the engine serves it: each row its own sequence, its tokens those of its
    prompt served alone by the engine's decode step (a peer's batch goes through one cache)."""
    ids, _ = prompt_ids(tiny, 24, 2, None)
    entries, _ = make_entries(tiny, {"h2o": {"budget": 0.5}}, ("hf-dynamic",))
    policy, peer = entries
    with contextlib.closing(policy.open(tiny, 2)) as rows:
        assert len({id(cache.policy) for cache in rows.caches}) == 2
        tokens, _, _ = rows.prefill(ids, chunk=16, memo=None)
        served = [tokens]
        for _ in range(3):
            served.append(rows.step(served[-1]))
    for row in range(2):
        with contextlib.closing(policy.open(tiny, 1)) as one:
            first, _, _ = one.prefill(ids[row : row + 1], chunk=16, memo=None)
            alone = [first]
            for _ in range(3):
                alone.append(one.step(alone[-1]))
        assert [int(t[row]) for t in served] == [int(t[0]) for t in alone]
    with contextlib.closing(peer.open(tiny, 2)) as batch:
        assert isinstance(batch.driver.cache, Cache)
        tokens, _, _ = batch.prefill(ids, chunk=16, memo=None)
        assert tokens.shape == (2,)


def test_only_policies_that_prefetch_are_projected_as_overlapped(tiny):
    # Quest copies the layers it does not score one layer ahead and the others on demand, once their query
    # exists: projected as overlapped with its on-demand part waiting. The oracle starts no copy ahead: its
    # gathers are exposed.
    config = BenchConfig(
        policies=("offload", "streaming", "quest", "oracle"),
        batches=(1,),
        contexts=(24,),
        gen=3,
        repeats=1,
        warmup=0,
        prefill_chunk=16,
        knobs=(("budget", 0.5), ("page_size", 4)),
        corpus=None,
    )
    rows = {r["name"]: r for r in run_bench(tiny, config, progress=False)["cells"][0]["rows"]}
    assert rows["offload"]["traffic"]["overlapped"] and rows["streaming"]["traffic"]["overlapped"]
    quest = rows["quest"]["traffic"]
    assert quest["overlapped"] and 0 < quest["bytes_on_demand"] < quest["bytes_h2d"]
    oracle = rows["oracle"]
    assert oracle["traffic"]["overlapped"] is False and oracle["bytes_h2d_per_step"] > 0
    projection = project(StepTraffic(**oracle["traffic"]), LINKS["pcie3"], DEVICES["a6000"])
    assert oracle["projected_step_s"]["a6000/pcie3"] == pytest.approx(projection.link_s + projection.device_s)


def test_link_model_arithmetic():
    link = Link("test", bandwidth=10e9, latency=10e-6, source="hand-made")
    device = Device("test", bandwidth=1e12, memory=1e10, source="hand-made")
    traffic = StepTraffic(bytes_h2d=1e9, copies=60, device_read_bytes=1e9, overlapped=True, layers=30)
    p = project(traffic, link, device)
    assert p.link_s == pytest.approx(0.1 + 60 * 10e-6)  # 1 GB at 10 GB/s + 60 copy latencies
    assert p.device_s == pytest.approx(1e-3)  # 1 GB at 1 TB/s
    assert p.step_s == pytest.approx(0.1006 + 1e-3 / 30)  # overlapped: max + one layer of the smaller
    serial = StepTraffic(bytes_h2d=1e9, copies=60, device_read_bytes=1e9, overlapped=False, layers=30)
    assert project(serial, link, device).step_s == pytest.approx(0.1006 + 1e-3)
    # a device-bound step a tenth of whose bytes are copied on demand (waiting on their own layer's query):
    # their link time is added after the overlapped rest
    small = StepTraffic(bytes_h2d=1e7, copies=0, device_read_bytes=2e9, overlapped=True, layers=30)
    waiting = StepTraffic(**{**small.__dict__, "bytes_on_demand": 1e6})
    assert project(small, link, device).step_s == pytest.approx(2e-3 + 1e-3 / 30)
    assert project(waiting, link, device).step_s == pytest.approx(2e-3 + 0.9e-3 / 30 + 0.1e-3)


def test_crossover_bandwidth():
    device = Device("test", bandwidth=1e12, memory=1e10, source="hand-made")
    # Offload: 1 GB per step, 1 ms of device work. Selective: 0.1 GB, 2 ms of device work (the rehearsal).
    slow = StepTraffic(bytes_h2d=1e9, copies=0, device_read_bytes=1e9, overlapped=True, layers=1_000_000)
    fast = StepTraffic(bytes_h2d=1e8, copies=0, device_read_bytes=2e9, overlapped=True, layers=1_000_000)
    # With a (nearly) perfect overlap, offload takes max(1e9/bw, 1 ms) and selective max(1e8/bw, 2 ms):
    # they are equal at 1e9/bw = 2 ms, i.e. 500 GB/s.
    assert crossover_bandwidth(fast, slow, device, latency=0.0) == pytest.approx(5e11, rel=1e-3)
    # "Pays off" with a 10 % margin: 1e9/bw = 1.1 x 2 ms, i.e. about 454.5 GB/s.
    assert crossover_bandwidth(fast, slow, device, latency=0.0, margin=0.1) == pytest.approx(
        1e9 / 2.2e-3, rel=1e-3
    )
    cheaper = StepTraffic(bytes_h2d=1e8, copies=0, device_read_bytes=5e8, overlapped=True, layers=1_000_000)
    assert crossover_bandwidth(cheaper, slow, device, latency=0.0) is None  # never stops paying off


def test_config_rejects_bad_grids():
    with pytest.raises(InputError):
        BenchConfig(gen=1)
    with pytest.raises(InputError):
        BenchConfig(peers=("nope",))
    with pytest.raises(InputError):
        BenchConfig(batches=())
    with pytest.raises(InputError, match="--warmup of at least 2"):
        BenchConfig(compile=True, warmup=1)  # the first compiled steps compile: not to be timed
    with pytest.raises(InputError, match="no policy"):
        BenchConfig(compile=True, policies=(), peers=("hf-dynamic",))


def test_cli_bench_json_report_and_plots(tmp_path, capsys, monkeypatch):
    from infinikv.reporting import KEEP_MARKER
    from infinikv.testing import tiny_model

    monkeypatch.setattr("infinikv.models.load", lambda name, device=None, dtype=None: tiny_model())
    report = tmp_path / "bench.md"
    report.write_text(f"an old report\n{KEEP_MARKER}\nmy notes\n")
    code = main(
        [
            "bench",
            "--policies",
            "dense,offload",
            "--peers",
            "none",
            "--batch",
            "1",
            "--context",
            "16",
            "--gen",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--corpus",
            "none",
            "--quiet",
            "--json",
            "--report",
            str(report),
            "--plot",
            str(tmp_path / "img"),
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in result["cells"][0]["rows"]] == ["dense", "offload"]
    assert {"command", "cpu", "torch", "transformers", "infinikv_commit"} <= set(result["environment"])
    text = report.read_text()
    assert "| 1 | 16 | offload |" in text and text.rstrip().endswith("my notes")
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "bytes_per_token.png",
        "crossover.png",
        "throughput_vs_batch.png",
        "throughput_vs_context.png",
    ]


def test_cli_rejects_unknown_policy(capsys):
    assert main(["bench", "--policies", "nope", "--quiet"]) != 0
    assert "nope" in capsys.readouterr().err


def test_fetch_with_a_spare_slot_copies_once_and_counts_only_the_cached_tokens():
    import torch

    from infinikv.kvpool import KVPool

    pool = KVPool(1, torch.device("cpu"), overlap="none")
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    pool.append(0, k, v)
    keys, values = pool.fetch(0, extra=1).wait()
    assert keys.shape == values.shape == (2, 3, 6, 4)
    assert torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, :5], v)
    assert keys.data_ptr() != pool.keys(0).data_ptr()  # a copy, not a view of the pool
    assert pool.counters.bytes_h2d == 2 * k.numel() * 4


def test_a_recording_repeats_over_a_peers_batch_only(tiny):
    """A policy's rows are each a sequence of its own (the bench's PolicyBatch): a driver over one policy
    cache refuses to repeat a prompt over rows."""
    ids, _ = prompt_ids(tiny, 24, 1, None)
    driver = Driver(tiny, InfinikvCache(tiny.model, "dense"))
    with driver, pytest.raises(ValueError, match="repeat is for a transformers cache's batch"):
        driver.prefill(ids, repeat=2)
