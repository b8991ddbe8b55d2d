"""``infinikv lm-eval ARGS`` / ``python -m infinikv.lm_eval ARGS``: lm-eval's own command line with the
``infinikv`` model registered.

Every option goes to lm-eval unchanged. Two things are added. For ``--model infinikv`` with a registered model
or an HF directory, the model's tokenizer directory becomes the default ``tokenizer`` of ``--metadata``, which
RULER's synthetic tasks read to size their samples (they would otherwise look the model name up on the Hub);
a ``tokenizer`` the user gives in ``--metadata`` wins. And an error a user can cause (a bad model argument, a
task name lm-eval does not know, a task whose data cannot be had offline) ends in one line and exit status 2
instead of a traceback.
"""

from __future__ import annotations

import json
import sys

from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from lm_eval.__main__ import cli_evaluate
from lm_eval.utils import simple_parse_args_string

from ..errors import InfinikvError
from ..models import DEFAULT_MODEL, default_device, tokenizer_dir
from .model import Options

# What a task raises when its data or files cannot be had: a Hub look-up offline (ConnectionError), a dataset
# or file not there (FileNotFoundError, datasets' DatasetNotFoundError), a repository the Hub refuses, a
# tokenizer name that is no path and no repository id, an nltk resource not installed (LookupError).
DATA_ERRORS = (ConnectionError, FileNotFoundError, HfHubHTTPError, HFValidationError, LookupError)
# How lm-eval's ValueError for a task name it does not know begins (raised before any model work)
UNKNOWN_TASKS = "Tasks not found"


def _option(argv: list[str], name: str) -> list[str]:
    """The values given to ``name`` (``--name v1 v2`` or ``--name=v``), in order, over every occurrence."""
    values: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == name:
            for value in argv[i + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
    return values


def _arguments(values: list[str]) -> dict:
    """``key=value`` pairs (comma- or space-separated) or one JSON object, as lm-eval reads them."""
    if values and values[0].lstrip().startswith("{"):
        return json.loads(values[0])
    return simple_parse_args_string(",".join(values))


def with_defaults(argv: list[str]) -> list[str]:
    """``argv`` for the infinikv model, its ``model_args`` checked (a mistake is reported before lm-eval
    spends its seconds reading every task), with two defaults put first, so that what the user gives wins:
    ``--metadata tokenizer=DIR``, the model's tokenizer directory (left out when the model has none of its
    own, a GGUF file: pass ``--metadata tokenizer=DIR``), and ``--device``, infinikv's default device
    (lm-eval's own default is cuda:0, also where there is none) unless model_args name one. Other models'
    arguments are left as they are."""
    if _option(argv, "--model") != ["infinikv"]:
        return argv
    model_args = _arguments(_option(argv, "--model_args"))
    Options.parse(**{k: v for k, v in model_args.items() if k not in ("pretrained", "device")})
    added = []
    directory = tokenizer_dir(str(model_args.get("pretrained", DEFAULT_MODEL)))
    if directory is not None:
        added += ["--metadata", json.dumps({"tokenizer": str(directory)})]
    if "device" not in model_args and not _option(argv, "--device"):
        added += ["--device", str(default_device())]
    head = argv[:1] if argv[:1] == ["run"] else []  # lm-eval's subcommand, when given, stays first
    return [*head, *added, *argv[len(head) :]]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    try:
        sys.argv = ["lm-eval", *with_defaults(argv)]  # lm-eval's command line reads sys.argv
        cli_evaluate()
    except InfinikvError as exc:
        print(f"infinikv lm-eval: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        if not str(exc).startswith(UNKNOWN_TASKS):
            raise
        print(f"infinikv lm-eval: error: {exc} (`infinikv lm-eval ls tasks` lists them)", file=sys.stderr)
        return 2
    except DATA_ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"infinikv lm-eval: error: a task's data is missing (no Hub access?): {first}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0
