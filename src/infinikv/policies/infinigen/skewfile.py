"""InfiniGen's skew file: per-KV-head skewing matrices and partial-column scores of one model.

A :class:`Skew` is what calibration (``calibration.py``) produces and the policy reads. Files live in
``cache_dir()/skew/`` as safetensors, named by the weights id and the calibration settings, with the weights
id in their metadata: loading one made for other weights is an error. The file stores the per-column scores
rather than the columns, so any ``partial_ratio`` can use one file; it also stores the scores of the
unskewed basis (identity) for the ``skew=False`` ablation, and, in its metadata ("tuned", JSON), the knobs
calibrated for the model, a :class:`Tuned` record (``calibration.tune``: the share of key columns, on the
calibration text and per prompt length, the threshold ``alpha`` per layer (scored with the layer's own query
and rehearsed) and for all layers, and the layers that choose with their own query, each with the rule that
chose it and its curve). The record carries its format's version; a file whose record is of another version
(or has none: files written before the record was versioned) reads as a calibration without calibrated
knobs, which ``calibration.ensure_skew`` redoes.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
class AlphaPoint:
    """What the count rule keeps and fetches at one alpha of ``tuning.ALPHAS``, averaged over the managed
    layers, each scored with the query it chooses with at the default knobs."""

    alpha: float
    """The threshold, in logits below each head's best speculated score."""
    mass_kept: float
    """Share of the dense attention the fetched tokens plus the new one keep (4 decimals)."""
    fetched: float
    """Share of the past tokens fetched (4 decimals)."""


@dataclass(frozen=True)
class RatioPoint:
    """How well the partial columns of one ratio of ``tuning.RATIOS`` speculate, on the calibration text."""

    partial_ratio: float
    """The share of ``head_dim`` columns."""
    recall: float
    """Share of the real top-k tokens the speculated top-k holds, averaged over the rehearsed layers (4
    decimals)."""


@dataclass(frozen=True)
class RatioAtLength:
    """The partial ratio calibrated at the end of one window of the calibration text."""

    tokens: int
    """Where the window ends; a prompt takes the shortest window at least as long as itself (longer
    prompts: the longest)."""
    partial_ratio: float
    """The ratio the rule (``Tuned.ratio_rule``) picks at that window's end."""
    curve: tuple[float, ...]
    """The recall per ratio of ``tuning.RATIOS`` it was picked from (as :attr:`RatioPoint.recall`)."""
    layer_curves: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """Per rehearsed layer, (layer, its own recall per ratio of ``tuning.RATIOS``): what columns allocated
    per layer (``InfiniGenConfig.column_allocation``) are chosen from. Empty in a record written before
    they were kept."""


@dataclass(frozen=True)
class OwnQueryPoint:
    """How much of its own query's recall one rehearsed layer's rehearsal keeps."""

    layer: int
    """The layer."""
    recall_kept: float
    """Share of its own query's recall of the real top-k that the rehearsal from the previous layer's input
    keeps, averaged over the calibration windows (4 decimals)."""


TUNED_VERSION = 2  # the version of the :class:`Tuned` record this code writes and reads


