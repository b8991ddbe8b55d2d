"""The speculation probe: InfiniGen's speculated sets scored against the real attention, per layer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from infinikv.eval import ppl
from infinikv.eval.speculation import SpeculationConfig, SpeculationProbe, probe, write
from infinikv.policies import InfiniGenConfig, make_config
from infinikv.policies.infinigen import calibration, skewfile, tuning
from infinikv.policies.infinigen.config import PARTIAL_KEYS
from infinikv.policies.infinigen.skewfile import RatioAtLength

TEXT = "She had a lively, playful disposition, which delighted in anything ridiculous. " * 12
LAYER = 2  # managed: the tiny Llama has 4 global layers, the first 2 dense


@pytest.fixture(scope="module")
def tiny_skew(tiny):
    return calibration.calibrate(tiny, text=TEXT, tokens=256, save=False)


def _constructed(tiny, tiny_skew, monkeypatch, attend_query_noise: float) -> SpeculationProbe:
    """A probe whose layer 2 holds 40 random keys and is rehearsed with query Q; layer 2 then attends with
    Q plus ``attend_query_noise`` times another random query."""
    spec = tiny.spec
    config = InfiniGenConfig(
        alpha=5.0, budget=8, partial_ratio=1.0, skew=False, n_sink=0, window=0, min_tokens=0
    )
    policy = SpeculationProbe(config, spec, torch.device("cpu"), skew=tiny_skew)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, spec.num_kv_heads, 40, spec.head_dim, generator=gen)
    policy.prefill(LAYER, k, k.clone())
    policy.begin_decoding()
    query = 3 * torch.randn(1, spec.num_heads, 1, spec.head_dim, generator=gen)
    monkeypatch.setattr(type(spec), "query", lambda self, *args: query)
    policy.plan(LAYER, torch.zeros(1, 1, 1), torch.zeros(1, 1, dtype=torch.long))  # from layer 1's hook
    new = torch.randn(1, spec.num_kv_heads, 1, spec.head_dim, generator=gen)
    selection = policy.decode(LAYER, new, new.clone())
    real_query = query + attend_query_noise * torch.randn(query.shape, generator=gen)
    policy.attend(LAYER, real_query, selection.keys, selection.values, None, spec.attention[LAYER].scaling)
    return policy


def test_recall_is_one_when_speculation_equals_the_real_scores(tiny, tiny_skew, monkeypatch):
    """All columns, no skew, and the same query: speculated scores are the real ones."""
    row = _constructed(tiny, tiny_skew, monkeypatch, 0.0).layer_report()
    assert [r["layer"] for r in row] == [LAYER]
    row = row[0]
    assert row["recall_budget"] == pytest.approx(1.0) and row["recall_fetched"] == pytest.approx(1.0)
    assert row["recall_realq_budget"] == pytest.approx(1.0)
    assert row["mass_spec_budget"] == pytest.approx(row["mass_oracle_budget"])
    assert 0 < row["mass_oracle_fetched"] <= row["mass_oracle_budget"] <= 1


def test_a_different_real_query_lowers_recall(tiny, tiny_skew, monkeypatch):
    row = _constructed(tiny, tiny_skew, monkeypatch, 3.0).layer_report()[0]
    assert row["recall_budget"] < 0.9
    assert row["mass_spec_budget"] < row["mass_oracle_budget"]  # the oracle keeps more mass at k ...
    assert row["mass_oracle_budget"] <= row["mass_best_budget"] + 1e-6  # ... and the mass-optimal set most


def test_alpha_grid_reproduces_the_configured_alpha(tiny, tiny_skew, monkeypatch):
    policy = _constructed(tiny, tiny_skew, monkeypatch, 1.0)
    row = policy.layer_report()[0]
    at_five = next(r for r in policy.alpha_report() if r["alpha"] == 5.0)
    assert at_five["mass_kept"] == pytest.approx(row["mass_spec_fetched"])
    assert at_five["fetched"] == pytest.approx(row["fetched"])
    kept = [r["mass_kept"] for r in policy.alpha_report()]
    assert kept == sorted(kept)  # a larger alpha never keeps less


def _probe_and_infinigen(tiny, skew, monkeypatch, tmp_path, knobs: InfiniGenConfig) -> tuple[dict, dict]:
    """The probe over a 160-token window (40 scored) with ``skew``, and InfiniGen's perplexity run of it."""
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: skew)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    result = probe(tiny, knobs, SpeculationConfig(str(text), context=160, scored=40))
    reference = ppl.perplexity(tiny, knobs, ppl.PerplexityConfig(str(text), context=160, prefill=120))
    return result, reference


