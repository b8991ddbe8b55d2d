"""One test per class of fault a hostile user can cause (docs/reliability.md lists them and what holds)."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from infinikv import cli, models, store
from infinikv.cache import InfinikvCache
from infinikv.cli import main
from infinikv.errors import CacheError, InputError, ModelError, PolicyError
from infinikv.generate import GenerationConfig, Generator, sample
from infinikv.policies import make_config
from infinikv.policies.config import MAX_COUNT
from infinikv.policies.infinigen import skewfile
from infinikv.store import MANIFEST
from infinikv.testing import tiny_model

ROOT = Path(__file__).resolve().parents[1]


# -- bad numbers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": -1.0},
        {"top_p": math.nan},
        {"top_p": 0.0},
        {"max_new_tokens": 0},
        {"max_new_tokens": 2.5},
        {"seed": -1},
        {"stop": ("",)},
        {"stop": "abc"},
        {"prefill_chunk": 1},
    ],
)
def test_bad_sampling_numbers_are_one_line(bad):
    with pytest.raises(InputError):
        GenerationConfig(**bad)


def test_bad_numbers_stop_the_cli_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    for flags in (["--temperature", "nan"], ["--temperature", "inf"], ["--stop", ""], ["--budget", "nan"]):
        assert main(["generate", "--prompt", "hi", "--policy", "quest", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("infinikv: error:"), err
    for flags in (["--prompt", ""], ["--prompt", "  \n"]):
        assert main(["generate", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("infinikv: error:"), err


def _one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("infinikv") and "Traceback" not in err


@pytest.mark.parametrize(
    "policy, knobs",
    [
        ("quest", {"page_size": 10**9}),  # its unfinished page alone would be 768 GB on SmolLM2
        ("quest", {"page_size": 4097}),
        ("h2o", {"budget": 1e30}),  # past int64
        ("quest", {"budget": MAX_COUNT + 1}),
        ("infinigen", {"window": 10**20}),
        ("oracle", {"window": 10**20}),
        ("streaming", {"n_sink": MAX_COUNT + 1}),
        ("infinigen", {"capacity": 1e19}),
        ("quest", {"page_size": 1.5}),
        ("quest", {"page_size": 2.0}),  # a whole float too: it would reach tensor shapes
        ("quant", {"residual": 8.0}),
    ],
)
def test_knob_out_of_range_is_one_line(policy, knobs):
    with pytest.raises(PolicyError, match=next(iter(knobs))):
        make_config(policy, **knobs)


def test_huge_knobs_stop_the_cli_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    for flags in (
        ["--policy", "quest", "--page-size", "1000000000"],
        ["--policy", "h2o", "--budget", "1e30"],
        ["--policy", "infinigen", "--window", str(10**20)],
        ["--policy", "oracle", "--window", str(10**20)],
    ):
        assert main(["generate", "--prompt", "hi", *flags]) == 2
        assert _one_line(capsys.readouterr().err)


def test_counts_beyond_the_context_mean_everything(tiny):
    """The largest accepted counts run, and mean what a count above the context means: all of it."""
    prompts, config = (
        ["the quick brown fox jumps over the lazy dog", "hello"],
        GenerationConfig(max_new_tokens=4),
    )
    dense = [r.token_ids for r in Generator(tiny, "dense").generate(prompts, config)]
    for policy, knobs in (
        ("quest", {"page_size": 4096}),
        ("quest", {"budget": MAX_COUNT}),
        ("h2o", {"budget": MAX_COUNT}),
        ("streaming", {"window": MAX_COUNT, "n_sink": MAX_COUNT}),
        ("quant", {"scheme": "kivi", "group_size": MAX_COUNT, "residual": MAX_COUNT}),
    ):
        results = Generator(tiny, make_config(policy, **knobs)).generate(prompts, config)
        assert [r.token_ids for r in results] == dense, (policy, knobs)


def test_seed_is_a_signed_64_bit_integer():
    assert GenerationConfig(seed=2**63 - 1).seed == 2**63 - 1
    for seed in (2**63, 2**64 - 1, 2**64):
        with pytest.raises(InputError, match="seed"):
            GenerationConfig(seed=seed)


def _reference_sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Sampling as it was: the softmax of logits / temperature, without the shift by the best logit."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def test_sampling_is_safe_at_tiny_temperatures_and_top_p():
    logits = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 4
    best = logits.argmax(dim=-1)
    for temperature in (1e-45, 1e-50, 5e-324, 1e-30, 1e-6):
        drawn = sample(logits, GenerationConfig(temperature=temperature), torch.Generator().manual_seed(1))
        assert torch.equal(drawn, best), temperature
    for top_p in (1e-45, 1e-300):
        config = GenerationConfig(temperature=1.0, top_p=top_p)
        assert torch.equal(sample(logits, config, torch.Generator().manual_seed(1)), best), top_p
    for temperature in (0.3, 0.7, 1.0, 1.5):  # ordinary temperatures draw what they drew before
        for seed in range(10):
            drawn = sample(
                logits, GenerationConfig(temperature=temperature), torch.Generator().manual_seed(seed)
            )
            assert torch.equal(
                drawn, _reference_sample(logits, temperature, torch.Generator().manual_seed(seed))
            )


def test_tiny_temperature_generates_the_greedy_tokens(tiny):
    prompts = ["the quick brown fox jumps over the lazy dog", "hello"]
    greedy = Generator(tiny, "dense").generate(prompts, GenerationConfig(max_new_tokens=6))
    tiny_t = Generator(tiny, "dense").generate(
        prompts, GenerationConfig(max_new_tokens=6, temperature=1e-45, seed=3)
    )
    assert [r.token_ids for r in tiny_t] == [r.token_ids for r in greedy]


def test_undecodable_prompt_is_one_line(tiny, monkeypatch, capsys):
    """Undecodable bytes in a command-line argument arrive as lone surrogates (Python's surrogateescape)."""
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    for flags in (["--prompt", "Hello \udcff there", "--json"], ["--prompt", "hi", "--stop", "\udcff"]):
        assert main(["generate", *flags]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and "UTF-8" in err, err
    with pytest.raises(InputError, match="prompt 2 is not valid UTF-8"):
        Generator(tiny, "dense").generate(["fine", "not \ud800 fine"], GenerationConfig(max_new_tokens=2))


@pytest.mark.parametrize(
    "command", [["eval", "speculation", "--out"], ["bench", "--corpus", "none", "--plot"]]
)
def test_output_folder_that_cannot_be_written_is_one_line_before_work(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model for an unusable output"))
    afile = tmp_path / "results"
    afile.write_text("kept")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as stop:
            main([*command, str(out)])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert _one_line(err) and str(afile) in err, err
    assert afile.read_text() == "kept"


def test_unreachable_server_is_one_line(capsys):
    import signal

    handler = signal.getsignal(signal.SIGTERM)  # bench-serve installs its own
    try:
        assert main(["bench-serve", "--url", "http://127.0.0.1:1", "--no-warmup"]) == 2
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert _one_line(err) and "http://127.0.0.1:1" in err, err


@pytest.mark.parametrize("corpus", ["missing.txt", "latin1.txt"])
def test_bench_corpus_that_cannot_be_read_is_one_line_before_loading(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        models, "load", lambda *a, **k: pytest.fail("loaded a model for an unreadable corpus")
    )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(["bench", "--corpus", str(tmp_path / corpus), "--policies", "dense", "--peers", "none"]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and corpus in err, err


# -- devices -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta", "cuda"])
def test_bad_device_is_one_line_before_loading(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="device"):
        models.load("no-such-model", device=device)  # the device is checked before the name


# -- cache damage and repair ---------------------------------------------------------------------------------
FAKE_GGUF = b"not really a gguf file"


def install_fake_model(cache: Path, conversions: Path | None = None, delay: float = 0.0) -> str:
    """Register ``fake-tiny``: its "download" writes a small file, its "conversion" returns the tiny Llama
    (each conversion appends a line to ``conversions``, after ``delay`` seconds)."""
    import time

    os.environ["INFINIKV_CACHE"] = str(cache)
    models.REGISTRY["fake-tiny"] = models.RegisteredModel(
        name="fake-tiny",
        description="tiny random Llama",
        wheels=(),
        gguf_parts=(),
        gguf_sha256=hashlib.sha256(FAKE_GGUF).hexdigest(),
        gguf_name="fake.gguf",
    )

    def download(entry, gguf: Path) -> None:
        gguf.parent.mkdir(parents=True, exist_ok=True)
        gguf.write_bytes(FAKE_GGUF)

    def read(gguf: Path):
        if conversions is not None:
            with open(conversions, "a") as log:
                log.write(f"{os.getpid()}\n")
        time.sleep(delay)
        tiny = tiny_model("llama")
        return tiny.model, tiny.tokenizer

    models.download_gguf = download
    models.read_gguf = read
    return "fake-tiny"


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "REGISTRY", dict(models.REGISTRY))
    monkeypatch.setattr(models, "download_gguf", models.download_gguf)
    monkeypatch.setattr(models, "read_gguf", models.read_gguf)
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    return install_fake_model(tmp_path)


def _damage_weights(hf: Path) -> None:
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _damage_bytes(hf: Path) -> None:  # same size, other bytes: only the hash sees it
    weights = hf / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10:] = b"\x7f" * 10
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        _damage_weights,
        _damage_bytes,
        lambda hf: (hf / "tokenizer.json").unlink(),
        lambda hf: (hf / "infinikv.json").write_text("{not json"),
        # An entry converted before manifests were kept is adopted only when whole.
        lambda hf: ((hf / MANIFEST).unlink(), _damage_weights(hf)),
    ],
    ids=["truncated-weights", "changed-bytes", "deleted-tokenizer", "corrupt-marker", "old-and-truncated"],
)
def test_damaged_entry_is_reported_and_repaired(fake_model, tmp_path, damage, capsys):
    hf = models.pull(fake_model)
    assert models.is_pulled(fake_model)
    reference = json.loads((hf / MANIFEST).read_text())["files"]
    damage(hf)
    crashed = hf.with_name(".hf.999.0123456789ab.tmp")  # what a writer killed mid-conversion leaves
    crashed.mkdir()
    capsys.readouterr()
    assert not models.is_pulled(fake_model)  # `models list` tells the truth
    assert main(["models", "pull", fake_model]) == 0  # hashes every file, repairs with one line
    assert "re-creating fake-tiny" in capsys.readouterr().err
    assert not crashed.exists()
    assert models.is_pulled(fake_model)
    repaired = json.loads((hf / MANIFEST).read_text())["files"]
    assert repaired.keys() == reference.keys()
    assert repaired["model.safetensors"]["sha256"] == reference["model.safetensors"]["sha256"]  # same weights


