"""What breaks in 16 bits: ``precision_report`` per module, ``suggest_rules`` from it, ``jmp-lite doctor``."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.tools.doctor import main
from jmp_lite._src.tools.precision_report import Measurements, PrecisionReport, precision_report
from jmp_lite._src.tools.rule_suggestions import RuleSuggestion, suggest_rules

__all__ = [
    "Measurements",
    "PrecisionReport",
    "RuleSuggestion",
    "main",
    "precision_report",
    "suggest_rules",
]

_export(__name__, globals(), __all__)
