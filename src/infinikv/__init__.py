"""infinikv: KV-cache management for Hugging Face causal LMs.

The cache lives in a host pool; a policy decides, per layer and decode step, what attention sees and what
crosses to the compute device. Typical use::

    import infinikv
    loaded = infinikv.load("smollm2-135m")
    gen = infinikv.Generator(loaded, policy="offload")
    result = gen.generate("Once upon a time", infinikv.GenerationConfig(max_new_tokens=32))[0]
    print(result.text, result.stats)

The names below are imported when first used (PEP 562), so that ``import infinikv`` alone, and the command
line before its work starts (``launch.py``), do not wait for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import InfinikvCache
    from .engine import Engine, EngineConfig
    from .errors import InfinikvError
    from .generate import GenerationConfig, Generator, RequestResult
    from .hooks import install
    from .models import REGISTRY, LoadedModel, load, pull
    from .policies import POLICIES, Policy, PolicyConfig, make_config

# public name -> the module that defines it
_HOMES = {
    "InfinikvCache": "cache",
    "Engine": "engine",
    "EngineConfig": "engine",
    "InfinikvError": "errors",
    "GenerationConfig": "generate",
    "Generator": "generate",
    "RequestResult": "generate",
    "install": "hooks",
    "REGISTRY": "models",
    "LoadedModel": "models",
    "load": "models",
    "pull": "models",
    "POLICIES": "policies",
    "Policy": "policies",
    "PolicyConfig": "policies",
    "make_config": "policies",
}
__all__ = [
    "POLICIES",
    "REGISTRY",
    "Engine",
    "EngineConfig",
    "GenerationConfig",
    "Generator",
    "InfinikvCache",
    "InfinikvError",
    "LoadedModel",
    "Policy",
    "PolicyConfig",
    "RequestResult",
    "install",
    "load",
    "make_config",
    "pull",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'infinikv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
