"""The documentation holds: the policy that docs/architecture.md walks through runs and passes every policy's
checks, and a policy declared by another distribution (the entry-point group) is found the same way; every
command the pages show parses; every generated table is what its generator writes from the stored cells; the
README's policy table stays one short line per policy; no page cites a commit outside its "measured at"
line."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from infinikv import GenerationConfig, Generator, cli
from infinikv.eval.report import write_outputs, write_report
from infinikv.eval.sweep import read_config
from infinikv.gpucheck.report import render
from infinikv.policies import POLICIES, registry
from infinikv.reporting import KEEP_MARKER

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The pages a user reads: the README and docs/*.md (docs/results/ holds stored measurements, not pages).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_ROW_LIMIT = 200
# A word of 7 to 40 hex digits with a digit and a letter in it reads as a commit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# The line of a page that names what was measured, where a commit belongs (a generated page: its versions).
MEASURED_AT = re.compile(r"^- (Measured at|Versions):")
ENVIRONMENT = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")
PROMPTS = ["A short one.", "A much longer prompt, padded on the left of its shorter batch mate " * 3]


def _documented_module(monkeypatch, name: str) -> types.ModuleType:
    """The documentation's code block, executed as the module ``name`` (nothing registered yet)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text[text.index("## Add a policy") :]
    source = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(source.splitlines()) < 40
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    exec(compile(source, str(ARCHITECTURE), "exec"), module.__dict__)
    return module


@pytest.fixture
def keynorm(monkeypatch):
    """The ``keynorm`` policy, registered by its own decorator for the test."""
    module = _documented_module(monkeypatch, "keynorm_policy")
    yield module.KeyNormPolicy
    POLICIES.pop("keynorm", None)


def _generate(loaded, policy: str, **knobs):
    config = GenerationConfig(max_new_tokens=8)
    return Generator(loaded, policy, **knobs).generate(PROMPTS, config)


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
def test_documented_policy_matches_dense_at_full_budget_and_prefetches(keynorm, model, request):
    loaded = request.getfixturevalue(model)
    dense = _generate(loaded, "dense")
    full = _generate(loaded, "keynorm", budget=1.0)
    assert [r.token_ids for r in full] == [r.token_ids for r in dense]
    assert keynorm.prefetches and full[0].stats["bytes_h2d"] > 0


def test_documented_policy_limits_attention_and_checks_its_knob(keynorm, tiny):
    narrow = _generate(tiny, "keynorm", budget=4)
    assert narrow[0].stats["mean_tokens_attended"] == pytest.approx(5.0)  # 4 past + the new token
    alone = Generator(tiny, "keynorm", budget=4).generate(PROMPTS[:1], GenerationConfig(max_new_tokens=8))
    assert alone[0].token_ids == narrow[0].token_ids  # the short row of the batch gets what it gets alone
    with pytest.raises(Exception, match="budget must be > 0"):
        _generate(tiny, "keynorm", budget=0)


def test_a_policy_from_another_distribution_appears_in_the_cli(monkeypatch, capsys):
    """An ``infinikv.policies`` entry point is registered under its name, listed by ``infinikv policies``
    and runnable by name; a broken one is one line on stderr and the others still load."""
    module = _documented_module(monkeypatch, "plugin_keynorm")
    POLICIES.pop("keynorm", None)  # registered by the decorator as the block ran: start as a plug-in would
    group = registry.ENTRY_POINT_GROUP
    found = [
        EntryPoint("plugged", "plugin_keynorm:KeyNormPolicy", group),
        EntryPoint("broken", "no_such_module_here:Policy", group),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: found)
    try:
        registry.load_entry_points()
        assert POLICIES["plugged"] is module.KeyNormPolicy
        assert "broken" not in POLICIES
        assert "policy plug-in 'broken'" in capsys.readouterr().err
        assert cli.main(["policies"]) == 0
        assert "plugged" in capsys.readouterr().out
    finally:
        POLICIES.pop("plugged", None)


