"""The ``infinikv`` command line.

Every subcommand that produces numbers takes ``--json``. Mistakes a user can make end in one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from .errors import InfinikvError, InputError
from .models import DEFAULT_MODEL, REGISTRY, is_pulled
from .policies import POLICIES


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# -- policy knobs: one flag per knob name across all policies ------------------------------------------------
def _knob_table() -> dict[str, tuple[type, list[str]]]:
    table: dict[str, tuple[type, list[str]]] = {}
    for name, cls in POLICIES.items():
        for f in fields(cls.config_class):
            kind = type(f.default) if f.default is not MISSING else str
            table.setdefault(f.name, (kind, []))[1].append(name)
    return table


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _parse_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None


def add_policy_arguments(parser: argparse.ArgumentParser, multiple: bool = False) -> None:
    """``--policy`` plus a flag for every knob of every registered policy."""
    if multiple:
        parser.add_argument(
            "--policies", default="dense", help=f"comma-separated, from: {', '.join(POLICIES)}"
        )
    else:
        parser.add_argument("--policy", default="dense", help=f"one of: {', '.join(POLICIES)}")
    group = parser.add_argument_group("policy knobs (each applies to the policies named in its help)")
    for knob, (kind, owners) in sorted(_knob_table().items()):
        parse = {bool: _parse_bool, int: int, float: _parse_number}.get(kind, str)
        group.add_argument(f"--{knob.replace('_', '-')}", dest=knob, type=parse, help=", ".join(owners))


def policy_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """Knob values the user set (others stay at each policy's default)."""
    return {k: getattr(args, k) for k in _knob_table() if getattr(args, k, None) is not None}


def knobs_for(policy: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``knobs`` that ``policy`` has (for commands that run several policies)."""
    own = {f.name for f in fields(POLICIES[policy].config_class)}
    return {k: v for k, v in knobs.items() if k in own}


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None


# -- subcommands ---------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import GenerationConfig, Generator
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
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        prefill_chunk=args.prefill_chunk,
    )
    policy = make_config(args.policy, **policy_knobs(args))  # check knobs before the slow model load
    loaded = load(args.model, device=args.device)
    if args.chat:
        prompts = [_chat(loaded.tokenizer, p) for p in prompts]
    generator = Generator(loaded, policy)
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
        knobs = {f.name: (None if f.default is MISSING else f.default) for f in fields(cls.config_class)}
        summary = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        rows.append({"name": name, "knobs": knobs, "summary": summary})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            knobs = ", ".join(f"{k}={v}" for k, v in row["knobs"].items()) or "no knobs"
            print(f"{row['name']:<10} {knobs}\n           {row['summary']}")
    return 0


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
    gen.add_argument("--temperature", type=_parse_number, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=_parse_number, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill pass")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_policy_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or fetch registered models")
    models.add_argument("action", choices=["list", "pull"])
    models.add_argument("name", nargs="?")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_models)

    policies = sub.add_parser("policies", help="list KV policies with their knobs and defaults")
    policies.add_argument("--json", action="store_true")
    policies.set_defaults(func=cmd_policies)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands that live beside their feature (calibrate, data, eval, bench, serve)."""
    from . import bench, data, skew
    from .eval import cli as eval_cli
    from .serve import cli as serve_cli

    return [
        data.register_cli,
        skew.register_cli,
        bench.register_cli,
        eval_cli.register_cli,
        serve_cli.register_cli,
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InfinikvError as exc:
        print(f"infinikv: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("infinikv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
