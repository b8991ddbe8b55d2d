"""KV policies: what each attention layer sees and what crosses from the host pool to the device."""

from .base import ModelSpec, Policy, PolicyConfig, Selection, resolve_budget
from .dense import DenseConfig, DensePolicy
from .infinigen import InfiniGenConfig, InfiniGenPolicy
from .offload import OffloadConfig, OffloadPolicy
from .registry import POLICIES, make_config, make_policy, policy_class

__all__ = [
    "POLICIES",
    "DenseConfig",
    "DensePolicy",
    "InfiniGenConfig",
    "InfiniGenPolicy",
    "ModelSpec",
    "OffloadConfig",
    "OffloadPolicy",
    "Policy",
    "PolicyConfig",
    "Selection",
    "make_config",
    "make_policy",
    "policy_class",
    "resolve_budget",
]
