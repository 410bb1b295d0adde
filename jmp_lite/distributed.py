"""Data-parallel helpers: gradient all-reduce in a chosen dtype."""

from jmp_lite._src.distributed import reduce_gradients
from jmp_lite._src.exports import export as _export

__all__ = [
    "reduce_gradients",
]

_export(__name__, globals(), __all__)