@pytest.mark.parametrize(
    "damage",
    [_damage_weights, lambda hf: (hf / "tokenizer.json").unlink()],
    ids=["truncated-weights", "deleted-tokenizer"],
)
def test_load_repairs_what_it_cannot_read(fake_model, damage, capsys):
    damage(models.pull(fake_model))
    loaded = models.load(fake_model, device="cpu")  # the size check on open sees it: re-created once
    assert "re-creating fake-tiny" in capsys.readouterr().err
    assert loaded.model.config.num_hidden_layers == 4
    assert models.is_pulled(fake_model)


def _overwrite_in_place(path: Path, size: int) -> None:
    """Zero ``size`` bytes at the end of ``path`` through the same inode (tensor data, not the header), and
    move its mtime on as a later write would."""
    before = path.stat().st_mtime_ns
    with open(path, "r+b") as handle:
        handle.seek(-size, 2)
        handle.write(bytes(size))
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_weights_changed_in_place_are_caught_on_load(fake_model, capsys):
    """Same size, other bytes, written in place: the load sees the new mtime, hashes and re-creates."""
    hf = models.pull(fake_model)
    weights = hf / "model.safetensors"
    reference = json.loads((hf / MANIFEST).read_text())["files"]["model.safetensors"]
    _overwrite_in_place(weights, min(4 << 20, weights.stat().st_size // 2))
    capsys.readouterr()
    loaded = models.load(fake_model, device="cpu")
    err = capsys.readouterr().err
    assert f"{weights} does not match the SHA-256" in err and "re-creating fake-tiny" in err, err
    assert loaded.model.config.num_hidden_layers == 4
    assert store.sha256_file(weights) == reference["sha256"]  # the weights that were converted, again


def test_a_file_touched_but_unchanged_is_hashed_once(fake_model, monkeypatch):
    hf = models.pull(fake_model)
    weights = hf / "model.safetensors"
    moved = weights.stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(moved, moved))
    assert store.check_manifest(hf) is None  # hashed: the bytes are those recorded
    assert json.loads((hf / MANIFEST).read_text())["files"]["model.safetensors"]["mtime_ns"] == moved
    monkeypatch.setattr(store, "sha256_file", lambda path: pytest.fail(f"hashed {path} again"))
    assert store.check_manifest(hf) is None
    models.load(fake_model, device="cpu")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_cache_entries_are_readable_by_the_users_who_share_it(umask, fake_model, tmp_path):
    """Weights, skew files and lock files get the shared-cache modes (less the umask), whatever mode
    their writer (safetensors: 0600) created them with."""
    from infinikv.policies.infinigen.calibration import calibrate

    old = os.umask(umask)
    try:
        hf = models.pull(fake_model)
        tiny = tiny_model("llama")
        skew = calibrate(tiny, text="calibration text " * 20, tokens=64, save=False)
        path = skew.save(skewfile.skew_path(tiny.weights_id, skew.source, skew.tokens))
        with store.locked("shared"):
            pass
    finally:
        os.umask(old)
    files = [*(p for p in hf.rglob("*") if p.is_file()), path, tmp_path / "locks" / "shared.lock"]
    assert hf / "model.safetensors" in files
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in files} == {
        str(p): oct(0o644 & ~umask) for p in files
    }
    assert oct(hf.stat().st_mode & 0o777) == oct(0o755 & ~umask)


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another user's identity needs root")
def test_another_user_reads_the_cache_and_takes_its_locks(monkeypatch):
    """What one user wrote, another (uid 65534) loads, reads and locks, as it failed to with 0600 files and
    a lock file opened for writing."""
    from infinikv.policies.infinigen.calibration import calibrate

    shared = Path(tempfile.mkdtemp(prefix="infinikv-shared-"))  # pytest's own folder is private to root
    old = os.umask(0o022)
    try:
        shared.chmod(0o755)
        monkeypatch.setattr(models, "REGISTRY", dict(models.REGISTRY))
        monkeypatch.setattr(models, "download_gguf", models.download_gguf)
        monkeypatch.setattr(models, "read_gguf", models.read_gguf)
        monkeypatch.setenv("INFINIKV_CACHE", str(shared))
        name = install_fake_model(shared)
        models.pull(name)
        tiny = tiny_model("llama")
        skew = calibrate(tiny, text="calibration text " * 20, tokens=64, save=False)
        path = skew.save(skewfile.skew_path(tiny.weights_id, skew.source, skew.tokens))
        with store.locked(f"model-{name}"):
            pass
        os.seteuid(65534)
        try:
            assert models.load(name, device="cpu").model.config.num_hidden_layers == 4
            assert skewfile.read_skew(path).tokens == skew.tokens
            with store.locked(f"model-{name}"):
                pass
        finally:
            os.seteuid(0)
    finally:
        os.umask(old)
        shutil.rmtree(shared)


