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
import functools
import importlib.abc
import sys
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

T = TypeVar("T")

_F32 = np.finfo(np.float32)
_F32_MAX = float(_F32.max)
# The floor of every dynamic scale: below float32's smallest normal number,
# halving loses bits and finally reaches 0, from which nothing recovers.
_F32_TINY = float(_F32.tiny)
_INT32_MAX = int(np.iinfo(np.int32).max)


class _ExpectedScalarError(ValueError, AssertionError):
    """A ValueError that is also the AssertionError jmp raises for the same mistake."""


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _real_scalar(value: Any, what: str) -> Any:
    """``value`` as a numpy real scalar or a traced jax scalar; refuses bools, strings, complex."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.generic, np.ndarray, jax.Array)
    ):
        raise TypeError(
            f"{what} must be a real number (Python, numpy or jax scalar), got {value!r} "
            f"({type(value).__name__})"
        )
    if isinstance(value, int) and not isinstance(value, np.integer):
        try:
            return np.float64(float(value))  # float(): 2**32 is fine, a Python int has no int32 limit
        except OverflowError:
            raise ValueError(f"{what}={value} is not representable as a float32") from None
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.dtype(type(value))
    # jnp.issubdtype: it knows bfloat16 and the fp8 types are floating, numpy does not.
    if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{what} must be a real number, got dtype {dtype}")
    if np.shape(value) != ():
        raise ValueError(f"{what} must be a scalar, got shape {np.shape(value)}")
    return value if _is_tracer(value) else np.asarray(value)[()]


def _to_f32(value: Any, what: str) -> np.float32:
    """A concrete real scalar rounded to float32 (the dtype it is used in), checked finite."""
    with np.errstate(over="ignore"):
        v = np.float32(value)
    if not np.isfinite(v):
        raise ValueError(f"{what}={value!r} is not a finite float32 (largest is {_F32_MAX:.8g})")
    return v


def _warn_if_not_floating(value: Any, what: str) -> None:
    # jmp's warning, with jmp's wording: an integer scale is almost always a typo for a float.
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.dtype(type(value))
    if not jnp.issubdtype(dtype, jnp.floating):
        name = "int32" if isinstance(value, int) else dtype.name
        warnings.warn(f"Expected floating type for {what}, got {name}; it is used as float32", stacklevel=4)


def _scale_leaf(loss_scale: Any, what: str, *, warn_int: bool = False) -> jax.Array:
    """The scale as a float32 scalar array; a concrete value must be positive and finite.

    A Python scalar (or weakly typed array) gives a weakly typed float32, so that,
    as in jmp, ``scale``/``unscale`` keep float16 and bfloat16 leaves in their dtype.
    """
    value = _real_scalar(loss_scale, what)
    if warn_int:
        _warn_if_not_floating(loss_scale, what.rsplit(".", 1)[-1])
    if _is_tracer(value):
        return value if value.dtype == jnp.float32 else value.astype(jnp.float32)
    v = _to_f32(value, what)
    if not v > 0:
        raise ValueError(f"{what} must be positive and finite in float32, got {loss_scale!r}")
    weak = isinstance(loss_scale, (int, float)) or getattr(loss_scale, "weak_type", False)
    arr = jnp.asarray(float(v)) if weak else jnp.asarray(v)
    # Under x64 a Python float is a weak float64: the leaf is always float32 (strong then).
    return arr if arr.dtype == jnp.float32 else arr.astype(jnp.float32)


def _hyper_f32(value: Any, what: str) -> float:
    """A static hyperparameter: a concrete real number, returned as the float32 value it is used as."""
    value = _real_scalar(value, what)
    if _is_tracer(value):
        raise TypeError(f"{what} must be a concrete number (it is static pytree data), got a tracer")
    return float(_to_f32(value, what))


def _bound_f32(value: Any, what: str, *, up: bool) -> float:
    """A concrete bound as a float32 value, rounded towards the inside of the interval."""
    v = np.float32(_hyper_f32(value, what))
    exact = float(_real_scalar(value, what))
    if up and float(v) < exact:
        v = np.nextafter(v, np.float32(np.inf))
    elif not up and float(v) > exact:
        v = np.nextafter(v, np.float32(-np.inf))
    return float(v)


def _whole_number(value: Any, what: str, *, low: int = 1, high: int = _INT32_MAX) -> int:
    """A concrete whole number in ``[low, high]`` as a Python int.

    Shared by every count-like hyperparameter (``DynamicLossScale.period``,
    ``loss_scaling(max_consecutive_skips=)``): Python and numpy ints are
    accepted, and so is a whole float as jmp does (``period=5.``); bools,
    strings, fractions and tracers are refused. ``high`` defaults to the int32
    maximum because the counters these are compared with are int32.
    """
    original, value = value, _real_scalar(value, what)
    if _is_tracer(value):
        raise TypeError(f"{what} must be a concrete int (it is static pytree data), got a tracer")
    if not (np.isfinite(value) and float(value).is_integer() and low <= value <= high):
        raise ValueError(f"{what} must be a whole number in [{low}, {high}], got {original!r}")
    return int(value)


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
        scale = _scale_leaf(loss_scale, "StaticLossScale.loss_scale")
        if _is_tracer(scale):
            # Built from a traced value (inside jit with a traced argument): Python
            # cannot check it, so an invalid scale becomes NaN, which makes every
            # step's loss and gradients NaN: visible at once, and skipped by loss_scaling.
            scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, jnp.nan)
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
        period = _whole_number(period, "DynamicLossScale.period")
        factor_f = _hyper_f32(factor, "DynamicLossScale.factor")
        if not factor_f > 1:
            raise ValueError(
                f"DynamicLossScale.factor must be > 1 in float32, where it is used; got {factor!r}, "
                f"which is {factor_f!r} in float32 (the smallest factor above 1 is 1 + 2**-23)"
            )
        _warn_if_not_floating(
            _real_scalar(min_loss_scale, "DynamicLossScale.min_loss_scale"), "min_loss_scale"
        )
        # Bounds are rounded inwards to float32, the dtype the scale lives in, so
        # the scale never leaves [min_loss_scale, max_loss_scale] as written.
        lo = _bound_f32(min_loss_scale, "DynamicLossScale.min_loss_scale", up=True)
        hi = _bound_f32(max_loss_scale, "DynamicLossScale.max_loss_scale", up=False)
        if lo < 0 or 0 < lo < _F32_TINY:
            raise ValueError(
                f"DynamicLossScale.min_loss_scale={min_loss_scale!r} is negative or subnormal in float32; "
                f"it must be 0 (jmp's 'no floor': the scale then stops at float32's smallest normal "
                f"number, {_F32_TINY:.8g}) or >= {_F32_TINY:.8g}; a subnormal floor lets halving reach 0, "
                "after which every step is skipped"
            )
        if not lo <= hi:
            raise ValueError(
                "DynamicLossScale needs min_loss_scale <= max_loss_scale with a float32 value between "
                f"them, got min_loss_scale={min_loss_scale!r}, max_loss_scale={max_loss_scale!r}"
            )
        floor = max(lo, _F32_TINY)
        scale = _scale_leaf(loss_scale, "DynamicLossScale.loss_scale", warn_int=True)
        if _is_tracer(loss_scale):
            # Built from a traced value (e.g. inside jit from a traced argument):
            # Python cannot check it, so clamp into [min, max] with jnp; NaN starts at the top.
            scale = jnp.clip(jnp.where(jnp.isnan(scale), hi, scale), floor, hi)
        else:
            # A concrete value (also a Python constant inside jit or pmap) is checked here.
            exact = float(_real_scalar(loss_scale, "DynamicLossScale.loss_scale"))
            if not float(min_loss_scale) <= exact <= float(max_loss_scale):
                raise ValueError(
                    f"DynamicLossScale.loss_scale={loss_scale!r} is outside "
                    f"[min_loss_scale, max_loss_scale] = [{min_loss_scale!r}, {max_loss_scale!r}]"
                )
            v32 = float(np.float32(exact))
            clamped = min(max(v32, floor), hi)  # rounding to float32 may step one ulp out
            if clamped != v32:
                weak = isinstance(loss_scale, (int, float)) or getattr(loss_scale, "weak_type", False)
                scale = jnp.asarray(clamped) if weak else jnp.asarray(np.float32(clamped))
        if isinstance(counter, (bool, np.bool_)):
            raise TypeError(f"DynamicLossScale.counter must be an integer scalar, got {counter!r}")
        count = counter if _is_tracer(counter) else np.asarray(counter)
        if count.shape != () or not jnp.issubdtype(count.dtype, jnp.integer):
            raise ValueError(f"DynamicLossScale.counter must be an integer scalar, got {counter!r}")
        if _is_tracer(count):
            count = jnp.clip(count, 0, period - 1)  # traced: clamp with jnp
        elif not 0 <= int(count) < period:
            raise ValueError(f"DynamicLossScale.counter must be in [0, period={period}), got {int(count)}")
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", jnp.asarray(count, jnp.int32))
        object.__setattr__(self, "period", period)
        # Keep a whole-number factor an int so ``repr`` and pytree aux data read as in jmp.
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
            raise _ExpectedScalarError(
                "DynamicLossScale.adjust: expected boolean scalar grads_finite, "
                f"got dtype {finite.dtype} shape {finite.shape}"
            )
        at_period = self.counter == self.period - 1
        grown = self.loss_scale * jnp.float32(self.factor)
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale), self.loss_scale)
        floor = max(self.min_loss_scale, _F32_TINY)  # 0 (jmp's "no floor") stops at the smallest normal
        shrunk = jnp.maximum(self.loss_scale / jnp.float32(self.factor), floor)
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


def _same_values(a: Any, b: Any) -> bool:
    """Value equality of two concrete leaves (what jmp's dataclass ``==`` computes)."""
    if a is b:
        return True
    if _is_tracer(a) or _is_tracer(b):
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
        raise _ExpectedScalarError(
            f"select_tree: expected boolean scalar pred, got dtype {pred.dtype} shape {pred.shape}"
        )
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)


def _register_flax_serialization(serialization: Any) -> None:
    # override=True: registering twice (a reload, or the hook racing an import) is harmless.
    register = functools.partial(serialization.register_serialization_state, override=True)
    register(NoOpLossScale, lambda x: {}, lambda target, state: target)
    register(
        StaticLossScale,
        lambda x: {"loss_scale": x.loss_scale},
        lambda target, state: _new(StaticLossScale, loss_scale=jnp.asarray(state["loss_scale"])),
    )
    register(
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


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps the loader of ``flax.serialization`` to register our states once it has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register_flax_serialization(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and tools
        return getattr(self._loader, name)


class _FlaxSerializationHook(importlib.abc.MetaPathFinder):
    """A post-import hook: flax stays an optional extra that ``import jmp_lite`` never loads."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "flax.serialization":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


if "flax.serialization" in sys.modules:
    _register_flax_serialization(sys.modules["flax.serialization"])
elif not any(isinstance(f, _FlaxSerializationHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _FlaxSerializationHook())
