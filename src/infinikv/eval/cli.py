"""``infinikv eval ppl | retrieval | speculation | sweep | report``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cliargs import add_dtype_argument, int_list, output_folder
from ..errors import InputError


def _floats(text: str) -> list[float]:
    try:
        numbers = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if not numbers:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'")
    return numbers


def cmd_ppl(args: argparse.Namespace) -> int:
    from ..models import load
    from ..policies import make_config
    from ..policy_flags import policy_knobs
    from .ppl import PerplexityConfig, perplexity

    config = PerplexityConfig(args.text, args.context, args.prefill, args.windows)
    policy = make_config(args.policy, **policy_knobs(args))
    result = perplexity(load(args.model, device=args.device, dtype=args.dtype), policy, config, progress=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['policy']} on {result['text']} ({result['windows']} x {result['context']} tokens, "
        f"prefill {result['prefill']}): ppl {result['ppl']:.3f}, dense {result['dense']['ppl']:.3f}, "
        f"KV fetched {_pct(result['kv_fraction'])}"
    )
    print("block        ppl    dense")
    for mine, dense in zip(result["blocks"], result["dense"]["blocks"], strict=True):
        print(f"{mine['start']:>5}-{mine['end']:<5} {mine['ppl']:8.3f} {dense['ppl']:8.3f}")
    return 0


def cmd_retrieval(args: argparse.Namespace) -> int:
    from ..models import load
    from ..policies import make_config
    from ..policy_flags import policy_knobs
    from .retrieval import evaluate
    from .tasks import TASKS

    tasks = list(TASKS) if args.task == "all" else [t.strip() for t in args.task.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if not tasks:
        raise InputError(f"--task names no task; available: {', '.join(TASKS)} (or all)")
    if unknown:
        raise InputError(f"unknown task {', '.join(unknown)}; available: {', '.join(TASKS)} (or all)")
    policy = make_config(args.policy, **policy_knobs(args))
    loaded = load(args.model, device=args.device, dtype=args.dtype)
    results = [
        evaluate(loaded, policy, task, ctx, args.samples, args.depths, args.seed, args.chat, progress=True)
        for task in tasks
        for ctx in args.context
    ]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'task':<18} {'context':>7} {'score':>6} {'KV fetched':>10}   ({results[0]['policy']})")
    for r in results:
        print(f"{r['task']:<18} {r['context']:>7} {r['score']:6.1f} {_pct(r['kv_fraction']):>10}")
    return 0


def cmd_speculation(args: argparse.Namespace) -> int:
    from ..models import load
    from ..policies import InfiniGenConfig, make_config
    from .speculation import SpeculationConfig, markdown, probe, write

    config = SpeculationConfig(args.text, args.context, args.scored, args.attend)
    knobs = {
        k: getattr(args, k) for k in InfiniGenConfig.__dataclass_fields__ if getattr(args, k) is not None
    }
    policy = make_config("infinigen", **knobs)
    result = probe(load(args.model, device=args.device, dtype=args.dtype), policy, config, progress=True)
    paths = write(result, args.out)
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _infinigen_knob_arguments(parser: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from ..policies import InfiniGenConfig
    from ..policy_flags import parse_bool, parse_number

    group = parser.add_argument_group("InfiniGen knobs (default: the policy's)")
    for f in fields(InfiniGenConfig):
        parse = {bool: parse_bool, int: int, float: parse_number}.get(type(f.default), str)
        group.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, type=parse, help=f"default {f.default}"
        )


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..cluster import spread_from_args
    from .report import write_outputs
    from .sweep import parse_shard, read_config, run_sweep

    config = read_config(args.config)
    shard = parse_shard(args.shard)
    failures = run_sweep(config, shard=shard, spread=spread_from_args(args))
    summary = write_outputs(config)
    print(
        f"{summary['measured']} cells measured, {len(summary['missing'])} missing; outputs in {config.out}",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print((config.out / "tables.md").read_text(encoding="utf-8"))
    return _failed(failures, config.out)


def _failed(failures: int, out: Path) -> int:
    """Exit status 1, with one line, when cells failed in this run (the outputs hold the others)."""
    if not failures:
        return 0
    print(
        f"sweep: {failures} cell(s) failed (errors in {out / 'failed.jsonl'}); a rerun measures them again",
        file=sys.stderr,
    )
    return 1


def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_outputs, write_report
    from .sweep import read_config, run_sweep

    config = read_config(args.config)
    if config.report is None:
        raise InputError(f"sweep config {args.config} names no report path (add: report = 'docs/results.md')")
    failures = 0 if args.no_run else run_sweep(config)  # --no-run: only what is already measured
    summary = write_outputs(config)
    notes = config.raw.get("notes", "")
    path = write_report(config, summary, f"infinikv eval report --config {args.config}", notes)
    print(path)
    return _failed(failures, config.out)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def register_cli(subparsers) -> None:
    from ..cluster import add_arguments as add_ray_arguments
    from ..models import DEFAULT_MODEL
    from ..policy_flags import add_policy_arguments
    from .retrieval import DEFAULT_DEPTHS

    parser = subparsers.add_parser("eval", help="perplexity, retrieval accuracy, sweeps and reports")
    sub = parser.add_subparsers(dest="eval_command", required=True, parser_class=type(parser))

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=DEFAULT_MODEL)
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
        add_dtype_argument(p)
        p.add_argument("--json", action="store_true")
        add_policy_arguments(p)

    ppl = sub.add_parser("ppl", help="perplexity through the decode path, with the dense reference")
    ppl.add_argument("--text", default="austen", help="austen, essays, or a UTF-8 text file")
    ppl.add_argument("--context", type=int, default=4096, help="tokens per window")
    ppl.add_argument("--prefill", type=int, default=512, help="leading tokens fed densely")
    ppl.add_argument("--windows", type=int, default=1, help="windows, run as one batch")
    common(ppl)
    ppl.set_defaults(func=cmd_ppl)

    ret = sub.add_parser("retrieval", help="passkey and RULER-style retrieval tasks")
    ret.add_argument("--task", default="passkey", help="comma-separated task names, or all")
    ret.add_argument("--context", type=int_list, default=(2048,), help="comma-separated context lengths")
    ret.add_argument("--samples", type=int, default=3, help="samples per task and context")
    ret.add_argument("--depths", type=_floats, default=list(DEFAULT_DEPTHS), help="needle depths, cycled")
    ret.add_argument("--seed", type=int, default=0)
    ret.add_argument(
        "--chat",
        choices=["auto", "on", "off"],
        default="off",
        help="wrap the prompt in the model's chat template (auto: when it has one)",
    )
    common(ret)
    ret.set_defaults(func=cmd_retrieval)

    spec = sub.add_parser(
        "speculation", help="per layer: how well InfiniGen's speculation predicts the real attention"
    )
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_dtype_argument(spec)
    spec.add_argument("--text", default="austen", help="austen, essays, or a UTF-8 text file")
    spec.add_argument("--context", type=int, default=2048, help="tokens in the window")
    spec.add_argument("--scored", type=int, default=512, help="last tokens fed through the decode path")
    spec.add_argument(
        "--attend",
        choices=["infinigen", "dense"],
        default="infinigen",
        help="what managed layers attend to: InfiniGen's selection, or everything (speculation alone)",
    )
    spec.add_argument(
        "--out", type=output_folder, required=True, help="folder for speculation.json, .md and .png"
    )
    spec.add_argument("--json", action="store_true")
    _infinigen_knob_arguments(spec)
    spec.set_defaults(func=cmd_speculation)

    sweep = sub.add_parser("sweep", help="run a sweep config (TOML or JSON); resumable")
    sweep.add_argument("--config", required=True)
    sweep.add_argument("--shard", default="0/1", help="I/N: measure every N-th cell group from the I-th")
    sweep.add_argument("--json", action="store_true")
    add_ray_arguments(sweep, "one Ray task per group of cells that share prompts")
    sweep.set_defaults(func=cmd_sweep)

    report = sub.add_parser("report", help="run a sweep config (resuming) and write its results document")
    report.add_argument("--config", required=True)
    report.add_argument("--no-run", action="store_true", help="report finished cells only, measure nothing")
    report.set_defaults(func=cmd_report)
