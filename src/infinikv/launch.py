"""The ``infinikv`` command's entry point: imports the command line (torch, transformers: seconds) and runs
it, so that Ctrl-C during those seconds ends in one line, as it does later (``cli.main``): once the imports
are done, or at once on a second Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys

from .cliargs import INTERRUPTED, say_interrupted


def main() -> int:
    presses = 0

    def interrupt(signum: int, frame: object) -> None:
        # Counted, not raised: a KeyboardInterrupt raised inside an import can abort the process (torch's
        # C++ calling back into Python) or come out as another error. A second press ends it at once.
        nonlocal presses
        presses += 1
        if presses > 1:
            say_interrupted()
            os._exit(INTERRUPTED)

    try:
        previous = signal.signal(signal.SIGINT, interrupt)
    except ValueError:  # not the main thread: signals are not ours to handle
        previous = None
    try:
        from .cli import main as run
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if presses:
        say_interrupted()
        return INTERRUPTED
    return run()


if __name__ == "__main__":
    sys.exit(main())
