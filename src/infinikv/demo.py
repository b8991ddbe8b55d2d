"""``make demo``: SmolLM2-135M reads about 2,000 tokens of Pride and Prejudice and answers a question about
it, once per policy; the text streams for the first policy, then each policy's KV statistics are printed
side by side. All run on one engine with a prefix cache: the policies that prefill densely (dense, offload,
InfiniGen, Quest) read the prompt once and restore its cached blocks after that; H2O reads its own (it also
accumulates attention scores)."""

from __future__ import annotations

import sys

from .data import load_corpus
from .engine import Engine, EngineConfig
from .generate import GenerationConfig, Generator
from .models import load
from .policies import POLICIES

CONTEXT_TOKENS = 2000
QUESTION = "In two sentences: who are the people in this passage, and what happens?"


def build_prompt(loaded) -> str:
    tokenizer = loaded.tokenizer
    novel = load_corpus("austen")
    start = novel.find("It is a truth universally acknowledged")
    passage_ids = tokenizer(novel[start : start + 20 * CONTEXT_TOKENS])["input_ids"][:CONTEXT_TOKENS]
    passage = tokenizer.decode(passage_ids)
    messages = [{"role": "user", "content": f"{passage}\n\n{QUESTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main() -> int:
    loaded = load("smollm2-135m")
    prompt = build_prompt(loaded)
    config = GenerationConfig(max_new_tokens=64)
    policies = [p for p in ("dense", "offload", "infinigen", "h2o", "quest") if p in POLICIES]
    rows = []
    reference = None
    engine = Engine(loaded, EngineConfig(prefix_cache=True))  # the prompt's blocks, read once per family
    for i, policy in enumerate(policies):
        print(f"\n== {policy} ==", flush=True)

        def stream(_row: int, piece: str) -> None:
            print(piece, end="", flush=True)

        generator = Generator(loaded, policy, engine=engine)
        result = generator.generate(prompt, config, on_text=stream, progress=True)[0]
        print()
        reference = reference if i else result.token_ids
        rows.append((policy, result))

    mib = 1 / 2**20
    header = f"{'policy':<10} {'prompt':>6} {'tok/s':>6} {'host MiB':>9} {'dev MiB':>8} {'moved MiB':>10}"
    print(f"\n{header} {'attended':>9}  same tokens as dense", file=sys.stderr)
    for policy, r in rows:
        s = r.stats
        print(
            f"{policy:<10} {s['prompt_tokens']:>6} {s['decode_tokens_per_s']:>6.1f} "
            f"{s['kv_bytes_host'] * mib:>9.1f} {s['kv_bytes_device'] * mib:>8.1f} "
            f"{s['bytes_h2d'] * mib:>10.1f} "
            f"{s['mean_tokens_attended']:>9.1f}  {r.token_ids == reference}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
