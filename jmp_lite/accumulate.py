"""16-bit contractions that accumulate in float32, forward and backward."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.kernels.accumulate import conv_general_dilated, dot_general, einsum, is_accumulated

__all__ = [
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "is_accumulated",
]

_export(__name__, globals(), __all__)
