"""Memory, measured where it runs: the compiled program of a step on a TPU slice or an NVIDIA GPU,
compiled on this machine without the hardware (``compiled``, ``plan``, ``compile_only_target``); the
bytes reverse-mode differentiation keeps for the backward pass, counted by tracing (``residual_bytes``);
the bytes of the parameters and optimizer state, per parameter and by component (``state_bytes``)."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.tools.collectives import Collective
from jmp_lite._src.tools.compiled import (
    CompiledReport,
    CompilerOutOfMemory,
    Contraction,
    compiled,
    report_of,
)
from jmp_lite._src.tools.live_buffers import LiveValue
from jmp_lite._src.tools.memory import Residual, ResidualBytes, StateBytes, residual_bytes, state_bytes
from jmp_lite._src.tools.plan import Plan, Workload, plan
from jmp_lite._src.tools.targets import Target, compile_only_target, known_targets

__all__ = [
    "Collective",
    "CompiledReport",
    "CompilerOutOfMemory",
    "Contraction",
    "LiveValue",
    "Plan",
    "Residual",
    "ResidualBytes",
    "StateBytes",
    "Target",
    "Workload",
    "compile_only_target",
    "compiled",
    "known_targets",
    "plan",
    "report_of",
    "residual_bytes",
    "state_bytes",
]

_export(__name__, globals(), __all__)
