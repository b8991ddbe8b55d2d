"""Shared fixtures: tiny random models for unit tests, SmolLM2 for the real-model tests."""

from __future__ import annotations

import pytest
import torch

from infinikv.testing import tiny_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma():
    return tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_bf16():
    return tiny_model("llama", dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def smollm2():
    from infinikv.models import load

    return load("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def long_prompt(smollm2) -> str:
    """About 1,100 tokens of varied text, built without any corpus download."""
    facts = [
        f"Entry {i}: the {color} {animal} of {place} counted {i * 7 % 97} {thing} before sunrise."
        for i, (color, animal, place, thing) in enumerate(
            (c, a, p, t)
            for c in ("red", "blue", "green", "amber", "grey")
            for a in ("fox", "heron", "otter", "lynx")
            for p in ("Oslo", "Lima", "Perth", "Quito", "Riga")
            for t in ("stones", "boats", "lanterns")
        )
    ]
    text = "Read the log below, then continue it.\n" + "\n".join(facts[:90])
    assert len(smollm2.tokenizer(text)["input_ids"]) >= 1000
    return text