def _shell_commands(text: str) -> list[str]:
    """The ``infinikv …`` lines of a page's ```sh blocks, continuation lines joined and leading environment
    assignments (``OMP_NUM_THREADS=1 infinikv …``) dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            command = ENVIRONMENT.sub("", line)
            if command.startswith("infinikv "):
                commands.append(command)
    return commands


DOCUMENTED_COMMANDS = [
    pytest.param(command, id=f"{page.name}:{command[:60]}")
    for page in PAGES
    for command in _shell_commands(page.read_text(encoding="utf-8"))
]


def test_the_pages_show_commands():
    """The parsing test below has commands to check: the README's and InfiniGen's page at least."""
    pages = {param.id.split(":", 1)[0] for param in DOCUMENTED_COMMANDS}
    assert {"README.md", "results-infinigen.md"} <= pages


@pytest.mark.parametrize("command", DOCUMENTED_COMMANDS)
def test_every_documented_command_parses(command):
    """Each command a page shows is one the CLI accepts (parsed, not run)."""
    argv = shlex.split(command, comments=True)[1:]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`{command}` does not parse (exit {exc.code})")
    assert callable(args.func)


def test_policies_page_is_the_generated_reference(capsys):
    assert cli.main(["policies", "--markdown"]) == 0
    generated = capsys.readouterr().out
    assert (ROOT / "docs" / "policies.md").read_text(encoding="utf-8") == generated
    for name, cls in POLICIES.items():
        assert f"## `{name}`" in generated
        for knob in cls.config_class.knob_docs():
            assert f"`--{knob.replace('_', '-')}`" in generated


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("config_path", ["configs/results.toml"])
def test_results_tables_are_what_the_report_writes_from_the_stored_cells(config_path, tmp_path):
    """The generated part of a results page, regenerated from a copy of its stored cells (nothing measured):
    every table row and every line of the front are the page's."""
    config = read_config(ROOT / config_path)
    shutil.copy(config.out / "cells.jsonl", tmp_path / "cells.jsonl")
    copy = dataclasses.replace(config, out=tmp_path, report=tmp_path / "report.md")
    summary = write_outputs(copy)
    write_report(copy, summary, f"infinikv eval report --config {config_path}")
    generated = (tmp_path / "report.md").read_text(encoding="utf-8").split(KEEP_MARKER)[0]
    page = config.report.read_text(encoding="utf-8").split(KEEP_MARKER)[0]
    assert _table_lines(page) == _table_lines(generated)
    fronts = [line for line in generated.splitlines() if line.startswith("- ") and "front" in line]
    assert fronts and all(line in page.splitlines() for line in fronts)


def test_gpu_table_is_what_the_gpu_check_writes_from_its_stored_run():
    stored = ROOT / "docs" / "results" / "gpu" / "run5.json"
    generated = _table_lines(render(json.loads(stored.read_text(encoding="utf-8"))))
    page = _table_lines((ROOT / "docs" / "benchmarks-gpu.md").read_text(encoding="utf-8"))
    assert generated and generated == page[: len(generated)]


def _policy_table_rows(readme: str) -> list[str]:
    section = readme[readme.index("## Policies") :]
    return _table_lines(section.split("\n## ", 1)[0])


def test_readme_policy_table_is_one_short_row_per_policy():
    rows = _policy_table_rows((ROOT / "README.md").read_text(encoding="utf-8"))[2:]
    assert sorted(row.split("`")[1] for row in rows) == sorted(POLICIES)
    too_long = [row for row in rows if len(row) > README_ROW_LIMIT]
    assert not too_long, too_long
    assert all("docs/policies.md" in row for row in rows)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_commit_outside_the_measured_at_line(page):
    cited = [
        line
        for line in page.read_text(encoding="utf-8").splitlines()
        if COMMIT.search(line) and not MEASURED_AT.match(line)
    ]
    assert not cited, cited
