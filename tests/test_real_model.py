"""SmolLM2-135M: infinikv's dense and offload policies against transformers' own generate."""

from __future__ import annotations

import json

import pytest

from infinikv import GenerationConfig, Generator
from infinikv.cli import main

from .test_generate import reference_tokens

pytestmark = pytest.mark.real_model
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def expected(smollm2, long_prompt):
    return reference_tokens(smollm2, long_prompt, NEW_TOKENS)


@pytest.mark.parametrize("policy", ["dense", "offload"])
def test_greedy_matches_transformers_on_a_long_prompt(smollm2, long_prompt, expected, policy):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    result = Generator(smollm2, policy).generate(long_prompt, config)[0]
    assert result.stats["prompt_tokens"] >= 1000
    assert result.token_ids == expected


def test_cli_offload_json_reports_the_arithmetic(smollm2, long_prompt, expected, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(long_prompt)
    runs = {}
    for policy in ("dense", "offload"):
        argv = ["generate", "--prompt-file", str(prompt_file), "--policy", policy, "--json"]
        assert main([*argv, "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]) == 0
        runs[policy] = json.loads(capsys.readouterr().out)
    offload = runs["offload"]
    assert offload["token_ids"] == runs["dense"]["token_ids"] == expected
    spec = smollm2.spec
    stats = offload["stats"]
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4  # fp32, batch 1
    moved = sum(per_token * (stats["prompt_tokens"] + s) for s in range(stats["decode_steps"]))
    assert stats["bytes_h2d"] == moved
    assert runs["dense"]["stats"]["bytes_h2d"] == 0
