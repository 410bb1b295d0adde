"""The bytes reverse-mode differentiation keeps for the backward pass, by dtype and named scope."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.tools.memory import Residual, ResidualBytes, residual_bytes

__all__ = [
    "Residual",
    "ResidualBytes",
    "residual_bytes",
]

_export(__name__, globals(), __all__)
