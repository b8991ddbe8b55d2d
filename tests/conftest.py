"""Shared fixtures: tiny random models for unit tests, SmolLM2 for the real-model tests."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from infinikv.testing import tiny_model

# The tests build and drop many engines in one process, each reserving segments of block-store arenas of tens
# of MiB. glibc's malloc serves a block below its mmap threshold from its heap, and raises that threshold to
# the largest block freed (up to 32 MiB), so freed segments stayed mapped: 23 GiB after the real-model tests,
# where this machine has 24, and the kernel then refused the fork that starts Ray's local cluster
# (test_scale_out). A fixed threshold turns the adjustment off: every block of 1 MiB or more is mapped apart
# and unmapped when freed.
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
if sys.platform == "linux":
    _libc = ctypes.CDLL(None)
    if hasattr(_libc, "mallopt"):  # glibc (musl has none)
        _libc.mallopt(_M_MMAP_THRESHOLD, 2**20)


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
