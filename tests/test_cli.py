"""The command line on a tiny model saved as a local HF directory: output shapes and one-line errors."""

from __future__ import annotations

import json

import pytest

from infinikv.cli import main
from infinikv.testing import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    loaded = tiny_model(max_context=512)
    path = tmp_path_factory.mktemp("tiny")
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


def test_generate_json(model_dir, capsys):
    argv = ["generate", "--model", model_dir, "--prompt", "hello there", "--max-new-tokens", "6", "--json"]
    assert main([*argv, "--policy", "offload"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str)
    for key in ("prompt_tokens", "prefill_s", "decode_tokens_per_s", "bytes_h2d"):
        assert key in out["stats"]


def test_generate_streams_text_and_stats_line(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    assert "[dense] prompt 5 tok" in captured.err


def test_batch_file(model_dir, tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("first prompt\n\nsecond, longer prompt\n")
    argv = ["generate", "--model", model_dir, "--batch-file", str(batch), "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["stats"]["batch_size"] for r in results] == [2, 2]


def test_generate_in_bfloat16_holds_half_the_bytes(model_dir, capsys):
    """``--dtype bfloat16`` loads the model in bfloat16, and its K/V are kept so: half float32's bytes."""
    argv = ["generate", "--model", model_dir, "--prompt", "hello there", "--max-new-tokens", "6", "--json"]
    held = {}
    for dtype in ("float32", "bfloat16"):
        assert main([*argv, "--policy", "offload", "--dtype", dtype]) == 0
        held[dtype] = json.loads(capsys.readouterr().out)["stats"]["kv_bytes_host"]
    assert held["float32"] > 0 and held["bfloat16"] * 2 == held["float32"]


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "Loading weights" not in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", ""], "empty"),
        (["--prompt", "x" * 600], "exceeds the model's context"),
        (["--prompt", "hi", "--policy", "nonesuch"], "unknown policy"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "hi", "--temperature", "-2"], "temperature"),
        (["--prompt", "hi", "--top-p", "abc"], "expected a number"),
        (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int value"),
        (["--prompt", "hi", "--unknown-option"], "unrecognized arguments"),
        (["--prompt-file", "/no/such/file"], "prompt file not found"),
        (["--prompt", "hi", "--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_bad_input_is_one_line(model_dir, capsys, extra, message):
    try:
        code = main(["generate", "--model", model_dir, "--max-new-tokens", "4", *extra])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    assert code != 0
    assert message in error_line(capsys)


@pytest.mark.parametrize(
    "model, message",
    [
        ("no-such-model", "unknown model"),
        ("/no/such/model.gguf", "model file not found"),
        ("", "model must be a non-empty name or path, got ''"),
    ],
)
def test_bad_models(capsys, model, message):
    assert main(["generate", "--model", model, "--prompt", "hi"]) != 0
    assert message in error_line(capsys)


def test_corrupt_gguf_file(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["generate", "--model", str(bad), "--prompt", "hi"]) != 0
    assert f"could not load model '{bad}'" in error_line(capsys)  # the file, not its folder


def test_a_folder_that_holds_no_model_is_named(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) != 0
    assert error_line(capsys).endswith(f"not a model folder: {tmp_path} has no config.json")


def test_infinigen_uses_the_calibrated_alpha_unless_a_flag_sets_it(model_dir, tmp_path, monkeypatch, capsys):
    """Without --alpha the run uses the alpha calibrated with the model's skew (reported in the stats);
    --alpha overrides it."""
    from infinikv.models import load
    from infinikv.policies.infinigen import calibration

    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path / "cache"))
    prompt = "The quick brown fox jumps over the lazy dog and keeps running. " * 4
    calibration.calibrate(load(model_dir, device="cpu"), text=prompt * 4, tokens=200)  # in the cache
    argv = ["generate", "--model", model_dir, "--prompt", prompt, "--max-new-tokens", "3", "--json"]
    assert main([*argv, "--policy", "infinigen"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["knobs"]["alpha"] == 0 and stats["alpha_source"].startswith("calibrated")
    assert stats["knobs"]["n_sink"] == 0 and stats["knobs"]["window"] == 32
    assert main([*argv, "--policy", "infinigen", "--alpha", "5", "--n-sink", "0", "--window", "0"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert {a for a in stats["alpha_used"] if a is not None} == {5.0} and stats["alpha_source"] == "given"
    assert stats["knobs"]["window"] == 0


def run_argv(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse usage errors
        return exc.code


@pytest.mark.parametrize(
    "where, message",
    [("folder", "is a folder, not a file"), ("under a file", "exists and is not a folder")],
)
def test_a_bench_report_that_cannot_be_written_is_one_line_before_any_work(
    model_dir, tmp_path, capsys, where, message
):
    blocker = tmp_path / "blocker"
    blocker.write_text("kept")
    report = tmp_path if where == "folder" else blocker / "report.md"
    argv = ["bench", "--model", model_dir, "--policies", "dense", "--peers", "none", "--corpus", "none"]
    assert run_argv([*argv, "--context", "16", "--gen", "2", "--report", str(report)]) == 2
    assert message in error_line(capsys) and blocker.read_text() == "kept"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--policies", "dense", "--prefill-chunk", "0"], "--prefill-chunk must be at least 2"),
        (["bench", "--policies", "dense", "--context", "16", "--warmup", "600"], "exceeds the model's"),
        (["bench", "--policies", "dense", "--context", "16", "--batch", "1000000000"], "of memory free"),
        (["eval", "retrieval", "--task", " ", "--context", "128"], "names no task"),
        (["eval", "retrieval", "--task", "passkey", "--depths", ","], "expected comma-separated numbers"),
    ],
)
def test_empty_or_impossible_sizes_are_one_line(model_dir, capsys, argv, message):
    bench = ["--peers", "none", "--corpus", "none", "--gen", "2"] if argv[0] == "bench" else []
    assert run_argv([*argv, "--model", model_dir, *bench]) == 2
    assert message in error_line(capsys)


def test_a_prefill_chunk_above_the_context_is_the_context(model_dir, capsys):
    argv = ["generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", "3", "--json"]
    assert main([*argv, "--prefill-chunk", "10000000"]) == 0
    wide = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(argv) == 0
    assert wide == json.loads(capsys.readouterr().out)["token_ids"]


def test_ctrl_c_while_the_command_line_loads_is_one_line():
    """Ctrl-C in the first second, while torch and transformers are still being imported, ends in one line
    and exit status 130, as it does once the command runs (once the imports are done, or at once on a
    second Ctrl-C)."""
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "infinikv", "generate", "--model", "dummy:tiny", "--prompt", "hi"]
    for presses in (1, 2):  # a second Ctrl-C ends it without waiting for the imports
        started = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(presses):
            time.sleep(0.5)
            started.send_signal(signal.SIGINT)
        _, err = started.communicate(timeout=60)
        assert started.returncode == 130 and err.strip().splitlines() == ["infinikv: interrupted"], presses


def test_every_public_name_of_the_package_resolves():
    """``import infinikv`` imports nothing heavy; each public name is imported when first used."""
    import infinikv

    assert all(getattr(infinikv, name) is not None for name in infinikv.__all__)
    with pytest.raises(AttributeError):
        _ = infinikv.no_such_name
