"""KV policies: what each attention layer sees and what crosses from the host pool to the device."""

from ..spec import ModelSpec
from .base import HostPoolPolicy, Policy, PolicyConfig, Selection, knob, resolve_budget
from .dense import DenseConfig, DensePolicy
from .gather import GatherPolicy
from .h2o import H2OConfig, H2OPolicy
from .infinigen import InfiniGenConfig, InfiniGenPolicy
from .offload import OffloadConfig, OffloadPolicy
from .oracle import OracleConfig, OraclePolicy
from .quant import QuantConfig, QuantPolicy
from .quest import QuestConfig, QuestPolicy
from .registry import POLICIES, make_config, make_policy, policy_class
from .streaming import StreamingConfig, StreamingPolicy

__all__ = [
    "StreamingPolicy",
    "StreamingConfig",
    "QuestPolicy",
    "QuestConfig",
    "QuantPolicy",
    "QuantConfig",
    "H2OPolicy",
    "H2OConfig",
    "POLICIES",
    "DenseConfig",
    "DensePolicy",
    "InfiniGenConfig",
    "InfiniGenPolicy",
    "GatherPolicy",
    "HostPoolPolicy",
    "ModelSpec",
    "knob",
    "OffloadConfig",
    "OffloadPolicy",
    "OracleConfig",
    "OraclePolicy",
    "Policy",
    "PolicyConfig",
    "Selection",
    "make_config",
    "make_policy",
    "policy_class",
    "resolve_budget",
]
