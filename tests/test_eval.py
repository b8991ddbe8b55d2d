"""Evaluation: task generators, RULER scorers, decode-path perplexity, retrieval and resumable sweeps."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from infinikv.cli import main
from infinikv.engine.forced import ForcedRows
from infinikv.errors import InputError
from infinikv.eval import ppl, report, retrieval, scoring, sweep, tasks
from infinikv.eval.runner import DecodeRun, PrefillMemo
from infinikv.generate import GenerationConfig, Generator
from infinikv.policies import POLICIES, make_config

from .test_policy_matrix import CASES


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def fake_essays(monkeypatch):
    sentences = tuple(f"Essay sentence number {i} says something plain." for i in range(3000))
    vocabulary = tuple(f"word{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(800))
    monkeypatch.setattr(tasks, "essay_sentences", lambda: sentences)
    monkeypatch.setattr(tasks, "essay_words", lambda: vocabulary)


# -- task generators -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_are_deterministic_and_fit(task, fake_essays):
    a = tasks.generate(task, 1500, words, depth=0.3, seed=4)
    b = tasks.generate(task, 1500, words, depth=0.3, seed=4)
    c = tasks.generate(task, 1500, words, depth=0.3, seed=5)
    assert a == b
    assert a.answers != c.answers
    used = words(a.context + a.question + " " + a.answer_prefix) + a.max_new_tokens
    assert 1300 < used <= 1500  # fills the context without overflowing it
    for answer in a.answers:
        assert answer in a.context


@pytest.mark.parametrize("task", sorted(tasks.DEPTH_TASKS))
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_requested_depth(task, depth, fake_essays):
    sample = tasks.generate(task, 3000, words, depth=depth, seed=1)
    offset = sample.needle_offsets[0]
    first_answer = sample.answers[0]
    assert first_answer in sample.context[offset : offset + 200]
    assert abs(offset / len(sample.context) - depth) < 0.03


def test_multi_needle_tasks_hide_every_answer_once(fake_essays):
    multi = tasks.generate("niah_multivalue", 2000, words, seed=2)
    assert len(multi.answers) == 4 and all(multi.context.count(a) == 1 for a in multi.answers)
    keys = tasks.generate("niah_multikey_1", 2000, words, seed=2)
    assert keys.context.count("One of the special magic numbers for") == 4
    haystack = tasks.generate("niah_multikey_3", 2000, words, seed=2)
    assert re.fullmatch(r"[0-9a-f-]{36}", haystack.answers[0])
    assert haystack.context.count("special magic uuids for") > 20


def test_vt_chain_and_extraction_answers(fake_essays):
    vt = tasks.generate("vt", 2000, words, depth=0.2, seed=0)
    value = re.search(r"value (\d+)", vt.question).group(1)
    assert f"VAR {vt.answers[0]} = {value}." in vt.context
    for before, after in zip(vt.answers, vt.answers[1:], strict=False):
        assert f"VAR {after} = VAR {before}." in vt.context
    cwe = tasks.generate("cwe", 3000, words, seed=0)
    listed = re.findall(r"\d+\. (\S+)", cwe.context)
    counts = {w: listed.count(w) for w in set(listed)}
    assert sorted(cwe.answers) == sorted(sorted(counts, key=counts.get, reverse=True)[:10])
    fwe = tasks.generate("fwe", 3000, words, seed=0)
    coded = fwe.context.split("\n", 1)[1].split()
    top = sorted(set(coded), key=lambda w: (-coded.count(w), w))[:3]
    assert list(fwe.answers) == top


def test_unknown_task_and_bad_depth():
    with pytest.raises(Exception, match="unknown task"):
        tasks.generate("nope", 1000, words)
    with pytest.raises(Exception, match="depth"):
        tasks.generate("passkey", 1000, words, depth=1.5)


# -- scorers -------------------------------------------------------------------------------------------------
def test_string_match_all_and_part_follow_ruler():
    predictions = ["The numbers are 123 and 456.", "only 123", "nothing"]
    references = [["123", "456"], ["123", "456"], ["123"]]
    assert scoring.score("string_match_all", predictions, references) == pytest.approx(50)  # (1 + .5 + 0) / 3
    assert scoring.score("string_match_part", predictions, references) == pytest.approx(100 * 2 / 3)
    assert scoring.score("string_match_all", ["ABC-def"], [["abc-DEF"]]) == 100  # case-insensitive


def test_passkey_is_exact_on_the_first_number():
    refs = [["71432"]] * 4
    preds = [" 71432.", "71432 is it", "714321", "the key is 1 or 71432"]
    assert scoring.score("passkey_exact", preds, refs) == 50


# -- decode path ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tiny", "tiny_gemma"])
def test_decode_path_perplexity_equals_one_forward_pass(kind, request):
    loaded = request.getfixturevalue(kind)
    windows = torch.randint(3, 259, (2, 160), generator=torch.Generator().manual_seed(0))
    nll, stats = ppl.token_nll(loaded, make_config("dense"), windows, prefill=40)
    with torch.inference_mode():
        logits = loaded.model(input_ids=windows).logits.float()
    reference = -torch.log_softmax(logits[:, 39:-1], -1).gather(2, windows[:, 40:, None])[..., 0]
    torch.testing.assert_close(nll, reference, atol=1e-4, rtol=1e-4)
    assert stats["decode_steps"] == 119 and stats["kv_fraction"] == pytest.approx(1.0)


def test_offload_moves_everything_and_matches_dense(tiny):
    windows = torch.randint(3, 259, (1, 120), generator=torch.Generator().manual_seed(1))
    dense, _ = ppl.token_nll(tiny, make_config("dense"), windows, prefill=30)
    offload, stats = ppl.token_nll(tiny, make_config("offload"), windows, prefill=30)
    torch.testing.assert_close(offload, dense, atol=1e-5, rtol=1e-5)
    assert stats["kv_fetched_fraction"] == pytest.approx(1.0)


def test_every_policy_reports_its_three_costs(tiny, monkeypatch):
    """Bytes moved, bytes resident on the device and the selector's reads, each a fraction of the dense KV:
    dense holds everything and chooses nothing; offload holds nothing and moves everything; the oracle's
    selector reads every key (half the KV) on its scored layers, Quest's only page summaries; InfiniGen holds
    its partial keys within its device budget."""
    from infinikv.policies.infinigen import calibration, skewfile

    skew = calibration.calibrate(tiny, text="The quick brown fox jumps over the lazy dog. " * 40, save=False)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    windows = torch.randint(3, 259, (1, 120), generator=torch.Generator().manual_seed(1))
    knobs = {  # no floor: the 120-token window would be within most of it
        "oracle": dict(dense_layers=0, min_tokens=0),
        "quest": dict(dense_layers=0, page_size=4, min_tokens=0),
        "infinigen": dict(min_tokens=0),
    }
    cost = {}
    for name in ("dense", "offload", "oracle", "quest", "streaming", "infinigen"):
        _, stats = ppl.token_nll(
            tiny,
            make_config(name, budget=0.2, **knobs.get(name, {}))
            if name in ("oracle", "quest", "infinigen")
            else make_config(name),
            windows,
            30,
        )
        cost[name] = stats
    assert cost["dense"]["device_resident_fraction"] == pytest.approx(1.0)
    assert cost["dense"]["selector_fraction"] == 0 == cost["offload"]["selector_fraction"]
    assert cost["offload"]["device_resident_fraction"] == 0 < cost["offload"]["fetch_buffer_fraction"]
    assert cost["streaming"]["selector_fraction"] == 0
    assert cost["oracle"]["selector_fraction"] == pytest.approx(0.5, rel=0.02)  # every key, every layer
    assert 0 < cost["quest"]["selector_fraction"] < cost["oracle"]["selector_fraction"]
    assert 0 < cost["infinigen"]["device_resident_fraction"] <= 0.125
    assert cost["infinigen"]["selector_fraction"] > 0 and cost["infinigen"]["selector_time_fraction"] > 0


def test_the_front_is_drawn_over_accuracy_and_all_three_costs():
    def record(policy, budget, ppl_value, moved, resident, selector, buffer=0.01):
        result = {"ppl": ppl_value, "kv_fraction": moved, "kv_fetched_fraction": moved}
        result |= {"device_resident_fraction": resident, "selector_fraction": selector}
        result |= {"fetch_buffer_fraction": buffer}
        cell = {"model": "m", "context": 4096, "kind": "ppl", "target": "austen", "policy": policy}
        return {"cell": cell | {"knobs": {"budget": budget} if budget else {}}, "result": result}

    cheap = record("infinigen", 0.1, 20.5, 0.1, 0.1, 0.05)
    records = [
        record("dense", None, 20.0, 0.0, 1.0, 0.0),
        cheap,
        record("infinigen", 0.2, 20.4, 0.2, 0.1, 0.05),
        record("oracle", 0.1, 20.2, 0.1, 0.0, 0.5),  # more accurate, holds less, but reads every key
        # as accurate as cheap, holds less, reads as much; its larger fetch buffer is shown, not an axis
        record("h2o", 0.1, 20.5, 0.1, 0.0, 0.05, buffer=0.5),
        record("quest", 0.1, 20.6, 0.1, 0.1, None),  # a cost not recorded: left out
    ]
    assert report.dominates(
        report.costs([records[4]["result"]]) | {"accuracy": -20.5},
        report.costs([cheap["result"]]) | {"accuracy": -20.5},
    )
    assert report.costs([records[4]["result"]])["buffer"] == 0.5
    (line,) = report.front_lines(records)
    assert line.startswith("m, 4096 tokens, perplexity on austen: front dense, infinigen budget=0.2, oracle")
    assert "InfiniGen points dominated: infinigen budget=0.1 (by h2o budget=0.1)" in line
    assert "(1 cells without all three costs left out)" in line


@pytest.mark.parametrize("kind", ["tiny", "tiny_gemma"])
def test_a_replayed_prefill_equals_the_policys_own(kind, request):
    loaded = request.getfixturevalue(kind)
    prompt = torch.randint(3, 259, (2, 100), generator=torch.Generator().manual_seed(2))
    follow = torch.randint(3, 259, (12, 2), generator=torch.Generator().manual_seed(3))
    tight = {"budget": 0.3, "window": 8, "page_size": 4, "dense_layers": 1}  # selective below the context

    def logits_of(name: str, knobs: dict, memo: PrefillMemo | None) -> torch.Tensor:
        with DecodeRun(loaded, make_config(name, **knobs), prefill_chunk=32, memo=memo) as run:
            return torch.stack([run.prefill(prompt), *(run.step(tokens) for tokens in follow)])

    memo, recorded = PrefillMemo(), set()
    for name, policy in POLICIES.items():
        own_knobs = policy.config_class.__dataclass_fields__
        for knobs in ({k: v for k, v in tight.items() if k in own_knobs}, {}):
            own = logits_of(name, knobs, None)
            replays = memo.replays
            replayed = logits_of(name, knobs, memo)  # four prompt chunks, recorded or replayed
            torch.testing.assert_close(replayed, own, atol=0, rtol=0, msg=f"{name} {knobs}")
            # each row's prompt is recorded and replayed apart
            assert memo.replays - replays == len(prompt) * (policy.prefill_family in recorded), name
            if policy.prefill_family is not None:
                recorded.add(policy.prefill_family)
    assert recorded == {"dense", "h2o"}


@pytest.mark.parametrize("kind", ["tiny", "tiny_gemma"])
@pytest.mark.parametrize("setting", ["defaults", "tight"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_eval_scores_what_the_engine_serves(policy, setting, kind, request):
    """A DecodeRun runs the engine's prefill and decode step, each row alone: a row's logits beside another
    row are its logits alone, bit for bit, and its greedy tokens are those the Generator serves for the same
    prompt (prompt chunks of the same size), so what the eval scores is what a user is served."""
    loaded = request.getfixturevalue(kind)
    config = make_config(policy, **(CASES[policy].tight if setting == "tight" else {}))
    prompts = torch.randint(3, 259, (2, 70), generator=torch.Generator().manual_seed(4))
    new_tokens = 8

    def greedy(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with DecodeRun(loaded, config, prefill_chunk=32) as run:
            logits, tokens = [run.prefill(prompts[rows])], []
            for _ in range(new_tokens):
                tokens.append(logits[-1].argmax(dim=-1))
                logits.append(run.step(tokens[-1]))
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

    tokens, logits = greedy([0, 1])
    for row in (0, 1):
        torch.testing.assert_close(greedy([row])[1][0], logits[row], atol=0, rtol=0, msg=f"row {row}")
    sampling = GenerationConfig(max_new_tokens=new_tokens, prefill_chunk=32)
    served = Generator(loaded, config).generate([p.tolist() for p in prompts], sampling)
    for row, result in enumerate(served):
        expected = tokens[row].tolist()
        if result.finish_reason == "eos":  # the Generator stops at an end-of-sequence token
            expected = expected[: len(result.token_ids)]
        assert result.token_ids == expected, f"row {row}"


def test_a_runs_costs_add_up_over_its_rows(tiny):
    """Each row has its own cache: a run of two equal rows moves and holds twice what one row does (offload
    copies every cached token each step), and attends what one row attends."""
    prompt = torch.randint(3, 259, (1, 60), generator=torch.Generator().manual_seed(5))

    def stats(rows: int) -> dict:
        with DecodeRun(tiny, make_config("offload"), prefill_chunk=32) as run:
            run.prefill(prompt.expand(rows, -1))
            for _ in range(3):
                run.step(torch.full((rows,), 7))
            return run.stats()

    one, two = stats(1), stats(2)
    for name in ("decode_bytes_h2d", "kv_bytes_host", "offload_equivalent_bytes"):
        assert two[name] == 2 * one[name] > 0, name
    assert two["kv_fetched_fraction"] == one["kv_fetched_fraction"] == 1.0
    assert two["mean_tokens_attended"] == one["mean_tokens_attended"]


def test_rows_with_other_sinks_and_windows_choose_as_alone(tiny):
    """InfiniGen rows that differ only in their sinks and window (requests with their own knobs) each get
    their logits alone, bit for bit, beside each other: each keeps its own reserved slots."""
    prompt = torch.randint(3, 259, (1, 60), generator=torch.Generator().manual_seed(6))
    knobs = [{"n_sink": 0, "window": 0}, {}, {"n_sink": 4, "window": 4}]
    configs = [make_config("infinigen", budget=0.1, min_tokens=0, **own) for own in knobs]

    def logits(rows: list) -> torch.Tensor:
        with ForcedRows(tiny, rows) as forced:
            out = [torch.cat([forced.prefill(row, prompt, chunk=32) for row in range(len(rows))])]
            for _ in range(4):
                out.append(forced.step(range(len(rows)), out[-1].argmax(dim=-1)))
        return torch.stack(out, dim=1)

    together = logits(configs)
    for row, config in enumerate(configs):
        torch.testing.assert_close(logits([config])[0], together[row], atol=0, rtol=0, msg=str(knobs[row]))


def test_rows_that_choose_together_count_a_shared_read_once(tiny):
    """InfiniGen's rows of an engine step rehearse with one projection of every row's query (the query
    weights read once a step): two equal rows count those weights once between them, and their partial
    keys each, so their selector reads are more than one row's and less than twice."""
    prompt = torch.randint(3, 259, (1, 60), generator=torch.Generator().manual_seed(5))

    def selector_bytes(rows: int) -> int:
        with ForcedRows(tiny, [make_config("infinigen", budget=0.3, dense_layers=1)] * rows) as forced:
            for row in range(rows):
                forced.prefill(row, prompt, chunk=32)
            for _ in range(3):
                forced.step(range(rows), torch.full((rows,), 7))
            return forced.stats()["selector_bytes"]

    one, two = selector_bytes(1), selector_bytes(2)
    assert one < two < 2 * one