def test_unusable_cache_folder_is_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("INFINIKV_CACHE", str(blocker / "cache"))
    assert main(["models", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(blocker / "cache") in err and "INFINIKV_CACHE" in err
    with pytest.raises(CacheError, match="INFINIKV_CACHE"):
        skewfile.skew_dir()


def _no_leftovers(cache: Path) -> bool:
    """Nothing half-written under the models folder: no temporaries, no converted entry."""
    return not [p for p in (cache / "models").rglob("*") if p.name.startswith(".") or p.name == "hf"]


def test_a_disk_too_small_for_the_conversion_is_one_line_before_converting(fake_model, tmp_path, monkeypatch):
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(
        CacheError, match=r"converting fake.gguf needs about \d+ MiB in .*, and 0 MiB are free"
    ):
        models.pull(fake_model)
    assert _no_leftovers(tmp_path)


def test_a_full_disk_during_the_conversion_is_one_line_leaves_nothing_and_heals(
    fake_model, tmp_path, monkeypatch
):
    """safetensors reports a full disk as its own error: one line with the path and the size needed, the
    temporary folder removed, and the next pull converts again."""
    read = models.read_gguf

    def full_disk(gguf):
        model, tokenizer = read(gguf)

        def save(folder, **kwargs):
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, message: "No space left" })'
            )

        model.save_pretrained = save
        return model, tokenizer

    monkeypatch.setattr(models, "read_gguf", full_disk)
    with pytest.raises(
        CacheError, match=r"cannot write the converted fake.gguf \(.*\): .*No space left.*MiB"
    ) as exc:
        models.pull(fake_model)
    assert "\n" not in str(exc.value) and _no_leftovers(tmp_path)
    monkeypatch.setattr(models, "read_gguf", read)
    assert (models.pull(fake_model) / "model.safetensors").stat().st_size > 1000


