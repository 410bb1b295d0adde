"""``autocast``: mixed precision for any JAX function, as a program transformation; ``explain`` says
what it decided for each operation, and why."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.base.exports import lazy as _lazy
from jmp_lite._src.frontends.autocast import autocast, float32_region
from jmp_lite._src.primitive_rules import UnknownPrimitiveWarning

__all__ = [
    "Decision",
    "Explanation",
    "UnknownPrimitiveWarning",
    "autocast",
    "explain",
    "float32_region",
]

_EXPLAIN = "jmp_lite._src.tools.explain"  # a tool: loaded on first use
__getattr__ = _lazy(__name__, globals(), dict.fromkeys(["Decision", "Explanation", "explain"], _EXPLAIN))
_export(__name__, globals(), [n for n in __all__ if n in globals()])
