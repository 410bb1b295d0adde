"""``flax.serialization`` support for the loss scales, registered when ``jmp_lite.flax`` is imported.

``import jmp_lite`` never imports flax and installs no import hook: importing
``jmp_lite.flax`` (which Flax users do for ``TrainState`` and
``LossScaledOptimizer`` anyway) imports this module, which registers the three
loss-scale classes. Without it, ``flax.serialization.to_bytes`` of a loss-scaled
state fails with flax's own ``can not serialize`` error, and a state restored
into an unregistered target holds a dict, which ``loss_scaling`` refuses with a
message naming ``import jmp_lite.flax``. orbax needs no registration (the loss
scales are pytrees; ``DynamicLossScale.adjust`` clamps what a restore brings in).

A restore is validated like a constructor, against the *target's*
hyperparameters: a checkpoint of another loss-scale type is refused with both
types named; a scale that is not positive and finite, or a counter that is not
a whole number >= 0, is refused; a scale outside the target's
``[min_loss_scale, max_loss_scale]`` or a counter at or past its ``period`` (the
target's hyperparameters changed since the save) is clamped, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import serialization

from jmp_lite._src import validate
from jmp_lite._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, _new

# What each class saves: the saved type is read from the keys.
_KEYS = {
    NoOpLossScale: frozenset(),
    StaticLossScale: frozenset({"loss_scale"}),
    DynamicLossScale: frozenset({"loss_scale", "counter"}),
}


def _checked(target: Any, state: Any) -> str:
    """Refuses a saved state of another loss-scale type; returns the path for messages."""
    path = serialization.current_path() or "."
    keys = frozenset(state) if isinstance(state, dict) else None
    if keys != _KEYS[type(target)]:
        saved = next((cls.__name__ for cls, k in _KEYS.items() if k == keys), None)
        what = f"a {saved}" if saved else f"{type(state).__name__} {sorted(keys) if keys else state!r}"
        raise ValueError(
            f"flax.serialization: the checkpoint holds {what} at {path!r}, but the restore target there is "
            f"a {type(target).__name__}; restore into a target built with the loss-scale type that was saved "
            f"({saved or 'NoOpLossScale, StaticLossScale or DynamicLossScale'})"
        )
    return path


def _restore_noop(target: NoOpLossScale, state: Any) -> NoOpLossScale:
    _checked(target, state)
    return target


def _restore_static(target: StaticLossScale, state: Any) -> StaticLossScale:
    path = _checked(target, state)
    scale = validate.positive_scale(
        state["loss_scale"], f"the restored StaticLossScale.loss_scale at {path!r}"
    )
    return _new(StaticLossScale, loss_scale=scale)


def _restore_dynamic(target: DynamicLossScale, state: Any) -> DynamicLossScale:
    path = _checked(target, state)
    what = f"the restored DynamicLossScale at {path!r}"
    scale = float(validate.positive_scale(state["loss_scale"], f"{what}: loss_scale"))
    counter = validate.whole_number(state["counter"], f"{what}: counter", low=0)
    low, high = max(target.min_loss_scale, validate.F32_TINY), target.max_loss_scale
    clamped = (min(max(scale, low), high), min(counter, target.period - 1))
    if clamped != (scale, counter):
        warnings.warn(
            f"{what} has loss_scale={scale!r}, counter={counter}, outside the target's "
            f"[min_loss_scale, max_loss_scale] = [{target.min_loss_scale!r}, {high!r}] or [0, period) = "
            f"[0, {target.period}); restored clamped into them: "
            f"loss_scale={clamped[0]!r}, counter={clamped[1]}",
            stacklevel=2,
        )
    return _new(
        DynamicLossScale,
        **{
            **target.__dict__,
            "loss_scale": jnp.asarray(np.float32(clamped[0])),
            "counter": jnp.asarray(clamped[1], jnp.int32),
        },
    )


# override=True: a reload of this module re-registers harmlessly.
serialization.register_serialization_state(NoOpLossScale, lambda x: {}, _restore_noop, override=True)
serialization.register_serialization_state(
    StaticLossScale, lambda x: {"loss_scale": x.loss_scale}, _restore_static, override=True
)
serialization.register_serialization_state(
    DynamicLossScale,
    lambda x: {"loss_scale": x.loss_scale, "counter": x.counter},
    _restore_dynamic,
    override=True,
)
