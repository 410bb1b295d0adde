"""Flax NNX: run an unmodified model under a ``Policy``, and a skip-safe ``nnx.Optimizer``."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.flax.nnx_attention import attention
from jmp_lite._src.flax.nnx_optimizer import LossScaledOptimizer, snapshot
from jmp_lite._src.flax.nnx_policy import (
    DEFAULT_FLOAT32_MODULES,
    Fp8Variable,
    PolicyView,
    apply_policy,
    policy_of,
)

__all__ = [
    "DEFAULT_FLOAT32_MODULES",
    "Fp8Variable",
    "LossScaledOptimizer",
    "PolicyView",
    "apply_policy",
    "attention",
    "policy_of",
    "snapshot",
]

_export(__name__, globals(), __all__)
