"""Flax integration: a ``Policy`` for a whole Linen or NNX model, and skip-safe training state.

Linen: ``apply_policy`` and ``TrainState`` (in ``jmp_lite.flax.linen`` and
``jmp_lite.flax.train_state``). NNX: ``jmp_lite.flax.nnx.apply_policy`` and
``LossScaledOptimizer``.
"""

from jmp_lite.flax import nnx
from jmp_lite.flax.linen import DEFAULT_FLOAT32_MODULES, PolicyApplied, apply_policy
from jmp_lite.flax.nnx import LossScaledOptimizer
from jmp_lite.flax.train_state import TrainState

__all__ = [
    "DEFAULT_FLOAT32_MODULES",
    "LossScaledOptimizer",
    "PolicyApplied",
    "TrainState",
    "apply_policy",
    "nnx",
]
