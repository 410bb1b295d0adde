"""A skip-safe ``nnx.Optimizer`` for a ``tx`` built with ``jmp_lite.loss_scaling``.

On a skipped (non-finite) step the params, the whole optimizer state
(transformations chained around ``loss_scaling`` included), the ``step``
counter, and the model state passed as ``rollback`` (BatchNorm statistics) all
stay bitwise as they were.

With a ``PolicyView`` that holds delayed fp8 states (``Fp8Variable``), the optimizer
holds them too (the same variables, ``optimizer.fp8_state``), so that
``nnx.state(optimizer)`` saves them next to the optimizer state, and ``update`` also
makes the next fp8 states from their gradients (the amaxes the step observed;
``jmp_lite.value_and_grad`` takes them along), through the same rule as Linen's
``TrainState`` (``step._fp8_update``): never through ``tx``, unchanged on a skipped
step, max-combined over ``optax.MultiSteps`` microbatches.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax
from flax import nnx

from jmp_lite._src.flax.nnx_policy import Fp8Variable, PolicyView, fp8_variables
from jmp_lite._src.frontends.fp8_weights import nest as _nest
from jmp_lite._src.optim import quantized_state
from jmp_lite._src.optim.loss_scale import LossScale, NoOpLossScale, keep_if_skipped
from jmp_lite._src.optim.loss_scaling import LossScalingState, PlainNnxOptimizerWarning, _find_states
from jmp_lite._src.optim.step import (
    _apply_scaled,
    _checked_state,
    _fp8_pending,
    _fp8_update,
    _last_step_applied,
    _skipped_total,
)

__all__ = ["LossScaledOptimizer", "snapshot"]


def snapshot(model: nnx.Module, *filters: Any) -> Any:
    """The values of ``model``'s variables matching ``filters``, as plain arrays.

    ``nnx.state`` returns the model's live variables, which the forward pass
    then updates in place; a snapshot keeps the values of this moment, for
    ``LossScaledOptimizer.update(..., rollback=...)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jmp_lite.flax.nnx import snapshot
        >>> bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        >>> before = snapshot(bn, nnx.BatchStat)
        >>> _ = bn(jnp.full((4, 2), 5.0))
        >>> float(before["mean"][0]), round(float(bn.mean[0]), 3)
        (0.0, 0.05)
    """
    if not filters:
        raise TypeError("snapshot needs at least one filter, e.g. snapshot(model, nnx.BatchStat)")
    return nnx.as_pure(nnx.state(model, filters[0] if len(filters) == 1 else filters))


def _pure_snapshot(rollback: Any) -> Any:
    leaves = jax.tree_util.tree_leaves(rollback, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if any(isinstance(leaf, nnx.Variable) for leaf in leaves):
        raise TypeError(
            "rollback holds the model's live variables (from nnx.state), which the forward pass has "
            "already updated; take it with jmp_lite.flax.nnx.snapshot(model, nnx.BatchStat)"
        )
    return rollback


class LossScaledOptimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose update is loss-scaled and skip-safe.

    With a ``tx`` containing one ``jmp_lite.loss_scaling``: scale the loss with
    ``optimizer.loss_scale.scale(loss)`` (or ``jmp_lite.value_and_grad``);
    ``update`` unscales and checks the gradients. On a non-finite step nothing
    that belongs to training moves: params and the whole optimizer state
    (bitwise), ``step`` (Flax's ``Optimizer`` counts every call; this one counts
    applied steps, so whatever you drive from it does not move), and the model
    state given as ``rollback`` (take it before the forward pass with
    ``snapshot(model, nnx.BatchStat)``). Only the loss-scale state changes. A
    plain optax ``tx`` (float32 or bfloat16 runs) works as in ``nnx.Optimizer``,
    with a ``NoOpLossScale``, as Linen's ``TrainState`` does.

    As ``nnx.Optimizer.update``, ``update`` returns the updates it applied
    (``-0.0`` on a skipped step); ``optimizer.last_step_applied`` says whether
    the last step was applied and ``optimizer.skipped_total`` counts the skipped
    ones, both plain arrays.

    Built on a ``PolicyView`` with delayed fp8 scaling, ``update(view, grads)`` also
    updates the view's ``Fp8Variable``s from their gradients (take them with
    ``jmp_lite.value_and_grad``), max-reduced over ``fp8_axis_name`` replicas;
    ``optimizer.fp8_observed`` keeps the ``optax.MultiSteps`` microbatches' amaxes
    until the inner step. The optimizer holds the view's ``Fp8Variable``s as well (the same
    variables, ``optimizer.fp8_state``): a checkpoint of ``nnx.state(model)`` and
    ``nnx.state(optimizer)`` keeps the fp8 scaling state that the model does not hold.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> from flax import nnx
        >>> from jmp_lite.flax.nnx import LossScaledOptimizer
        >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 10))
        >>> optimizer = LossScaledOptimizer(model, tx)
        >>> grads = nnx.grad(lambda m: optimizer.loss_scale.scale(m(jnp.full((1, 3), jnp.inf)).sum()))(model)
        >>> _ = optimizer.update(model, grads)
        >>> int(optimizer.step[...]), float(optimizer.loss_scale.loss_scale)
        (0, 512.0)
        >>> optimizer.last_step_applied
        Array(False, dtype=bool)
        >>> optimizer.skipped_total
        Array(1, dtype=int32)
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        fp8_axis_name: Any = None,
        **kwargs: Any,
    ) -> None:
        with warnings.catch_warnings():  # this is no plain nnx.Optimizer
            warnings.simplefilter("ignore", PlainNnxOptimizerWarning)
            super().__init__(model, tx, wrt=wrt, **kwargs)
        opt_state = nnx.as_pure(self.opt_state)
        if _find_states(opt_state):
            try:
                _checked_state(opt_state)
            except ValueError as e:
                raise ValueError(f"LossScaledOptimizer: {e}") from None
        self.fp8_axis_name = fp8_axis_name
        states = fp8_variables(model) if isinstance(model, PolicyView) else {}
        if states:  # pending microbatch amaxes, at the states' paths
            zeros = {p: nnx.OptState(_fp8_pending(v.get_value())) for p, v in states.items()}
            self.fp8_observed = nnx.data(_nest(zeros))
            # The view's own Fp8Variables, shared (not copies): the habit of checkpointing nnx.state(model)
            # and nnx.state(optimizer) then keeps the scaling state, which the model does not hold, and
            # restoring the optimizer restores the view's states (nnx.update writes the shared variables).
            self.fp8_state = nnx.data(_nest(dict(states)))

    def _loss_scaling_state(self) -> LossScalingState | None:
        found = _find_states(nnx.as_pure(self.opt_state))
        return found[0] if found else None

    def __jmp_lite_loss_scale__(self) -> LossScale:
        """The protocol ``jmp_lite.value_and_grad`` reads the scale through."""
        return self.loss_scale

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale; multiply the loss by it (``optimizer.loss_scale.scale(loss)``)."""
        state = self._loss_scaling_state()
        return NoOpLossScale() if state is None else state.loss_scale

    @property
    def last_step_applied(self) -> jax.Array:
        """A bool scalar: whether the last ``update`` applied its step (``True`` before any)."""
        return _last_step_applied(nnx.as_pure(self.opt_state))

    @property
    def skipped_total(self) -> jax.Array:
        """An int32 scalar: the steps skipped since the optimizer was built (0 when nothing is checked)."""
        return _skipped_total(nnx.as_pure(self.opt_state))

    def update(self, model: nnx.Module, grads: Any, /, *, rollback: Any = None, **kwargs: Any) -> nnx.State:
        """Unscale, check, update; on a non-finite step keep everything but the loss scale.

        Args:
            model: the model (or view) the gradients were taken of.
            grads: scaled gradients from ``nnx.grad``.
            rollback: ``snapshot(model, nnx.BatchStat)`` taken before the forward
                pass, written back on a skipped step. Required when the model has
                ``BatchStat`` variables; pass ``()`` to opt out.
            **kwargs: extra arguments for ``tx.update``.

        Returns:
            The updates applied to the ``wrt`` variables (``-0.0`` on a skipped
            step), as ``nnx.Optimizer.update`` returns them. Whether the step was
            applied: ``optimizer.last_step_applied``.
        """
        if rollback is None and nnx.state(model, nnx.BatchStat, graph=self.graph):
            raise ValueError(
                "the model has BatchStat variables that a skipped step must not advance: pass "
                "rollback=jmp_lite.flax.nnx.snapshot(model, nnx.BatchStat) taken before the forward "
                "pass (or rollback=() to opt out)"
            )
        old = None
        if rollback is not None and not (isinstance(rollback, tuple) and rollback == ()):
            old = _pure_snapshot(rollback)
            # Bad paths fail before anything is updated.
            _restrict(nnx.as_pure(nnx.state(model, graph=self.graph)), old)
        fp8 = self._fp8_inputs(model, grads)  # its errors, too, come before anything is updated
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        updates, new_params, new_opt_state, finite = _apply_scaled(
            self.tx, grad_arrays, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
        )
        nnx.update(model, new_params)
        if fp8 is not None:
            self._update_fp8(model, *fp8, finite, nnx.as_pure(self.opt_state), new_opt_state)
        _write_state(self.opt_state, new_opt_state, self.graph)
        if old is not None:
            now = _restrict(nnx.as_pure(nnx.state(model, graph=self.graph)), old)
            nnx.update(model, keep_if_skipped(finite, now, old))
        self.step[...] += finite.astype(self.step.dtype)
        return updates

    def _fp8_inputs(self, model: nnx.Module, grads: Any) -> tuple[dict, dict, dict] | None:
        """The view's fp8 states, their pending observations and their gradients; checked."""
        states = fp8_variables(model) if isinstance(model, PolicyView) else {}
        if not states:
            return None
        pending = fp8_variables(self, "fp8_observed", nnx.OptState)
        if set(pending) != set(states):
            raise ValueError(
                "LossScaledOptimizer.update: the model's fp8 states are not those this optimizer was built "
                "for; build the optimizer on the same view (LossScaledOptimizer(view, tx))"
            )
        observed = {
            tuple(path[1:]): var
            for path, var in nnx.to_flat_state(grads)
            if isinstance(var, Fp8Variable) and path[:1] == ("fp8_state",)
        }
        if set(observed) != set(states):
            raise ValueError(
                "LossScaledOptimizer.update: the view holds fp8 states (Fp8Variable) but grads have no "
                "gradient for them, so their scales would never move: take the gradients with "
                "jmp_lite.value_and_grad (it differentiates them along with the nnx.Param), or with "
                "nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param, jmp_lite.flax.nnx.Fp8Variable)))"
            )
        return states, pending, observed

    def _update_fp8(
        self, model: Any, states: dict, pending: dict, observed: dict, finite: Any, old: Any, new: Any
    ) -> None:
        key = lambda p: "/".join(map(str, p))  # noqa: E731  (string keys: paths mix ints and names)
        new_states, new_pending = _fp8_update(
            {key(p): v.get_value() for p, v in states.items()},
            {key(p): v.get_value() for p, v in pending.items()},
            {key(p): v.get_value() for p, v in observed.items()},
            model.fp8_recipe,
            finite,
            old,
            new,
            self.fp8_axis_name,
        )
        held = fp8_variables(self)  # the same variables as the view's, unless split apart (tree mode)
        for p, v in states.items():
            v.set_value(new_states[key(p)])
            if held.get(p, v) is not v:  # kept equal, so that a checkpoint of either is the state
                held[p].set_value(new_states[key(p)])
        for p, v in pending.items():
            v.set_value(new_pending[key(p)])


