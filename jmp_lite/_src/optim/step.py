"""``apply_scaled_gradients``: the one place that decides whether a loss-scaled step applies.

Linen's ``jmp_lite.flax.TrainState``, NNX's ``LossScaledOptimizer`` and plain
optax loops all call it, so the three cannot disagree about what a skipped
step keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src.base import validate
from jmp_lite._src.fp8.fp8 import Fp8Recipe, Fp8State, update_fp8_state
from jmp_lite._src.optim.loss_scale import LossScale, check_loss_scale, keep_if_skipped
from jmp_lite._src.optim.loss_scaling import (
    LossScalingState,
    _find_states,
    _no_update_unless,
    get_loss_scaling_state,
)

# Wrappers that do not call their inner update on every step: the finiteness
# flag of a loss_scaling inside them is stale on the steps they skip or
# accumulate, and a non-finite micro-gradient would already sit in their state.
_STALE_WRAPPERS: tuple[type, ...] = (
    optax.MultiStepsState,
    optax.ApplyIfFiniteState,
    optax.ConditionallyTransformState,
    optax.ConditionallyMaskState,
)

_NESTING_HINT = (
    "put loss_scaling outermost instead, e.g. "
    "jmp_lite.loss_scaling(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4), "
    "jmp_lite.DynamicLossScale(2.0**15))"
)


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScalingState)


def _check_nesting(opt_state: Any) -> None:
    """Refuses a ``loss_scaling`` state that sits inside a wrapper that does not update every step."""

    def visit(node: Any, wrapper: str | None) -> None:
        if _is_state(node):
            if wrapper is not None:
                raise ValueError(
                    f"jmp_lite.loss_scaling is inside {wrapper}, which does not run it on every step, so a "
                    f"skipped step could not be told from an applied one; {_NESTING_HINT}"
                )
            return
        if isinstance(node, _STALE_WRAPPERS):
            wrapper = f"optax.{type(node).__name__.removesuffix('State')}"
        children = jax.tree_util.tree_leaves(
            node, is_leaf=lambda x: x is not node and (_is_state(x) or isinstance(x, _STALE_WRAPPERS))
        )
        if len(children) == 1 and children[0] is node:
            return  # an array leaf
        for child in children:
            visit(child, wrapper)

    visit(opt_state, None)


def _checked_state(opt_state: Any) -> LossScalingState:
    """The one ``loss_scaling`` state in ``opt_state``; refuses chains that cannot skip safely.

    ``ValueError`` (naming the right nesting) when there is no ``loss_scaling``,
    more than one, or one inside ``optax.MultiSteps``, ``optax.apply_if_finite``
    or ``optax.conditionally_transform``/``conditionally_mask``.
    """
    state = get_loss_scaling_state(opt_state)
    _check_nesting(opt_state)
    return state


def _keep_optimizer_state(new: Any, old: Any, finite: jax.Array) -> Any:
    """``new`` if ``finite``, else ``old`` everywhere but the ``loss_scaling`` state (always ``new``)."""

    def keep(n: Any, o: Any) -> Any:
        # loss_scaling already kept its inner state; its scale and counters must move.
        return n if _is_state(n) else keep_if_skipped(finite, n, o)

    return jax.tree_util.tree_map(keep, new, old, is_leaf=_is_state)


def _last_step_applied(opt_state: Any) -> jax.Array:
    """Whether the step that returned ``opt_state`` applied (``True`` when nothing is checked)."""
    found = _find_states(opt_state)
    flag = found[0].last_grads_finite if found else None
    return jnp.array(True) if flag is None else flag


def _skipped_total(opt_state: Any) -> jax.Array:
    """Steps skipped since ``init``: ``0`` when nothing is checked (no step can be skipped then, and the
    unchecked ``LossScalingState`` holds ``None`` so as to add no arrays)."""
    found = _find_states(opt_state)
    total = found[0].skipped_total if found else None
    return jnp.zeros([], jnp.int32) if total is None else total


def apply_scaled_gradients(
    tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any, jax.Array]:
    """One loss-scaled optimizer step: unscale, check, and apply or keep.

    ``grads`` are the gradients of the *scaled* loss
    (``get_loss_scale(opt_state).scale(loss)``) and ``tx`` contains one
    ``jmp_lite.loss_scaling``. With ``finite`` the all-replica finiteness of the
    unscaled gradients (Micikevicius et al., 2018, "Mixed Precision Training"):

    * ``finite``: ``new_params = optax.apply_updates(params, u)`` and
      ``new_opt_state`` as ``tx.update`` returns them, exactly the plain optax step;
    * otherwise ``new_params == params`` and ``new_opt_state == opt_state`` bit
      for bit, except the ``loss_scaling`` state's loss scale and skip counters.

    When ``tx`` *is* the ``loss_scaling`` transformation (the recommended
    ``loss_scaling(optax.chain(...), scale)``), the skipped step's updates are
    ``-0.0`` and ``p + (-0.0) == p`` for every ``p``, so nothing is selected or
    copied. When ``loss_scaling`` is one element of a chain, the elements after
    it (``optax.add_decayed_weights``, a schedule's count) would still move
    params and state: the updates are made ``-0.0`` and the state is kept with
    ``keep_if_skipped`` (one select each).
    Chains that cannot be made safe are refused with a ``ValueError`` that shows
    the right nesting (``loss_scaling`` inside ``optax.MultiSteps``,
    ``apply_if_finite`` or ``conditionally_transform``; none, or two nested).

    Args:
        tx: the optax transformation containing ``jmp_lite.loss_scaling``.
        grads: gradients of the scaled loss, same structure as ``params``.
        opt_state: ``tx``'s state.
        params: the parameters the gradients were taken at.
        **extra_args: forwarded to ``tx.update`` (e.g. ``value=`` for line searches).

    Returns:
        ``(new_params, new_opt_state, grads_finite)``; ``grads_finite`` is a bool
        scalar (``True`` when ``loss_scaling`` does not check finiteness).

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> tx = optax.chain(
        ...     jmp_lite.loss_scaling(optax.scale_by_adam(), jmp_lite.DynamicLossScale(16.0)),
        ...     optax.add_decayed_weights(0.1),
        ...     optax.scale(-1.0),
        ... )
        >>> params = {"w": jnp.ones(2)}
        >>> opt_state = tx.init(params)
        >>> step = jax.jit(lambda g, s, p: jmp_lite.apply_scaled_gradients(tx, g, s, p))
        >>> new_params, opt_state, finite = step({"w": jnp.array([jnp.inf, 1.0])}, opt_state, params)
        >>> new_params["w"], bool(finite), float(jmp_lite.get_loss_scale(opt_state).loss_scale)
        (Array([1., 1.], dtype=float32), False, 8.0)
    """
    tx = validate.gradient_transformation(tx, "apply_scaled_gradients.tx")
    _checked_state(opt_state)
    _, new_params, new_opt_state, finite = _apply_scaled(tx, grads, opt_state, params, **extra_args)
    return new_params, new_opt_state, finite


def _apply_scaled(
    tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any, Any, jax.Array]:
    """``apply_scaled_gradients`` on a checked state, also returning the updates it applied.

    The updates are ``-0.0`` on a skipped step. A ``tx`` without ``loss_scaling``
    (Linen's ``TrainState`` and NNX's ``LossScaledOptimizer`` take one) gives the
    plain optax step, and every step applies.
    """
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
    found = _find_states(new_opt_state)
    finite = found[0].last_grads_finite if found else None
    if finite is None:  # no loss_scaling, or loss_scaling(check_finite=False): every step applies
        finite = jnp.array(True)
    elif not _is_state(new_opt_state):
        # loss_scaling is one element of a chain: what follows it still moved the updates and its state.
        # (Outermost, its -0.0 updates keep params bitwise and its cond/select kept the state.)
        updates = _no_update_unless(finite, updates)
        new_opt_state = _keep_optimizer_state(new_opt_state, opt_state, finite)
    return updates, optax.apply_updates(params, updates), new_opt_state, finite


def scale_loss_fn(
    fn: Callable[..., Any], loss_scale: LossScale, *, has_aux: bool = False
) -> Callable[..., Any]:
    """``fn`` with only its loss multiplied by ``loss_scale``, for ``jax.grad(..., has_aux=True)``.

    The returned function gives ``(loss_scale.scale(loss), (loss, aux))`` when
    ``has_aux`` (``fn`` returns ``(loss, aux)``), else ``(loss_scale.scale(loss), loss)``.
    Only the differentiated output is scaled (Micikevicius et al., 2018, "Mixed
    Precision Training"): the aux outputs (``batch_stats``, metrics) and the
    returned ``loss`` stay as ``fn`` computed them, unlike
    ``lambda p: ls.scale(fn(p))``, which would scale them too. Differentiate it
    with ``has_aux=True`` in both cases. It takes any arguments ``fn`` takes, so
    the same call works for ``nnx.grad`` on an NNX model.

    Args:
        fn: the loss function.
        loss_scale: the current ``LossScale`` (``get_loss_scale(opt_state)``,
            ``state.loss_scale``, ``optimizer.loss_scale``).
        has_aux: whether ``fn`` returns ``(loss, aux)``.

    Returns:
        The scaled loss function.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def loss_fn(w):
        ...     return jnp.sum(w**2), {"max": jnp.max(w)}
        >>> scaled = jmp_lite.scale_loss_fn(loss_fn, jmp_lite.StaticLossScale(1024.0), has_aux=True)
        >>> grads, (loss, aux) = jax.grad(scaled, has_aux=True)(jnp.ones(2))
        >>> grads, float(loss), float(aux["max"])
        (Array([2048., 2048.], dtype=float32), 2.0, 1.0)
    """
    validate.function(fn, "scale_loss_fn.fn")
    check_loss_scale(loss_scale, "scale_loss_fn.loss_scale")
    return _scaled_loss_fn(fn, loss_scale, validate.flag(has_aux, "scale_loss_fn.has_aux"))


def _scaled_loss_fn(fn: Callable[..., Any], loss_scale: LossScale, has_aux: bool) -> Callable[..., Any]:
    """``scale_loss_fn`` for arguments that are already validated."""

    @functools.wraps(fn)
    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(f"with has_aux=True fn must return (loss, aux), got {type(out).__name__}")
            loss, aux = out
            return loss_scale.scale(loss), (loss, aux)
        return loss_scale.scale(out), out

    return scaled


def _is_fp8_state(x: Any) -> bool:
    return isinstance(x, Fp8State)


def _fp8_pending(states: Any) -> Any:
    """Zeros in the shape of each state's amaxes: no microbatch observed yet."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros_like(s.fp8_amax), states, is_leaf=_is_fp8_state)


def _gradient_step(opt_state: Any) -> Any:
    """The ``gradient_step`` count of the (first) ``optax.MultiSteps`` in ``opt_state``; ``None`` without."""
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_multi) if is_multi(x)]
    return found[0].gradient_step if found else None


