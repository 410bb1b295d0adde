"""Optax transformations for 16-bit parameters and 16-bit optimizer state (no float32 master copy)."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.low_precision import (
    KahanSummationState,
    LowPrecisionState,
    StochasticRoundingState,
    kahan_summation,
    low_precision_state,
    stochastic_rounding,
)

__all__ = [
    "KahanSummationState",
    "LowPrecisionState",
    "StochasticRoundingState",
    "kahan_summation",
    "low_precision_state",
    "stochastic_rounding",
]

_export(__name__, globals(), __all__)