def test_perplexity_blocks_and_dense_reference(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    config = ppl.PerplexityConfig(str(text), context=200, prefill=140, windows=2, block=32)
    result = ppl.perplexity(tiny, "offload", config)
    assert [b["start"] for b in result["blocks"]] == [128, 160, 192]
    assert result["dense"]["ppl"] == pytest.approx(result["ppl"], rel=1e-4)
    assert result["tokens"] == 2 * 60


def test_retrieval_feeds_the_question_through_decode(tiny):
    result = retrieval.evaluate(tiny, "offload", "passkey", 500, samples=2)
    assert result["score"] in (0.0, 50.0, 100.0) and not result["chat"]
    for row in result["rows"]:
        assert row["prompt_tokens"] <= 500
    # The question and answer prefix went through the decode path: every step moved the whole cache.
    assert result["kv_fraction"] == pytest.approx(1.0)


# -- sweep ---------------------------------------------------------------------------------------------------
def test_sweep_resumes_without_recomputing(tiny, tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text("Some text to score, again and again. " * 40, encoding="utf-8")
    path = tmp_path / "sweep.json"
    path.write_text(
        json.dumps(
            {
                "name": "t",
                "out": str(tmp_path / "out"),
                "models": [{"name": "tiny", "contexts": [300]}],
                "policies": {"dense": {}, "offload": {}, "no_such_policy": {"budget": [0.1]}},
                "retrieval": {"tasks": ["passkey"], "samples": 1},
                "ppl": {"texts": [str(text)], "prefill": 270},
            }
        )
    )
    config = sweep.read_config(path)
    calls = []
    real = sweep.run_cell

    def counting(cell, *args):
        calls.append(cell.key)
        return real(cell, *args)

    monkeypatch.setattr(sweep, "run_cell", counting)
    sweep.run_sweep(config, loader=lambda name: tiny, progress=False)
    summary = report.write_outputs(config)
    assert len(calls) == 4 and summary["measured"] == 4 and not summary["missing"]
    assert summary["unavailable_policies"] == ["no_such_policy"]
    for name in ("cells.jsonl", "summary.json", "tables.md", "accuracy_vs_kv.png", "ppl_vs_kv.png"):
        assert (config.out / name).exists()
    # every table's separator row has as many cells as its header (else Markdown draws no table)
    tables = (config.out / "tables.md").read_text().splitlines()
    headers = [i for i, line in enumerate(tables) if line.startswith("| model |")]
    assert len(headers) == 2  # retrieval and perplexity
    for i in headers:
        assert tables[i + 1].startswith("|---") and tables[i].count("|") == tables[i + 1].count("|")

    # Interrupted during the last cell: its line is torn. A restart measures only that cell.
    log = config.out / "cells.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    calls.clear()
    sweep.run_sweep(config, loader=lambda name: tiny, progress=False)
    summary = report.write_outputs(config)
    assert calls == [json.loads(lines[-1])["key"]] and summary["measured"] == 4
    calls.clear()
    sweep.run_sweep(config, loader=lambda name: tiny, progress=False)
    assert calls == []

    # A cell measured on the left-padded batch's decode path (no decode_path in its record) is shown marked
    # with that difference, and the next sweep measures it again.
    lines = log.read_text().splitlines()
    first = json.loads(lines[0])
    del first["result"]["decode_path"]
    log.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    summary = report.write_outputs(config)
    stale = [record for record in summary["cells"] if record.get("stale")]
    assert [record["key"] for record in stale] == [first["key"]]
    assert stale[0]["stale"] == "decode path: left-padded batch → engine"
    sweep.run_sweep(config, loader=lambda name: tiny, progress=False)
    assert calls == [first["key"]]
    assert not any(record.get("stale") for record in report.write_outputs(config)["cells"])


def test_a_sweep_whose_cells_fail_exits_1_after_writing_its_outputs(tmp_path, monkeypatch, capsys):
    """A failed cell does not stop the sweep (the others are measured and reported), but the command ends
    with one line counting the failures and exit status 1, so a script notices."""
    text = tmp_path / "t.txt"
    text.write_text("Some text to score, again and again. " * 40, encoding="utf-8")
    path = tmp_path / "sweep.json"
    config = {
        "name": "t",
        "out": str(tmp_path / "out"),
        "models": [{"name": "dummy:tiny", "contexts": [96]}],
        "policies": {"dense": {}, "offload": {}},
        "ppl": {"texts": [str(text)], "prefill": 64},
    }
    path.write_text(json.dumps(config))
    real = sweep.run_cell

    def failing_offload(cell, *args):
        if cell.policy == "offload":
            raise InputError("this cell cannot run")
        return real(cell, *args)

    monkeypatch.setattr(sweep, "run_cell", failing_offload)
    assert main(["eval", "sweep", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "1 cell(s) failed" in err and "Traceback" not in err
    assert (tmp_path / "out" / "tables.md").exists() and (tmp_path / "out" / "failed.jsonl").exists()
    monkeypatch.setattr(sweep, "run_cell", real)
    assert main(["eval", "sweep", "--config", str(path)]) == 0  # the rerun measures it


def test_context_fraction_knobs_resolve_per_cell():
    assert sweep.resolve_knobs({"window": "0.1*context", "n_sink": 4}, 2048) == {"window": 205, "n_sink": 4}


def test_cli_rejects_unknown_task_in_one_line(capsys):
    assert main(["eval", "retrieval", "--task", "bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infinikv: error: unknown task bogus") and "\n" not in err


def test_shards_split_whole_groups_and_cover_the_sweep(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(
        'models = [{name = "tiny", contexts = [300, 600]}]\n'
        "[policies]\ndense = {}\nquest = { budget = [0.1, 0.2] }\n"
        '[retrieval]\ntasks = ["passkey"]\n[ppl]\ntexts = ["austen"]\nscored = 100\n'
    )
    config = sweep.read_config(path)
    every = [cell.key for cell in sweep.cells(config)]
    first, second = ([c for c in sweep.cells(config, (i, 2))] for i in range(2))
    assert sorted(c.key for c in first + second) == sorted(every) and len(every) == 12
    # A group (model, context, target) stays in one shard, so its ppl cells find their dense reference.
    groups = [{(c.context, c.target) for c in shard} for shard in (first, second)]
    assert not groups[0] & groups[1]
    assert [sweep.ppl_prefill(config, n) for n in (300, 600)] == [200, 500]
    assert sweep.parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "x", "1"):
        with pytest.raises(InputError):
            sweep.parse_shard(bad)


def test_a_model_entry_can_name_its_own_tasks(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(
        'models = [{name = "a", contexts = [300]},\n'
        '  {name = "b", contexts = [300], tasks = ["niah_single_2"]}]\n'
        '[policies]\ndense = {}\n[retrieval]\ntasks = ["passkey"]\n'
    )
    targets = {(c.model, c.target) for c in sweep.cells(sweep.read_config(path))}
    assert targets == {("a", "passkey"), ("b", "niah_single_2")}
    path.write_text(path.read_text().replace("niah_single_2", "bogus"))
    with pytest.raises(InputError, match="unknown tasks bogus"):
        sweep.read_config(path)


def test_a_model_entry_can_name_its_own_samples_and_other_counts_are_remeasured(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(
        'models = [{name = "a", contexts = [300], samples = 8}, {name = "b", contexts = [300]}]\n'
        '[policies]\ndense = {}\n[retrieval]\ntasks = ["passkey"]\nsamples = 4\n'
        '[ppl]\ntexts = ["austen"]\n'
    )
    config = sweep.read_config(path)
    planned = {(c.model, c.kind): c for c in sweep.cells(config)}
    assert planned["a", "retrieval"].samples == 8 and planned["b", "retrieval"].samples == 4
    assert planned["a", "ppl"].samples is None
    # The key leaves the sample count out; a cell recorded with 4 samples does not stand for 8.
    four = {planned["a", "retrieval"].identity: {"result": {"samples": 4, "knobs": {}}}}
    assert not sweep.is_measured(planned["a", "retrieval"], four)
    eight = {planned["a", "retrieval"].identity: {"result": {"samples": 8, "knobs": {}}}}
    assert sweep.is_measured(planned["a", "retrieval"], eight)
    assert "8 for a, 4 for b" in report.retrieval_setup(config)


def test_a_cell_measured_under_other_default_knobs_is_measured_again(tmp_path):
    """A measurement stands for a planned cell when every knob the policy ran with matches, defaults
    included: a cell measured when a default was different (here InfiniGen's partial ratio before it was
    calibrated) is measured again, and a plan that names the old value finds it."""
    cell = sweep.Cell("a", 300, "ppl", "austen", "infinigen", (("budget", 0.1),))
    now = sweep.make_config("infinigen", budget=0.1).knobs()

    def recorded(knobs):
        record = {
            "key": cell.key,
            "cell": cell.__dict__ | {"knobs": dict(cell.knobs)},
            "result": {"knobs": knobs},
        }
        (tmp_path / "cells.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
        return sweep.finished(tmp_path)

    assert sweep.is_measured(cell, recorded(now))
    assert not sweep.is_current(cell, recorded(now))  # measured before its costs were recorded
    assert not sweep.is_measured(cell, recorded({**now, "partial_ratio": 0.2}))
    pinned = dataclasses.replace(cell, knobs=(("budget", 0.1), ("partial_ratio", 0.2)))
    assert sweep.is_measured(pinned, recorded({**now, "partial_ratio": 0.2}))
    # A knob added later whose default is the policy as it ran before (``neutral``) leaves a measurement
    # from before it existed standing at that default, and only there.
    before = {name: value for name, value in now.items() if name != "own_query_prefetch"}
    assert sweep.is_measured(cell, recorded(before))
    assert not sweep.is_measured(cell, recorded({**now, "budget": 0.2}))
    prefetching = dataclasses.replace(cell, knobs=(("budget", 0.1), ("own_query_prefetch", True)))
    assert not sweep.is_measured(prefetching, recorded(before))
    assert sweep.is_measured(prefetching, recorded({**now, "own_query_prefetch": True}))
