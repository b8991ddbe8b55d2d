"""The user cache folder where fetched models, converted weights, skew files and corpora live.

``INFINIKV_CACHE`` moves it; otherwise it is ``$XDG_CACHE_HOME/infinikv`` (``~/.cache/infinikv``).

Everything the cache holds is written the same way, so a crash, a full disk or a second process never
leaves a half-written entry under its final name:

* :func:`atomic_write` hands out a temporary name unique to the call, beside the target; when the block
  ends cleanly the content is given the modes of a shared cache (:data:`FILE_MODE`, :data:`DIR_MODE`,
  less the umask), flushed to disk (fsync) and renamed onto the target in one step.
* :func:`locked` serialises first-time work (a model's conversion, a calibration) across processes with an
  ``fcntl`` lock: a second process waits, then finds the entry made.
* :func:`write_manifest` records each file's size, mtime and SHA-256 beside an entry;
  :func:`check_manifest` compares sizes and mtimes on every open, and hashes a file whose mtime moved (or
  every file, when asked).
* :func:`cache_errors` turns an ``OSError`` into one line naming the file and the fix;
  :func:`require_space` refuses, in one line, work whose output would not fit the disk, before it starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import CacheError

MANIFEST = "manifest.json"
# A cache may be shared by several users: what one writes, the others can read (the umask still applies).
FILE_MODE = 0o644
DIR_MODE = 0o755


def cache_dir() -> Path:
    """The cache folder, created if missing."""
    root = os.environ.get("INFINIKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "infinikv"
    )
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(
            f"cannot create the cache folder {path}: {exc.strerror or exc}; "
            "set INFINIKV_CACHE to a folder you can write"
        ) from None
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- errors --------------------------------------------------------------------------------------------------
def _fix(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable, or set INFINIKV_CACHE to a folder you can write"
    if exc.errno == errno.ENOSPC:
        return "free some disk space, or set INFINIKV_CACHE to a folder on another disk"
    return "check the folder, or set INFINIKV_CACHE to another one"


SPACE_MARGIN = 1.1  # what a write needs beyond its payload (file headers, the rename's temporary)


def require_space(folder: Path, needed: int, what: str) -> None:
    """CacheError, before any work, when ``folder``'s disk has less free space than ``needed`` bytes (with
    :data:`SPACE_MARGIN`) for ``what``."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed * SPACE_MARGIN:
        raise CacheError(
            f"{what} needs about {needed * SPACE_MARGIN / 2**20:.0f} MiB in {folder}, and "
            f"{free / 2**20:.0f} MiB are free; {_fix(OSError(errno.ENOSPC, 'no space'))}"
        )


@contextlib.contextmanager
def cache_errors(what: str) -> Iterator[None]:
    """Turn an OSError raised in the block into a CacheError: ``what`` failed, on which file, and the fix."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or cache_dir()
        raise CacheError(f"{what}: {exc.strerror or exc} ({where}); {_fix(exc)}") from None


# -- writing -------------------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    """Flush a file, or every file in a folder and the folder itself, to disk."""
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                _fsync(child)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it (another thread may be creating
    files meanwhile)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _share(path: Path) -> None:
    """Give ``path`` (and everything under a folder) the shared-cache modes: writers such as safetensors
    create files readable by their owner only."""
    mask = _umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if item.is_symlink():
            continue
        item.chmod((DIR_MODE if item.is_dir() else FILE_MODE) & ~mask)


def _unique_name(target: Path, kind: str) -> str:
    """A hidden name beside ``target``, unique to this process and call."""
    return f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{kind}"


@contextlib.contextmanager
def atomic_write(target: Path, folder: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary path (a folder, with ``folder``) beside ``target``; write it in the block.

    On a clean exit the content is given the shared-cache modes, fsynced and renamed onto ``target`` (a
    folder replaces the old one); on an error the temporary is removed and ``target`` is left as it was.
    The name is unique to this call, so concurrent writers never share one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its private permissions would hide the entry from other users of a shared cache.
    tmp = target.with_name(_unique_name(target, "tmp"))
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        _share(tmp)
        _fsync(tmp)
        if folder and target.exists():
            old = target.with_name(_unique_name(target, "old"))
            target.replace(old)  # set aside first: a folder cannot be renamed onto a full one
            tmp.replace(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(target)
        _fsync(target.parent)
    except BaseException:
        if folder:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def remove_leftovers(target: Path) -> None:
    """Remove what crashed writers of ``target`` left beside it. Only call it holding the lock that every
    writer of ``target`` holds, so no live writer's temporary is removed."""
    for leftover in target.parent.glob(f".{target.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def write_bytes(target: Path, data: bytes) -> None:
    with atomic_write(target) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Hold the cache-wide lock ``name`` (an exclusive ``fcntl`` lock on ``locks/<name>.lock``); a second
    process blocks here, with one line saying so, until the first is done. The lock file is opened read
    only (flock needs no more), so users who share the cache can take one another's lock files."""
    with cache_errors(f"cannot take the lock for {name} in the cache"):
        folder = cache_dir() / "locks"
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
        fd = os.open(folder / f"{name}.lock", os.O_RDONLY | os.O_CREAT, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"infinikv: waiting for another infinikv process ({name})", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# -- manifests -----------------------------------------------------------------------------------------------
def _record(path: Path, sha256: str) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def write_manifest(folder: Path, extra: dict | None = None) -> dict:
    """Record the size, mtime and SHA-256 of every file under ``folder`` (the manifest itself aside) in
    ``folder/manifest.json``, with ``extra`` fields. Returns what was written."""
    files = {
        str(path.relative_to(folder)): _record(path, sha256_file(path))
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {**(extra or {}), "files": files}
    write_bytes(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(folder: Path) -> dict | None:
    """The manifest of ``folder``, or None when it is missing or unreadable (the entry is then damaged)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def check_manifest(folder: Path, full: bool = False) -> str | None:
    """Why ``folder`` does not match its manifest (missing, wrong size, wrong SHA-256), or None.

    A file is hashed when its mtime differs from the one recorded (it was written to since), or always with
    ``full``. A file whose hash still matches gets its new mtime recorded, so it is hashed once per
    modification; a cache this process cannot write just hashes it again next time."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"{folder / MANIFEST} is missing or unreadable"
    moved = False
    for name, record in manifest["files"].items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{path} is missing"
        if stat.st_size != record.get("size"):
            return f"{path} has {stat.st_size} bytes, {record.get('size')} were written"
        if full or stat.st_mtime_ns != record.get("mtime_ns"):
            if sha256_file(path) != record.get("sha256"):
                return f"{path} does not match the SHA-256 recorded when it was written"
            moved |= stat.st_mtime_ns != record.get("mtime_ns")
            record["mtime_ns"] = stat.st_mtime_ns
    if moved:
        with contextlib.suppress(OSError):
            write_bytes(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    return None
