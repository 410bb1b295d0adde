"""Losses that keep a large vocabulary's logits out of memory: ``fused_linear_cross_entropy``."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.kernels.losses import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]

_export(__name__, globals(), __all__)
