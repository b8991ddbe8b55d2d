"""Every registered policy through a short batched generation on tiny Llama and tiny Gemma-3."""

from __future__ import annotations

from dataclasses import fields

import pytest

from infinikv import GenerationConfig, Generator
from infinikv.policies import POLICIES

PROMPTS = ["A short one.", "A much longer prompt, padded on the left of its shorter batch mate " * 3]
NEW_TOKENS = 8
# Knob values that force a selective policy below the full context (applied where the policy has the knob).
TIGHT = {"budget": 0.3, "window": 8, "page_size": 4, "dense_layers": 1}


def _run(loaded, policy: str, knobs: dict):
    generator = Generator(loaded, policy, **knobs)  # may calibrate (InfiniGen) before the hook goes on
    finite = []
    hook = loaded.model.lm_head.register_forward_hook(
        lambda _module, _inputs, logits: finite.append(bool(logits.isfinite().all()))
    )
    try:
        results = generator.generate(PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS))
    finally:
        hook.remove()
    return results, finite


@pytest.fixture(scope="module")
def dense_runs():
    return {}


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_matrix(policy, model, request, dense_runs):
    loaded = request.getfixturevalue(model)
    own = {f.name for f in fields(POLICIES[policy].config_class)}
    knobs = {k: v for k, v in TIGHT.items() if k in own}
    results, finite = _run(loaded, policy, knobs)
    if model not in dense_runs:
        dense_runs[model] = _run(loaded, "dense", {})[0]
    dense = dense_runs[model]

    assert len(results) == len(PROMPTS)
    assert all(finite) and len(finite) == NEW_TOKENS  # prefill + one forward per further token
    for result, reference in zip(results, dense, strict=True):
        assert 1 <= len(result.token_ids) <= NEW_TOKENS
        stats = result.stats
        for key in ("bytes_h2d", "mean_tokens_attended", "kv_bytes_host", "kv_bytes_device"):
            assert key in stats and stats[key] >= 0
        assert stats["policy"] == policy
        # Never more than the whole context; strictly less when a budget or window applies.
        assert stats["mean_tokens_attended"] <= reference.stats["mean_tokens_attended"]
        if knobs.get("budget") or knobs.get("window"):
            assert stats["mean_tokens_attended"] < reference.stats["mean_tokens_attended"]
        if policy != "dense":
            assert stats["kv_bytes_host"] > 0


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
def test_oracle_at_full_budget_is_dense(model, request, dense_runs):
    """The ceiling of token selection at full budget attends to everything: dense, token for token."""
    loaded = request.getfixturevalue(model)
    results, _ = _run(loaded, "oracle", {"budget": 1.0, "dense_layers": 0})
    if model not in dense_runs:
        dense_runs[model] = _run(loaded, "dense", {})[0]
    assert [r.token_ids for r in results] == [r.token_ids for r in dense_runs[model]]


# -- batch invariance ----------------------------------------------------------------------------------------
# A prompt's greedy tokens must not depend on its batchmates. The padding of the short prompt below is a
# multiple of every page and group size used here (192 tokens); MISALIGNED pads it by 189.
ALIGNED = [
    "A short one.",
    "A short one." + "Sixty-four characters of a longer prompt, padded to line up. ok " * 3,
]
MISALIGNED = PROMPTS
KIVI = {"scheme": "kivi", "group_size": 4, "residual": 4}


VARIANTS = [pytest.param(policy, policy, {}, id=policy) for policy in POLICIES]
VARIANTS.append(pytest.param("quant-kivi", "quant", KIVI, id="quant-kivi"))


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma"])
@pytest.mark.parametrize("padding", ["aligned", "misaligned"])
@pytest.mark.parametrize(("variant", "policy", "extra"), VARIANTS)
def test_batch_invariance(variant, policy, extra, padding, model, request):
    loaded = request.getfixturevalue(model)
    own = {f.name for f in fields(POLICIES[policy].config_class)}
    knobs = {**{k: v for k, v in TIGHT.items() if k in own}, **extra}
    prompts = ALIGNED if padding == "aligned" else MISALIGNED
    assert len(loaded.tokenizer(prompts[1])["input_ids"]) - len(
        loaded.tokenizer(prompts[0])["input_ids"]
    ) == (192 if padding == "aligned" else 189)
    generator = Generator(loaded, policy, **knobs)
    config = GenerationConfig(max_new_tokens=16)
    batched = generator.generate(prompts, config)
    for prompt, together in zip(prompts, batched, strict=True):
        alone = generator.generate([prompt], config)[0]
        assert together.token_ids == alone.token_ids, f"{prompt[:20]!r} changed by its batchmate"
