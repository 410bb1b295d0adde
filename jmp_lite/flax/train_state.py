"""Flax Linen ``TrainState`` that skips non-finite steps."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.flax.train_state import TrainState

__all__ = [
    "TrainState",
]

_export(__name__, globals(), __all__)
