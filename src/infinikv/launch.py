"""The ``infinikv`` command's entry point: imports the command line (torch, transformers: seconds) and runs
it, so that Ctrl-C during those seconds ends in one line, as it does later (``cli.main``)."""

from __future__ import annotations

import signal
import sys


def main() -> int:
    interrupted = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True  # kept even where an import catches the KeyboardInterrupt raised inside it
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, interrupt)
    except ValueError:  # not the main thread: signals are not ours to handle
        previous = None
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        print("infinikv: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
