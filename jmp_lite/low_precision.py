"""Optax transformations for 16-bit parameters and 16- or 8-bit optimizer state (no float32 master copy)."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.optim.low_precision import (
    KahanSummationState,
    LowPrecisionState,
    StochasticRoundingState,
    kahan_summation,
    low_precision_state,
    stochastic_rounding,
)
from jmp_lite._src.optim.quantized_state import QuantizedArray, dequantized

__all__ = [
    "KahanSummationState",
    "LowPrecisionState",
    "QuantizedArray",
    "StochasticRoundingState",
    "dequantized",
    "kahan_summation",
    "low_precision_state",
    "stochastic_rounding",
]

_export(__name__, globals(), __all__)
