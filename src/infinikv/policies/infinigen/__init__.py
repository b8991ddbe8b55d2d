"""InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707): speculative KV selection and prefetch.

Each module imports only those listed after it:

* ``policy.py``: the policy (rehearsal of the next layer, selection, prefetch, host-pool capacity);
* ``calibration.py``: how a model's calibration is computed, once per model, and cached;
* ``tuning.py``: the knobs calibrated in the same pass: the share of key columns (``partial_ratio``: how
  much of the real top-k the speculated top-k holds), ``alpha`` per layer (the attention its count keeps)
  and the layers that choose with their own query;
* ``config.py``: the policy's knobs (``InfiniGenConfig``) and how the calibrated ones resolve;
* ``layer.py`` and ``rehearsal.py``: what the policy keeps per layer (``LayerState``), and the rehearsal as
  pure functions with the ``Rehearsal`` record an observer gets;
* ``skewfile.py``: the calibration a policy reads (skewing matrices + column scores, and the calibrated
  knobs as a ``Tuned`` record), its file format;
* ``slots.py``: what each slot of its host pool holds (position, fetch counts, partial key).
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
