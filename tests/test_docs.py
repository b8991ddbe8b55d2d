"""The policy that docs/architecture.md walks through is real: it runs and passes every policy's checks."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from infinikv import GenerationConfig, Generator
from infinikv.policies import POLICIES

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
PROMPTS = ["A short one.", "A much longer prompt, padded on the left of its shorter batch mate " * 3]


@pytest.fixture
def recent(monkeypatch):
    """The ``recent`` policy, executed from the documentation's code block and registered for the test."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text[text.index("## Add a policy") :]
    source = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(source.splitlines()) < 60
    module = types.ModuleType("recent_policy")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
    exec(compile(source, str(ARCHITECTURE), "exec"), module.__dict__)
    monkeypatch.setitem(POLICIES, "recent", module.RecentPolicy)
    return module.RecentPolicy


def _generate(loaded, policy: str, **knobs):
    config = GenerationConfig(max_new_tokens=8)
    return Generator(loaded, policy, **knobs).generate(PROMPTS, config)


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
def test_documented_policy_matches_dense_at_full_window_and_prefetches(recent, model, request):
    loaded = request.getfixturevalue(model)
    dense = _generate(loaded, "dense")
    full = _generate(loaded, "recent", window=10_000)
    assert [r.token_ids for r in full] == [r.token_ids for r in dense]
    assert recent.prefetches and full[0].stats["bytes_h2d"] > 0


def test_documented_policy_limits_attention_and_checks_its_knob(recent, tiny):
    narrow = _generate(tiny, "recent", window=4)
    assert narrow[0].stats["mean_tokens_attended"] == pytest.approx(5.0)  # 4 past + the new token
    with pytest.raises(Exception, match="window must be >= 1"):
        _generate(tiny, "recent", window=0)
