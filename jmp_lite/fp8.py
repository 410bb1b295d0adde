"""FP8 training: recipes, fp8 contractions (forward and backward), their scaling state, diagnostics."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.fp8 import (
    Fp8Recipe,
    Fp8State,
    accumulate_observed,
    get_fp8_recipe,
    init_fp8_state,
    update_fp8_state,
)
from jmp_lite._src.fp8_ops import Fp8Report, Fp8TensorReport, dot_general, einsum, fp8_report

__all__ = [
    "Fp8Recipe",
    "Fp8Report",
    "Fp8State",
    "Fp8TensorReport",
    "accumulate_observed",
    "dot_general",
    "einsum",
    "fp8_report",
    "get_fp8_recipe",
    "init_fp8_state",
    "update_fp8_state",
]

_export(__name__, globals(), __all__)
