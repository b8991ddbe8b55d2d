"""InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707): speculative KV selection and prefetch.

Each module imports only those listed after it:

* ``policy.py``: the policy (rehearsal of the next layer, selection, prefetch, host-pool capacity);
* ``together.py``: an engine step's sequences that choose a layer together, each as it would alone;
* ``plan.py``: what the first decode step settles, in one immutable ``DecodePlan`` (each sequence's
  columns and count rule, each layer's alpha, the own-query layers);
* ``schedule.py``: when layers choose and what they read between choices (``select_every``,
  ``own_query_prefetch``);
* ``calibration.py``: how a model's calibration is computed, once per model, and cached;
* ``tuning.py``: the knobs calibrated in the same pass: the share of key columns (``partial_ratio``: how
  much of the real top-k the speculated top-k holds), ``alpha`` per layer (the attention its count keeps)
  and the layers that choose with their own query;
* ``config.py``: the policy's knobs (``InfiniGenConfig``) and how the calibrated ones resolve;
* ``layer.py``: what the policy keeps per layer (``LayerState``);
* ``slots.py``: what each slot of its host pool holds (position, fetch counts, partial key) and the block
  bounds over them;
* ``blocks.py``: coarse-to-fine speculation's block bounds;
* ``rehearsal.py``: the rehearsal as pure functions, with the ``Rehearsal`` record an observer gets;
* ``skewfile.py``: the calibration a policy reads (skewing matrices + column scores, and the calibrated
  knobs as a ``Tuned`` record), its file format.
"""

from .calibration import calibrate, ensure_skew
from .config import InfiniGenConfig
from .policy import InfiniGenPolicy
from .skewfile import Skew, SkewError, Tuned, cached_skew, read_skew

__all__ = [
    "InfiniGenConfig",
    "InfiniGenPolicy",
    "Skew",
    "SkewError",
    "Tuned",
    "cached_skew",
    "calibrate",
    "ensure_skew",
    "read_skew",
]
