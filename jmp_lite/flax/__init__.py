"""Flax integration: a ``Policy`` for a whole Linen or NNX model, and skip-safe training state.

Linen: ``jmp_lite.flax.linen.apply_policy`` and ``TrainState``. NNX:
``jmp_lite.flax.nnx.apply_policy`` and ``LossScaledOptimizer``. The Linen names
``apply_policy``, ``PolicyApplied`` and ``DEFAULT_FLOAT32_MODULES`` are also
reachable here for older code; they are deprecated at this path.

Importing ``jmp_lite.flax`` registers the loss scales with ``flax.serialization``
(``import jmp_lite`` alone never imports flax and installs no import hook).
"""

from jmp_lite._src.base.exports import moved as _moved
from jmp_lite._src.flax import serialization as _serialization  # noqa: F401  (registers the loss scales)
from jmp_lite.flax import linen, nnx
from jmp_lite.flax.nnx import LossScaledOptimizer
from jmp_lite.flax.train_state import TrainState

__all__ = [
    "LossScaledOptimizer",
    "TrainState",
    "linen",
    "nnx",
]

__getattr__ = _moved(
    __name__,
    ("DEFAULT_FLOAT32_MODULES", "PolicyApplied", "apply_policy"),
    linen,
    "jmp_lite.flax.{name} is the Linen one and is deprecated at this path; use jmp_lite.flax.linen.{name} "
    "(or jmp_lite.flax.nnx.{name} for NNX)",
)