def _write_state(opt_state: Any, new: Any, graph: Any) -> None:
    """Writes ``new`` into ``opt_state``'s variables one by one, keeping their values' pytree types.

    ``nnx.update(opt_state, nnx.state(new))``, what ``nnx.Optimizer`` does, turns a NamedTuple held
    by one variable (an 8-bit ``QuantizedArray``) into a ``State`` of its fields; a state restored in
    that form is written back as the ``QuantizedArray`` the update returns."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    variables, slots = jax.tree_util.tree_flatten(opt_state, is_leaf=is_var)
    try:
        parts = slots.flatten_up_to(new)
    except (TypeError, ValueError):
        parts = None
    structure = jax.tree_util.tree_structure
    same = parts is not None and all(
        is_var(v) and structure(quantized_state.rebuilt(v.get_value())) == structure(p)
        for v, p in zip(variables, parts)
    )
    if not same:  # a state whose structure changed: let nnx merge it
        nnx.update(opt_state, nnx.state(new, graph=graph))
        return
    for variable, value in zip(variables, parts):
        nnx.update(variable, value)  # as nnx.update writes a variable: no set_value hooks


def _restrict(state: Any, template: Any) -> Any:
    """``state`` restricted to the paths ``template`` has."""
    flat = dict(nnx.to_flat_state(state))
    try:
        return nnx.from_flat_state({path: flat[path] for path, _ in nnx.to_flat_state(template)})
    except KeyError as e:
        raise ValueError(f"rollback has a path the model does not: {e.args[0]}") from None
