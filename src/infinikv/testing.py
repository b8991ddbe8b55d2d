"""Tiny randomly initialised models for fast tests: a byte-level tokenizer and a Llama or Gemma-3 config
small enough to run hundreds of decode steps in a second on a CPU."""

from __future__ import annotations

import hashlib

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
)

from .dummy import byte_tokenizer
from .models import LoadedModel


def tiny_model(
    kind: str = "llama", seed: int = 0, max_context: int = 4096, dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """A tiny random model: ``llama`` (4 layers, 4 q / 2 kv heads) or ``gemma3`` (sliding + global layers),
    its float32 weights cast to ``dtype``."""
    tokenizer = byte_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_context,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0)
    elif kind == "gemma3":
        config = Gemma3TextConfig(
            **common,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger logits than the default init, so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.to(dtype).eval()
    cast = "" if dtype == torch.float32 else f"-{dtype}"
    weights_id = hashlib.sha256(f"tiny-{kind}-{seed}{cast}".encode()).hexdigest()
    return LoadedModel(f"tiny-{kind}", model, tokenizer, weights_id, torch.device("cpu"))
