"""The policy that docs/architecture.md walks through is real: it runs and passes every policy's checks, and
a policy declared by another distribution (the entry-point group) is found the same way."""

from __future__ import annotations

import re
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from infinikv import GenerationConfig, Generator, cli
from infinikv.policies import POLICIES, registry

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
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
