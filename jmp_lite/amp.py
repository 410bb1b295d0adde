"""Automatic mixed precision for any JAX function: ``autocast``, a program transformation, with
``float32_region``; ``explain`` says what it decided for each operation, and why.

``jmp_lite.autocast`` is the function (as ``torch.autocast`` lives in ``torch.amp``); this module holds it
with the names that go with it, so that ``jmp_lite.amp.explain`` and ``import jmp_lite.amp`` work where the
function's name would hide a module of the same name.

Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> f = jmp_lite.amp.autocast(lambda x: x @ x, "p=f32,c=bf16,o=f32")
    >>> f(jnp.ones((2, 2))).dtype
    dtype('float32')
"""

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
