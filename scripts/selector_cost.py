"""Where InfiniGen's selector spends one layer's time on a CPU (docs/results-infinigen.md, "Speed").

    OMP_NUM_THREADS=1 python scripts/selector_cost.py [batch] [tokens] [columns]

Times one layer's selection at the bench's target cell (default: batch 8, 8,064 tokens, SmolLM2-135M's 3 KV
heads of 3 query heads, 48 int8 columns: the ratio calibrated for 4k and 8k tokens) on random partial keys:
the speculated scores (by the host loop a CPU runs, and by the tensor operations CUDA runs: int8 keys
converted to bfloat16, the product, the per-token scales, the group's relative max), the count rule, and
the pick of each head's top tokens (the window lifted; the cut, the ties at it and the slot order, by the
host kernel a CPU runs and by the tensor operations CUDA runs; the whole pick, the window lifted in the
kernel, as the policy picks where nothing was evicted), and the scores and the pick at each row's budget,
apart and in one call of the host loop (where each row's count is known on the host: at the defaults on
the registry's models); then the same with coarse-to-fine (block) speculation (``--block-size 16
--block-candidates 1.25``, not the default): the blocks' bounds, the pick of candidate blocks, the
candidates' keys, their scores, the count and the pick among them. Each step is timed alone, and each
whole selection once more, median of 30 runs after 2 warm-ups. Random scores, not a model's: how many
tokens come within alpha changes the count, not the cost, which is set by the shapes.
"""

import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

from infinikv.policies.base import group_relative_max, pick_top, pick_with_tensor_ops
from infinikv.policies.bounds import BlockBounds
from infinikv.policies.infinigen import rehearsal
from infinikv.policies.infinigen.blocks import BOUND_DTYPE, block_scores, gather_slots, partial_values
from infinikv.policies.infinigen.rehearsal import (
    count_within,
    quantize,
    scores_and_pick_on_host,
    speculative_scores,
)
from infinikv.policies.ranked import pick_on_host

KV_HEADS, GROUP, WINDOW, BUDGET, ALPHA, BLOCK, CANDIDATES = 3, 3, 32, 0.2, 4.0, 16, 1.25


