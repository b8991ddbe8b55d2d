"""The ``infinikv`` command line.

Every subcommand that produces numbers takes ``--json``. Mistakes a user can make end in one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .cliargs import COMPILE_HELP, INTERRUPTED, add_dtype_argument, say_interrupted
from .errors import InfinikvError, InputError
from .models import DEFAULT_MODEL, REGISTRY, is_pulled
from .policies import POLICIES
from .policy_flags import add_policy_arguments, parse_number, policy_knobs


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None


# -- subcommands ---------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from .generate import GenerationConfig, Generator, check_text
    from .models import load
    from .policies import make_config

    if args.batch_file:
        prompts = [line for line in _read_text(args.batch_file, "batch file").splitlines() if line.strip()]
        if not prompts:
            raise InputError(f"batch file {args.batch_file} holds no prompts")
    elif args.prompt_file:
        prompts = [_read_text(args.prompt_file, "prompt file")]
    else:
        prompts = [args.prompt]
    # before the slow model load (the Generator checks every prompt again)
    if not prompts[0].strip():
        raise InputError("the prompt is empty")
    if args.prompt is not None:  # files are read as strict UTF-8; an argument may carry undecodable bytes
        check_text("the prompt", args.prompt)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        prefill_chunk=args.prefill_chunk,
    )
    policy = make_config(args.policy, **policy_knobs(args))  # check knobs before the slow model load
    loaded = load(args.model, device=args.device, dtype=args.dtype)
    if args.chat:
        prompts = [_chat(loaded.tokenizer, p) for p in prompts]
    generator = Generator(loaded, policy, compile=args.compile)
    stream = not args.json and len(prompts) == 1
    on_text = (lambda _row, piece: print(piece, end="", flush=True)) if stream else None
    results = generator.generate(prompts, config, on_text=on_text, progress=True)
    if args.json:
        objects = [
            {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason, "stats": r.stats}
            for r in results
        ]
        print(json.dumps(objects[0] if len(objects) == 1 else {"results": objects}, indent=2))
    else:
        if stream:
            print()
        else:
            for i, r in enumerate(results):
                print(f"--- [{i + 1}] ---\n{r.text}")
        print(_stats_line(results[0].stats), file=sys.stderr)
    return 0


def _chat(tokenizer, prompt: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model's tokenizer has no chat template; drop --chat")
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _stats_line(stats: dict[str, Any]) -> str:
    mib = 1 / 2**20
    return (
        f"[{stats['policy']}] prompt {stats['prompt_tokens']} tok, prefill {stats['prefill_s']:.2f} s, "
        f"decode {stats['decode_tokens_per_s']:.2f} tok/s (batch {stats['batch_size']}), "
        f"KV host {stats['kv_bytes_host'] * mib:.1f} MiB / device {stats['kv_bytes_device'] * mib:.1f} MiB, "
        f"moved h2d {stats['bytes_h2d'] * mib:.1f} MiB, "
        f"attended {stats['mean_tokens_attended']:.1f} tok/layer/step"
    )


def cmd_models(args: argparse.Namespace) -> int:
    from .models import pull

    if args.action == "list":
        rows = [
            {"name": m.name, "pulled": is_pulled(m.name), "description": m.description}
            for m in REGISTRY.values()
        ]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for row in rows:
                mark = "*" if row["pulled"] else " "
                print(f"{mark} {row['name']:<14} {row['description']}")
            print("(* = in the local cache; any local .gguf file, HF model directory or hub id also works)")
        return 0
    if not args.name:
        raise InputError("models pull needs a model name")
    print(pull(args.name))
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    rows = []
    for name, cls in POLICIES.items():
        config = cls.config_class
        summary = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        rows.append(
            {"name": name, "knobs": config.defaults(), "docs": config.knob_docs(), "summary": summary}
        )
    if args.markdown:
        print(policies_markdown(), end="")
    elif args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['name']:<10} {row['summary']}")
            for knob, default in row["knobs"].items():
                print(f"           --{knob.replace('_', '-')}={default}: {row['docs'][knob]}")
    return 0


POLICIES_MARKDOWN_INTRO = """\
# Policies

