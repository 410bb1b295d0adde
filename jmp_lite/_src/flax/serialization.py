"""``flax.serialization`` support for the loss scales, registered when ``jmp_lite.flax`` is imported.

``import jmp_lite`` never imports flax, and installs no import hook: the three
loss-scale classes are registered with ``flax.serialization`` by importing
``jmp_lite.flax`` (which imports this module), the module Flax users import
for ``TrainState`` and ``LossScaledOptimizer`` anyway. A program that uses
``flax.serialization.to_bytes`` on a loss-scaled optimizer state without
``import jmp_lite.flax`` gets flax's own ``can not serialize`` error when
saving, and restoring into an unregistered target gives a state whose
``loss_scale`` is a dict, which ``loss_scaling`` refuses with a message naming
``import jmp_lite.flax``. orbax needs no registration: the loss scales are
pytrees.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import serialization

from jmp_lite._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, _new


def _restore_static(target: StaticLossScale, state: dict[str, Any]) -> StaticLossScale:
    return _new(StaticLossScale, loss_scale=jnp.asarray(state["loss_scale"]))


def _restore_dynamic(target: DynamicLossScale, state: dict[str, Any]) -> DynamicLossScale:
    return _new(
        DynamicLossScale,
        **{
            **target.__dict__,
            "loss_scale": jnp.asarray(state["loss_scale"], jnp.float32),
            "counter": jnp.asarray(state["counter"], jnp.int32),
        },
    )


# override=True: a reload of this module re-registers harmlessly.
serialization.register_serialization_state(
    NoOpLossScale, lambda x: {}, lambda target, state: target, override=True
)
serialization.register_serialization_state(
    StaticLossScale, lambda x: {"loss_scale": x.loss_scale}, _restore_static, override=True
)
serialization.register_serialization_state(
    DynamicLossScale,
    lambda x: {"loss_scale": x.loss_scale, "counter": x.counter},
    _restore_dynamic,
    override=True,
)
