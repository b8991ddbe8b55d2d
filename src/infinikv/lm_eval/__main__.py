"""``python -m infinikv.lm_eval ARGS``: lm-eval's command line with the ``infinikv`` model registered."""

import sys

from .launcher import main

sys.exit(main())