@dataclass(frozen=True)
class Tuned:
    """InfiniGen's knobs calibrated for one model (``calibration.tune``), stored with its skew.

    Per-layer tuples are indexed by layer, None where a layer was not calibrated (sliding-window layers)."""

    partial_ratio: float
    """The share of key columns picked on the calibration text (its window is the first of
    :attr:`ratio_by_length`); the alphas are calibrated at it."""
    partial_keys: str
    """How the partial keys were stored when the ratios were picked and the alphas calibrated
    (``InfiniGenConfig.partial_keys``'s default then)."""
    ratio_rule: str
    """How :attr:`partial_ratio` was picked (``tuning.RATIO_RULE``)."""
    ratio_curve: tuple[RatioPoint, ...]
    """The recall per ratio of ``tuning.RATIOS`` on the calibration text."""
    ratio_by_length: tuple[RatioAtLength, ...]
    """The ratio per window of the calibration text, the shortest first (empty when nothing was
    rehearsed)."""
    alpha_per_layer: tuple[float | None, ...]
    """Each layer's alpha scored with the query it chooses with at the default knobs (its own on the first
    ``dense_layers`` and the own-query layers, else rehearsed)."""
    alpha_per_layer_own: tuple[float | None, ...]
    """Each layer's alpha scored with its own query."""
    alpha_per_layer_rehearsed: tuple[float | None, ...]
    """Each layer's alpha scored with the query rehearsed from the previous layer's input."""
    layer_rule: str
    """How the per-layer alphas were picked (``tuning.LAYER_RULE``)."""
    alpha: float
    """One alpha for all layers (a summary beside the per-layer ones): the one a layer without its own
    takes."""
    rule: str
    """How :attr:`alpha` was picked (``tuning.RULE``)."""
    curve: tuple[AlphaPoint, ...]
    """What the count rule keeps and fetches per alpha of ``tuning.ALPHAS``, averaged over the layers."""
    own_query_layers: tuple[int, ...]
    """The later layers (from ``dense_layers``) that choose with their own query, in layer order."""
    own_query_rule: str
    """How they were picked (``tuning.OWN_QUERY_RULE``)."""
    own_query_curve: tuple[OwnQueryPoint, ...]
    """Per rehearsed layer, the share of its own query's recall its rehearsal keeps."""
    version: int = TUNED_VERSION
    """The record's format (:data:`TUNED_VERSION` when written by this code)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Tuned | None:
        """The record stored as ``text``; None when it is of another version than :data:`TUNED_VERSION` (or
        has none). Raises ValueError when a record of this version is malformed."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != TUNED_VERSION:
                return None
            return cls(
                partial_ratio=data["partial_ratio"],
                partial_keys=data["partial_keys"],
                ratio_rule=data["ratio_rule"],
                ratio_curve=tuple(RatioPoint(**point) for point in data["ratio_curve"]),
                ratio_by_length=tuple(
                    RatioAtLength(
                        entry["tokens"],
                        entry["partial_ratio"],
                        tuple(entry["curve"]),
                        tuple((layer, tuple(c)) for layer, c in entry.get("layer_curves", ())),
                    )
                    for entry in data["ratio_by_length"]
                ),
                alpha_per_layer=tuple(data["alpha_per_layer"]),
                alpha_per_layer_own=tuple(data["alpha_per_layer_own"]),
                alpha_per_layer_rehearsed=tuple(data["alpha_per_layer_rehearsed"]),
                layer_rule=data["layer_rule"],
                alpha=data["alpha"],
                rule=data["rule"],
                curve=tuple(AlphaPoint(**point) for point in data["curve"]),
                own_query_layers=tuple(data["own_query_layers"]),
                own_query_rule=data["own_query_rule"],
                own_query_curve=tuple(OwnQueryPoint(**point) for point in data["own_query_curve"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed calibrated knobs: {exc!r}") from None


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
    tuned: Tuned | None = None  # calibrated knobs (``calibration.tune``); None: none of this version
    # projections made so far, by (layer, ratio, skewed, device, dtype): see ``projection``
    _projections: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def columns(self, layer: int, ratio: float, skewed: bool = True) -> Tensor:
        """Indices [kv_heads, k] of the partial columns, k = ⌈ratio·d⌉ (paper's rule, top-k of the scores)."""
        scores = (self.scores if skewed else self.identity_scores)[layer]
        k = max(1, math.ceil(round(ratio * scores.shape[-1], 6)))  # a ratio of c/d gives c columns
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values

    def projection(
        self,
        layer: int,
        ratio: float,
        skewed: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """[kv_heads, d, k]: post-RoPE q or k (d) times this gives the partial skewed columns (k); on
        ``device`` in ``dtype`` where given (else float32 on the CPU). Made once per argument set and shared
        by every caller (read-only), so the sequences of an engine step that project with one calibration
        hold one tensor (``together.partial_keys_together``)."""
        key = (layer, ratio, skewed, device, dtype)
        made = self._projections.get(key)
        if made is None:
            cols = self.columns(layer, ratio, skewed)
            kv_heads, d = cols.shape[0], self.matrices.shape[-1]
            basis = self.matrices[layer] if skewed else torch.eye(d).expand(kv_heads, d, d)
            made = torch.gather(basis, 2, cols[:, None, :].expand(-1, d, -1)).to(device=device, dtype=dtype)
            self._projections[key] = made
        return made

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
            meta["tuned"] = self.tuned.to_json()
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
    try:
        tuned = Tuned.from_json(meta["tuned"]) if "tuned" in meta else None
    except ValueError as exc:
        raise SkewDamaged(f"skew file {path} is damaged: {exc}") from None
    skew = Skew(
        weights_id=meta["weights_id"],
        model=meta.get("model", "?"),
        source=meta.get("source", "?"),
        tokens=int(meta.get("tokens", 0)),
        matrices=tensors["matrices"],
        scores=tensors["scores"],
        identity_scores=tensors["identity_scores"],
        tuned=tuned,
    )
    if spec is not None:
        skew.check(spec)
    return skew


# calibrations read by cached_skew, by path, with the file's (inode, size, mtime) when read
_READ: dict[Path, tuple[tuple[int, int, int], Skew]] = {}


def _read_once(path: Path, spec: ModelSpec) -> Skew:
    """``read_skew(path, spec)``, read (and its checksum verified) once while the file is unchanged: every
    sequence of a server shares one calibration and its projections."""
    try:
        info = path.stat()
    except OSError:  # gone since it was listed: read_skew says so
        return read_skew(path, spec)
    stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
    known = _READ.get(path)
    if known is not None and known[0] == stamp:
        known[1].check(spec)
        return known[1]
    skew = read_skew(path, spec)
    _READ[path] = (stamp, skew)
    return skew


def cached_skew(spec: ModelSpec) -> Skew | None:
    """The most recently written calibration for ``spec``'s weights, or None. A damaged file is set aside
    (renamed ``*.damaged``) with one line saying so, and the next one, or None, is returned."""
    if not spec.weights_id or not skew_dir().is_dir():
        return None
    files = sorted(skew_dir().glob(f"{spec.weights_id[:16]}-*.safetensors"), key=lambda p: p.stat().st_mtime)
    for path in reversed(files):
        try:
            return _read_once(path, spec)
        except SkewDamaged as exc:
            print(f"infinikv: {exc}; setting it aside, calibration will run again", file=sys.stderr)
            with cache_errors(f"cannot set aside the damaged skew file {path.name}"):
                path.replace(path.with_suffix(".damaged"))
    return None