def test_an_output_that_cannot_be_written_is_one_line(monkeypatch, capsys):
    """A full disk (or no permission) while a command writes its results: one line naming the file."""

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/results/cells.jsonl")

    monkeypatch.setattr(cli, "cmd_policies", full)
    assert main(["policies"]) == 1
    err = capsys.readouterr().err
    assert err == "infinikv: error: /results/cells.jsonl: No space left on device\n"


def _flip_tail(data: bytes) -> bytes:  # inside the last tensor: same size, other values
    return data[:-8] + bytes(b ^ 0xFF for b in data[-8:])


@pytest.mark.parametrize(
    "damage", [_flip_tail, lambda data: data[: len(data) // 2]], ids=["changed-bytes", "truncated"]
)
def test_damaged_skew_file_is_set_aside(damage, tmp_path, monkeypatch, capsys):
    from infinikv.policies.infinigen.calibration import calibrate

    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    tiny = tiny_model("llama")
    skew = calibrate(tiny, text="calibration text " * 20, tokens=64, save=False)
    path = skew.save(skewfile.skew_path(tiny.weights_id, skew.source, skew.tokens))
    assert skewfile.cached_skew(tiny.spec) is not None
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(skewfile.SkewError, match="damaged|checksum"):
        skewfile.read_skew(path)
    assert skewfile.cached_skew(tiny.spec) is None  # so ensure_skew calibrates again
    assert "calibration will run again" in capsys.readouterr().err
    assert not path.exists() and path.with_suffix(".damaged").exists()


# -- concurrent first use ------------------------------------------------------------------------------------
def test_two_processes_share_first_time_conversion(tmp_path):
    """Two real processes pull the same model into a fresh cache: one converts, the other waits, both
    succeed and the entry is whole."""
    conversions = tmp_path / "conversions.log"
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from tests.test_faults import install_fake_model; from infinikv import models;"
        "name = install_fake_model(Path(sys.argv[2]), Path(sys.argv[3]), delay=2.0);"
        "print(models.pull(name))"
    )
    cache = tmp_path / "cache"
    argv = [sys.executable, "-c", script, str(ROOT), str(cache), str(conversions)]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert len(conversions.read_text().splitlines()) == 1  # the second found the first one's work
    assert outs[0][0] == outs[1][0]
    hf = Path(outs[0][0].strip())
    assert (hf / MANIFEST).exists()
    assert not [p for p in hf.parent.iterdir() if p.name.endswith((".tmp", ".old"))]


# -- transformers' generate with an InfinikvCache ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_inputs():
    tiny = tiny_model("llama")
    return tiny, tiny.tokenizer(["hello there"], return_tensors="pt")


def test_beam_search_is_refused(tiny_inputs):
    tiny, inputs = tiny_inputs
    with pytest.raises(ModelError, match="num_beams=1"):
        tiny.model.generate(**inputs, cache=InfinikvCache(tiny.model, "dense"), num_beams=2, max_new_tokens=3)
    with pytest.raises(ModelError, match="beam search"):
        InfinikvCache(tiny.model, "dense").reorder_cache(torch.zeros(1, dtype=torch.long))


def test_reused_cache_is_refused(tiny_inputs):
    tiny, inputs = tiny_inputs
    cache = InfinikvCache(tiny.model, "dense")
    tiny.model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ModelError, match="new InfinikvCache"):
        tiny.model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False)


def test_unwritable_cache_fails_before_calibrating(tmp_path, monkeypatch):
    """InfiniGen's first use on a cache it cannot write: one line before any calibration work."""
    from infinikv.policies.infinigen import calibration

    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    (tmp_path / "locks").write_text(
        ""
    )  # the lock folder cannot be made (as a read-only cache, even for root)
    monkeypatch.setattr(
        calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated into an unwritable cache")
    )
    with pytest.raises(CacheError, match="INFINIKV_CACHE"):
        calibration.ensure_skew(tiny_model("llama"))


def test_entry_without_manifest_that_fails_to_load_is_recreated(fake_model, capsys):
    """A folder from before manifests is adopted on sight; if it then fails to load, it is re-created."""
    hf = models.pull(fake_model)
    (hf / MANIFEST).unlink()
    config = hf / "config.json"
    config.write_bytes(b"{" + b" " * (config.stat().st_size - 1))  # same size, no longer JSON
    loaded = models.load(fake_model, device="cpu")
    assert "re-creating fake-tiny" in capsys.readouterr().err
    assert loaded.model.config.num_hidden_layers == 4
    assert "adopted" not in json.loads((hf / MANIFEST).read_text())
