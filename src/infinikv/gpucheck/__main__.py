"""``python -m infinikv.gpucheck``: the check's command line (:mod:`infinikv.gpucheck.cli`)."""

import sys

from .cli import main

sys.exit(main())
