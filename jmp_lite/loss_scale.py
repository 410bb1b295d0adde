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
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

T = TypeVar("T")

_F32_MAX = float(np.finfo(np.float32).max)


def _concrete_float(x: Any) -> float | None:
    """``x`` as a Python float if its value is known now, else None (a tracer)."""
    try:
        return float(np.asarray(x))
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _hyper_float(value: Any, what: str) -> float:
    """Converts a static hyperparameter to a finite Python float."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number, got {value!r}")
    v = _concrete_float(value)
    if v is None:
        raise TypeError(f"{what} must be a concrete number (it is static pytree data), got a tracer")
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v


def _scale_leaf(loss_scale: Any, what: str) -> jax.Array:
    """The scale as a float32 scalar array, checked when its value is known."""
    if isinstance(loss_scale, bool):
        raise TypeError(f"{what} must be a positive number, got {loss_scale!r}")
    arr = jnp.asarray(loss_scale)
    if arr.shape != ():
        raise ValueError(f"{what} must be a scalar, got shape {arr.shape}")
    if not jnp.issubdtype(arr.dtype, jnp.number):
        raise TypeError(f"{what} must be a positive number, got dtype {arr.dtype}")
    arr = arr.astype(jnp.float32)
    value = _concrete_float(arr)
    if value is not None and not (0 < value < math.inf):
        raise ValueError(f"{what} must be positive and finite, got {value}")
    return arr


def _apply(tree: T, factor: jax.Array) -> T:
    # Same promotion as jmp: a f16/bf16 leaf times the f32 scale becomes f32.
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
        object.__setattr__(self, "loss_scale", _scale_leaf(loss_scale, "StaticLossScale.loss_scale"))

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
    whatever dtype is passed; both are the only pytree leaves.

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
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"DynamicLossScale.period must be a positive int, got {period!r}")
        factor_f = _hyper_float(factor, "DynamicLossScale.factor")
        if factor_f <= 1:
            raise ValueError(f"DynamicLossScale.factor must be > 1, got {factor!r}")
        lo = _hyper_float(min_loss_scale, "DynamicLossScale.min_loss_scale")
        hi = _hyper_float(max_loss_scale, "DynamicLossScale.max_loss_scale")
        if not 0 < lo <= hi <= _F32_MAX:
            raise ValueError(
                "DynamicLossScale needs 0 < min_loss_scale <= max_loss_scale <= float32 max, "
                f"got min_loss_scale={lo}, max_loss_scale={hi}"
            )
        scale = _scale_leaf(loss_scale, "DynamicLossScale.loss_scale")
        value = _concrete_float(scale)
        if value is not None and not lo <= value <= hi:
            raise ValueError(
                f"DynamicLossScale.loss_scale={value} is outside "
                f"[min_loss_scale, max_loss_scale] = [{lo}, {hi}]"
            )
        count = jnp.asarray(counter)
        if count.shape != () or not jnp.issubdtype(count.dtype, jnp.integer):
            raise ValueError(f"DynamicLossScale.counter must be an integer scalar, got {counter!r}")
        count_value = _concrete_float(count)
        if count_value is not None and not 0 <= count_value < period:
            raise ValueError(
                f"DynamicLossScale.counter must be in [0, period={period}), got {int(count_value)}"
            )
        # Keep a whole-number factor an int so ``repr`` and pytree aux data read as in jmp.
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", count.astype(jnp.int32))
        object.__setattr__(self, "period", int(period))
        object.__setattr__(self, "factor", int(factor_f) if factor_f.is_integer() else factor_f)
        object.__setattr__(self, "min_loss_scale", lo)
        object.__setattr__(self, "max_loss_scale", hi)

    def scale(self, tree: T) -> T:
        """Multiplies every leaf by the scale."""
        return _apply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Multiplies every leaf by ``1 / loss_scale``."""
        return _apply(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were finite."""
        finite = jnp.asarray(grads_finite)
        if finite.shape != () or finite.dtype != jnp.bool_:
            raise ValueError(
                f"adjust expects a boolean scalar, got dtype {finite.dtype} shape {finite.shape}"
            )
        at_period = self.counter == self.period - 1
        grown = self.loss_scale * jnp.float32(self.factor)
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale), self.loss_scale)
        shrunk = jnp.maximum(self.loss_scale / jnp.float32(self.factor), self.min_loss_scale)
        scale = jnp.where(finite, jnp.where(at_period, grown, self.loss_scale), shrunk)
        counter = jnp.where(finite, (self.counter + 1) % self.period, 0)
        return _new(
            DynamicLossScale,
            **{
                **self.__dict__,
                "loss_scale": scale.astype(jnp.float32),
                "counter": counter.astype(jnp.int32),
            },
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss scales: a type alias for annotations and ``isinstance`` checks."""

LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


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
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if x is not None]
    if not leaves:
        return jnp.array(True)
    # A boolean and-reduce per leaf. sum(x * 0) (NaN iff any element is not
    # finite) is 1.5x faster in isolation on CPU but fused worse inside a full
    # train step (5% slower step, benchmarks/skip_mechanisms.py), so it is not used.
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: Any, a: T, b: T) -> T:
    """Leafwise ``a if pred else b`` for a boolean scalar ``pred`` (as jmp).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
        Array([0., 0.], dtype=float32)
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(
            f"select_tree expects a boolean scalar pred, got dtype {pred.dtype} shape {pred.shape}"
        )
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)


def _register_flax_serialization() -> None:
    from flax import serialization

    serialization.register_serialization_state(NoOpLossScale, lambda x: {}, lambda target, state: target)
    serialization.register_serialization_state(
        StaticLossScale,
        lambda x: {"loss_scale": x.loss_scale},
        lambda target, state: _new(StaticLossScale, loss_scale=jnp.asarray(state["loss_scale"])),
    )
    serialization.register_serialization_state(
        DynamicLossScale,
        lambda x: {"loss_scale": x.loss_scale, "counter": x.counter},
        lambda target, state: _new(
            DynamicLossScale,
            **{
                **target.__dict__,
                "loss_scale": jnp.asarray(state["loss_scale"], jnp.float32),
                "counter": jnp.asarray(state["counter"], jnp.int32),
            },
        ),
    )


_register_flax_serialization()
