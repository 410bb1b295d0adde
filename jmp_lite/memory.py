"""The bytes reverse-mode differentiation keeps for the backward pass, by dtype and named scope; the bytes
of the parameters and optimizer state, per parameter and by component."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.tools.memory import Residual, ResidualBytes, StateBytes, residual_bytes, state_bytes

__all__ = [
    "Residual",
    "ResidualBytes",
    "StateBytes",
    "residual_bytes",
    "state_bytes",
]

_export(__name__, globals(), __all__)
