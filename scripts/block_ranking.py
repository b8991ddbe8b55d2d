"""Could a better block score save coarse-to-fine speculation? (docs/results-infinigen.md)

    OMP_NUM_THREADS=1 python scripts/block_ranking.py [tokens] [budget] [candidates]

Runs one decode step of InfiniGen (token speculation) on SmolLM2-135M over an Austen prompt (default 4,000
tokens, budget 0.1) and, per managed layer and KV head, counts how many of the tokens it fetched lie in the
best blocks of 16 tokens when the blocks are ranked by the exact best speculated score of their tokens (the
best any block score could do), keeping as many blocks as coarse-to-fine speculation keeps (default
``block_candidates`` 1.25, plus the recent window's blocks). Prints the mean and the worst share.
"""

import math
import sys

import torch

from infinikv import models
from infinikv.bench.prompts import prompt_ids
from infinikv.cache import InfinikvCache
from infinikv.forward import Driver, PrefillMemo
from infinikv.policies.infinigen.calibration import ensure_skew
from infinikv.policies.infinigen.rehearsal import Rehearsal
from infinikv.policies.registry import make_config

BLOCK, RESERVE = 16, 4  # RESERVE: the recent window's blocks, as the policy adds them


def main(tokens: int, budget: float, candidates: float) -> None:
    loaded = models.load("smollm2-135m", device="cpu")
    ensure_skew(loaded)
    ids, _ = prompt_ids(loaded, tokens, 1, "austen")
    records: list[Rehearsal] = []
    config = make_config("infinigen", budget=budget)
    with torch.inference_mode():
        driver = Driver(loaded, InfinikvCache(loaded.model, config, loaded.device))
        driver.policy.observer = records.append
        driver.step(driver.prefill(ids, chunk=2048, memo=PrefillMemo()).argmax(-1)[:, None])
        driver.close()
    shares = []
    for record in records:
        scores, picked = record.scores[0], record.index[0]  # [kv_heads, n], [kv_heads, n']
        blocks = math.ceil(scores.shape[-1] / BLOCK)
        take = min(math.ceil(candidates * picked.shape[-1] / BLOCK) + RESERVE, blocks)
        padded = torch.nn.functional.pad(scores, (0, blocks * BLOCK - scores.shape[-1]), value=-math.inf)
        best = padded.view(scores.shape[0], blocks, BLOCK).amax(-1).topk(take, dim=-1).indices
        kept = torch.zeros(scores.shape[0], blocks, dtype=torch.bool).scatter_(1, best, True)
        shares.append(kept.gather(1, picked // BLOCK).float().mean().item())
    print(
        f"SmolLM2-135M, {ids.shape[1]} tokens, budget {budget:g}, {candidates:g}x candidates: "
        f"the best blocks by their best token hold {sum(shares) / len(shares):.1%} of token "
        f"speculation's picks (worst layer {min(shares):.1%})"
    )


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(
        int(arguments[0]) if arguments else 4000,
        float(arguments[1]) if len(arguments) > 1 else 0.1,
        float(arguments[2]) if len(arguments) > 2 else 1.25,
    )
