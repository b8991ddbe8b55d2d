"""KV policies: what each attention layer sees and what crosses from the host pool to the device.

Importing this package registers every built-in policy (each module's ``@register``) and then the policies
other distributions declare in the ``infinikv.policies`` entry-point group (``registry.py``).
"""

from ..spec import ModelSpec
from .base import (
    HostPoolPolicy,
    Policy,
    RowAttention,
    ScoredPolicy,
    Selection,
    StepRows,
    pick_top,
    resolve_budget,
)
from .config import PolicyConfig, knob
from .registry import (
    POLICIES,
    load_entry_points,
    make_config,
    make_policy,
    policy_class,
    policy_of,
    prepare,
    register,
)

# isort: off
# Registration order is listing order: the reference, full offload, the selectors, quantisation, InfiniGen
# and its ceiling.
from .dense import DenseConfig, DensePolicy
from .offload import OffloadConfig, OffloadPolicy
from .streaming import StreamingConfig, StreamingPolicy
from .quest import QuestConfig, QuestPolicy
from .h2o import H2OConfig, H2OPolicy
from .quant import QuantConfig, QuantPolicy
from .infinigen import InfiniGenConfig, InfiniGenPolicy
from .oracle import OracleConfig, OraclePolicy
# isort: on

load_entry_points()

__all__ = [
    "POLICIES",
    "DenseConfig",
    "DensePolicy",
    "H2OConfig",
    "H2OPolicy",
    "HostPoolPolicy",
    "InfiniGenConfig",
    "InfiniGenPolicy",
    "ModelSpec",
    "OffloadConfig",
    "OffloadPolicy",
    "OracleConfig",
    "OraclePolicy",
    "Policy",
    "PolicyConfig",
    "QuantConfig",
    "QuantPolicy",
    "QuestConfig",
    "QuestPolicy",
    "RowAttention",
    "ScoredPolicy",
    "Selection",
    "StepRows",
    "StreamingConfig",
    "StreamingPolicy",
    "knob",
    "make_config",
    "make_policy",
    "pick_top",
    "policy_class",
    "policy_of",
    "prepare",
    "register",
    "resolve_budget",
]
