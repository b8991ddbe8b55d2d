"""How much of token speculation's choice coarse-to-fine speculation keeps (docs/results-infinigen.md).

    OMP_NUM_THREADS=1 python scripts/block_overlap.py [tokens] [budget] [candidates ...]

Runs InfiniGen on SmolLM2-135M over one Austen prompt (default 4,000 tokens) for three decode steps, once
scoring every token (``block_size`` 0) and once per candidate count with blocks of 16 tokens (default
``block_candidates`` 1.25, 3 and 8), and prints, per run, the share of the tokens token speculation fetched
that block speculation fetched too, over every managed layer, KV head and step (mean and worst). Both runs
decode from the same prompt; the first step's choices see the same past, later ones may differ with it.
"""

import sys

import torch

from infinikv import models
from infinikv.bench.prompts import prompt_ids
from infinikv.cache import InfinikvCache
from infinikv.forward import Driver, PrefillMemo
from infinikv.policies.infinigen.calibration import ensure_skew
from infinikv.policies.infinigen.rehearsal import Rehearsal
from infinikv.policies.registry import make_config

STEPS = 3


def choices(loaded, ids: torch.Tensor, memo: PrefillMemo, **knobs) -> dict[tuple[int, int, int], set[int]]:
    """(layer, step, KV head) -> the slots InfiniGen fetched there, for one run with ``knobs``."""
    fetched: dict[tuple[int, int, int], set[int]] = {}

    def observe(record: Rehearsal) -> None:
        for head in range(record.index.shape[1]):
            fetched[record.layer, record.step, head] = set(record.index[0, head].tolist())

    with torch.inference_mode():
        driver = Driver(loaded, InfinikvCache(loaded.model, make_config("infinigen", **knobs), loaded.device))
        driver.policy.observer = observe
        token = driver.prefill(ids, chunk=2048, memo=memo).argmax(-1)[:, None]
        for _ in range(STEPS - 1):
            token = driver.step(token).argmax(-1)[:, None]
        driver.close()
    return fetched


def main(tokens: int, budget: float, candidates: list[float]) -> None:
    loaded = models.load("smollm2-135m", device="cpu")
    ensure_skew(loaded)
    ids, _ = prompt_ids(loaded, tokens, 1, "austen")
    memo = PrefillMemo()
    token = choices(loaded, ids, memo, budget=budget, block_size=0)
    print(f"SmolLM2-135M, {ids.shape[1]} tokens, budget {budget:g}, {STEPS} decode steps")
    for count in candidates:
        blocked = choices(loaded, ids, memo, budget=budget, block_size=16, block_candidates=count)
        kept = [len(blocked[key] & chosen) / len(chosen) for key, chosen in token.items() if chosen]
        print(
            f"  block_candidates {count:g}: {sum(kept) / len(kept):.1%} of token speculation's picks "
            f"(worst layer and head {min(kept):.1%})"
        )


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(
        int(arguments[0]) if arguments else 4000,
        float(arguments[1]) if len(arguments) > 1 else 0.1,
        [float(value) for value in arguments[2:]] or [1.25, 3.0, 8.0],
    )
