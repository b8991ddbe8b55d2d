"""The GPU check's smoke run (``scripts/gpu_check.sh OUT --tiny``): the same code path as on a GPU machine,
on a tiny dummy model and tiny contexts, so the check cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinikv.gpucheck import tests as cuda_tests
from infinikv.gpucheck.cli import main
from infinikv.gpucheck.report import render

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_tiny_check_writes_every_row(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(SCRIPT), str(out), "--tiny", "--no-tests"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    plan = report["plan"]
    assert report["label"] == "dummy weights" and report["contexts"] == [{"context": 96, "status": "ok"}]
    rows = {(r["batch"], r["name"]): r for r in report["rows"]}
    assert set(rows) == {(b, p) for b in plan["batches"] for p in plan["policies"]}
    for row in rows.values():
        assert row["decode_steps"] == plan["steps"] and row["decode_tokens_per_s"] > 0
        assert row["projected_step_s_h200"]["h200/pcie5"] > 0
    for batch in plan["batches"]:
        offload, infinigen = rows[batch, "offload"], rows[batch, "infinigen"]
        assert rows[batch, "dense"]["bytes_h2d_per_step"] == 0
        # dummy:tiny has 4 layers, each choosing at most a tenth of its context (budget 0.1; the first two
        # by their own query) plus the new token: about 0.1 of offload's bytes, where loading the first
        # two whole (--first-layers dense) would take more than 2/4
        share = infinigen["bytes_h2d_per_step"] / offload["bytes_h2d_per_step"]
        assert 0.05 < share < 0.2
    markdown = (out / "gpu_check.md").read_text()
    assert "dummy weights" in markdown and markdown.count("| 96 |") == len(rows)


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "smollm2-135m"],
        ["--model", "dummy:nope"],
        ["--batches", "8,x"],
        ["--batches", "0,8"],
        ["--contexts", "8"],
        ["--contexts", "200000"],
        ["--policies", "dense,nope"],
        ["--steps", "0"],
    ],
)
def test_bad_plan_is_one_line(args, capsys):
    assert main(["check", "/tmp/unused", *args]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_skipped_rows_are_reported():
    report = {
        "plan": {"model": "dummy:llama-3-8b", "budget": 0.1, "steps": 8},
        "rows": [{"batch": 16, "context": 32768, "name": "dense", "skipped": "device memory: ~160 GiB"}],
    }
    assert "skipped: device memory: ~160 GiB" in render(report)


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "cuda-tests.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase name="test_ok"/><testcase name="test_skip"><skipped message="no CUDA"/></testcase>'
        '<testcase name="test_copy"><failure message="wrong rows"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = cuda_tests.parse_junit(xml)
    assert counts.pop("failed") == ["test_copy: wrong rows"]
    assert counts == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}


def test_tests_found_in_the_checkout_and_said_missing_without_one(tmp_path, monkeypatch):
    assert cuda_tests.checkout() == Path(__file__).resolve().parents[1]
    monkeypatch.setattr(cuda_tests, "checkout", lambda: None)
    result = cuda_tests.run_tests(tmp_path, timeout=1)
    assert result == {"status": cuda_tests.NO_CHECKOUT} and result["status"].startswith("not run")
    assert "\n" not in result["status"] and not any(tmp_path.iterdir())


def test_preflight_skips_a_package_whose_extra_is_absent_without_importing_it(monkeypatch):
    """A GPU box without an extra (lm-eval, the server's) still passes preflight: the package that needs it
    is neither listed nor imported, and everything else is."""
    import importlib.util

    import infinikv
    from infinikv.gpucheck import preflight

    real_find_spec = importlib.util.find_spec
    absent = {"lm_eval", "fastapi"}
    monkeypatch.setattr(
        preflight.importlib.util,
        "find_spec",
        lambda name, *args: None if name in absent else real_find_spec(name, *args),
    )
    for name in [name for name in sys.modules if name.startswith("infinikv.lm_eval")]:
        monkeypatch.delitem(sys.modules, name)
    names = preflight.importable_modules(infinikv.__path__, "infinikv.")
    assert "infinikv.policies.infinigen.policy" in names and "infinikv.gpucheck.preflight" in names
    assert not [name for name in names if name.startswith(("infinikv.lm_eval", "infinikv.serve"))]
    assert "infinikv.lm_eval" not in sys.modules
