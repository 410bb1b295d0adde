"""Gradient range diagnostics: underflow and overflow per leaf, a recommended loss scale."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.tools.diagnostics import GradientReport, LeafReport, gradient_diagnostics

__all__ = [
    "GradientReport",
    "LeafReport",
    "gradient_diagnostics",
]

_export(__name__, globals(), __all__)
