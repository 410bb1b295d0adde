"""``loss_scaling``: an optax wrapper that unscales, checks and skips.

The training step multiplies the loss by the current scale ``S``
(``get_loss_scale(opt_state).scale(loss)``); ``update`` then

1. unscales: ``g = g_scaled / S`` (in float32 or wider, cast back to each
   gradient's dtype so the inner optimizer sees the dtypes it was built for);
2. checks ``finite = all(isfinite(g))`` over every leaf, agreed across
   ``axis_name`` replicas when given;
3. if finite, returns ``inner.update(g, ...)``; otherwise zero updates and the
   inner state unchanged bit for bit;
4. adjusts ``S`` (``DynamicLossScale.adjust``) and the skip counters.

This is the recipe of Micikevicius et al., 2018, "Mixed Precision Training"
(https://arxiv.org/abs/1710.03740), as an optax ``GradientTransformation``
that owns the inner state, so a skipped step cannot advance Adam's count or
moments the way a separate ``optax.chain`` element would.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src.base import reports, validate
from jmp_lite._src.optim.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    all_finite,
    check_loss_scale,
    finite_leaves,
    keep_if_skipped,
)
from jmp_lite._src.parallel.distributed import ReduceOp, reduce_gradients

SkipMechanism = Literal["auto", "cond", "select"]

DEFAULT_MAX_CONSECUTIVE_SKIPS = 100


class LossScalingState(NamedTuple):
    """State of ``loss_scaling``. Field names are unique across optax states.

    Attributes:
        loss_scale: the current ``LossScale``.
        scaled_inner_state: the inner transformation's state.
        skipped_total: int32, steps skipped since ``init``.
        consecutive_skips: int32, consecutive skipped steps up to the last one.
        nonfinite_leaves: with ``loss_scaling(..., record_nonfinite=True)``, a
            pytree of the gradients' structure holding one bool per leaf: whether
            that leaf was non-finite on the last *skipped* step (all ``False``
            until a step is skipped; applied steps leave it as it is).
            ``describe_skip`` names the ``True`` leaves. ``None`` otherwise.
        last_grads_finite: bool, whether the last step's gradients were finite.
        skip_limit_reached: bool, ``consecutive_skips >= max_consecutive_skips``.

    The four counters are ``None`` when finiteness is not checked (the
    default with ``NoOpLossScale``), so that state adds no arrays.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.DynamicLossScale(4.0))
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state)
        >>> int(state.skipped_total), bool(state.last_grads_finite), float(state.loss_scale.loss_scale)
        (1, False, 2.0)
        >>> float(optax.tree.get(state, "consecutive_skips"))
        1.0
    """

    loss_scale: LossScale
    scaled_inner_state: optax.OptState
    skipped_total: jax.Array | None
    consecutive_skips: jax.Array | None
    # Before the two flags: jit drops those unused inputs and pairs donated buffers with outputs of
    # the same type in order, so the record's inputs then pair with its own outputs (no copies).
    nonfinite_leaves: Any
    last_grads_finite: jax.Array | None
    skip_limit_reached: jax.Array | None


class TinyGradientsState(NamedTuple):
    """State of ``loss_scaling(..., underflow_steps=K)``'s check, first in its inner chain.

    Attributes:
        tiny_grad_steps: int32, consecutive applied steps whose unscaled gradients
            all sat below float16's smallest normal number (2**-14).
        tiny_grad_limit: int32, ``K``: ``raise_if_skip_limit_reached`` warns at it.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(2.0**15), underflow_steps=2)
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> int(optax.tree.get(state, "tiny_grad_steps")), int(optax.tree.get(state, "tiny_grad_limit"))
        (0, 2)
    """

    tiny_grad_steps: jax.Array
    tiny_grad_limit: jax.Array


# Loss scaling exists for float16: gradients below its smallest normal lose bits, below 2**-24 vanish.
_F16_TINY = float(jnp.finfo(jnp.float16).tiny)


def _count_tiny_gradients(limit: int) -> optax.GradientTransformation:
    """An identity transformation that counts consecutive steps of all-tiny gradients (no host sync)."""

    def init(params: Any) -> TinyGradientsState:
        return TinyGradientsState(jnp.zeros([], jnp.int32), jnp.asarray(limit, jnp.int32))

    def update(updates: Any, state: TinyGradientsState, params: Any = None) -> tuple[Any, TinyGradientsState]:
        leaves = [
            g for g in jax.tree_util.tree_leaves(updates) if jnp.issubdtype(jnp.result_type(g), jnp.inexact)
        ]
        tiny = jnp.stack([jnp.all(jnp.abs(g) < _F16_TINY) for g in leaves] or [jnp.array(False)]).all()
        steps = jnp.where(tiny, jnp.minimum(state.tiny_grad_steps, validate.INT32_MAX - 1) + 1, 0)
        return updates, state._replace(tiny_grad_steps=steps)

    return optax.GradientTransformation(init, update)


class SkipLimitReachedError(RuntimeError):
    """Raised by ``raise_if_skip_limit_reached`` after too many consecutive skips.

    Example:
        >>> import jmp_lite
        >>> issubclass(jmp_lite.SkipLimitReachedError, RuntimeError)
        True
    """


def _unscale(loss_scale: LossScale, grads: Any) -> Any:
    if isinstance(loss_scale, NoOpLossScale):
        return grads
    inv = 1 / loss_scale.loss_scale

    def leaf(g: Any) -> Any:
        if g is None or not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
            return g
        g = jnp.asarray(g)
        wide = jnp.promote_types(g.dtype, jnp.float32)
        return (g.astype(wide) * inv.astype(wide)).astype(g.dtype)

    return jax.tree_util.tree_map(leaf, grads)


def _varying_axes(x: Any) -> frozenset:
    # The shard_map mesh axes x varies over (jax >= 0.10; empty outside shard_map).
    return frozenset(getattr(jax.typeof(x).manual_axis_type, "varying", None) or ())


def _as(x: Any, like: jax.ShapeDtypeStruct, *, placeholder: bool = False) -> Any:
    """``x`` with the type of ``like`` (dtype, and inside shard_map the axes it varies over).

    ``lax.cond`` needs both branches to return equal types. A ``placeholder`` is
    any value of that type (the caller discards it): zeros when ``x`` cannot be
    made one (another shape, or varying over more axes than ``like``).
    """
    x = jnp.asarray(x)  # Python scalars in the gradients or the state
    if placeholder and (x.shape != like.shape or not _varying_axes(x) <= _varying_axes(like)):
        return jnp.zeros(like.shape, like.dtype)
    x = x if x.dtype == like.dtype else x.astype(like.dtype)
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _no_update_unless(finite: jax.Array, updates: Any) -> Any:
    # -0.0, not +0.0: p + (-0.0) == p bit for bit for every p, including p = -0.0,
    # so optax.apply_updates leaves skipped parameters exactly as they were.
    return jax.tree_util.tree_map(lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), updates)


def skip_by_cond(
    finite: jax.Array, apply: Callable[[], tuple[Any, Any]], updates: Any, inner_state: Any
) -> tuple[Any, Any]:
    """``apply()`` if ``finite``, else ``-0.0`` updates and ``inner_state`` kept, with ``lax.cond``.

    ``apply`` (the inner update) runs only on finite steps and the kept state is
    not copied; on NVIDIA GPUs the predicate travels to the host every step.
    The kept state takes the dtypes ``apply`` would give it
    (``keep_if_skipped``'s rule). ``updates``, passed through the skipped
    branch and zeroed after the cond, give it a value of the right type without
    materialising zeros in the branch.
    """
    out_types = jax.eval_shape(apply)

    def skipped() -> tuple[Any, Any]:
        placeholder = jax.tree_util.tree_map(functools.partial(_as, placeholder=True), updates, out_types[0])
        return placeholder, jax.tree_util.tree_map(_as, inner_state, out_types[1])

    new_updates, new_state = jax.lax.cond(finite, apply, skipped)
    return _no_update_unless(finite, new_updates), new_state


def skip_by_select(
    finite: jax.Array, apply: Callable[[], tuple[Any, Any]], inner_state: Any
) -> tuple[Any, Any]:
    """``apply()`` always, then ``-0.0`` updates and ``inner_state`` kept where not ``finite``.

    No host sync (the choice is an elementwise select), at the price of
    computing the inner update on skipped steps and one copy of each state
    buffer; the kept state is selected with ``keep_if_skipped``.
    """
    new_updates, new_state = apply()
    return _no_update_unless(finite, new_updates), keep_if_skipped(finite, new_state, inner_state)


def _resolve_skip(skip: SkipMechanism) -> Literal["cond", "select"]:
    if skip == "auto":
        # lax.cond is copy-free but on NVIDIA GPUs moves its predicate to the
        # host every step; a select never syncs but copies the inner state.
        return "select" if jax.default_backend() == "gpu" else "cond"
    return skip


class _Config(NamedTuple):
    """``loss_scaling``'s hyperparameters, each validated once by ``loss_scaling``."""

    inner: optax.GradientTransformationExtraArgs
    loss_scale: LossScale
    axis_name: Any
    reduce: ReduceOp | None
    reduce_dtype: Any
    checking: bool
    max_consecutive_skips: int
    skip: SkipMechanism
    record_nonfinite: bool


class PlainNnxOptimizerWarning(UserWarning):
    """``loss_scaling`` initialised by a plain ``nnx.Optimizer`` (``LossScaledOptimizer`` ignores it)."""


def _warn_if_plain_nnx_optimizer(params: Any) -> None:
    """Warns when ``init`` gets a model's ``nnx.Variable``s, as ``nnx.Optimizer(model, tx)`` passes them."""
    nnx = sys.modules.get("flax.nnx")  # no NNX object can exist unless the program imported it
    if nnx is None:
        return
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if any(isinstance(x, nnx.Variable) for x in leaves):
        warnings.warn(
            "jmp_lite.loss_scaling is initialised with a model's nnx.Variables, as a plain nnx.Optimizer "
            "does: nnx.Optimizer.update advances optimizer.step on skipped (non-finite) steps, so schedules "
            "driven by it move; use jmp_lite.flax.nnx.LossScaledOptimizer(model, tx), which counts applied "
            "steps and keeps the model state of skipped ones",
            PlainNnxOptimizerWarning,
            stacklevel=2,
        )


def _without_nnx_variables(tree: Any) -> Any:
    """``tree`` with each ``nnx.Variable`` replaced by its value (``tree`` itself without NNX)."""
    nnx = sys.modules.get("flax.nnx")  # no NNX object can exist unless the program imported it
    return tree if nnx is None else nnx.as_pure(tree)


def _init(config: _Config, params: Any) -> LossScalingState:
    _warn_if_plain_nnx_optimizer(params)
    inner_state = config.inner.init(params)
    # Fresh buffers: a donated state must not delete the caller's loss scale.
    # dtype= also makes a weakly typed scale strong, as adjust returns it: no retrace at step 1.
    scale = jax.tree_util.tree_map(lambda x: jnp.array(x, dtype=x.dtype), config.loss_scale)
    if not config.checking:
        return LossScalingState(scale, inner_state, None, None, None, None, None)
    # One buffer per leaf: a state passed with donate_argnums must not hold the same buffer twice.
    zeros = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
    # Plain arrays even for NNX's Variables: a Param's metadata (its sharding) does not fit a flag.
    record = (
        jax.tree_util.tree_map(lambda _: jnp.array(False), _without_nnx_variables(params))
        if config.record_nonfinite
        else None
    )
    return LossScalingState(scale, inner_state, *zeros, record, jnp.array(True), jnp.array(False))


def _finite_and_record(config: _Config, grads: Any, record: Any) -> tuple[jax.Array, Any]:
    """The step's finiteness (agreed over ``axis_name``) and the new ``nonfinite_leaves``.

    One finiteness flag per leaf, reduced to the step's flag: the record is a
    by-product of the check, not a second pass over the gradients.
    """
    if record is None:
        raise ValueError(
            "loss_scaling(record_nonfinite=True) got a state without nonfinite_leaves: it was built by "
            "a loss_scaling without record_nonfinite; build the state with this transformation's init"
        )
    flags, treedef = jax.tree_util.tree_flatten(finite_leaves(grads))
    if treedef != jax.tree_util.tree_structure(record):
        raise ValueError(
            "loss_scaling(record_nonfinite=True): the gradients' tree structure differs from that of the "
            f"params given to init, whose leaves it records; gradients: {treedef}, recorded: "
            f"{jax.tree_util.tree_structure(record)}"
        )
    if not flags:
        return jnp.array(True), record
    nonfinite = ~jnp.stack(flags)
    if config.axis_name is not None:
        # One collective, as the plain check's pmin: a leaf non-finite on any replica is recorded,
        # and the step applies only if no replica has one.
        nonfinite = jax.lax.pmax(nonfinite.astype(jnp.int32), config.axis_name).astype(jnp.bool_)
    finite = ~nonfinite.any()
    now = treedef.unflatten([nonfinite[i] for i in range(len(flags))])
    return finite, jax.tree_util.tree_map(lambda old, new: jnp.where(finite, old, new), record, now)


def _update(
    config: _Config, updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
) -> tuple[Any, LossScalingState]:
    if not isinstance(state, LossScalingState):
        raise TypeError(f"loss_scaling.update expects a LossScalingState, got {type(state).__name__}")
    if isinstance(state.loss_scale, dict):
        raise TypeError(
            "the loss_scaling state holds a dict, not a loss scale: it was restored with "
            "flax.serialization into a target whose loss scale flax did not know; `import jmp_lite.flax` "
            "(which registers the loss scales with flax.serialization) before restoring"
        )
    if config.reduce is not None:
        updates = reduce_gradients(
            updates, config.axis_name, reduce_dtype=config.reduce_dtype, reduce=config.reduce
        )

    def apply() -> tuple[Any, Any]:
        grads = _unscale(state.loss_scale, updates)
        return config.inner.update(grads, state.scaled_inner_state, params, **extra_args)

    if not config.checking:
        new_updates, inner_state = apply()
        return new_updates, state._replace(scaled_inner_state=inner_state)

    # The unscale is written twice on purpose: here it fuses into the
    # finiteness reduction, and inside ``apply`` into the inner update, so
    # the unscaled gradients are never materialised (one read, no write).
    if config.record_nonfinite:
        finite, record = _finite_and_record(
            config, _unscale(state.loss_scale, updates), state.nonfinite_leaves
        )
    else:
        finite, record = all_finite(_unscale(state.loss_scale, updates)), state.nonfinite_leaves
        if config.axis_name is not None:
            finite = jax.lax.pmin(finite.astype(jnp.int32), config.axis_name).astype(jnp.bool_)
    if _resolve_skip(config.skip) == "cond":
        new_updates, inner_state = skip_by_cond(finite, apply, updates, state.scaled_inner_state)
    else:
        new_updates, inner_state = skip_by_select(finite, apply, state.scaled_inner_state)
    not_finite = (~finite).astype(jnp.int32)
    in_a_row = (state.consecutive_skips + 1) * not_finite
    return new_updates, LossScalingState(
        loss_scale=state.loss_scale.adjust(finite),
        scaled_inner_state=inner_state,
        skipped_total=state.skipped_total + not_finite,
        consecutive_skips=in_a_row,
        nonfinite_leaves=record,
        last_grads_finite=finite,
        skip_limit_reached=in_a_row >= config.max_consecutive_skips,
    )


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: Any = None,
    reduce: ReduceOp | None = None,
    reduce_dtype: Any = None,
    check_finite: bool | None = None,
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    skip: SkipMechanism = "auto",
    underflow_steps: int | None = None,
    record_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss-scale unscaling and non-finite step skipping.

    Args:
        inner: the optimizer to protect (``optax.adam(...)``, a chain,
            ``optax.MultiSteps``, ...). Put ``loss_scaling`` outside
            ``MultiSteps``: a non-finite micro-gradient is then skipped before
            it can poison the accumulator.
        loss_scale: the initial ``NoOpLossScale``, ``StaticLossScale`` or
            ``DynamicLossScale``.
        axis_name: a ``pmap``/``shard_map`` axis name (or tuple of names);
            replicas then agree on finiteness, so all skip together. Not
            needed under ``jax.jit`` with sharded arrays, where the check is
            already global.
        reduce: ``"mean"`` or ``"sum"`` to all-reduce the gradients over
            ``axis_name`` before anything else (``None``: the caller reduces).
        reduce_dtype: the dtype of that all-reduce (default: the gradients'
            own); e.g. ``jnp.bfloat16`` halves the bytes communicated.
        check_finite: whether to check gradients and skip non-finite steps.
            Default: ``True`` unless ``loss_scale`` is a ``NoOpLossScale``, where
            the step then adds no work at all over ``inner``. ``False`` with a
            ``StaticLossScale`` applies whatever the gradients hold (as plain
            optax does); with a ``DynamicLossScale`` it is an error.
        max_consecutive_skips: after this many skips in a row
            ``skip_limit_reached`` becomes ``True`` (the update still never
            applies a non-finite value); ``raise_if_skip_limit_reached`` raises.
        skip: ``"cond"`` runs ``inner.update`` under ``lax.cond`` (no state
            copies; a host round-trip per step on NVIDIA GPUs), ``"select"``
            always runs it and selects (no sync; XLA copies each state buffer),
            ``"auto"`` picks ``select`` on GPU and ``cond`` elsewhere.
        underflow_steps: opt-in check for a loss that was never multiplied by
            the scale (the update is then the true one divided by it: with SGD
            training stalls without an error). ``K`` counts, on the device, the
            consecutive applied steps whose unscaled gradients all sit below
            float16's smallest normal number (2**-14); ``raise_if_skip_limit_reached``
            warns once ``K`` are reached. The count costs one max-abs pass over the
            gradients and no host sync: a warning from inside the step (a
            ``jax.debug.callback``, or a ``cond`` on the count) would move a value
            to the host every step on GPU, so it comes from the host check you
            call every few hundred steps anyway. The inner state becomes
            ``(TinyGradientsState, inner state)``.
        record_nonfinite: opt-in record of *where* a skipped step's gradients
            were non-finite: ``nonfinite_leaves`` in the state, one bool per
            gradient leaf, set on each skipped step (a leaf non-finite on any
            ``axis_name`` replica counts) and kept on applied steps.
            ``describe_skip(opt_state)`` and ``raise_if_skip_limit_reached`` then
            name the parameter paths. The flags come from the finiteness check
            the step does anyway (per leaf, then reduced): no second pass over
            the gradients and no host sync. Needs the check (not with
            ``check_finite=False``).

    Returns:
        An ``optax.GradientTransformationExtraArgs``; extra keyword arguments to
        ``update`` are forwarded to ``inner``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
        >>> params = {"w": jnp.ones(3)}
        >>> opt_state = tx.init(params)
        >>> ls = jmp_lite.get_loss_scale(opt_state)
        >>> grads = jax.grad(lambda p: ls.scale(jnp.sum(p["w"] ** 2)))(params)
        >>> updates, opt_state = tx.update(grads, opt_state, params)
        >>> updates["w"]
        Array([-0.2, -0.2, -0.2], dtype=float32)
    """
    check_loss_scale(loss_scale, "loss_scaling.loss_scale")
    inner = validate.gradient_transformation(inner, "loss_scaling.inner")
    if underflow_steps is not None:
        limit = validate.whole_number(underflow_steps, "loss_scaling.underflow_steps")
        inner = optax.chain(_count_tiny_gradients(limit), inner)
    validate.choice(skip, "loss_scaling.skip", ("auto", "cond", "select"))
    validate.choice(reduce, "loss_scaling.reduce", (None, "mean", "sum"))
    if (reduce is not None or reduce_dtype is not None) and axis_name is None:
        raise ValueError("reduce and reduce_dtype need an axis_name to reduce over")
    if reduce is None and reduce_dtype is not None:
        raise ValueError("reduce_dtype is set but reduce is None; pass reduce='mean' or 'sum'")
    checking = (
        not isinstance(loss_scale, NoOpLossScale)
        if check_finite is None
        else validate.flag(check_finite, "loss_scaling.check_finite")
    )
    if isinstance(loss_scale, DynamicLossScale) and not checking:
        raise ValueError(
            "check_finite=False with a DynamicLossScale would apply inf/NaN updates and never lower "
            "the scale; use check_finite=True (the default) or a StaticLossScale"
        )
    record_nonfinite = validate.flag(record_nonfinite, "loss_scaling.record_nonfinite")
    if record_nonfinite and not checking:
        raise ValueError(
            "record_nonfinite=True records which gradient leaves were non-finite on skipped steps, but "
            "this loss_scaling does not check finiteness (check_finite=False, the default with a "
            "NoOpLossScale); pass check_finite=True as well"
        )
    config = _Config(
        inner=optax.with_extra_args_support(inner),
        loss_scale=loss_scale,
        axis_name=axis_name,
        reduce=reduce,
        reduce_dtype=reduce_dtype,
        checking=checking,
        max_consecutive_skips=validate.whole_number(
            max_consecutive_skips, "loss_scaling.max_consecutive_skips"
        ),
        skip=skip,
        record_nonfinite=record_nonfinite,
    )
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, config), functools.partial(_update, config)
    )


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScalingState)


def _find_states(tree: Any) -> list[LossScalingState]:
    # Also looks inside each state's inner state, so nested loss_scaling is found.
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_state) if _is_state(x)]
    return found + [y for x in found for y in _find_states(x.scaled_inner_state)]


def get_loss_scaling_state(opt_state: Any) -> LossScalingState:
    """Finds the one ``LossScalingState`` anywhere inside an optax state.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.MultiSteps(optax.adam(1e-3), 2), jmp_lite.StaticLossScale(8.0))
        >>> int(jmp_lite.get_loss_scaling_state(tx.init(jnp.ones(2))).skipped_total)
        0
    """
    found = _find_states(opt_state)
    if len(found) != 1:
        nested = any(_find_states(x.scaled_inner_state) for x in found)
        raise ValueError(
            "expected exactly one jmp_lite.loss_scaling state inside the optimizer state, "
            f"found {len(found)}"
            + (
                " (one loss_scaling nested inside another: scaling twice unscales twice; "
                "keep only the outer one)"
                if nested
                else "; pass the sub-state you mean"
            )
        )
    return found[0]


def get_loss_scale(opt_state: Any) -> LossScale:
    """The current loss scale of the ``loss_scaling`` state inside ``opt_state``.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> ls = jmp_lite.DynamicLossScale(2.0 ** 15)
        >>> tx = optax.chain(jmp_lite.loss_scaling(optax.scale_by_adam(), ls), optax.scale(-1e-3))
        >>> float(jmp_lite.get_loss_scale(tx.init(jnp.ones(2))).loss_scale)
        32768.0
    """
    return get_loss_scaling_state(opt_state).loss_scale


def _warn_if_gradients_stay_tiny(state: LossScalingState) -> None:
    """The host side of ``loss_scaling(underflow_steps=K)``: one read of the device count."""
    is_check = lambda x: isinstance(x, TinyGradientsState)  # noqa: E731
    found = [x for x in jax.tree_util.tree_leaves(state.scaled_inner_state, is_leaf=is_check) if is_check(x)]
    if not found:
        return
    steps, limit = (np.asarray(jax.device_get(x)) for x in found[0])
    if np.any(steps >= limit):
        warnings.warn(
            f"loss_scaling: the unscaled gradients of the last {int(np.max(steps))} applied steps all sat "
            f"below float16's smallest normal number ({_F16_TINY:.3g}); was the loss multiplied by the loss "
            "scale? "
            "loss_scaling divides the gradients by the scale whether or not it was. Take the gradients with "
            "jmp_lite.value_and_grad(loss_fn)(opt_state, params, ...), or of "
            "jmp_lite.get_loss_scale(opt_state).scale(loss). (If they truly are this small, a larger loss "
            "scale keeps float16 from flushing them.)",
            stacklevel=2,
        )


def raise_if_skip_limit_reached(opt_state: Any) -> None:
    """Raises ``SkipLimitReachedError`` if the skip limit was reached.

    Call it outside ``jit`` (it reads a device scalar: a host sync), e.g. every
    few hundred steps, to stop a run whose gradients stay non-finite. With
    ``loss_scaling(underflow_steps=K)`` it also warns (``UserWarning``) when the
    last ``K`` steps' unscaled gradients all sat below float16's smallest normal
    number: the sign of a loss never multiplied by the scale. Inside a
    transformation it raises a ``TypeError`` that says so (a raise from inside
    a compiled step would need ``checkify`` around every step). On a
    ``pmap``-stacked state it checks every replica and names those that hit the
    limit.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(1.0), max_consecutive_skips=1)
        >>> state = tx.update(jnp.array([jnp.nan]), tx.init(jnp.zeros(1)))[1]
        >>> jmp_lite.raise_if_skip_limit_reached(state)
        Traceback (most recent call last):
        ...
        jmp_lite.optax_transform.SkipLimitReachedError: 1 consecutive steps had non-finite gradients ...
    """
    state = _state_on_host(opt_state, "raise_if_skip_limit_reached")
    _warn_if_gradients_stay_tiny(state)
    if state.skip_limit_reached is None:
        return
    # A pmap-stacked state has one flag per replica: report every replica that hit the limit.
    reached = np.asarray(jax.device_get(state.skip_limit_reached), bool)
    if not reached.any():
        return
    in_a_row = np.asarray(jax.device_get(state.consecutive_skips))
    total = np.asarray(jax.device_get(state.skipped_total))
    scale = np.asarray(jax.device_get(state.loss_scale.loss_scale), np.float64)
    if reached.ndim == 0:
        where, pick = "", ()
    else:
        idx = np.argwhere(reached)
        where, pick = (
            f" on replica(s) {[tuple(map(int, i)) if len(i) > 1 else int(i[0]) for i in idx]}",
            tuple(idx[0]),
        )
    named = ""
    if state.nonfinite_leaves is not None:
        paths = [
            path for path, flags in _recorded_leaves(state) if np.broadcast_to(flags, reached.shape)[pick]
        ]
        named = f"; non-finite on the last skipped step: {', '.join(map(_shown, paths))}"
    raise SkipLimitReachedError(
        f"{int(in_a_row[pick])} consecutive steps had non-finite gradients{where} "
        f"(loss scale {float(np.broadcast_to(scale, reached.shape)[pick])}, "
        f"{int(total[pick])} skipped in total); the model or data produce inf/NaN{named}"
    )


def _state_on_host(opt_state: Any, who: str) -> LossScalingState:
    """The ``loss_scaling`` state in ``opt_state``, for a host-side read outside any transformation."""
    state = _without_nnx_variables(get_loss_scaling_state(opt_state))
    if any(validate.is_tracer(x) for x in jax.tree_util.tree_leaves(state)):
        raise TypeError(
            f"{who} reads the skip flag on the host, so it cannot run inside jax.jit, "
            "pmap, scan or another transformation; call it outside, on the optimizer state the jitted step "
            "returns (e.g. every few hundred steps: each call is one host sync)"
        )
    return state


def leaf_path(path: tuple[Any, ...]) -> str:
    """A key path as Flax writes parameter paths: keys joined by ``/`` (``encoder/layers_3/kernel``)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _shown(path: str) -> str:
    return path or "(the gradient itself, a single array)"