Generated by `infinikv policies --markdown` from each policy's config (its knobs, their defaults and their
help); do not edit by hand. Every knob is a flag of every command that runs a policy (`generate`, `eval`,
`bench`, `serve`) and a field of the server's request body (`kv_<knob>`); a knob the chosen policy does not
have is an error. `budget` is a fraction of the context when at most 1, else a token count.
"""


def _source_link(module_name: str) -> str:
    """A link from docs/ to the module's source file, or the module's name for a policy outside infinikv."""
    module = sys.modules.get(module_name)
    path = Path(getattr(module, "__file__", "") or "")
    package = Path(__file__).resolve().parent
    if not path.is_absolute() or package not in path.resolve().parents:
        return f"`{module_name}`"
    relative = path.resolve().relative_to(package.parent).as_posix()
    return f"[{relative.removeprefix('infinikv/')}](../src/{relative})"


def _markdown_cell(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text.replace("|", "\\|")


def policies_markdown() -> str:
    """docs/policies.md: per policy, its summary, source and paper, and a table of its knobs."""
    sections = [POLICIES_MARKDOWN_INTRO]
    for name, cls in POLICIES.items():
        module_doc = (sys.modules[cls.__module__].__doc__ or "").strip()
        summary = " ".join(module_doc.split("\n\n", 1)[0].split())
        paper = re.search(r"https?://[^\s),]+", summary)
        links = [f"Source: {_source_link(cls.__module__)}"]
        if paper:
            links.append(f"paper: <{paper.group(0)}>")
        lines = [f"## `{name}`", "", _markdown_cell(summary.replace("``", "`")), "", "; ".join(links), ""]
        config = cls.config_class
        docs = config.knob_docs()
        if not docs:
            lines.append("No knobs.")
        else:
            lines += ["| knob | flag | default | meaning |", "|---|---|---|---|"]
            for knob, default in config.defaults().items():
                flag = f"--{knob.replace('_', '-')}"
                cells = [f"`{knob}`", f"`{flag}`", f"`{_markdown_cell(default)}`", _markdown_cell(docs[knob])]
                lines.append("| " + " | ".join(cells) + " |")
        sections.append("\n".join(lines) + "\n")
    return "\n".join(sections)


# -- calibrate (InfiniGen) ---------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .models import load
    from .policies.infinigen.calibration import calibrate, concentration
    from .policies.infinigen.skewfile import skew_path
    from .store import locked

    text = None
    if args.text:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read calibration text {args.text}: {exc}") from None
    loaded = load(args.model, device=args.device, dtype=args.dtype)
    with locked(f"skew-{loaded.weights_id[:16]}"):  # fails before the work when the cache is read-only
        skew = calibrate(loaded, text=text, tokens=args.tokens)
    tuned = skew.tuned
    report: dict[str, Any] = {
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "weights_id": loaded.weights_id,
        "path": str(skew_path(loaded.weights_id, skew.source, skew.tokens)),
        "source": skew.source,
        "tokens": skew.tokens,
        "layers": int(skew.matrices.shape[0]),
        "kv_heads": int(skew.matrices.shape[1]),
        "head_dim": int(skew.matrices.shape[2]),
        # InfiniGen's calibrated knobs, used when --partial-ratio / --alpha are not given
        "partial_ratio": tuned.partial_ratio,
        "partial_ratio_rule": tuned.ratio_rule,
        "partial_ratio_curve": [asdict(point) for point in tuned.ratio_curve],
        # per prompt length: the ratio the same rule picks at the end of a window of that many tokens
        "partial_ratio_by_length": [asdict(entry) for entry in tuned.ratio_by_length],
        "alpha_per_layer": list(tuned.alpha_per_layer),
        "alpha_per_layer_rule": tuned.layer_rule,
        "alpha_per_layer_own": list(tuned.alpha_per_layer_own),  # scored with the layer's own query
        "alpha_per_layer_rehearsed": list(tuned.alpha_per_layer_rehearsed),  # and rehearsed
        "alpha": tuned.alpha,  # one for all layers: a summary (the mean curve's)
        "alpha_rule": tuned.rule,
        "alpha_curve": [asdict(point) for point in tuned.curve],
        # later layers that choose with their own query, not rehearsed from the layer before
        "own_query_layers": list(tuned.own_query_layers),
        "own_query_rule": tuned.own_query_rule,
        "own_query_curve": [asdict(point) for point in tuned.own_query_curve],
    }
    # what column_allocation per_layer would give each rehearsed layer within this model's device budget
    report["columns_per_layer"] = _columns_per_layer(skew, loaded)
    ratio = report["partial_ratio"]
    report["partial_share_skewed"] = round(concentration(skew, ratio), 4)
    report["partial_share_identity"] = round(concentration(skew, ratio, skewed=False), 4)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(report["path"])
        print(
            f"{report['tokens']} tokens of {report['source']}; calibrated partial ratio {ratio:g} "
            f"({report['partial_ratio_rule']}): those columns hold {report['partial_share_skewed']:.1%} of "
            f"Σ|Q|+Σ|K| skewed vs {report['partial_share_identity']:.1%} unskewed; by prompt length "
            f"{_by_length(report['partial_ratio_by_length'])}; calibrated alpha per "
            f"layer {_spread(report['alpha_per_layer'])} ({report['alpha_per_layer_rule']}), for all "
            f"layers {report['alpha']:g} ({report['alpha_rule']}); layers choosing with their own query "
            f"{_listed(report['own_query_layers'])} ({report['own_query_rule']})",
            file=sys.stderr,
        )
    return 0


def _columns_per_layer(skew, loaded) -> list[dict[str, Any]]:
    """Per calibration window: each rehearsed layer's ratio under ``column_allocation`` per_layer within the
    model's device budget, and the mean recall of the real top-k the calibration measured at those ratios
    and at the uniform ratio (None where the budget cuts it between the measured ratios)."""
    from .policies import InfiniGenConfig
    from .policies.infinigen.tuning import RATIOS

    config = InfiniGenConfig(column_allocation="per_layer")
    element = next(loaded.model.parameters()).element_size()
    cap = (config.column_cap(loaded.spec, element), loaded.spec.head_dim)
    allocations = config.allocations(skew, cap)
    out = []
    for window in skew.tuned.ratio_by_length if allocations else ():
        curves = dict(window.layer_curves)
        allocated = allocations[window.tokens]
        uniform = config.resolve("partial_ratio", skew, tokens=window.tokens, cap=cap)[0]
        at_uniform = (
            [curve[RATIOS.index(uniform)] for curve in curves.values()] if uniform in RATIOS else None
        )
        at_allocated = [curves[layer][RATIOS.index(ratio)] for layer, ratio in allocated.items()]
        out.append(
            {
                "tokens": window.tokens,
                "uniform_ratio": uniform,
                "recall_uniform": None if at_uniform is None else round(sum(at_uniform) / len(curves), 4),
                "recall_allocated": round(sum(at_allocated) / len(curves), 4),
                "ratio_by_layer": sorted(allocated.items()),
            }
        )
    return out


def _by_length(entries: list[dict[str, Any]]) -> str:
    """'≤2048: 0.3, ≤4096: 0.4, longer: 0.75' for a calibration's ratio per prompt length."""
    parts = [f"≤{e['tokens']}: {e['partial_ratio']:g}" for e in entries]
    return ", ".join(parts + [f"longer: {entries[-1]['partial_ratio']:g}"]) if entries else "none"


