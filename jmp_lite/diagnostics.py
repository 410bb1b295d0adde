"""Gradient range diagnostics: underflow and overflow per leaf, a recommended loss scale."""

from jmp_lite._src.diagnostics import GradientReport, LeafReport, gradient_diagnostics
from jmp_lite._src.exports import export as _export

__all__ = [
    "GradientReport",
    "LeafReport",
    "gradient_diagnostics",
]

_export(__name__, globals(), __all__)
