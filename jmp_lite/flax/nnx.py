"""Flax NNX: run an unmodified model under a ``Policy``, and a skip-safe ``nnx.Optimizer``."""

import warnings
from typing import Any

from jmp_lite._src.base.exports import export as _export
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
    "policy_of",
    "snapshot",
]

_export(__name__, globals(), __all__)


def __getattr__(name: str) -> Any:
    if name == "attention":  # deprecated: see CHANGELOG.md
        warnings.warn(
            "jmp_lite.flax.nnx.attention is deprecated and will be removed: under apply_policy, "
            "nnx.dot_product_attention and nnx.MultiHeadAttention already run with a float32 softmax, and "
            "plain attention runs as jmp_lite.attention.dot_product_attention (no T x T array), which "
            "you can also call directly",
            DeprecationWarning,
            stacklevel=2,
        )
        from jmp_lite._src.flax.nnx_attention import attention

        return attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
