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

from jmp_lite._src.base import validate
from jmp_lite._src.optim.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, _new

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


def _replicas(saved: Any, target: Any, what: str) -> tuple[Any, tuple[int, ...]]:
    """The one value of a saved field and the target's shape for it.

    A pmap-replicated state holds one copy per device (shape ``(N,)``): the copies must agree, and the
    restore keeps the target's shape, so a replicated target restores replicated.
    """
    value, shape = np.asarray(saved), np.shape(target)
    if value.shape != shape:
        raise ValueError(
            f"{what} has shape {value.shape}, but the restore target's has shape {shape}: restore into a "
            "target of the saved layout (a scalar, or one copy per device for a pmap-replicated state)"
        )
    copies = np.unique(value)
    if copies.size > 1:
        raise ValueError(
            f"{what} holds {copies.size} different values across its {value.size} replicas "
            f"({copies[:4].tolist()}...); a replicated loss scale must agree on every device"
        )
    return (value.reshape(-1)[0] if value.size else value), shape


def _restore_noop(target: NoOpLossScale, state: Any) -> NoOpLossScale:
    _checked(target, state)
    return target


def _restore_static(target: StaticLossScale, state: Any) -> StaticLossScale:
    path = _checked(target, state)
    what = f"the restored StaticLossScale.loss_scale at {path!r}"
    scale, shape = _replicas(state["loss_scale"], target.loss_scale, what)
    scale = validate.positive_scale(scale, what)
    return _new(StaticLossScale, loss_scale=jnp.broadcast_to(scale, shape) if shape else scale)


def _restore_dynamic(target: DynamicLossScale, state: Any) -> DynamicLossScale:
    path = _checked(target, state)
    what = f"the restored DynamicLossScale at {path!r}"
    scale, shape = _replicas(state["loss_scale"], target.loss_scale, f"{what}: loss_scale")
    counter, counter_shape = _replicas(state["counter"], target.counter, f"{what}: counter")
    scale = float(validate.positive_scale(scale, f"{what}: loss_scale"))
    counter = validate.whole_number(counter, f"{what}: counter", low=0)
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
            "loss_scale": jnp.broadcast_to(jnp.asarray(np.float32(clamped[0])), shape),
            "counter": jnp.broadcast_to(jnp.asarray(clamped[1], jnp.int32), counter_shape),
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