def _listed(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if layers else "none"


def _spread(values: list[float | None]) -> str:
    """'3-12' for the calibrated values of a list (None where a layer has none)."""
    known = [v for v in values if v is not None]
    return f"{min(known):g}-{max(known):g}" if known else "none"


def register_calibrate(subparsers) -> None:
    from .policies.infinigen.calibration import DEFAULT_CORPUS, DEFAULT_TOKENS

    parser = subparsers.add_parser(
        "calibrate", help="compute and cache InfiniGen's skewing matrices for a model"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="registered name, .gguf file, HF directory or hub id"
    )
    parser.add_argument("--text", help=f"UTF-8 calibration text file (default: the {DEFAULT_CORPUS} corpus)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="calibration tokens")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_dtype_argument(parser)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=cmd_calibrate)


# -- lm-eval ------------------------------------------------------------------------------------------------
def register_lm_eval(subparsers) -> None:
    # Everything after the subcommand goes to lm-eval's own command line as given, --help included: with a
    # prefix character no argument starts with, argparse takes every option as a plain value.
    parser = subparsers.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness with the infinikv model (the lm-eval extra; docs/lm-eval.md)",
        add_help=False,
        prefix_chars="\0",
    )
    parser.add_argument("lm_eval_args", nargs="*")
    parser.set_defaults(func=cmd_lm_eval)


def cmd_lm_eval(args: argparse.Namespace) -> int:
    from .lm_eval.launcher import main as lm_eval_main  # lazily: lm-eval is an optional extra

    return lm_eval_main(args.lm_eval_args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="infinikv", description="KV-cache policies for Hugging Face causal LMs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text with a KV policy")
    gen.add_argument(
        "--model", default=DEFAULT_MODEL, help="registered name, .gguf file, HF directory or hub id"
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding one prompt")
    source.add_argument("--batch-file", help="file with one prompt per line, generated as one batch")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=parse_number, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=parse_number, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill pass")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_dtype_argument(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    add_policy_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or fetch registered models")
    models.add_argument("action", choices=["list", "pull"])
    models.add_argument("name", nargs="?")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_models)

    policies = sub.add_parser("policies", help="list KV policies with their knobs and defaults")
    policies.add_argument("--json", action="store_true")
    policies.add_argument(
        "--markdown", action="store_true", help="print docs/policies.md: one table of knobs per policy"
    )
    policies.set_defaults(func=cmd_policies)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands that live beside their feature (data, eval, bench, serve), calibrate and lm-eval."""
    from . import bench, data
    from .eval import cli as eval_cli
    from .serve import cli as serve_cli

    return [
        data.register_cli,
        register_calibrate,
        bench.register_cli,
        eval_cli.register_cli,
        serve_cli.register_cli,
        register_lm_eval,
    ]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # imports each command's module: Ctrl-C may land here too
        return args.func(args)
    except InfinikvError as exc:
        print(f"infinikv: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a report, a results file or an output folder: a full disk, no permission, a
        if exc.filename is None:  # file or folder in the way; an OSError naming no file is not the user's
            raise
        print(f"infinikv: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1  # the run itself failed, not its command line
    except KeyboardInterrupt:
        say_interrupted()
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