def _recorded_leaves(state: LossScalingState) -> list[tuple[str, np.ndarray]]:
    """Each gradient leaf's path and its recorded flag (one per replica on a ``pmap``-stacked state)."""
    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(state.nonfinite_leaves))
    return [(leaf_path(path), np.asarray(flag, bool)) for path, flag in flat]


@dataclasses.dataclass(frozen=True)
class SkipReport:
    """Where the last skipped step's gradients were non-finite: what ``describe_skip`` returns.

    ``str(report)`` is the readable description; the fields are the same facts as values.

    Attributes:
        paths: the parameter paths (keys joined by ``/``, as Flax writes them:
            ``encoder/layers_3/attn/query/kernel``) of the gradient leaves that
            were non-finite on the last skipped step, in the gradients' leaf
            order; empty when no step was skipped. On a ``pmap``-stacked state,
            the leaves recorded on any replica.
        skipped_total: steps skipped since ``init`` (the largest over replicas).
        consecutive_skips: skipped steps in a row up to the last one (the largest over replicas).
        last_step_applied: whether the last step was applied (on every replica).
        replicas: on a ``pmap``-stacked state whose replicas recorded different
            leaves, each such path and the replicas (indices) that recorded it;
            empty otherwise.

    Example:
        >>> import jmp_lite
        >>> report = jmp_lite.SkipReport(("dense/kernel",), 1, 1, False)
        >>> print(report)
        last step skipped (1 in a row, 1 skipped in total); non-finite gradients in 1 leaf:
          dense/kernel
    """

    paths: tuple[str, ...]
    skipped_total: int
    consecutive_skips: int
    last_step_applied: bool
    replicas: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The report's fields as JSON-ready values."""
        return reports.plain(self)

    def table(self) -> str:
        """The readable description ``str()`` gives."""
        if self.skipped_total == 0:
            return "no step skipped yet: no non-finite gradient recorded"
        if self.last_step_applied:
            head = (
                f"last step applied; the last skipped step ({self.skipped_total} skipped in total) had "
                "non-finite gradients in"
            )
        else:
            head = (
                f"last step skipped ({self.consecutive_skips} in a row, {self.skipped_total} skipped in "
                "total); non-finite gradients in"
            )
        lines = [
            f"  {_shown(path)}"
            + (f"  (replicas {list(self.replicas[path])})" if path in self.replicas else "")
            for path in self.paths
        ]
        count = f"{len(self.paths)} leaf" if len(self.paths) == 1 else f"{len(self.paths)} leaves"
        return "\n".join([f"{head} {count}:", *lines])


