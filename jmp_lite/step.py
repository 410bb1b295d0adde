"""One skip-safe optimizer step (``apply_scaled_gradients``) and ``scale_loss_fn``."""

from jmp_lite._src.exports import export as _export
from jmp_lite._src.step import apply_scaled_gradients, scale_loss_fn

__all__ = [
    "apply_scaled_gradients",
    "scale_loss_fn",
]

_export(__name__, globals(), __all__)
