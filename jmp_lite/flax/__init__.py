"""Flax integration: a ``Policy`` for a whole Linen model, and a skip-safe ``TrainState``."""

from jmp_lite.flax.linen import DEFAULT_FLOAT32_MODULES, PolicyApplied, apply_policy
from jmp_lite.flax.train_state import TrainState

__all__ = ["DEFAULT_FLOAT32_MODULES", "PolicyApplied", "TrainState", "apply_policy"]
