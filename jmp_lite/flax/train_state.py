"""A Linen ``TrainState`` whose ``apply_gradients`` goes through ``loss_scaling``.

On a skipped (non-finite) step nothing that belongs to training moves: not the
params, not the optimizer state (``loss_scaling`` guarantees both), not the
``step`` counter that drives schedules, and not the mutable collections such
as ``batch_stats`` passed back in ``model_state``. Only the loss-scale state
changes. Flax's fp8 ``_overwrite_with_gradient`` collection carries new fp8
scales rather than gradients, so it is never unscaled or given to ``tx``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jmp_lite.flax._skip import keep_optimizer_state
from jmp_lite.loss_scale import LossScale
from jmp_lite.optax_transform import get_loss_scaling_state

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _split(tree: Any) -> tuple[Any, Any]:
    """(trainable part, overwrite-with-gradient part or None)."""
    if isinstance(tree, dict) and OVERWRITE_WITH_GRADIENT in tree:
        return tree["params"], tree[OVERWRITE_WITH_GRADIENT]
    return tree, None


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with loss-scaled, skip-safe updates.

    ``tx`` must contain a ``jmp_lite.loss_scaling`` transformation. Keep the
    non-gradient collections (``batch_stats``...) in ``model_state`` and pass
    the updated ones to ``apply_gradients``; they are kept on skipped steps.

    Example:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jmp_lite
        >>> from jmp_lite.flax import TrainState
        >>> model = nn.Dense(2)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 10))
        >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        >>> grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)
        >>> skipped = state.apply_gradients(grads=grads)
        >>> int(skipped.step), float(skipped.loss_scale.loss_scale)
        (0, 512.0)
    """

    model_state: Any = struct.field(default_factory=dict)

    @classmethod
    def create(
        cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation, **kwargs: Any
    ) -> TrainState:
        """Like Flax's ``TrainState.create``; checks that ``tx`` does loss scaling."""
        trainable, _ = _split(params)
        opt_state = tx.init(trainable)
        try:
            get_loss_scaling_state(opt_state)
        except ValueError:
            raise TypeError(
                "jmp_lite.flax.TrainState needs tx to contain exactly one jmp_lite.loss_scaling(...) "
                "transformation, e.g. "
                "tx=jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**15))"
            ) from None
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state, **kwargs)

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale; multiply the loss by it (``state.loss_scale.scale(loss)``)."""
        return get_loss_scaling_state(self.opt_state).loss_scale

    def apply_gradients(self, *, grads: Any, model_state: Any = None, **kwargs: Any) -> TrainState:
        """Unscale, check, update; on a non-finite step keep everything but the loss scale."""
        trainable, overwrite = _split(self.params)
        grads_trainable, grads_overwrite = _split(grads)
        updates, opt_state = self.tx.update(grads_trainable, self.opt_state, trainable)
        finite = get_loss_scaling_state(opt_state).last_grads_finite
        if finite is None:  # NoOpLossScale without checks: always apply
            finite = jnp.array(True)
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_params = optax.apply_updates(trainable, updates)
        if overwrite is not None:
            new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: keep(grads_overwrite, overwrite)}
        new_model_state = self.model_state if model_state is None else keep(model_state, self.model_state)
        return self.replace(
            step=self.step + finite.astype(jnp.asarray(self.step).dtype),
            params=new_params,
            opt_state=keep_optimizer_state(opt_state, self.opt_state, finite),
            model_state=new_model_state,
            **kwargs,
        )
