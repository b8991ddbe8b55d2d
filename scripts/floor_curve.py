"""The curve behind ``min_tokens``'s default (docs/reliability.md): how many short prompts keep dense's greedy
answer under each selective policy at its defaults, per floor.

    python scripts/floor_curve.py oracle,infinigen,quest,h2o curve.json

Prompts: 12 windows of the Austen corpus, 5 to 240 tokens, each asked alone for 16 greedy tokens on
SmolLM2-135M.
"""

import json
import sys

import infinikv
from infinikv.data import load_corpus

FLOORS = (0, 16, 32, 64, 128)
LENGTHS = (5, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 240)


def main(policies: list[str], out: str) -> None:
    loaded = infinikv.load("smollm2-135m")
    ids = loaded.tokenizer(load_corpus("austen")[:200_000])["input_ids"]
    prompts = [ids[1000 + 997 * i : 1000 + 997 * i + n] for i, n in enumerate(LENGTHS)]
    config = infinikv.GenerationConfig(max_new_tokens=16)
    dense = [infinikv.Generator(loaded, policy="dense").generate([p], config)[0].token_ids for p in prompts]
    same = {}
    for name in policies:
        for floor in FLOORS:
            generator = infinikv.Generator(loaded, policy=name, min_tokens=floor)
            answers = [generator.generate([p], config)[0].token_ids for p in prompts]
            kept = [answer == d for answer, d in zip(answers, dense, strict=True)]
            same[f"{name} {floor}"] = kept
            missed = [n for n, ok in zip(LENGTHS, kept, strict=True) if not ok]
            print(f"{name} floor {floor}: {sum(kept)} of {len(kept)} equal dense; not: {missed}", flush=True)
    with open(out, "w", encoding="utf-8") as handle:
        json.dump({"lengths": LENGTHS, "floors": FLOORS, "same": same}, handle)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
