"""FP8 training: recipes, fp8 contractions (forward and backward), their scaling state, diagnostics."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.base.exports import lazy as _lazy
from jmp_lite._src.fp8.fp8 import (
    Fp8Recipe,
    Fp8State,
    NoFp8ContractionWarning,
    accumulate_observed,
    get_fp8_recipe,
    init_fp8_state,
    update_fp8_state,
)
from jmp_lite._src.fp8.fp8_ops import dot_general, einsum

__all__ = [
    "Fp8Recipe",
    "Fp8Report",
    "Fp8State",
    "Fp8TensorReport",
    "NoFp8ContractionWarning",
    "accumulate_observed",
    "dot_general",
    "einsum",
    "fp8_report",
    "get_fp8_recipe",
    "init_fp8_state",
    "update_fp8_state",
]

_REPORT = "jmp_lite._src.tools.fp8_report"  # a tool: loaded on first use
__getattr__ = _lazy(
    __name__, globals(), dict.fromkeys(["Fp8Report", "Fp8TensorReport", "fp8_report"], _REPORT)
)
_export(__name__, globals(), [n for n in __all__ if n in globals()])
