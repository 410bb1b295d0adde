"""A Linen ``TrainState`` whose ``apply_gradients`` goes through ``loss_scaling``.

The apply-or-keep decision is ``jmp_lite.apply_scaled_gradients``'s. On a
skipped (non-finite) step nothing that belongs to training moves: not the
params, not the optimizer state, not the ``step`` counter that drives
schedules, and not the mutable collections such as ``batch_stats`` passed back
in ``model_state`` (or as any other field given to ``apply_gradients``). Only
the loss-scale state changes. Flax's fp8 ``_overwrite_with_gradient`` collection carries new fp8
scales rather than gradients, so it is never unscaled or given to ``tx``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jmp_lite._src.loss_scale import LossScale, NoOpLossScale, keep_if_skipped
from jmp_lite._src.loss_scaling import _find_states
from jmp_lite._src.step import _apply_scaled, _checked_state, _last_step_applied

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _split(tree: Any) -> tuple[Any, Any]:
    """(trainable part, overwrite-with-gradient part or None)."""
    if isinstance(tree, dict) and OVERWRITE_WITH_GRADIENT in tree:
        return tree["params"], tree[OVERWRITE_WITH_GRADIENT]
    return tree, None


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with loss-scaled, skip-safe updates.

    With a ``tx`` containing one ``jmp_lite.loss_scaling``, ``apply_gradients``
    takes the gradients of the scaled loss (``state.loss_scale.scale(loss)``)
    and skips non-finite steps. Keep the non-gradient collections
    (``batch_stats``...) in ``model_state`` and pass the updated ones to
    ``apply_gradients``; any field passed there is kept on skipped steps. With a
    plain optax ``tx`` (float32 or bfloat16 runs) it behaves as Flax's
    ``TrainState``, and ``loss_scale`` is a ``NoOpLossScale``. As Flax's,
    ``apply_gradients`` returns the new state; ``new_state.last_step_applied``
    says whether the step was applied (``False``: skipped).

    Example:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jmp_lite
        >>> from jmp_lite.flax import TrainState
        >>> model = nn.Dense(2)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 10))
        >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        >>> grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)
        >>> skipped = state.apply_gradients(grads=grads)
        >>> int(skipped.step), float(skipped.loss_scale.loss_scale), bool(skipped.last_step_applied)
        (0, 512.0, False)
    """

    model_state: Any = struct.field(default_factory=dict)

    @classmethod
    def create(
        cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation, **kwargs: Any
    ) -> TrainState:
        """Like Flax's ``TrainState.create``; refuses a ``tx`` whose loss scaling cannot skip safely."""
        trainable, _ = _split(params)
        opt_state = tx.init(trainable)
        if _find_states(opt_state):
            try:
                _checked_state(opt_state)
            except ValueError as e:
                raise ValueError(f"jmp_lite.flax.TrainState: {e}") from None
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state, **kwargs)

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale; multiply the loss by it (``state.loss_scale.scale(loss)``)."""
        found = _find_states(self.opt_state)
        return found[0].loss_scale if found else NoOpLossScale()

    @property
    def last_step_applied(self) -> jax.Array:
        """A bool scalar: whether the ``apply_gradients`` that returned this state applied its step.

        ``False`` after a skipped (non-finite) step; ``True`` after an applied one,
        on a fresh state, and always with a plain optax ``tx``. Read it inside
        ``jit`` or on the returned state (``state.last_step_applied``).
        """
        return _last_step_applied(self.opt_state)

    def apply_gradients(self, *, grads: Any, model_state: Any = None, **kwargs: Any) -> TrainState:
        """Unscale, check, update; on a non-finite step keep everything but the loss scale."""
        trainable, overwrite = _split(self.params)
        grads_trainable, grads_overwrite = _split(grads)
        _, new_params, opt_state, finite = _apply_scaled(self.tx, grads_trainable, self.opt_state, trainable)
        keep = functools.partial(keep_if_skipped, finite)
        if overwrite is not None:
            new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: keep(grads_overwrite, overwrite)}
        new_model_state = self.model_state if model_state is None else keep(model_state, self.model_state)
        # Other fields (Flax's `batch_stats=` in a subclass) are kept too: no NaN written on a skip.
        data = {f.name for f in dataclasses.fields(self) if f.metadata.get("pytree_node", True)}
        kept = {k: keep(v, getattr(self, k)) if k in data else v for k, v in kwargs.items()}
        return self.replace(
            step=self.step + finite.astype(jnp.asarray(self.step).dtype),
            params=new_params,
            opt_state=opt_state,
            model_state=new_model_state,
            **kept,
        )
