"""InfiniGen calibration: per-KV-head skewing matrices and partial-column scores, cached per model.

InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707) rehearses layer i+1's attention during
layer i with a few columns of its query and key. An orthogonal change of basis ("skewing") first moves most
of the energy of Q and K into few columns, so that those columns approximate QKᵀ well.

Calibration runs the model once over a calibration text (default: the first ``tokens`` tokens of the
``austen`` corpus, see ``infinikv.data``) and captures every layer's post-RoPE queries and keys exactly as
the attention sees them. For each KV head it stacks the post-RoPE queries of the query heads that share it
(g·n rows × d) and takes their SVD, Q = UΣVᵀ; the skewing matrix is A = V (columns by descending singular
value). A is orthogonal, so (QA)(KA)ᵀ = QKᵀ; with grouped-query attention one A per KV head is the only
choice that keeps the shared keys consistent. RoPE does not commute with A, so A is applied only on the
speculation path (to post-RoPE queries and keys); the model's own attention is never changed.

Partial columns follow the paper's rule: the k = ⌈partial_ratio·d⌉ columns with the largest
Σ_tokens |Q̃| + Σ_tokens |K̃| (Q̃ summed over all query heads of the group). The public artifact differs:
its accuracy path takes the union of the top-k columns by |Q̃| and by |K̃| (up to 2k columns), and its
speed path the top-k by |Q̃| of the prompt itself. This module stores the per-column scores rather than the
columns, so any ``partial_ratio`` can use one file; it also stores the scores of the unskewed basis
(identity) for the ``skew=False`` ablation.

Files live in ``cache_dir()/skew/`` as safetensors, named by the weights id and the calibration settings,
with the weights id in their metadata: loading one made for other weights is an error.
"""

from __future__ import annotations

import argparse
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
from tqdm import tqdm

from .errors import InfinikvError, InputError
from .models import LoadedModel, cache_dir
from .policies.base import ModelSpec
from .policies.dense import DenseConfig, DensePolicy

Tensor = torch.Tensor
FORMAT = "infinikv-skew/1"
DEFAULT_CORPUS = "austen"
DEFAULT_TOKENS = 2048


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


def load(path: str | Path, spec: ModelSpec | None = None) -> Skew:
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
    )
    if spec is not None:
        skew.check(spec)
    return skew


def cached(spec: ModelSpec) -> Skew | None:
    """The most recently written calibration for ``spec``'s weights, or None."""
    if not spec.weights_id or not skew_dir().is_dir():
        return None
    files = sorted(skew_dir().glob(f"{spec.weights_id[:16]}-*.safetensors"), key=lambda p: p.stat().st_mtime)
    return load(files[-1], spec) if files else None


def ensure(loaded: LoadedModel) -> Skew:
    """The cached calibration of ``loaded``, calibrating (with the defaults) if there is none."""
    found = cached(loaded.spec)
    if found is not None:
        return found
    print(f"calibrating InfiniGen skew for {loaded.name} (once per model)", file=sys.stderr)
    return calibrate(loaded)


# -- calibration ---------------------------------------------------------------------------------------------
class _Capture(DensePolicy):
    """Dense attention that also turns each layer's post-RoPE q and k into its skew (prefill only)."""

    name = "skew-capture"

    def __init__(self, spec: ModelSpec, device: torch.device, bar: tqdm):
        super().__init__(DenseConfig(), spec, device)
        d = spec.head_dim
        shape = (spec.num_layers, spec.num_kv_heads)
        self.matrices = torch.zeros(*shape, d, d)
        self.scores = torch.zeros(*shape, d)
        self.identity_scores = torch.zeros(*shape, d)
        self.bar = bar

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        group = self.spec.group_size
        for head in range(self.spec.num_kv_heads):
            queries = q[0, head * group : (head + 1) * group].reshape(-1, q.shape[-1]).double()
            keys = k[0, head].double()
            # Right singular vectors of the group's stacked queries, by descending singular value.
            basis = torch.linalg.svd(queries, full_matrices=False).Vh.mT
            self.matrices[layer, head] = basis.float().cpu()
            self.scores[layer, head] = (
                ((queries @ basis).abs().sum(0) + (keys @ basis).abs().sum(0)).float().cpu()
            )
            self.identity_scores[layer, head] = (queries.abs().sum(0) + keys.abs().sum(0)).float().cpu()
        self.bar.update(1)
        return super().attend(layer, q, k, v, mask, scaling)


