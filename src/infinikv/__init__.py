"""infinikv: KV-cache management for Hugging Face causal LMs.

The cache lives in a host pool; a policy decides, per layer and decode step, what attention sees and what
crosses to the compute device. Typical use::

    import infinikv
    loaded = infinikv.load("smollm2-135m")
    gen = infinikv.Generator(loaded, policy="offload")
    result = gen.generate("Once upon a time", infinikv.GenerationConfig(max_new_tokens=32))[0]
    print(result.text, result.stats)
"""

from .cache import InfinikvCache
from .engine import Engine, EngineConfig
from .errors import InfinikvError
from .generate import GenerationConfig, Generator, RequestResult
from .hooks import install
from .models import REGISTRY, LoadedModel, load, pull
from .policies import POLICIES, Policy, PolicyConfig, make_config

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
