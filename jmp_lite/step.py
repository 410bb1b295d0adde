"""One skip-safe optimizer step (``apply_scaled_gradients``), ``scale_loss_fn`` and ``value_and_grad``."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.optim.scaled_grad import value_and_grad
from jmp_lite._src.optim.step import apply_scaled_gradients, scale_loss_fn

__all__ = [
    "apply_scaled_gradients",
    "scale_loss_fn",
    "value_and_grad",
]

_export(__name__, globals(), __all__)
