"""The ``loss_scaling`` optax transformation and helpers to read its state."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.optim.loss_scaling import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    LossScalingState,
    SkipLimitReachedError,
    SkipReport,
    TinyGradientsState,
    describe_skip,
    get_loss_scale,
    get_loss_scaling_state,
    loss_scaling,
    raise_if_skip_limit_reached,
)

__all__ = [
    "DEFAULT_MAX_CONSECUTIVE_SKIPS",
    "LossScalingState",
    "SkipLimitReachedError",
    "SkipReport",
    "TinyGradientsState",
    "describe_skip",
    "get_loss_scale",
    "get_loss_scaling_state",
    "loss_scaling",
    "raise_if_skip_limit_reached",
]

_export(__name__, globals(), __all__)
