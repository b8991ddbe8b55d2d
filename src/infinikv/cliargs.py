"""Values of command-line options shared by infinikv's commands, checked where they are parsed, and how a
command ended by Ctrl-C says so."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C


def say_interrupted() -> None:
    """The one line a command ended by Ctrl-C prints (``cli.main``, and ``launch`` while it imports)."""
    print("infinikv: interrupted", file=sys.stderr, flush=True)


COMPILE_HELP = (
    "run decode steps under torch.compile, the policy's calls eager (CUDA: CUDA graphs); off by default, "
    "as its products follow the batch size (a request's tokens could depend on its batchmates); compiled "
    "before the first request (docs/benchmarks.md)"
)

# The dtypes a model can be loaded in (models.DTYPES maps them to torch's): float32 is the default and that
# of the CPU figures in the docs; bfloat16 halves the weights' and K/V's bytes and, on a CPU with AMX,
# reads prompts faster (docs/benchmarks.md, "bfloat16").
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_HELP = (
    "the model's weights and activations (default float32; a dummy model's: bfloat16 on CUDA); bfloat16 "
    "reads prompts faster on a CPU with AMX (docs/benchmarks.md)"
)


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, one of :data:`DTYPE_NAMES` (None: the model's default, ``models.load``)."""
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help=DTYPE_HELP)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (``"8,16"``; blanks around the commas and empty items are ignored),
    usable as an argparse ``type``; anything else raises ``argparse.ArgumentTypeError`` in one line."""
    try:
        values = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values


def output_file(text: str) -> Path:
    """A file the command writes at its end, usable as an argparse ``type``: its folder made now, so a
    path it cannot write (a folder in its place, a file where its folder should be, no permission) is one
    line before any work."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    output_folder(str(path.parent))
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}")
    return path


def output_folder(text: str) -> Path:
    """A folder the command writes into, usable as an argparse ``type``: made now if missing, so a path it
    cannot write (a file in the way, no permission) is one line before any work."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {text}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in the folder {text}")
    return path
