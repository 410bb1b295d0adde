"""``autocast``: mixed precision for any JAX function, as a program transformation."""

from jmp_lite._src.autocast import autocast, float32_region
from jmp_lite._src.exports import export as _export

__all__ = [
    "autocast",
    "float32_region",
]

_export(__name__, globals(), __all__)
