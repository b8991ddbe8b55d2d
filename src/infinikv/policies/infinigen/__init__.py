"""InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707): speculative KV selection and prefetch.

* ``policy.py``: the policy (rehearsal of the next layer, selection, prefetch, host-pool capacity);
* ``slots.py``: what each slot of its host pool holds (position, fetch counts, partial key);
* ``skewfile.py``: the calibration a policy reads (skewing matrices + column scores), its file format;
* ``calibration.py``: how a model's calibration is computed, once per model, and cached;
* ``tuning.py``: the knobs calibrated in the same pass: the share of key columns (``partial_ratio``: how
  much of the real top-k the speculated top-k holds) and ``alpha`` per layer (the attention its count keeps).
"""

from .calibration import calibrate, ensure_skew
from .policy import InfiniGenConfig, InfiniGenPolicy
from .skewfile import Skew, SkewError, cached_skew, read_skew

__all__ = [
    "InfiniGenConfig",
    "InfiniGenPolicy",
    "Skew",
    "SkewError",
    "cached_skew",
    "calibrate",
    "ensure_skew",
    "read_skew",
]