def calibration_ids(loaded: LoadedModel, text: str | None, tokens: int) -> tuple[Tensor, str]:
    """Token ids [1, n] of the calibration text and the source tag that names it."""
    if tokens < 2:
        raise InputError(f"calibration needs at least 2 tokens, got {tokens}")
    tokens = min(tokens, loaded.max_context)
    if text is None:
        from .data import load_corpus

        text, source = load_corpus(DEFAULT_CORPUS), DEFAULT_CORPUS
    else:
        source = "text:" + hashlib.sha256(text.encode()).hexdigest()[:12]
    # Tokenise only a prefix long enough for ``tokens`` (no tokenizer makes more than 1 token per character).
    ids = loaded.tokenizer(text[: 16 * tokens], return_tensors="pt")["input_ids"][:, :tokens]
    if ids.shape[1] < 2:
        raise InputError("calibration text is too short (fewer than 2 tokens)")
    return ids, source


@torch.inference_mode()
def calibrate(
    loaded: LoadedModel, text: str | None = None, tokens: int = DEFAULT_TOKENS, save: bool = True
) -> Skew:
    """Compute ``loaded``'s skewing matrices and column scores over ``tokens`` tokens of ``text`` (default:
    the austen corpus); write them to the skew cache unless ``save`` is False."""
    from .cache import InfinikvCache

    ids, source = calibration_ids(loaded, text, tokens)
    spec = loaded.spec
    with tqdm(total=spec.num_layers, desc="calibrate", unit="layer", leave=False) as bar:
        capture = _Capture(spec, loaded.device, bar)
        cache = InfinikvCache(loaded.model, capture, device=loaded.device)
        loaded.model(input_ids=ids.to(loaded.device), cache=cache, use_cache=True, logits_to_keep=1)
    skew = Skew(
        weights_id=loaded.weights_id,
        model=loaded.name,
        source=source,
        tokens=int(ids.shape[1]),
        matrices=capture.matrices,
        scores=capture.scores,
        identity_scores=capture.identity_scores,
    )
    if save:
        skew.save(skew_path(loaded.weights_id, source, skew.tokens))
    return skew


def concentration(skew: Skew, ratio: float, skewed: bool = True) -> float:
    """Share of Σ|Q̃|+Σ|K̃| held by the partial columns, averaged over layers and KV heads.

    This is the paper's column rule, in L1, and skewing need not raise it: the L1 norm is not invariant
    under rotation, and A (from Q alone) does not diagonalise K. What the SVD guarantees (Ky Fan) is the L2
    energy of Q in its leading columns, so judge skewing by the partial QKᵀ, not by this share."""
    scores = skew.scores if skewed else skew.identity_scores
    k = max(1, math.ceil(ratio * scores.shape[-1]))
    return float((scores.topk(k, dim=-1).values.sum(-1) / scores.sum(-1)).mean())


# -- command line --------------------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    from .models import load

    text = None
    if args.text:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read calibration text {args.text}: {exc}") from None
    loaded = load(args.model, device=args.device)
    skew = calibrate(loaded, text=text, tokens=args.tokens)
    report: dict[str, Any] = {
        "model": loaded.name,
        "weights_id": loaded.weights_id,
        "path": str(skew_path(loaded.weights_id, skew.source, skew.tokens)),
        "source": skew.source,
        "tokens": skew.tokens,
        "layers": int(skew.matrices.shape[0]),
        "kv_heads": int(skew.matrices.shape[1]),
        "head_dim": int(skew.matrices.shape[2]),
        "partial_share_skewed": round(concentration(skew, 0.2), 4),
        "partial_share_identity": round(concentration(skew, 0.2, skewed=False), 4),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(report["path"])
        print(
            f"{report['tokens']} tokens of {report['source']}; 20% of columns hold "
            f"{report['partial_share_skewed']:.1%} of Σ|Q|+Σ|K| skewed vs "
            f"{report['partial_share_identity']:.1%} unskewed",
            file=sys.stderr,
        )
    return 0


def register_cli(subparsers) -> None:
    from .models import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "calibrate", help="compute and cache InfiniGen's skewing matrices for a model"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="registered name, .gguf file, HF directory or hub id"
    )
    parser.add_argument("--text", help=f"UTF-8 calibration text file (default: the {DEFAULT_CORPUS} corpus)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="calibration tokens")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=cmd_calibrate)
