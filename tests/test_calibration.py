"""InfiniGen calibration (policies/infinigen/calibration.py): skewing matrices, columns, skew files."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from infinikv import data
from infinikv.cache import InfinikvCache
from infinikv.policies import InfiniGenConfig, InfiniGenPolicy, prepare
from infinikv.policies.dense import DenseConfig, DensePolicy
from infinikv.policies.infinigen import calibration, skewfile
from infinikv.testing import tiny_model

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 12


class _Record(DensePolicy):
    """Dense attention that keeps each layer's post-RoPE q and k of the prompt."""

    name = "record"

    def __init__(self, spec, device):
        super().__init__(DenseConfig(), spec, device)
        self.q, self.k = {}, {}

    def attend(self, layer, q, k, v, mask, scaling):
        self.q[layer], self.k[layer] = q[0].clone(), k[0].clone()
        return super().attend(layer, q, k, v, mask, scaling)


def _record(loaded, tokens: int = 256):
    ids, _ = calibration.calibration_ids(loaded, TEXT, tokens)
    policy = _Record(loaded.spec, loaded.device)
    with torch.inference_mode():
        loaded.model(input_ids=ids, cache=InfinikvCache(loaded.model, policy), use_cache=True)
    return policy


@pytest.fixture(scope="module")
def tiny_skew(tiny):
    return calibration.calibrate(tiny, text=TEXT, tokens=256, save=False)


@pytest.fixture(scope="module")
def recorded(tiny):
    return _record(tiny)


def test_matrices_are_orthogonal(tiny, tiny_skew):
    spec = tiny.spec
    assert tiny_skew.matrices.shape == (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim)
    eye = torch.eye(spec.head_dim)
    assert torch.allclose(tiny_skew.matrices.mT @ tiny_skew.matrices, eye, atol=1e-5)


