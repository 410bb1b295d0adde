"""Loss scales: pure pytrees that scale a loss and unscale its gradients.

Loss scaling (Micikevicius et al., 2018, "Mixed Precision Training",
https://arxiv.org/abs/1710.03740) multiplies the loss by ``S`` before
backpropagation so small activation gradients stay representable in float16,
and divides the gradients by ``S`` before the update. ``DynamicLossScale``
adapts ``S``: halve on overflow, double after ``period`` consecutive finite
steps, clamped to ``[min_loss_scale, max_loss_scale]``.

Only ``loss_scale`` (float32) and ``counter`` (int32) are pytree leaves; the
hyperparameters are static pytree data, so they survive ``jit``, ``pmap``,
``scan`` and ``tree_map`` and are never validated on unflatten.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from jmp_lite._src.base import validate
from jmp_lite._src.base.validate import F32_TINY, is_tracer

T = TypeVar("T")


def _clamp_scale(scale: jax.Array, low: float, high: float) -> jax.Array:
    """A scale Python could not check, clamped into ``[low, high]`` with jnp; NaN goes to ``high``."""
    return jnp.clip(jnp.where(jnp.isnan(scale), high, scale), max(low, F32_TINY), high)


def _apply(tree: T, factor: jax.Array) -> T:
    # As jmp: a leaf times the scale. A weakly typed scale (from a Python number)
    # keeps float16/bfloat16 leaves in their dtype; a strong float32 one promotes them.
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


class NoOpLossScale:
    """A loss scale of 1 that does nothing: for bfloat16 and float32 training.

    Example:
        >>> import jmp_lite
        >>> jmp_lite.NoOpLossScale().scale(2.0)
        2.0
    """

    __slots__ = ()

    @property
    def loss_scale(self) -> int:
        """Always 1 (a Python int, as in jmp)."""
        return 1

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns ``self``: there is nothing to adapt."""
        del grads_finite
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoOpLossScale)

    def __hash__(self) -> int:
        return hash(NoOpLossScale)

    def __repr__(self) -> str:
        return "NoOpLossScale()"


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale:
    """Scales by a fixed constant ``loss_scale`` (a float32 pytree leaf).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> ls = jmp_lite.StaticLossScale(2.0 ** 10)
        >>> float(ls.unscale(ls.scale(jnp.float32(3.0))))
        3.0
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: Any) -> None:
        scale = validate.positive_scale(loss_scale, "StaticLossScale.loss_scale")
        if is_tracer(loss_scale):
            # Built from a traced value (inside jit with a traced argument): Python
            # cannot check it, so an invalid scale becomes NaN, which makes every
            # step's loss and gradients NaN: visible at once, and skipped by loss_scaling.
            scale = validate.nan_unless_positive(scale)
        object.__setattr__(self, "loss_scale", scale)

    def scale(self, tree: T) -> T:
        """Multiplies every leaf by the scale."""
        return _apply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Multiplies every leaf by ``1 / loss_scale``."""
        return _apply(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        del grads_finite
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StaticLossScale):
            return NotImplemented
        return _same_values(self.loss_scale, other.loss_scale)

    __hash__ = None  # type: ignore[assignment]  # equal by value, so unhashable (as jmp's)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale:
    """A loss scale that adapts to keep gradients finite.

    With scale ``S``, counter ``c``, period ``N`` and factor ``k``, after a step
    whose unscaled gradients are all finite::

        c' = (c + 1) mod N
        S' = min(S * k, max_loss_scale) if c == N - 1 (and S * k is finite) else S

    and after a step with any inf/NaN gradient::

        c' = 0,   S' = max(S / k, min_loss_scale)

    These are jmp's semantics (growth on the N-th consecutive finite step) plus
    the upper clamp. Defaults: ``period=2000`` and ``factor=2`` (NVIDIA's recipe,
    jmp, PyTorch, Keras), ``min_loss_scale=1`` (jmp, MindSpore; a scale below 1
    would amplify rounding instead of preventing underflow) and
    ``max_loss_scale=2**24`` (Apex), well below float32 overflow. A typical
    starting value is ``2**15``: large enough for float16 activation gradients,
    small enough that a float16 loss of order 1 times the scale is finite.

    ``loss_scale`` is stored as a float32 and ``counter`` as an int32 scalar
    whatever dtype is passed; both are the only pytree leaves. ``adjust`` first
    clamps ``S`` into the bounds (NaN to ``max_loss_scale``) and ``c`` into
    ``[0, N)``: the identity on any state the constructor accepts, and one step
    brings back a state that a restore rebuilt unchecked (orbax).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> ls = jmp_lite.DynamicLossScale(jnp.float16(2 ** 15), period=2)
        >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
        16384.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: int
    factor: float
    min_loss_scale: float
    max_loss_scale: float

    def __init__(
        self,
        loss_scale: Any,
        counter: Any = 0,
        period: int = 2000,
        factor: float = 2,
        min_loss_scale: Any = 1.0,
        max_loss_scale: Any = 2.0**24,
    ) -> None:
        period = validate.whole_number(period, "DynamicLossScale.period")
        factor = validate.factor(factor, "DynamicLossScale.factor")
        # Bounds are rounded inwards to float32, the dtype the scale lives in, so
        # the scale never leaves [min_loss_scale, max_loss_scale] as written.
        bounds = validate.scale_bounds(min_loss_scale, max_loss_scale, "DynamicLossScale")
        scale = validate.positive_scale(loss_scale, "DynamicLossScale.loss_scale", warn_int=True)
        if is_tracer(loss_scale):
            # Built from a traced value (e.g. inside jit from a traced argument):
            # Python cannot check it, so clamp into [min, max] with jnp; NaN starts at the top.
            scale = _clamp_scale(scale, bounds.low, bounds.high)
        else:
            # A concrete value (also a Python constant inside jit or pmap) is checked here.
            exact = float(loss_scale)
            if not bounds.low_as_written <= exact <= bounds.high_as_written:
                raise ValueError(
                    f"DynamicLossScale.loss_scale={loss_scale!r} is outside "
                    f"[min_loss_scale, max_loss_scale] = [{min_loss_scale!r}, {max_loss_scale!r}]"
                )
            v32 = float(np.float32(exact))
            clamped = min(max(v32, bounds.low, F32_TINY), bounds.high)  # float32 rounding may step out
            if clamped != v32:
                scale = jax.lax.full_like(scale, clamped)
        if is_tracer(counter):
            if counter.shape != () or not jnp.issubdtype(counter.dtype, jnp.integer):
                raise TypeError(f"DynamicLossScale.counter must be an integer scalar, got {counter!r}")
            counter = jnp.clip(counter, 0, period - 1)  # traced: clamp with jnp
        else:
            counter = validate.whole_number(counter, "DynamicLossScale.counter", low=0, high=period - 1)
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", jnp.asarray(counter, jnp.int32))
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "factor", factor)
        object.__setattr__(self, "min_loss_scale", bounds.low)
        object.__setattr__(self, "max_loss_scale", bounds.high)

    def scale(self, tree: T) -> T:
        """Multiplies every leaf by the scale."""
        return _apply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Multiplies every leaf by ``1 / loss_scale``."""
        return _apply(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were finite."""
        finite = validate.bool_scalar(grads_finite, "DynamicLossScale.adjust(grads_finite)")
        # Clamped first: a restore (orbax rebuilds pytrees unchecked) may bring a scale or counter
        # outside this object's bounds; one step brings it back in. Identity on every valid state.
        floor = max(self.min_loss_scale, F32_TINY)  # 0 (jmp's "no floor") stops at the smallest normal
        now = _clamp_scale(self.loss_scale, floor, self.max_loss_scale)
        count = jnp.clip(self.counter, 0, self.period - 1)
        grown = now * jnp.float32(self.factor)
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale), now)
        shrunk = jnp.maximum(now / jnp.float32(self.factor), floor)
        scale = jnp.where(finite, jnp.where(count == self.period - 1, grown, now), shrunk)
        counter = jnp.where(finite, (count + 1) % self.period, 0)
        return _new(
            DynamicLossScale,
            **{
                **self.__dict__,
                "loss_scale": scale.astype(jnp.float32),
                "counter": counter.astype(jnp.int32),
            },
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DynamicLossScale):
            return NotImplemented
        return _dyn_aux(self) == _dyn_aux(other) and all(
            _same_values(a, b)
            for a, b in ((self.loss_scale, other.loss_scale), (self.counter, other.counter))
        )

    __hash__ = None  # type: ignore[assignment]


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss scales: a type alias for annotations and ``isinstance`` checks."""

_LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def check_loss_scale(value: Any, what: str) -> LossScale:
    """``value`` if it is one of the three loss scales; the validator of that concept."""
    if not isinstance(value, _LOSS_SCALE_TYPES):
        raise TypeError(
            f"{what} must be a NoOpLossScale, StaticLossScale or DynamicLossScale "
            f"(e.g. jmp_lite.DynamicLossScale(2.0**15)), got {type(value).__name__}"
        )
    return value


def _same_values(a: Any, b: Any) -> bool:
    """Value equality of two concrete leaves (what jmp's dataclass ``==`` computes)."""
    if a is b:
        return True
    if is_tracer(a) or is_tracer(b):
        raise TypeError("loss scales holding traced values cannot be compared with ==; compare the leaves")
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _new(cls: type, **fields: Any) -> Any:
    # Unflatten must not validate: jax and orbax rebuild nodes with None,
    # object() or PartitionSpec leaves.
    obj = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(obj, k, v)
    return obj


tree_util.register_pytree_with_keys(
    NoOpLossScale,
    lambda x: ((), None),
    lambda aux, children: NoOpLossScale(),
    flatten_func=lambda x: ((), None),
)
tree_util.register_pytree_with_keys(
    StaticLossScale,
    lambda x: (((tree_util.GetAttrKey("loss_scale"), x.loss_scale),), None),
    lambda aux, children: _new(StaticLossScale, loss_scale=children[0]),
    flatten_func=lambda x: ((x.loss_scale,), None),
)


def _dyn_aux(x: DynamicLossScale) -> tuple[int, float, float, float]:
    return (x.period, x.factor, x.min_loss_scale, x.max_loss_scale)


def _dyn_unflatten(aux: tuple[int, float, float, float], children: Any) -> DynamicLossScale:
    period, factor, lo, hi = aux
    scale, counter = children
    return _new(
        DynamicLossScale,
        loss_scale=scale,
        counter=counter,
        period=period,
        factor=factor,
        min_loss_scale=lo,
        max_loss_scale=hi,
    )


tree_util.register_pytree_with_keys(
    DynamicLossScale,
    lambda x: (
        (
            (tree_util.GetAttrKey("loss_scale"), x.loss_scale),
            (tree_util.GetAttrKey("counter"), x.counter),
        ),
        _dyn_aux(x),
    ),
    _dyn_unflatten,
    flatten_func=lambda x: ((x.loss_scale, x.counter), _dyn_aux(x)),
)


def all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: whether every element of every leaf is finite.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> bool(jmp_lite.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    leaves = jax.tree_util.tree_leaves(finite_leaves(tree))
    if not leaves:
        return jnp.array(True)
    return jnp.stack(leaves).all()


def finite_leaves(tree: T) -> T:
    """A bool scalar per leaf of ``tree`` (same structure): whether all its elements are finite.

    ``all_finite`` reduces these flags, so a caller that wants both (``loss_scaling``'s
    ``record_nonfinite``) reads the gradients once.
    """
    # A boolean and-reduce per leaf. sum(x * 0) (NaN iff any element is not
    # finite) is 1.5x faster in isolation on CPU but fused worse inside a full
    # train step (5% slower step, benchmarks/skip_mechanisms.py), so it is not used.
    return jax.tree_util.tree_map(lambda x: jnp.isfinite(x).all(), tree)


def select_tree(pred: Any, a: T, b: T) -> T:
    """Leafwise ``a if pred else b`` for a boolean scalar ``pred`` (as jmp).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
        Array([0., 0.], dtype=float32)
    """
    pred = validate.bool_scalar(pred, "select_tree(pred)")
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)


def keep_if_skipped(finite: Any, new: T, old: Any) -> T:
    """The one skip rule: ``new`` if ``finite``, else ``old`` (a skipped step keeps the old values).

    The kept values take ``new``'s dtypes, as the step would have given them
    (an integer leaf's momentum becomes float, ``inject_hyperparams``' values
    change dtype on their first update), so a skipped step and an applied one
    return the same types. Built on ``select_tree``; every skip-safe step in
    jmp_lite (``loss_scaling``, ``apply_scaled_gradients``, Linen's
    ``TrainState``, NNX's ``LossScaledOptimizer``) keeps values through it.
    """
    as_new = jax.tree_util.tree_map(lambda n, o: jnp.asarray(o).astype(jnp.result_type(n)), new, old)
    return select_tree(finite, new, as_new)
