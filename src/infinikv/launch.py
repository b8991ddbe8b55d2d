"""The ``infinikv`` command's entry point: imports the command line (torch, transformers: seconds) and runs
it, so that Ctrl-C during those seconds ends in one line, as it does later (``cli.main``)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("infinikv: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
