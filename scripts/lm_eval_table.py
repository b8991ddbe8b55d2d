"""The measured table of docs/lm-eval.md: RULER niah_single_1 at 4k tokens on SmolLM2-135M under each policy
and budget, scored by lm-eval (``simple_evaluate`` with the ``infinikv`` model) and by infinikv's own
retrieval eval (``infinikv eval retrieval``'s ``evaluate``), side by side.

Everything runs in one process so that each prompt is prefilled once per prefill family and replayed into the
other policies' caches (``forward.PrefillMemo``: the replayed cache holds what the policy's own prefill
builds). Samples can be split over processes: ``--first`` picks lm-eval's documents first..first+count-1 and
the own eval's seeds first..first+count-1 (sample i of a run of ``count`` is sample first+i of one long run);
so can cells (``--cells``).

    python scripts/lm_eval_table.py --first 0 --count 3 --out runs/lm-eval-table   # then --first 3 ...
    python scripts/lm_eval_table.py --cells "oracle budget=0.2,h2o budget=0.2" --out runs/lm-eval-table
    python scripts/lm_eval_table.py --table runs/lm-eval-table                     # the Markdown table
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CONTEXT = 4096
TASK = "niah_single_1"
BUDGETS = (0.1, 0.2)


def cells() -> list[tuple[str, str, dict]]:
    """(label, policy, knobs): dense and offload once, every selective policy at each budget; StreamingLLM's
    cache is its 4 sinks plus a window, sized to the budget's share of the context."""
    rows = [("dense", "dense", {}), ("offload", "offload", {})]
    for budget in BUDGETS:
        for policy in ("infinigen", "oracle", "quest", "h2o"):
            rows.append((f"{policy} budget={budget}", policy, {"budget": budget}))
        window = round(budget * CONTEXT) - 4
        rows.append((f"streaming n_sink=4 window={window}", "streaming", {"n_sink": 4, "window": window}))
    return rows


def measure(first: int, count: int, out: Path, only: list[str] | None) -> None:
    import lm_eval

    from infinikv.eval.retrieval import evaluate
    from infinikv.forward import PrefillMemo
    from infinikv.lm_eval import InfinikvLM
    from infinikv.models import load, tokenizer_dir
    from infinikv.policies import make_config

    loaded = load("smollm2-135m", device="cpu")
    metadata = {"tokenizer": str(tokenizer_dir(loaded.name))}
    lm_memo, own_memo = PrefillMemo(), PrefillMemo()
    out.mkdir(parents=True, exist_ok=True)
    chosen = [cell for cell in cells() if only is None or cell[0] in only]
    chosen.sort(key=lambda cell: only.index(cell[0]) if only else 0)
    for label, policy, knobs in chosen:
        start = time.perf_counter()
        lm = InfinikvLM(loaded, policy=policy, memo=lm_memo, **knobs)
        result = lm_eval.simple_evaluate(
            model=lm,
            tasks=[TASK],
            samples={TASK: list(range(first, first + count))},
            metadata=metadata,
            log_samples=True,
        )
        harness = [
            {"doc_id": s["doc_id"], "score": s[str(CONTEXT)], "response": s["resps"][0][0]}
            for s in result["samples"][TASK]
        ]
        own = evaluate(loaded, make_config(policy, **knobs), TASK, CONTEXT, count, seed=first, memo=own_memo)
        row = {
            "cell": label,
            "first": first,
            "lm_eval": harness,
            "own": [{k: r[k] for k in ("seed", "depth", "score", "prediction")} for r in own["rows"]],
            "seconds": round(time.perf_counter() - start, 1),
        }
        with (out / f"first{first}.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{label}: {row['seconds']} s", flush=True)


def table(folder: Path) -> str:
    """Mean scores per cell over every run in ``folder`` (lm-eval's 0-1 scores as percentages)."""
    merged: dict[str, dict[str, list[float]]] = {}
    for path in sorted(folder.glob("first*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            cell = merged.setdefault(row["cell"], {"lm_eval": [], "own": []})
            cell["lm_eval"] += [100 * s["score"] for s in row["lm_eval"]]
            cell["own"] += [r["score"] for r in row["own"]]
    lines = [
        "| policy | lm-eval niah_single_1 | samples | infinikv eval retrieval | samples |",
        "|---|--:|--:|--:|--:|",
    ]
    for label, _, _ in cells():
        if label in merged:
            h, o = merged[label]["lm_eval"], merged[label]["own"]
            lines.append(f"| {label} | {sum(h) / len(h):.1f} | {len(h)} | {sum(o) / len(o):.1f} | {len(o)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/lm-eval-table"))
    parser.add_argument("--cells", help="comma-separated cell labels to run, in this order (default: all)")
    parser.add_argument("--table", type=Path, help="print the table of the runs in this folder and stop")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
    else:
        measure(args.first, args.count, args.out, args.cells.split(",") if args.cells else None)


if __name__ == "__main__":
    main()
