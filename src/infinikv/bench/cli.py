"""``infinikv bench``: the command line of the benchmark."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from ..cliargs import add_dtype_argument, int_list, output_file, output_folder
from ..errors import InputError
from ..models import DEFAULT_MODEL
from .peers import PEERS


def _names(text: str, allowed: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    if text.strip() in ("", "none"):
        return ()
    if text.strip() == "all":
        return tuple(allowed)
    return tuple(x.strip() for x in text.split(",") if x.strip())


def cmd_bench(args: argparse.Namespace) -> int:
    from ..cluster import spread_from_args
    from ..models import load
    from ..policies import POLICIES
    from ..policy_flags import policy_knobs
    from .grid import BenchConfig, run_bench
    from .report import bench_environment, write_bench_report, write_plots

    config = BenchConfig(
        policies=_names(args.policies, list(POLICIES)),
        peers=_names(args.peers, PEERS),
        batches=args.batch,
        contexts=args.context,
        gen=args.gen,
        repeats=args.repeats,
        warmup=args.warmup,
        prefill=args.prefill,
        prefill_chunk=args.prefill_chunk,
        knobs=tuple(sorted(policy_knobs(args).items())),
        corpus=None if args.corpus == "none" else args.corpus,
        compile=args.compile,
    )
    for knob, _ in config.knobs:  # a flag no benchmarked policy takes would go unchecked and unused
        if not any(knob in config.policy_knobs(name) for name in config.policies):
            benchmarked = ", ".join(config.policies) or "none"
            raise InputError(
                f"--{knob.replace('_', '-')} is a knob of none of the policies benchmarked ({benchmarked})"
            )
    if args.threads is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    command = "infinikv " + shlex.join(sys.argv[1:])
    spread = spread_from_args(args)
    if spread is not None:  # the workers load the model, each cell on its own task (threads: its CPUs)
        from .spread import run_bench_spread

        result = run_bench_spread(
            args.model, args.device, config, spread, command, progress=not args.quiet, dtype=args.dtype
        )
    else:
        loaded = load(args.model, device=args.device, dtype=args.dtype)
        result = run_bench(loaded, config, progress=not args.quiet)
        result["environment"] = bench_environment(loaded, command)
    if args.plot:
        result["plots"] = write_plots(result, args.plot)
    if args.report:
        write_bench_report(result, args.report)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from .report import summary_table

        print(summary_table(result))
    return 0


def register_cli(subparsers) -> None:
    from ..cluster import add_arguments as add_ray_arguments
    from ..policy_flags import add_policy_arguments

    bench = subparsers.add_parser(
        "bench", help="throughput / latency / bytes-moved benchmark of the policies"
    )
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--peers", default="all", help=f"transformers caches: {', '.join(PEERS)}, all or none")
    bench.add_argument("--batch", type=int_list, default=(1,), help="comma-separated batch sizes")
    bench.add_argument(
        "--context", type=int_list, default=(1024,), help="comma-separated prompt lengths (tokens)"
    )
    bench.add_argument("--gen", type=int, default=128, help="tokens generated per sequence")
    bench.add_argument(
        "--repeats", type=int, default=3, help="timed runs per policy and cell (medians reported)"
    )
    bench.add_argument("--warmup", type=int, default=4, help="decode steps of the untimed warm-up run")
    bench.add_argument("--prefill", default="shared", help="shared (prefill once per context) or per-run")
    bench.add_argument("--prefill-chunk", type=int, default=2048)
    bench.add_argument("--corpus", default="austen", help="prompt text: a registered corpus, a file, or none")
    bench.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_dtype_argument(bench)
    bench.add_argument("--json", action="store_true", help="print the full result as JSON")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="each policy also runs with its decode steps under torch.compile, as a row <policy>+compile",
    )
    bench.add_argument("--plot", type=output_folder, default=None, help="directory for the PNG plots")
    bench.add_argument(
        "--report", type=output_file, default=None, help="Markdown report to write (e.g. docs/benchmarks.md)"
    )
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(bench, multiple=True)
    add_ray_arguments(bench, "one Ray task per (batch, context) cell, side by side (see --gpus-per-task)")
    bench.set_defaults(func=cmd_bench, policies="all")
