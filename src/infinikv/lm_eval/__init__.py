"""lm-evaluation-harness support: importing this package registers the lm-eval model ``infinikv``.

Needs the ``lm-eval`` extra. Nothing else in infinikv imports lm-eval; ``infinikv lm-eval`` (or
``python -m infinikv.lm_eval``) imports this package and hands its options to lm-eval's own command line.
"""

from ..errors import InfinikvError

try:
    from .model import InfinikvLM
except ModuleNotFoundError as exc:
    if exc.name != "lm_eval":
        raise
    raise InfinikvError("lm-eval is not installed; pip install 'infinikv[lm-eval]'") from None

__all__ = ["InfinikvLM"]
