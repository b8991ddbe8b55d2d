"""How well InfiniGen's rehearsal predicts each layer's real attention, layer by layer, on real text.

InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707) chooses layer i's tokens from a
*speculated* score: layer i-1's input times a few skewed columns of layer i's query weights, against the
same columns of layer i's keys (its first layers, with ``first_layers`` own, and its own-query layers score
with their own input: there ``recall_realq_budget`` equals ``recall_budget``). The ``oracle`` policy chooses
from the real scores. This module measures, per layer, how far apart the two are while the text is fed
through the decode path (a dense prefill, then teacher-forced decode steps, with
:class:`~infinikv.eval.runner.DecodeRun`):

* ``recall_budget``: the share of the oracle's top-k (k = the budget cap) that the speculated top-k holds;
* ``mass_spec_budget`` / ``mass_oracle_budget``: the share of the real attention (softmax over every key,
  averaged over the query heads of a KV group) on the speculated / the oracle's top-k, plus the new token
  (always attended);
* ``mass_best_budget``: the most attention any k tokens per KV head can hold (top-k by the group's mean
  attention weight): what the oracle's combination rule (max over the group's heads) itself gives up;
* the same at the count InfiniGen actually fetches at its ``alpha`` (``*_fetched``), ``fetched`` being
  that count as a share of the past tokens: ``mass_spec_fetched`` is the attention InfiniGen keeps;
* ``recall_realq_budget``: recall when speculating with the layer's *own* query (partial columns only),
  which splits the miss into what the partial columns lose and what rehearsing from the previous layer's
  input loses;
* ``sink_mass`` / ``sink_kept``: real attention on the first ``n_sink`` tokens and the share of them
  InfiniGen fetches; ``recent_mass`` / ``recent_kept``: the same for the last ``n_recent`` past tokens;
* per threshold ``alpha`` of a grid: the mean attention kept and bytes fetched, had InfiniGen used that
  alpha (the count rule alone, without the reserved sinks and window) in the same steps (calibration
  picks InfiniGen's alpha of each layer from the same curve, ``policies.infinigen.tuning``).

Real scores use the layer's real query and every cached key, combined per KV group as InfiniGen and the
oracle combine them (each head relative to its own best, max over the group). With ``attend="dense"`` each
managed layer attends to everything instead of InfiniGen's selection, so the numbers describe speculation
alone on the dense trajectory rather than an InfiniGen run in which earlier misses compound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..errors import InputError
from ..models import LoadedModel
from ..policies import InfiniGenConfig, InfiniGenPolicy, prepare, resolve_budget
from ..policies.base import attention, group_relative_max, pick_top, reserved_first
from ..policies.infinigen.rehearsal import Rehearsal, dequantized
from ..policies.infinigen.tuning import ALPHAS, coverage_by_alpha
from .ppl import PerplexityConfig, make_windows
from .runner import DecodeRun

Tensor = torch.Tensor
ATTEND = ("infinigen", "dense")
N_SINK, N_RECENT = 4, 64  # the spans whose attention and fetch share are reported
METRICS = (
    "fetched",
    "recall_budget",
    "mass_spec_budget",
    "mass_oracle_budget",
    "mass_best_budget",
    "recall_fetched",
    "mass_spec_fetched",
    "mass_oracle_fetched",
    "recall_realq_budget",
    "sink_mass",
    "sink_kept",
    "recent_mass",
    "recent_kept",
)


def _top(scores: Tensor, k: int) -> Tensor:
    """bool mask [kv_heads, n] of the k highest ``scores`` [kv_heads, n] per head, ties broken as the
    policy breaks them (``pick_top``: the earlier slot)."""
    index, _ = pick_top(scores[None], [k])
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index[0], True)


class SpeculationProbe(InfiniGenPolicy):
    """InfiniGen that also scores its speculation against each managed layer's real attention: it observes
    each rehearsal (the policy's :class:`~infinikv.policies.infinigen.rehearsal.Rehearsal` records) and
    measures it when the layer attends, with the layer's real query.

    Needs the whole pool in position order, so the host pool never evicts (``capacity`` 1)."""

    name = "infinigen-probe"

    def __init__(
        self,
        config: InfiniGenConfig,
        spec: Any,
        device: torch.device,
        skew: Any = None,
        attend_dense: bool = False,
        alphas: tuple[float, ...] = ALPHAS,
        n_sink: int = N_SINK,
        n_recent: int = N_RECENT,
    ):
        if config.capacity != 1:
            raise InputError("the speculation probe needs the whole cache: capacity must be 1")
        super().__init__(config, spec, device, skew, observer=self._observe)
        self.attend_dense = attend_dense
        self.alphas = alphas
        self.n_sink, self.n_recent = n_sink, n_recent
        self._rehearsed: dict[int, Rehearsal] = {}  # per layer: this step's rehearsal, until it attends
        layers = spec.num_layers
        self.sums: list[dict[str, float]] = [dict.fromkeys(METRICS, 0.0) for _ in range(layers)]
        self.samples = [0] * layers  # (step, sequence) pairs measured per layer
        self.curve = torch.zeros(layers, len(alphas), 2, dtype=torch.float64)  # per alpha: kept mass, fetched

    def _observe(self, rehearsal: Rehearsal) -> None:
        self._rehearsed[rehearsal.layer] = rehearsal

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        if layer not in self._rehearsed:
            return super().attend(layer, q, k, v, mask, scaling)
        self._measure(layer, self._rehearsed.pop(layer), q, scaling)
        if not self.attend_dense:
            return super().attend(layer, q, k, v, mask, scaling)
        real = self.real_slots(layer)[:, :, None, :]
        keys, values = (t.to(q.device) for t in (self.host_pool.keys(layer), self.host_pool.values(layer)))
        return attention(q, keys, values, real, scaling)

    @torch.no_grad()
    def _measure(self, layer: int, rehearsal: Rehearsal, q: Tensor, scaling: float) -> None:
        speculated, per_row, real_tokens = rehearsal.scores, rehearsal.counts, rehearsal.real_tokens
        # the scores InfiniGen ranks by: reserved sinks and window first
        ranked = speculated if rehearsal.reserved is None else reserved_first(speculated, rehearsal.reserved)
        n = speculated.shape[-1]  # past slots; the pool now also holds the new token, in slot n
        batch, kv_heads, group, dim = q.shape[0], self.spec.num_kv_heads, self.spec.group_size, q.shape[-1]
        query = q[:, :, -1].reshape(batch, kv_heads, group, dim).float()
        keys = self.host_pool.keys(layer)[:, :, : n + 1].to(q.device).float()
        logits = torch.matmul(query, keys.transpose(-1, -2)) * scaling  # [batch, kv_heads, group, n + 1]
        real = self.real_slots(layer)[:, :, : n + 1].to(q.device)
        logits = logits.masked_fill(~real[:, :, None], -math.inf)
        mass = torch.softmax(logits, dim=-1).mean(dim=2)  # [batch, kv_heads, n + 1]
        past_mass, new_mass = mass[..., :n], mass[..., n]
        real_scores = group_relative_max(logits[..., :n].flatten(1, 2), group)
        partial_keys = dequantized(rehearsal.partial_keys, rehearsal.scale)
        realq = rehearsal.to_partial(query) * scaling  # query: float32, as the real logits
        realq = torch.matmul(realq, partial_keys[..., :n])
        realq = group_relative_max(realq.masked_fill(~real[:, :, None, :n], -math.inf).flatten(1, 2), group)
        sums = self.sums[layer]
        for row in range(batch):
            available = int(real[row, 0, :n].sum())
            floor = self.config.min_tokens
            budget = min(resolve_budget(self.config.budget, max(real_tokens[row], 1), floor=floor), available)
            fetched = int(per_row[row])
            spec_row, real_row, mass_row = ranked[row].float(), real_scores[row], past_mass[row]
            for tag, count in (("budget", budget), ("fetched", fetched)):
                chosen, best = _top(spec_row, count), _top(real_row, count)
                sums[f"recall_{tag}"] += float(((chosen & best).sum(-1) / count).mean())
                sums[f"mass_spec_{tag}"] += float(((mass_row * chosen).sum(-1) + new_mass[row]).mean())
                sums[f"mass_oracle_{tag}"] += float(((mass_row * best).sum(-1) + new_mass[row]).mean())
            sums["mass_best_budget"] += float(
                ((mass_row * _top(mass_row, budget)).sum(-1) + new_mass[row]).mean()
            )
            sums["fetched"] += fetched / max(available, 1)
            best = _top(real_row, budget)
            sums["recall_realq_budget"] += float(((_top(realq[row], budget) & best).sum(-1) / budget).mean())
            first = n - available  # left padding comes first
            kept = _top(spec_row, fetched)
            for tag, span in (
                ("sink", slice(first, first + self.n_sink)),
                ("recent", slice(max(first, n - self.n_recent), n)),
            ):
                sums[f"{tag}_mass"] += float(mass_row[:, span].sum(-1).mean())
                sums[f"{tag}_kept"] += float(kept[:, span].float().mean())
            raw = speculated[row].float()  # the count rule alone, without reserved tokens
            self._alpha_curve(layer, raw, mass_row, new_mass[row], budget, available)
        self.samples[layer] += batch

    def _alpha_curve(
        self, layer: int, spec_row: Tensor, mass_row: Tensor, new_mass: Tensor, budget: int, available: int
    ) -> None:
        """Attention kept and share fetched, per alpha of the grid, by InfiniGen's count rule."""
        kept, counts = coverage_by_alpha(spec_row, mass_row, new_mass, torch.tensor(budget), self.alphas)
        self.curve[layer, :, 0] += kept.double()
        self.curve[layer, :, 1] += counts.double() / max(available, 1)

    def layer_report(self) -> list[dict[str, Any]]:
        """Per managed layer: the means of every metric over the measured steps."""
        rows = []
        for layer, (sums, samples) in enumerate(zip(self.sums, self.samples, strict=True)):
            if samples:
                rows.append({"layer": layer, **{k: v / samples for k, v in sums.items()}})
        return rows

    def alpha_report(self) -> list[dict[str, float]]:
        """Per alpha of the grid: attention kept and share fetched, averaged over the managed layers."""
        measured = [layer for layer, samples in enumerate(self.samples) if samples]
        if not measured:
            return []
        means = torch.stack([self.curve[layer] / self.samples[layer] for layer in measured]).mean(dim=0)
        return [
            {"alpha": alpha, "mass_kept": float(means[i, 0]), "fetched": float(means[i, 1])}
            for i, alpha in enumerate(self.alphas)
        ]


@dataclass(frozen=True)
class SpeculationConfig:
    """text/context/scored: one window of ``context`` tokens from the start of ``text``, its last ``scored``
    tokens fed through the decode path; attend: "infinigen" (each layer attends to what InfiniGen chose)
    or "dense" (speculation measured on the dense trajectory)."""

    text: str = "austen"
    context: int = 2048
    scored: int = 512
    attend: str = "infinigen"

    def __post_init__(self):
        if self.attend not in ATTEND:
            raise InputError(f"attend must be one of {', '.join(ATTEND)}, got '{self.attend}'")
        if not 1 <= self.scored < self.context - 1:
            raise InputError(f"scored must be in [1, context - 1), got {self.scored} with {self.context}")


def probe(
    loaded: LoadedModel,
    policy: InfiniGenConfig,
    config: SpeculationConfig,
    alphas: tuple[float, ...] = ALPHAS,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the probe over one window: per-layer metrics, the alpha grid, and the run's perplexity."""
    prepare(policy, loaded)
    prefill = config.context - config.scored
    windows = make_windows(loaded, PerplexityConfig(config.text, config.context, prefill))
    probe_policy = SpeculationProbe(
        policy, loaded.spec, loaded.device, attend_dense=config.attend == "dense", alphas=alphas
    )
    nll = []
    with DecodeRun(loaded, probe_policy) as run:
        logits = run.prefill(windows[:, :prefill])
        steps = tqdm(range(config.scored), desc="speculation", unit="tok", disable=not progress, leave=False)
        for i in steps:
            target = windows[:, prefill + i]
            nll.append(float(-torch.log_softmax(logits, dim=-1)[0, int(target[0])]))
            if i + 1 < config.scored:
                logits = run.step(target)
        stats = run.stats()
    return {
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "text": config.text,
        "context": config.context,
        "prefill": prefill,
        "scored": config.scored,
        "attend": config.attend,
        "decode_path": stats["decode_path"],
        "knobs": policy.knobs(),
        # what the calibrated knobs (0 = calibrated) resolved to in this run
        "partial_ratio_used": policy.resolve("partial_ratio", probe_policy.skew(), tokens=prefill)[0],
        "alpha_used": stats.get("alpha_used"),
        "count_rule_used": (stats.get("count_rule_used") or ["alpha"])[0],
        "ppl": math.exp(sum(nll) / len(nll)),
        "kv_fetched_fraction": stats["kv_fetched_fraction"],
        "layers": probe_policy.layer_report(),
        "alphas": probe_policy.alpha_report(),
    }


# -- output --------------------------------------------------------------------------------------------------
def _alphas(per_layer: list[float | None] | None) -> str:
    return " ".join(f"{a:g}" for a in per_layer or [] if a is not None) or "none"


def markdown(result: dict[str, Any]) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in result["knobs"].items())
    lines = [
        f"# InfiniGen speculation on {result['model']}",
        "",
        f"{result['text']}, {result['context']} tokens ({result['prefill']} prefilled, {result['scored']} "
        f"scored through the decode path), layers attend to: {result['attend']}; knobs: {knobs} (partial "
        f"ratio used {result['partial_ratio_used']:g}, alpha per managed layer "
        f"{_alphas(result['alpha_used'])}, count by {result.get('count_rule_used', 'alpha')}). "
        f"Perplexity of this run {result['ppl']:.3f}, KV fetched {result['kv_fetched_fraction']:.3f}.",
        "",
        "| layer | fetched | recall@budget | spec mass@budget | oracle mass@budget | best mass@budget "
        "| recall@fetched "
        "| spec mass@fetched | oracle mass@fetched | recall own-q@budget | sink mass | sink kept "
        "| recent mass | recent kept |",
        "|---:" * 14 + "|",
    ]
    for row in result["layers"]:
        lines.append(f"| {row['layer']} | " + " | ".join(f"{row[k]:.3f}" for k in METRICS) + " |")
    lines += ["", "| alpha | attention kept | KV fetched (managed layers) |", "|---:|---:|---:|"]
    for row in result["alphas"]:
        lines.append(f"| {row['alpha']:g} | {row['mass_kept']:.3f} | {row['fetched']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [row["layer"] for row in result["layers"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, label in (
        ("recall_budget", "recall of the oracle's top-k (k = budget)"),
        ("recall_realq_budget", "same, speculating with the layer's own query"),
        ("mass_spec_fetched", "attention kept by InfiniGen's fetched set"),
        ("mass_oracle_fetched", "attention kept by the oracle, same count"),
        ("mass_best_budget", "most attention any k tokens hold (k = budget)"),
        ("fetched", "share of past tokens fetched"),
        ("sink_mass", f"attention on the first {N_SINK} tokens"),
    ):
        ax.plot(layers, [row[key] for row in result["layers"]], marker="o", label=label)
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{result['model']}, {result['context']} tokens, attend: {result['attend']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """speculation.json, speculation.md and speculation.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "speculation.json", out / "speculation.md", out / "speculation.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(result), encoding="utf-8")
    plot(result, paths[2])
    return paths