def _fp8_update(
    states: Any,
    pending: Any,
    observed: Any,
    recipe: Fp8Recipe,
    finite: jax.Array,
    old_opt_state: Any,
    new_opt_state: Any,
    axis_name: Any = None,
) -> tuple[Any, Any]:
    """The fp8 half of a training step: ``(new states, new pending)`` (the wrappers' one rule).

    ``observed`` (the states' cotangents: this step's amaxes) is max-combined with ``pending`` (the
    microbatches ``optax.MultiSteps`` has accumulated so far, zeros otherwise). When the inner optimizer
    step happens (every step, or when ``MultiSteps`` counts a gradient step) the states are updated with
    it (max-reduced over ``axis_name``) and ``pending`` is reset; a step ``loss_scaling`` skips changes
    neither (``update_fp8_state``'s ``finite``).
    """
    acc = jax.tree_util.tree_map(
        lambda p, o: jnp.maximum(p, o.fp8_amax), pending, observed, is_leaf=_is_fp8_state
    )
    before, after = _gradient_step(old_opt_state), _gradient_step(new_opt_state)
    applied = jnp.array(True) if after is None else after != before
    combined = jax.tree_util.tree_map(
        lambda a, o: o._replace(fp8_amax=a), acc, observed, is_leaf=_is_fp8_state
    )
    new_states = update_fp8_state(states, combined, recipe, axis_name=axis_name, finite=finite & applied)
    new_pending = jax.tree_util.tree_map(
        lambda a, p: jnp.where(finite, jnp.where(applied, jnp.zeros_like(a), a), p), acc, pending
    )
    return new_states, new_pending