def test_skewing_preserves_qk(tiny, tiny_skew, recorded):
    group = tiny.spec.group_size
    for layer in range(tiny.spec.num_layers):
        for head in range(tiny.spec.num_heads):
            q, k = recorded.q[layer][head], recorded.k[layer][head // group]
            a = tiny_skew.matrices[layer, head // group]
            exact = q @ k.T
            assert torch.allclose((q @ a) @ (k @ a).T, exact, atol=1e-4 * exact.abs().max())


def test_one_matrix_per_kv_head_diagonalises_its_group(tiny, tiny_skew, recorded):
    """A of KV head h comes from the SVD of the stacked queries of all its query heads: AᵀQᵀQA is diagonal
    for that group, and not for the other group."""
    group, layer = tiny.spec.group_size, 1
    assert tiny.spec.num_kv_heads < tiny.spec.num_heads  # the tiny model really is GQA

    def off_diagonal(head: int, matrix: torch.Tensor) -> float:
        q = recorded.q[layer][head * group : (head + 1) * group].reshape(-1, tiny.spec.head_dim)
        gram = matrix.T @ q.T @ q @ matrix
        return float((gram - torch.diag(gram.diagonal())).abs().max() / gram.diagonal().max())

    for head in range(tiny.spec.num_kv_heads):
        assert off_diagonal(head, tiny_skew.matrices[layer, head]) < 1e-4
        assert off_diagonal(head, tiny_skew.matrices[layer, 1 - head]) > 1e-2


def test_partial_columns_follow_the_papers_rule(tiny, tiny_skew, recorded):
    """Top-k columns of Σ|Q̃| + Σ|K̃| (Q̃ over the whole group), k = ⌈ratio·d⌉; identity basis for skew=False."""
    group, d = tiny.spec.group_size, tiny.spec.head_dim
    for layer in (0, 3):
        for head in range(tiny.spec.num_kv_heads):
            q = recorded.q[layer][head * group : (head + 1) * group].reshape(-1, d)
            k = recorded.k[layer][head]
            a = tiny_skew.matrices[layer, head]
            expected = (q @ a).abs().sum(0) + (k @ a).abs().sum(0)
            assert torch.allclose(tiny_skew.scores[layer, head], expected, rtol=1e-4)
            assert torch.allclose(
                tiny_skew.identity_scores[layer, head], q.abs().sum(0) + k.abs().sum(0), rtol=1e-4
            )
        cols = tiny_skew.columns(layer, 0.3)
        assert cols.shape == (tiny.spec.num_kv_heads, math.ceil(0.3 * d))
        for head in range(tiny.spec.num_kv_heads):
            top = set(tiny_skew.scores[layer, head].topk(cols.shape[1]).indices.tolist())
            assert set(cols[head].tolist()) == top
    projection = tiny_skew.projection(2, 0.25)
    assert torch.equal(projection[1], tiny_skew.matrices[2, 1][:, tiny_skew.columns(2, 0.25)[1]])
    identity = tiny_skew.projection(2, 0.25, skewed=False)
    assert torch.equal(identity[0], torch.eye(d)[:, tiny_skew.columns(2, 0.25, skewed=False)[0]])


def test_skewing_concentrates_the_columns():
    """On a trained model the partial columns hold more of Σ|Q|+Σ|K| after skewing; on the random tiny model
    this still holds because the SVD basis is the best rank-k basis for Q."""
    loaded = tiny_model("llama", seed=3)
    result = calibration.calibrate(loaded, text=TEXT, tokens=256, save=False)
    assert calibration.concentration(result, 0.25) > calibration.concentration(result, 0.25, skewed=False)


def test_file_is_cached_and_reused(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    assert skewfile.cached_skew(tiny.spec) is None
    made = calibration.calibrate(tiny, text=TEXT, tokens=128)
    files = list((tmp_path / "skew").glob("*.safetensors"))
    assert [f.name for f in files] == [skewfile.skew_path(tiny.weights_id, made.source, 128).name]
    stamp = files[0].stat().st_mtime_ns
    again = calibration.ensure_skew(tiny)  # found, not recalibrated
    assert files[0].stat().st_mtime_ns == stamp
    assert again.weights_id == tiny.weights_id and again.tokens == 128
    assert torch.equal(again.matrices, made.matrices) and torch.equal(again.scores, made.scores)


def test_file_from_another_model_is_rejected(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    calibration.calibrate(tiny, text=TEXT, tokens=64)
    path = next((tmp_path / "skew").glob("*.safetensors"))
    other = tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(skewfile.SkewError, match="other weights"):
        skewfile.read_skew(path, other.spec)
    with pytest.raises(skewfile.SkewError, match="other weights"):
        InfiniGenPolicy(InfiniGenConfig(), other.spec, torch.device("cpu"), skew=skewfile.read_skew(path))
    assert skewfile.cached_skew(other.spec) is None  # another model's file is never picked up
    gemma = tiny_model("gemma3")
    bare = type(gemma.spec)(**{**gemma.spec.__dict__, "weights_id": "", "num_layers": 3})
    with pytest.raises(skewfile.SkewError, match="shape"):
        skewfile.read_skew(path, bare)
    (tmp_path / "junk.safetensors").write_bytes(b"not a skew file")
    with pytest.raises(skewfile.SkewError, match="cannot read"):
        skewfile.read_skew(tmp_path / "junk.safetensors")


def test_calibrate_command(tiny, tmp_path, monkeypatch, capsys):
    from infinikv.cli import main

    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny.model.save_pretrained(model_dir)
    tiny.tokenizer.save_pretrained(model_dir)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    args = ["calibrate", "--model", str(model_dir), "--text", str(text)]
    assert main([*args, "--tokens", "96", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 96 and report["layers"] == 4 and report["kv_heads"] == 2
    assert (tmp_path / "cache" / "skew").is_dir() and report["path"].endswith(".safetensors")
    assert report["alpha"] in calibration.tuning.ALPHAS and len(report["alpha_curve"]) == len(
        calibration.tuning.ALPHAS
    )
    # every layer has its own (the first two scored with their own query)
    assert set(report["alpha_per_layer"]) <= set(calibration.tuning.ALPHAS)
    assert [row["layer"] for row in report["own_query_curve"]] == [2, 3]  # the rehearsed layers
    assert report["own_query_layers"] == []  # at most an eighth of two layers
    assert report["partial_ratio"] in calibration.tuning.RATIOS
    # per window, the per-layer allocation within the device budget and the recall it buys
    (window,) = report["columns_per_layer"]
    assert [layer for layer, _ in window["ratio_by_layer"]] == [2, 3]
    assert window["recall_allocated"] >= window["recall_uniform"] > 0
    assert main([*args, "--tokens", "96"]) == 0
    err = capsys.readouterr().err
    assert "calibrated alpha per layer" in err and "layers choosing with their own query none" in err
    assert main(["calibrate", "--model", str(model_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read calibration text" in capsys.readouterr().err
    assert main([*args, "--tokens", "1"]) == 2


def test_calibrated_knobs_are_stored_with_the_skew_and_reloaded(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    made = calibration.calibrate(tiny, text=TEXT, tokens=128)
    tuned = made.tuned
    assert tuned.version == skewfile.TUNED_VERSION
    assert [point.partial_ratio for point in tuned.ratio_curve] == list(calibration.tuning.RATIOS)
    recalls = [point.recall for point in tuned.ratio_curve]
    assert all(0 < r <= 1 for r in recalls)
    assert tuned.partial_ratio == calibration.tuning.pick_ratio(recalls)
    assert [point.alpha for point in tuned.curve] == list(calibration.tuning.ALPHAS)
    kept = [point.mass_kept for point in tuned.curve]
    assert kept == sorted(kept) and 0 < kept[0] <= kept[-1] <= 1  # a larger alpha never keeps less
    assert tuned.alpha == calibration.tuning.pick_alpha(kept)
    per_layer = tuned.alpha_per_layer
    assert len(per_layer) == tiny.spec.num_layers
    assert all(alpha in calibration.tuning.ALPHAS for alpha in per_layer)
    kept = {point.layer: point.recall_kept for point in tuned.own_query_curve}
    assert list(kept) == [2, 3] and all(0 < share <= 1 for share in kept.values())
    assert list(tuned.own_query_layers) == calibration.tuning.pick_own_query(kept)
    # each layer's alpha at the defaults is the one scored as it chooses there: the first two by their
    # own query, the others rehearsed (no own-query layer among two)
    assert per_layer == tuned.alpha_per_layer_own[:2] + tuned.alpha_per_layer_rehearsed[2:]
    # per window, each rehearsed layer's own recall curve, whose mean is the window's curve
    for entry in tuned.ratio_by_length:
        layers = [layer for layer, _ in entry.layer_curves]
        assert layers == [point.layer for point in tuned.own_query_curve]
        mean = torch.tensor([curve for _, curve in entry.layer_curves]).mean(0)
        assert torch.allclose(mean, torch.tensor(entry.curve), atol=1e-3)
    reloaded = skewfile.cached_skew(tiny.spec)
    assert reloaded.tuned == tuned  # the record, field for field, types included


def test_an_own_query_layer_is_calibrated_with_its_own_query(tiny, monkeypatch):
    """A layer the calibration names an own-query layer gets the alpha scored with its own query, and its
    recall curve (for columns allocated per layer) is its own query's; the ratio is picked as before."""
    rehearsed_only = calibration.calibrate(tiny, text=TEXT, tokens=128, save=False).tuned
    monkeypatch.setattr(calibration.tuning, "pick_own_query", lambda kept: [3])
    made = calibration.calibrate(tiny, text=TEXT, tokens=128, save=False)
    tuned = made.tuned
    assert tuned.own_query_layers == (3,)
    assert tuned.alpha_per_layer == tuned.alpha_per_layer_own[:2] + (
        tuned.alpha_per_layer_rehearsed[2],
        tuned.alpha_per_layer_own[3],
    )
    (before,), (after,) = rehearsed_only.ratio_by_length, tuned.ratio_by_length
    assert after.partial_ratio == before.partial_ratio and after.curve == before.curve
    assert after.layer_curves[0] == before.layer_curves[0]  # layer 2, rehearsed either way
    assert after.layer_curves[1][0] == 3 and after.layer_curves[1] != before.layer_curves[1]


def _save_with_tuned(skew: skewfile.Skew, path, tuned: str | None) -> None:
    """Write ``skew`` with ``tuned`` as the stored calibrated knobs (JSON as in the file; None: none)."""
    dataclasses.replace(skew, tuned=None).save(path)
    if tuned is not None:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata()
        save_file(load_file(str(path)), str(path), {**meta, "tuned": tuned})


def test_a_calibration_without_knobs_of_this_version_is_redone(tiny, tmp_path, monkeypatch, capsys):
    """Files written before the calibrated knobs were a versioned record (or by another version) are read,
    without their knobs: a policy loading one says to recalibrate and uses the paper's constants, and
    ``prepare`` (``ensure_skew``) calibrates again."""
    monkeypatch.setattr(data, "load_corpus", lambda name: TEXT)  # the default calibration text
    made = calibration.calibrate(tiny, text=TEXT, tokens=128, save=False)
    stored = dataclasses.asdict(made.tuned)
    unversioned = {key: value for key, value in stored.items() if key != "version"}
    older = (
        None,  # before calibrated alphas
        json.dumps({key: stored[key] for key in ("alpha", "rule", "curve")}),  # before calibrated ratios
        json.dumps(unversioned),  # every knob, but before the record was versioned
        json.dumps({**stored, "version": skewfile.TUNED_VERSION + 1}),  # another version's
    )
    for case, tuned in enumerate(older):
        monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path / str(case)))
        _save_with_tuned(made, skewfile.skew_path(tiny.weights_id, made.source, 128), tuned)
        assert skewfile.cached_skew(tiny.spec).tuned is None
        policy = InfiniGenPolicy(InfiniGenConfig(), tiny.spec, torch.device("cpu"))
        assert policy.alpha(2) == (5.0, "paper (this calibration has none)")
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "run `infinikv calibrate --model …` to recalibrate" in err
        prepare(InfiniGenConfig(), tiny)
        assert "has no calibrated knobs of this version" in capsys.readouterr().err
        redone = skewfile.cached_skew(tiny.spec).tuned
        assert redone is not None and redone.version == skewfile.TUNED_VERSION


def test_a_malformed_record_of_this_version_is_set_aside(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIKV_CACHE", str(tmp_path))
    made = calibration.calibrate(tiny, text=TEXT, tokens=128)
    path = skewfile.skew_path(tiny.weights_id, made.source, 128)
    _save_with_tuned(made, path, json.dumps({"version": skewfile.TUNED_VERSION, "alpha": 4.0}))
    with pytest.raises(skewfile.SkewDamaged, match="malformed calibrated knobs"):
        skewfile.read_skew(path)
    assert skewfile.cached_skew(tiny.spec) is None and path.with_suffix(".damaged").is_file()


def test_pick_ratio_takes_the_smallest_share_close_enough_to_full_width():
    ratios = (0.1, 0.2, 0.5, 1.0)
    assert calibration.tuning.pick_ratio([0.5, 0.7, 0.78, 0.8], ratios, target=0.9) == 0.5
    assert calibration.tuning.pick_ratio([0.5, 0.73, 0.78, 0.8], ratios, target=0.9) == 0.2
    assert calibration.tuning.pick_ratio([0.1, 0.2, 0.3, 0.8], ratios, target=0.9) == 1.0


def test_allocate_ratios_gives_the_columns_where_recall_gains_most_within_the_total():
    allocate = calibration.tuning.allocate_ratios
    ratios = (0.25, 0.5, 0.75, 1.0)  # 2, 4, 6 and 8 of 8 columns
    easy, hard = (0.9, 0.91, 0.915, 0.92), (0.4, 0.7, 0.85, 0.9)
    # the uniform ratio 0.5's total (4 columns each): the hard layer takes columns from the easy one
    assert allocate({2: easy, 3: hard}, 8, 8, ratios) == {2: 0.25, 3: 0.75}
    assert allocate({2: easy, 3: hard}, 16, 8, ratios) == {2: 1.0, 3: 1.0}  # room for all: every gain taken
    # equal curves share the total equally; a total below the narrowest keeps the narrowest
    assert allocate({2: hard, 3: hard}, 8, 8, ratios) == {2: 0.5, 3: 0.5}
    assert allocate({2: hard, 3: hard}, 1, 8, ratios) == {2: 0.25, 3: 0.25}
    # a widening that loses recall is never taken, even with room for it
    assert allocate({2: (0.9, 0.8, 0.85, 0.86)}, 8, 8, ratios) == {2: 0.25}
    # no layer wider than ``most`` allows (a longer window's allocation, whose columns must hold these)
    assert allocate({2: easy, 3: hard}, 16, 8, ratios, most={2: 0.5, 3: 0.75}) == {2: 0.5, 3: 0.75}
    # never more columns than the total (once the narrowest fit)
    for total in range(6, 25):
        got = allocate({2: easy, 3: hard, 4: (0.6, 0.8, 0.85, 0.87)}, total, 8, ratios)
        assert sum(math.ceil(r * 8) for r in got.values()) <= total


def test_pick_own_query_takes_the_worst_rehearsed_layers_below_the_target_up_to_the_share():
    pick = calibration.tuning.pick_own_query
    kept = {2: 0.95, 3: 0.7, 4: 0.85, 5: 0.99, 6: 0.89, 7: 0.97, 8: 0.96, 9: 0.98}
    assert pick(kept, target=0.9, most_share=0.25) == [3, 4]  # three below 0.9, the two worst kept
    assert pick(kept, target=0.9, most_share=0.5) == [3, 4, 6]
    assert pick(kept, target=0.8, most_share=0.5) == [3]
    assert pick(kept, target=0.9, most_share=0.1) == []  # a tenth of 8 layers rounds down to none
    assert pick({layer: 0.99 for layer in range(16)}, target=0.9, most_share=0.5) == []


def test_speculation_recall_is_one_when_speculation_sees_the_real_query_at_full_width(tiny_skew):
    """prompt_recall compares the speculated top-k with the real one: with the layer's own query and every
    column (any orthogonal basis) they are the same set; with fewer columns they need not be."""
    torch.manual_seed(0)
    kv_heads, group, n, d = 2, 2, 48, tiny_skew.matrices.shape[-1]
    q, k = torch.randn(kv_heads * group, 16, d), torch.randn(kv_heads, n, d)
    full = tiny_skew.projection(2, 1.0)[:kv_heads]
    narrow = tiny_skew.projection(2, 0.1)[:kv_heads]
    recalls = calibration.tuning.prompt_recall(q, k, q, [full, narrow], 0.125, budget=0.25, bits=None)
    assert recalls[0] == pytest.approx(1.0) and recalls[1] < 1.0
    assert (
        calibration.tuning.prompt_recall(q, k, torch.randn_like(q), [full], 0.125, budget=0.25, bits=None)[0]
        < 1.0
    )


def test_one_progress_line_counts_the_whole_calibration(tiny, monkeypatch):
    """Calibration shows one progress line, whose total is the work it then reports (both dense passes and
    the tuning, at the calibration text's length and a longer window), so its time left holds to the end."""
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.done, self.updates = total, 0.0, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, units):
            self.done += units
            self.updates += 1

    monkeypatch.setattr(calibration, "tqdm", Bar)
    monkeypatch.setattr(calibration.tuning, "LENGTHS", (256,))
    skew = calibration.calibrate(tiny, text=TEXT * 3, tokens=128, save=False)
    assert [entry.tokens for entry in skew.tuned.ratio_by_length] == [128, 256]  # a longer window was tuned
    (bar,) = bars
    assert bar.done == pytest.approx(bar.total, abs=0.5)  # the total is rounded to whole units
    assert bar.updates > 2 * tiny.spec.num_layers  # the tuning reports too, not only the passes
