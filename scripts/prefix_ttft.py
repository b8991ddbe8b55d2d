"""Time to first token of a question about a document, cold and with the document in the prefix cache
(docs/serving.md, "Load benchmark"): on one idle engine, a question about an Austen passage, then another
question about the same passage.

    OMP_NUM_THREADS=1 python scripts/prefix_ttft.py dense,infinigen 2048,4096

SmolLM2-135M, the engine's defaults, 4 new tokens; the time runs from ``add`` to the step that hands out the
first token.
"""

import sys
import time

from infinikv.data import load_corpus
from infinikv.engine import Engine, EngineConfig, GenerationConfig
from infinikv.models import load
from infinikv.policies import make_config

QUESTIONS = (" Who is mentioned first?", " Where does this take place?")


def first_token_s(engine: Engine, prompt: list[int], policy) -> float:
    engine.add(prompt, policy, GenerationConfig(max_new_tokens=4))
    start, first = time.perf_counter(), None
    while engine.has_work:
        outputs = engine.step()
        if first is None and outputs:
            first = time.perf_counter() - start
    return first


def main(policies: list[str], lengths: list[int]) -> None:
    loaded = load("smollm2-135m")
    tokenize = loaded.tokenizer
    text = load_corpus("austen")
    for tokens in lengths:
        document = tokenize(text[100_000 : 100_000 + tokens * 6])["input_ids"][:tokens]
        for name in policies:
            engine, policy = Engine(loaded, EngineConfig()), make_config(name)
            prompts = [document + tokenize(question)["input_ids"] for question in QUESTIONS]
            cold, cached = (first_token_s(engine, prompt, policy) for prompt in prompts)
            print(
                f"{tokens} tokens, {name}: TTFT cold {cold * 1000:.0f} ms, document cached "
                f"{cached * 1000:.0f} ms ({cached / cold:.1%})",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1].split(","), [int(n) for n in sys.argv[2].split(",")])
