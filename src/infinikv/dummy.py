"""Models of real architectures and sizes with random weights, built from a config written here.

``--model dummy:llama-3-8b`` gives a model with Llama-3-8B's shapes (layers, heads, head size, vocabulary) and
random weights: its decode steps move and read exactly the bytes the real model's would, so speed, bytes moved
and device memory can be measured where the real weights are not available (no hub access). Its text is
noise; every figure measured on one must say "dummy weights". Accuracy cannot be measured on one.

The model is constructed under the target device (``torch.device`` as a context manager), so parameters are
allocated and initialised there in the target dtype: an 8B model never passes through host memory in fp32.
bf16 on CUDA, fp32 on CPU (CPU matmuls in bf16 are slow). The tokenizer is :func:`byte_tokenizer`,
one token per byte (the tiny test models of ``infinikv.testing`` use it too).

InfiniGen's selection size depends on weight values (how peaked the rehearsed scores are), which random
weights do not have: measure it with ``alpha=inf`` so that the budget alone sets how many rows move.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from .errors import ModelError

SPECIAL = ["<pad>", "<s>", "</s>"]  # the byte tokenizer's special tokens, ids 0, 1, 2

PREFIX = "dummy:"


@dataclass(frozen=True)
class DummyModel:
    name: str
    description: str
    config_class: type[PretrainedConfig]
    config: dict[str, Any]


# Shapes from each model's published config.json; rope scaling where it sets the context length.
DUMMIES: dict[str, DummyModel] = {
    m.name: m
    for m in (
        DummyModel(
            "llama-3-8b",
            "Llama-3-8B shapes (32 layers, 32 q / 8 kv heads of 128, vocab 128256), Llama-3.1 128k RoPE",
            LlamaConfig,
            dict(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=131072,
                rms_norm_eps=1e-5,
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                tie_word_embeddings=False,
            ),
        ),
        DummyModel(
            "qwen2.5-7b",
            "Qwen2.5-7B shapes (28 layers, 28 q / 4 kv heads of 128, vocab 152064, 32k context)",
            Qwen2Config,
            dict(
                vocab_size=152064,
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                max_position_embeddings=32768,
                rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                use_sliding_window=False,
                tie_word_embeddings=False,
            ),
        ),
        DummyModel(
            "tiny",
            "a tiny Llama (4 layers, 4 q / 2 kv heads of 16, vocab 512) for smoke runs",
            LlamaConfig,
            dict(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=4096,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
        DummyModel(
            "smollm2-135m",
            "SmolLM2-135M shapes (30 layers, 9 q / 3 kv heads of 64, vocab 49152, 8k context)",
            LlamaConfig,
            dict(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                max_position_embeddings=8192,
                rms_norm_eps=1e-5,
                rope_parameters=dict(rope_type="default", rope_theta=100000.0),
                tie_word_embeddings=True,
            ),
        ),
    )
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (ids 3..258) plus <pad>=0, <s>=1, </s>=2."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    # Sorted: the alphabet comes as a set, whose order (so every id) would change from process to process.
    for byte_char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(byte_char, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    return tokenizer


def dummy_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_dummy(
    name: str, device: torch.device, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, str]:
    """``dummy:<registered shape>`` with random weights (seeded) on ``device`` in ``dtype`` (None:
    :func:`dummy_dtype`): (model, tokenizer, weights id); ``models.load`` wraps them."""
    key = name.removeprefix(PREFIX)
    if key not in DUMMIES:
        raise ModelError(f"unknown dummy model '{name}'; available: {', '.join(PREFIX + k for k in DUMMIES)}")
    entry = DUMMIES[key]
    tokenizer = byte_tokenizer()
    # The byte tokenizer's <pad>/<s> ids; end-of-sequence is the last vocabulary id, which the byte
    # tokenizer never produces, so random weights rarely stop a run early.
    eos = entry.config["vocab_size"] - 1
    config = entry.config_class(**entry.config, pad_token_id=0, bos_token_id=1, eos_token_id=eos)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or dummy_dtype(device))
    except torch.OutOfMemoryError as exc:
        raise ModelError(f"{name} does not fit on {device}: {str(exc).splitlines()[0]}") from exc
    model.eval().requires_grad_(False)
    return model, tokenizer, hashlib.sha256(f"{name}-seed{seed}".encode()).hexdigest()