def describe_skip(opt_state: Any) -> SkipReport:
    """Which parameters' gradients were non-finite on the last skipped step.

    Reads ``nonfinite_leaves`` from the ``loss_scaling(..., record_nonfinite=True)``
    state anywhere inside ``opt_state``: an optax state (chains, ``MultiSteps``,
    ``inject_hyperparams`` included), a Linen ``jmp_lite.flax.TrainState`` or its
    ``opt_state``, an NNX ``LossScaledOptimizer`` or its ``opt_state``. Call it
    outside ``jit`` (it copies the flags to the host: one sync), e.g. when a loss
    goes NaN or ``raise_if_skip_limit_reached`` raises. ``print`` the result for
    the description; ``.paths`` holds the parameter paths as strings.

    Raises:
        ValueError: the state was built without ``record_nonfinite=True``.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> params = {"encoder": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}}
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0), record_nonfinite=True)
        >>> state = tx.init(params)
        >>> grads = {"encoder": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.ones(2)}}
        >>> _, state = tx.update(grads, state, params)
        >>> jmp_lite.describe_skip(state).paths
        ('encoder/kernel',)
        >>> print(jmp_lite.describe_skip(state))
        last step skipped (1 in a row, 1 skipped in total); non-finite gradients in 1 leaf:
          encoder/kernel
    """
    state = _state_on_host(opt_state, "describe_skip")
    if state.nonfinite_leaves is None:
        checked = state.last_grads_finite is not None
        raise ValueError(
            "describe_skip needs jmp_lite.loss_scaling(..., record_nonfinite=True): this optimizer state "
            "records no per-leaf flags"
            + ("" if checked else " (and its loss_scaling does not check finiteness: check_finite=False)")
        )
    recorded = [(path, flags) for path, flags in _recorded_leaves(state) if flags.any()]
    replicas = {
        path: tuple(tuple(map(int, i)) if len(i) > 1 else int(i[0]) for i in np.argwhere(flags))
        for path, flags in recorded
        if flags.ndim > 0 and not flags.all()
    }
    total, in_a_row, finite = (
        np.asarray(jax.device_get(x))
        for x in (state.skipped_total, state.consecutive_skips, state.last_grads_finite)
    )
    return SkipReport(
        paths=tuple(path for path, _ in recorded),
        skipped_total=int(total.max()),
        consecutive_skips=int(in_a_row.max()),
        last_step_applied=bool(finite.all()),
        replicas=replicas,
    )