def test_probe_run_is_an_infinigen_run(tiny, tiny_skew, monkeypatch, tmp_path):
    """Attending to InfiniGen's selection, the probe's perplexity is InfiniGen's, and it writes its files."""
    knobs = InfiniGenConfig(alpha=3.0, budget=0.3, min_tokens=0)
    result, reference = _probe_and_infinigen(tiny, tiny_skew, monkeypatch, tmp_path, knobs)
    text = tmp_path / "t.txt"
    assert result["ppl"] == pytest.approx(reference["ppl"], rel=1e-5)
    assert result["kv_fetched_fraction"] == pytest.approx(reference["kv_fetched_fraction"])
    assert [r["layer"] for r in result["layers"]] == [0, 1, 2, 3]  # the first two select with their own query
    for row in result["layers"]:
        assert 0 <= row["recall_budget"] <= 1 and 0 < row["mass_spec_fetched"] <= 1
    dense = probe(tiny, knobs, SpeculationConfig(str(text), context=160, scored=40, attend="dense"))
    dense_ppl = ppl.perplexity(tiny, make_config("dense"), ppl.PerplexityConfig(str(text), 160, 120))["ppl"]
    assert dense["ppl"] == pytest.approx(dense_ppl, rel=1e-4)
    assert math.isfinite(dense["layers"][0]["recall_budget"])
    paths = write(result, tmp_path / "out")
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)


def test_probe_reads_a_store_cut_to_the_prompt_lengths_ratio(tiny, tiny_skew, monkeypatch, tmp_path):
    """With ratios per prompt length, a prompt that takes fewer columns than the widest calibrated (a shorter
    window's) is probed with those columns, and the probe's run is still InfiniGen's."""
    ratios = (RatioAtLength(100, 0.75, ()), RatioAtLength(4096, 0.25, ()))
    skew = dataclasses.replace(tiny_skew, tuned=dataclasses.replace(tiny_skew.tuned, ratio_by_length=ratios))
    knobs = InfiniGenConfig(alpha=3.0, budget=0.3, min_tokens=0)
    result, reference = _probe_and_infinigen(tiny, skew, monkeypatch, tmp_path, knobs)
    assert result["partial_ratio_used"] == 0.25 and reference["stats"]["partial_ratio_used"] == [0.25]
    assert result["ppl"] == pytest.approx(reference["ppl"], rel=1e-5)
    assert all(0 <= row["recall_realq_budget"] <= 1 for row in result["layers"])


def test_prompt_coverage_is_the_probe_on_the_dense_trajectory(tiny, tiny_skew, monkeypatch, tmp_path):
    """Calibration's one-pass alpha curve (each prompt position as a decode step) equals the probe's, measured
    through the decode path with every layer attending densely, on the rehearsed layers (those calibrated)."""
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: tiny_skew)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    knobs = InfiniGenConfig(budget=0.3, partial_ratio=0.25, first_layers="dense", min_tokens=0)
    result = probe(tiny, knobs, SpeculationConfig(str(text), context=160, scored=41, attend="dense"))
    ids = ppl.make_windows(tiny, ppl.PerplexityConfig(str(text), 160, 119))[:, :159]  # 40 decode steps

    spec, inputs = tiny.spec, {}
    hooks = [
        attention.register_forward_pre_hook(
            lambda _m, args, kwargs, layer=layer: inputs.__setitem__(layer, kwargs["hidden_states"]),
            with_kwargs=True,
        )
        for layer, attention in enumerate(spec.attention)
    ]
    with torch.inference_mode():
        tiny.model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    positions = torch.arange(ids.shape[1])[None]
    curves = []
    with torch.inference_mode():
        for layer in (2, 3):
            x, previous = inputs[layer], inputs[layer - 1]
            curves.append(
                tuning.prompt_coverage(
                    spec.query(layer, x, positions)[0, :, -40:],
                    spec.key(layer, x, positions)[0],
                    spec.query(layer, previous, positions)[0, :, -40:],
                    tiny_skew.projection(layer, knobs.partial_ratio, True),
                    spec.attention[layer].scaling,
                    knobs.budget,
                    PARTIAL_KEYS[knobs.partial_keys],
                )
            )
    kept = [curve[0] for curve in curves]
    fetched = [curve[1] for curve in curves]
    expected = [row["mass_kept"] for row in result["alphas"]]
    torch.testing.assert_close(torch.stack(kept).mean(0), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    expected = [row["fetched"] for row in result["alphas"]]
    torch.testing.assert_close(torch.stack(fetched).mean(0), torch.tensor(expected), atol=1e-4, rtol=1e-4)


def test_pick_alpha_is_the_smallest_reaching_the_target():
    kept = [0.5, 0.8, 0.93, 0.97]
    assert tuning.pick_alpha(kept, (1.0, 2.0, 4.0, 8.0), target=0.9) == 4.0
    assert tuning.pick_alpha(kept, (1.0, 2.0, 4.0, 8.0), target=0.99) == 8.0
    capped = [0.5, 0.79, 0.7935, 0.7936]  # the budget cap binds below the target: no need to go further
    assert tuning.pick_alpha(capped, (1.0, 2.0, 4.0, 8.0), target=0.9) == 4.0
