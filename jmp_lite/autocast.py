"""``autocast``: mixed precision for any JAX function, as a program transformation; ``explain`` says
what it decided for each operation, and why."""

from jmp_lite._src.autocast import autocast, float32_region
from jmp_lite._src.explain import Decision, Explanation, explain
from jmp_lite._src.exports import export as _export
from jmp_lite._src.primitive_rules import UnknownPrimitiveWarning

__all__ = [
    "Decision",
    "Explanation",
    "UnknownPrimitiveWarning",
    "autocast",
    "explain",
    "float32_region",
]

_export(__name__, globals(), __all__)
