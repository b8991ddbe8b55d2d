"""InfiniGen's skew file: per-KV-head skewing matrices and partial-column scores of one model.

A :class:`Skew` is what calibration (``calibration.py``) produces and the policy reads. Files live in
``cache_dir()/skew/`` as safetensors, named by the weights id and the calibration settings, with the weights
id in their metadata: loading one made for other weights is an error. The file stores the per-column scores
rather than the columns, so any ``partial_ratio`` can use one file; it also stores the scores of the
unskewed basis (identity) for the ``skew=False`` ablation, and, in its metadata ("tuned", JSON), the knobs
calibrated for the model (``tuning.py``: the threshold ``alpha``, the rule that chose it and its curve).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ...errors import InfinikvError
from ...spec import ModelSpec
from ...store import cache_dir

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
        None  # calibrated knobs ("alpha"), their "rule" and "curve"; None: older file
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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"matrices": self.matrices, "scores": self.scores, "identity_scores": self.identity_scores}
        meta = {"format": FORMAT, "weights_id": self.weights_id, "model": self.model, "source": self.source}
        if self.tuned is not None:
            meta["tuned"] = json.dumps(self.tuned)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(tmp), {**meta, "tokens": str(self.tokens)}
        )
        tmp.replace(path)
        return path


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
    except (SafetensorError, OSError) as exc:
        raise SkewError(f"cannot read skew file {path}: {exc}") from None
    if meta.get("format") != FORMAT or not {"matrices", "scores", "identity_scores"} <= set(tensors):
        raise SkewError(f"{path} is not an infinikv skew file ({FORMAT})")
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
    """The most recently written calibration for ``spec``'s weights, or None."""
    if not spec.weights_id or not skew_dir().is_dir():
        return None
    files = sorted(skew_dir().glob(f"{spec.weights_id[:16]}-*.safetensors"), key=lambda p: p.stat().st_mtime)
    return read_skew(files[-1], spec) if files else None
