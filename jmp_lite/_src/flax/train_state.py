"""A Linen ``TrainState`` whose ``apply_gradients`` goes through ``loss_scaling``.

The apply-or-keep decision is ``jmp_lite.apply_scaled_gradients``'s. On a
skipped (non-finite) step nothing that belongs to training moves: not the
params, not the optimizer state, not the ``step`` counter that drives
schedules, and not the mutable collections such as ``batch_stats`` passed back
in ``model_state`` (or as any other field given to ``apply_gradients``). Only
the loss-scale state changes. Flax's fp8 ``_overwrite_with_gradient`` collection carries new fp8
scales rather than gradients, so it is never unscaled or given to ``tx``.

jmp_lite's own fp8 states (the ``"fp8"`` collection of ``apply_policy(..., fp8=...)`` with delayed
scaling) ride along the same way: ``params={"params": ..., "fp8": ...}``; their "gradient" is the amaxes
the step observed, which go to ``jmp_lite.fp8.update_fp8_state`` (``step._fp8_update``), never to ``tx``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jmp_lite._src.flax.linen import FP8_COLLECTION
from jmp_lite._src.fp8.fp8 import as_fp8_recipe
from jmp_lite._src.optim.loss_scale import LossScale, NoOpLossScale, keep_if_skipped
from jmp_lite._src.optim.loss_scaling import _find_states
from jmp_lite._src.optim.step import (
    _apply_scaled,
    _checked_state,
    _fp8_pending,
    _fp8_update,
    _last_step_applied,
    _skipped_total,
)

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _split(tree: Any) -> tuple[Any, Any, Any]:
    """(trainable part, overwrite-with-gradient part or None, jmp_lite fp8 states or None)."""
    if (
        isinstance(tree, Mapping)
        and "params" in tree
        and {OVERWRITE_WITH_GRADIENT, FP8_COLLECTION} & set(tree)
    ):
        return tree["params"], tree.get(OVERWRITE_WITH_GRADIENT), tree.get(FP8_COLLECTION)
    return tree, None, None


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

    fp8 with delayed scaling: give ``params=variables`` (``{"params": ..., "fp8": ...}`` from
    ``apply_policy(..., fp8=...).init``), differentiate the loss with respect to all of it
    (``jmp_lite.value_and_grad(loss_fn)(state, state.params, ...)``) and pass those gradients
    on: ``grads["fp8"]`` holds the amaxes the step observed, and ``apply_gradients`` makes the
    next fp8 state from them (``update_fp8_state`` with the recipe of ``apply_fn``'s model, or
    ``fp8_recipe=``), max-reduced over ``fp8_axis_name`` replicas (``pmap``), max-combined over
    ``optax.MultiSteps`` microbatches (kept in ``fp8_observed`` until the inner step), and kept
    unchanged on a skipped step. ``tx`` never sees them.

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
    fp8_observed: Any = None  # the amaxes of MultiSteps microbatches not yet applied (zeros otherwise)
    fp8_recipe: Any = struct.field(pytree_node=False, default=None)
    fp8_axis_name: Any = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Any,
        params: Any,
        tx: optax.GradientTransformation,
        fp8_recipe: Any = None,
        fp8_axis_name: Any = None,
        **kwargs: Any,
    ) -> TrainState:
        """Like Flax's ``TrainState.create``; refuses a ``tx`` whose loss scaling cannot skip safely.

        With fp8 states in ``params`` (``params["fp8"]``), ``fp8_recipe`` defaults to the recipe of
        ``apply_fn``'s model (``PolicyApplied.apply``); ``fp8_axis_name`` is the ``pmap`` axis their
        amaxes are max-reduced over.
        """
        trainable, _, fp8 = _split(params)
        if fp8 is not None:
            fp8_recipe = fp8_recipe or getattr(getattr(apply_fn, "__self__", None), "fp8_recipe", None)
            if fp8_recipe is None:
                raise ValueError(
                    "jmp_lite.flax.TrainState: params hold fp8 states but no recipe is known: use "
                    "apply_fn=model.apply of the apply_policy(..., fp8=...) model, or pass fp8_recipe="
                )
            fp8_recipe = as_fp8_recipe(fp8_recipe, "TrainState.create's fp8_recipe")
            kwargs["fp8_observed"] = _fp8_pending(fp8)
        opt_state = tx.init(trainable)
        if _find_states(opt_state):
            try:
                _checked_state(opt_state)
            except ValueError as e:
                raise ValueError(f"jmp_lite.flax.TrainState: {e}") from None
        return cls(
            # An int32 array, not Flax's Python 0: the step it returns is one, so a jitted step whose first
            # call got a weakly typed 0 would compile again at the second.
            step=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            fp8_recipe=fp8_recipe,
            fp8_axis_name=fp8_axis_name,
            **kwargs,
        )

    def __jmp_lite_loss_scale__(self) -> LossScale:
        """The protocol ``jmp_lite.value_and_grad`` reads the scale through."""
        return self.loss_scale

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

    @property
    def skipped_total(self) -> jax.Array:
        """An int32 scalar: the steps skipped since ``create`` (``0`` when nothing is checked, as in
        ``LossScaledOptimizer.skipped_total``; the raw ``LossScalingState`` field is ``None`` then)."""
        return _skipped_total(self.opt_state)

    def apply_gradients(self, *, grads: Any, model_state: Any = None, **kwargs: Any) -> TrainState:
        """Unscale, check, update; on a non-finite step keep everything but the loss scale.

        ``grads["fp8"]`` (the observed amaxes, when ``params`` holds fp8 states) updates the fp8 states.
        """
        trainable, overwrite, fp8 = _split(self.params)
        grads_trainable, grads_overwrite, observed = _split(grads)
        if fp8 is not None and observed is None:
            raise ValueError(
                "jmp_lite.flax.TrainState.apply_gradients: params hold fp8 states but grads have no "
                f"{FP8_COLLECTION!r} entry, so their scales would never move: differentiate the loss with "
                "respect to all of state.params ({'params': ..., 'fp8': ...}), e.g. "
                "jmp_lite.value_and_grad(loss_fn)(state, state.params, batch)"
            )
        old_opt_state = self.opt_state
        _, new_params, opt_state, finite = _apply_scaled(self.tx, grads_trainable, self.opt_state, trainable)
        keep = functools.partial(keep_if_skipped, finite)
        fp8_fields = {}
        if overwrite is not None or fp8 is not None:
            new_params = {"params": new_params}
        if overwrite is not None:
            new_params[OVERWRITE_WITH_GRADIENT] = keep(grads_overwrite, overwrite)
        if fp8 is not None:
            new_params[FP8_COLLECTION], fp8_fields["fp8_observed"] = _fp8_update(
                fp8, self.fp8_observed, observed, self.fp8_recipe, finite, old_opt_state, opt_state,
                self.fp8_axis_name,
            )  # fmt: skip
        new_model_state = self.model_state if model_state is None else keep(model_state, self.model_state)
        # Other fields (Flax's `batch_stats=` in a subclass) are kept too: no NaN written on a skip.
        data = {f.name for f in dataclasses.fields(self) if f.metadata.get("pytree_node", True)}
        kept = {k: keep(v, getattr(self, k)) if k in data else v for k, v in kwargs.items()}
        return self.replace(
            step=self.step + finite.astype(jnp.asarray(self.step).dtype),
            params=new_params,
            opt_state=opt_state,
            model_state=new_model_state,
            **fp8_fields,
            **kept,
        )