def timed(step: Callable[[], object], runs: int = 30) -> float:
    """Median milliseconds of ``step``."""
    step(), step()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tensor_scores(query: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``speculative_scores`` by tensor operations, as on CUDA (the host loop switched off)."""
    on_host, rehearsal.runs_on_host = rehearsal.runs_on_host, lambda tensor: False
    try:
        return speculative_scores(query, keys, (), None, scale)
    finally:
        rehearsal.runs_on_host = on_host


def main(batch: int, tokens: int, columns: int) -> None:
    torch.manual_seed(0)
    query = torch.randn(batch, KV_HEADS, GROUP, columns) * 0.1
    keys, scale = quantize(torch.randn(batch, KV_HEADS, tokens, columns), 8)
    keys, scale = keys.transpose(2, 3).contiguous(), scale.transpose(2, 3).contiguous()  # slots last
    # the recent window, one row for every head (as the policy passes it while nothing is evicted)
    reserved = (torch.arange(tokens) >= tokens - WINDOW).expand(batch, KV_HEADS, tokens)
    budgets = [math.ceil(BUDGET * tokens)] * batch
    scores = speculative_scores(query, keys, (), None, scale)
    counts = count_within(scores, ALPHA, budgets, reserved).tolist()
    lifted_scores = scores.masked_fill(reserved, math.inf)  # every row takes its whole window
    converted = keys.to(torch.bfloat16)
    product = torch.matmul(query.bfloat16(), converted)
    scaled = product.float() * scale.float()
    steps = {
        "scores: host loop": lambda: speculative_scores(query, keys, (), None, scale),
        "  as tensor ops (CUDA's): all four": lambda: tensor_scores(query, keys, scale),
        "int8 keys to bfloat16": lambda: keys.to(torch.bfloat16),
        "product (bfloat16)": lambda: torch.matmul(query.bfloat16(), converted),
        "scales": lambda: product.float() * scale.float(),
        "group's relative max": lambda: group_relative_max(scaled.flatten(1, 2), GROUP),
        "count rule": lambda: count_within(scores, ALPHA, budgets, reserved),
        "window lifted to +inf (CUDA's)": lambda: scores.masked_fill(
            reserved & (scores > -math.inf), math.inf
        ),
        "cut, ties, order: host kernel": lambda: pick_on_host(lifted_scores, counts, max(counts), each=False),
        "the same as tensor ops (CUDA's)": lambda: pick_with_tensor_ops(
            lifted_scores, counts, max(counts), False
        ),
        "pick (window lifted in the kernel)": lambda: pick_top(scores, counts, reserved, WINDOW),
        "scores, then pick, at the budget": lambda: pick_top(
            speculative_scores(query, keys, (), None, scale), budgets, reserved, WINDOW
        ),
        "the same in one call": lambda: scores_and_pick_on_host(query, keys, None, scale, budgets, reserved),
    }

    def select() -> None:
        found = speculative_scores(query, keys, (), None, scale)
        pick_top(found, count_within(found, ALPHA, budgets, reserved).tolist(), reserved, WINDOW)

    print(f"batch {batch}, {tokens} tokens, {columns} int8 columns, {torch.get_num_threads()} thread(s)")
    print("token speculation (block_size 0):")
    for name, step in steps.items():
        print(f"  {name:<38} {timed(step):7.2f} ms")
    print(f"  {'whole selection':<38} {timed(select):7.2f} ms")

    # coarse to fine: bounds per block rank the blocks; tokens are scored and picked among the best ones
    bounds = BlockBounds(BLOCK, [0] * batch, keys.device, dtype=BOUND_DTYPE, outward=True)  # as InfiniGen's

    def every_real(slots: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(slots, dtype=torch.bool)  # random keys: no padding

    bounds.build(tokens, partial_values(keys, scale), every_real, batch, KV_HEADS)
    blocks = bounds.count(tokens)
    takes = [min(math.ceil(CANDIDATES * b / BLOCK) + math.ceil(WINDOW / BLOCK) + 2, blocks) for b in budgets]
    reserved_blocks = torch.zeros(batch, KV_HEADS, blocks, dtype=torch.bool)
    reserved_blocks[..., -math.ceil(WINDOW / BLOCK) - 1 :] = True
    coarse = group_relative_max(block_scores(query, bounds, blocks).flatten(1, 2), GROUP)
    chosen = pick_top(coarse, takes, reserved_blocks)[0]
    candidates = bounds.slots_of(chosen).clamp(0, tokens - 1)
    picked_keys, picked_scale = gather_slots(keys, scale, candidates)
    fine = speculative_scores(query, picked_keys, (), None, picked_scale)
    fine_reserved = torch.gather(reserved, 2, candidates)
    fine_counts = count_within(fine, ALPHA, budgets, fine_reserved).tolist()
    blocked = {
        "block bounds and the group's max": lambda: group_relative_max(
            block_scores(query, bounds, blocks).flatten(1, 2), GROUP
        ),
        "pick of candidate blocks": lambda: pick_top(coarse, takes, reserved_blocks),
        "candidates' keys (gather)": lambda: gather_slots(keys, scale, candidates),
        "candidates' scores": lambda: speculative_scores(query, picked_keys, (), None, picked_scale),
        "count rule": lambda: count_within(fine, ALPHA, budgets, fine_reserved),
        "pick among candidates": lambda: pick_top(fine, fine_counts, fine_reserved),
    }

    def select_blocks() -> None:
        ranked = group_relative_max(block_scores(query, bounds, blocks).flatten(1, 2), GROUP)
        among = bounds.slots_of(pick_top(ranked, takes, reserved_blocks)[0]).clamp(0, tokens - 1)
        picked, picked_scales = gather_slots(keys, scale, among)
        found = speculative_scores(query, picked, (), None, picked_scales)
        within = torch.gather(reserved, 2, among)
        pick_top(found, count_within(found, ALPHA, budgets, within).tolist(), within)

    print(
        f"coarse to fine (block_size {BLOCK}, block_candidates {CANDIDATES}: "
        f"{candidates.shape[-1]} candidates):"
    )
    for name, step in blocked.items():
        print(f"  {name:<38} {timed(step):7.2f} ms")
    print(f"  {'whole selection':<38} {timed(select_blocks):7.2f} ms")


if __name__ == "__main__":
    arguments = [int(value) for value in sys.argv[1:4]]
    main(*arguments, *(8, 8064, 48)[len(arguments) :])
