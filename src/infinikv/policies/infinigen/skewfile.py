"""InfiniGen's skew file: per-KV-head skewing matrices and partial-column scores of one model.

A :class:`Skew` is what calibration (``calibration.py``) produces and the policy reads. Files live in
``cache_dir()/skew/`` as safetensors, named by the weights id and the calibration settings, with the weights
id in their metadata: loading one made for other weights is an error. The file stores the per-column scores
rather than the columns, so any ``partial_ratio`` can use one file; it also stores the scores of the
unskewed basis (identity) for the ``skew=False`` ablation, and, in its metadata ("tuned", JSON), the knobs
calibrated for the model (``calibration.tune``: the share of key columns, on the calibration text and per
prompt length, the threshold ``alpha`` per layer (scored with the layer's own query and rehearsed) and
for all layers, and the layers that choose with their own query, each with the rule that chose it and its
curve).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ...errors import InfinikvError
from ...spec import ModelSpec
from ...store import atomic_write, cache_dir, cache_errors

Tensor = torch.Tensor
FORMAT = "infinikv-skew/1"


class SkewError(InfinikvError):
    """A skew file that is missing, unreadable, or made for other weights."""


@dataclass(frozen=True)
class Skew:
    """Calibration result for one model: per layer and KV head, A and the per-column scores."""

    weights_id: str
    model: str
    source: str  # "austen" or "text:<sha256 prefix>"
    tokens: int  # calibration tokens actually used
    matrices: Tensor  # [layers, kv_heads, d, d], orthogonal, float32
    scores: Tensor  # [layers, kv_heads, d]: Σ|Q̃| + Σ|K̃| per skewed column
    identity_scores: Tensor  # [layers, kv_heads, d]: Σ|Q| + Σ|K| per original column (skew=False)
    tuned: dict[str, Any] | None = (
        None  # calibrated knobs, their rules and curves (``calibration.tune``); None: older file
    )

    def columns(self, layer: int, ratio: float, skewed: bool = True) -> Tensor:
        """Indices [kv_heads, k] of the partial columns, k = ⌈ratio·d⌉ (paper's rule, top-k of the scores)."""
        scores = (self.scores if skewed else self.identity_scores)[layer]
        k = max(1, math.ceil(ratio * scores.shape[-1]))
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values

    def projection(self, layer: int, ratio: float, skewed: bool = True) -> Tensor:
        """[kv_heads, d, k]: post-RoPE q or k (d) times this gives the partial skewed columns (k)."""
        cols = self.columns(layer, ratio, skewed)
        kv_heads, d = cols.shape[0], self.matrices.shape[-1]
        basis = self.matrices[layer] if skewed else torch.eye(d).expand(kv_heads, d, d)
        return torch.gather(basis, 2, cols[:, None, :].expand(-1, d, -1))

    def check(self, spec: ModelSpec) -> None:
        """Raise SkewError unless this calibration was made for the weights and shape of ``spec``."""
        if spec.weights_id and self.weights_id != spec.weights_id:
            raise SkewError(
                f"skew file was calibrated for other weights ({self.model}, {self.weights_id[:12]}…), "
                f"not for this model ({spec.weights_id[:12]}…); run `infinikv calibrate --model …`"
            )
        expected = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim)
        if tuple(self.matrices.shape) != expected:
            raise SkewError(
                f"skew file has shape {tuple(self.matrices.shape)}, this model needs {expected} "
                "(layers, kv heads, head dim, head dim)"
            )

    def save(self, path: Path) -> Path:
        tensors = {"matrices": self.matrices, "scores": self.scores, "identity_scores": self.identity_scores}
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        meta = {"format": FORMAT, "weights_id": self.weights_id, "model": self.model, "source": self.source}
        if self.tuned is not None:
            meta["tuned"] = json.dumps(self.tuned)
        meta = {**meta, "tokens": str(self.tokens), CHECKSUM_KEY: tensor_checksum(tensors)}
        with cache_errors(f"cannot save the skew file {path.name}"), atomic_write(path) as tmp:
            save_file(tensors, str(tmp), meta)
        return path


# -- checksum ------------------------------------------------------------------------------------------------
CHECKSUM_KEY = "sha256"


class SkewDamaged(SkewError):
    """A skew file whose tensors no longer match the checksum written with them."""


def tensor_checksum(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over the tensors' names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def verify_checksum(path: Path, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    """Raise SkewDamaged when ``tensors`` do not match the checksum in ``meta`` (files written before
    checksums were kept carry none and are taken as they are)."""
    expected = meta.get(CHECKSUM_KEY)
    if expected is not None and tensor_checksum(tensors) != expected:
        raise SkewDamaged(f"skew file {path} does not match its checksum (damaged)")


# -- files ---------------------------------------------------------------------------------------------------
def skew_dir() -> Path:
    return cache_dir() / "skew"


def skew_path(weights_id: str, source: str, tokens: int) -> Path:
    return skew_dir() / f"{weights_id[:16]}-{source.replace(':', '-')}-{tokens}.safetensors"


def read_skew(path: str | Path, spec: ModelSpec | None = None) -> Skew:
    """Read a skew file; with ``spec``, also check it belongs to that model."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
    except FileNotFoundError:
        raise SkewError(f"skew file not found: {path}") from None
    except SafetensorError as exc:  # truncated or overwritten: as damaged as a checksum mismatch
        raise SkewDamaged(f"cannot read skew file {path}, it is damaged: {exc}") from None
    except OSError as exc:
        raise SkewError(f"cannot read skew file {path}: {exc}") from None
    if meta.get("format") != FORMAT or not {"matrices", "scores", "identity_scores"} <= set(tensors):
        raise SkewError(f"{path} is not an infinikv skew file ({FORMAT})")
    verify_checksum(path, tensors, meta)
    skew = Skew(
        weights_id=meta["weights_id"],
        model=meta.get("model", "?"),
        source=meta.get("source", "?"),
        tokens=int(meta.get("tokens", 0)),
        matrices=tensors["matrices"],
        scores=tensors["scores"],
        identity_scores=tensors["identity_scores"],
        tuned=json.loads(meta["tuned"]) if "tuned" in meta else None,
    )
    if spec is not None:
        skew.check(spec)
    return skew


def cached_skew(spec: ModelSpec) -> Skew | None:
    """The most recently written calibration for ``spec``'s weights, or None. A damaged file is set aside
    (renamed ``*.damaged``) with one line saying so, and the next one, or None, is returned."""
    if not spec.weights_id or not skew_dir().is_dir():
        return None
    files = sorted(skew_dir().glob(f"{spec.weights_id[:16]}-*.safetensors"), key=lambda p: p.stat().st_mtime)
    for path in reversed(files):
        try:
            return read_skew(path, spec)
        except SkewDamaged as exc:
            print(f"infinikv: {exc}; setting it aside, calibration will run again", file=sys.stderr)
            with cache_errors(f"cannot set aside the damaged skew file {path.name}"):
                path.replace(path.with_suffix(".damaged"))
    return None
