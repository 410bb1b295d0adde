"""Argument validators: one per concept, shared by every public entry point.

Each validator takes the value and ``what``, the argument's public name
(``"DynamicLossScale.period"``), and returns the value in the form it is used
in, or raises a ``TypeError`` (wrong kind of value) or ``ValueError`` (right
kind, wrong value) naming ``what``, the value, and what is accepted. Rules that
hold everywhere:

* numbers are Python, numpy or jax real scalars; bools, strings, complex
  numbers and arrays of rank > 0 are refused;
* counts (``period``, ``max_consecutive_skips``, ``margin_bits``, a
  ``counter``) are whole numbers: ``3``, ``np.int64(3)`` and ``3.0`` are the
  same count, as in jmp, whose own tests pass ``period=5.``; ``2.5`` is refused;
* flags are ``True`` or ``False`` (numpy bools too), never any truthy value;
* a value that ends up in a float32 leaf is checked in float32, the dtype it
  is used in;
* a traced value (inside ``jit``) cannot be checked in Python: it is passed
  through and the caller clamps it, or turns it into NaN, which every step
  then skips.

The check that a value is a loss scale lives next to the loss-scale classes
(``loss_scale.check_loss_scale``), which import this module.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32_MAX = float(np.finfo(np.float32).max)
# The floor of every dynamic scale: below float32's smallest normal number,
# halving loses bits and finally reaches 0, from which nothing recovers.
F32_TINY = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


class ExpectedScalarError(ValueError, AssertionError):
    """A ValueError that is also the AssertionError jmp raises for the same mistake."""


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _dtype(value: Any) -> np.dtype:
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.dtype(type(value))


def _real(value: Any, what: str) -> Any:
    """``value`` as a numpy real scalar, or a traced jax scalar."""
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
    dtype = _dtype(value)
    # jnp.issubdtype: it knows bfloat16 and the fp8 types are floating, numpy does not.
    if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{what} must be a real number, got dtype {dtype}")
    if np.shape(value) != ():
        raise ValueError(f"{what} must be a scalar, got shape {np.shape(value)}")
    return value if is_tracer(value) else np.asarray(value)[()]


def _concrete(value: Any, what: str) -> Any:
    value = _real(value, what)
    if is_tracer(value):
        raise TypeError(f"{what} must be a concrete number (it is static pytree data), got a tracer")
    return value


def _float32(value: Any, what: str) -> np.float32:
    with np.errstate(over="ignore"):
        v = np.float32(value)
    if not np.isfinite(v):
        raise ValueError(f"{what}={value!r} is not a finite float32 (largest is {F32_MAX:.8g})")
    return v


def warn_if_not_floating(value: Any, what: str) -> None:
    """jmp's warning, in jmp's words: an integer scale is almost always a typo for a float."""
    if not jnp.issubdtype(_dtype(value), jnp.floating):
        name = "int32" if isinstance(value, int) else _dtype(value).name
        warnings.warn(f"Expected floating type for {what}, got {name}; it is used as float32", stacklevel=4)


def positive_scale(value: Any, what: str, *, warn_int: bool = False) -> jax.Array:
    """A loss scale as a float32 scalar array: positive and finite in float32 when concrete.

    A Python scalar (or weakly typed array) gives a weakly typed float32, so that,
    as in jmp, scaling keeps float16 and bfloat16 leaves in their dtype. A traced
    value comes back as float32, unchecked.
    """
    v = _real(value, what)
    if warn_int:
        warn_if_not_floating(value, what.rsplit(".", 1)[-1])
    if is_tracer(v):
        return v if v.dtype == jnp.float32 else v.astype(jnp.float32)
    f = _float32(v, what)
    if not f > 0:
        raise ValueError(f"{what} must be positive and finite in float32, got {value!r}")
    weak = isinstance(value, (int, float)) or getattr(value, "weak_type", False)
    arr = jnp.asarray(float(f)) if weak else jnp.asarray(f)
    # Under x64 a Python float is a weak float64: the leaf is always float32 (strong then).
    return arr if arr.dtype == jnp.float32 else arr.astype(jnp.float32)


def nan_unless_positive(scale: jax.Array) -> jax.Array:
    """A traced scale that Python could not check: NaN unless positive and finite."""
    return jnp.where((scale > 0) & jnp.isfinite(scale), scale, jnp.nan)


def factor(value: Any, what: str) -> int | float:
    """A growth factor: above 1 in float32; a whole number comes back as an int (jmp's repr)."""
    f = float(_float32(_concrete(value, what), what))
    if not f > 1:
        raise ValueError(
            f"{what} must be > 1 in float32, where it is used; got {value!r}, which is {f!r} in float32 "
            "(the smallest factor above 1 is 1 + 2**-23)"
        )
    return int(f) if f.is_integer() else f


class ScaleBounds(NamedTuple):
    """``[low, high]`` rounded inwards to float32, and as written (to check a scale against)."""

    low: float
    high: float
    low_as_written: float
    high_as_written: float


def scale_bounds(low: Any, high: Any, what: str) -> ScaleBounds:
    """``what.min_loss_scale`` and ``what.max_loss_scale``, rounded inwards to float32.

    Rounding inwards keeps a float32 scale inside ``[low, high]`` as written. ``low``
    is 0 (jmp's "no floor": the scale then stops at float32's smallest normal number)
    or at least that number: a subnormal floor lets halving reach 0.
    """
    written = []
    for value, name, up in ((low, "min_loss_scale", True), (high, "max_loss_scale", False)):
        exact = _concrete(value, f"{what}.{name}")
        if up:
            warn_if_not_floating(value, name)
        v = _float32(exact, f"{what}.{name}")
        if up and float(v) < float(exact):
            v = np.nextafter(v, np.float32(np.inf))
        elif not up and float(v) > float(exact):
            v = np.nextafter(v, np.float32(-np.inf))
        written.append((float(v), float(exact)))
    (lo, lo_exact), (hi, hi_exact) = written
    if lo < 0 or 0 < lo < F32_TINY:
        raise ValueError(
            f"{what}.min_loss_scale={low!r} is negative or subnormal in float32; it must be 0 (jmp's "
            f"'no floor': the scale then stops at float32's smallest normal number, {F32_TINY:.8g}) or "
            f">= {F32_TINY:.8g}; a subnormal floor lets halving reach 0, after which every step is skipped"
        )
    if not lo <= hi:
        raise ValueError(
            f"{what} needs min_loss_scale <= max_loss_scale with a float32 value between them, got "
            f"min_loss_scale={low!r}, max_loss_scale={high!r}"
        )
    return ScaleBounds(lo, hi, lo_exact, hi_exact)


def whole_number(value: Any, what: str, *, low: int = 1, high: int = INT32_MAX) -> int:
    """A count in ``[low, high]`` as a Python int; ``high`` defaults to int32's maximum (the counters)."""
    v = _concrete(value, what)
    if not (np.isfinite(v) and float(v).is_integer() and low <= v <= high):
        raise ValueError(f"{what} must be a whole number in [{low}, {high}], got {value!r}")
    return int(v)


def fraction(value: Any, what: str) -> float:
    """A threshold fraction in ``[0, 1)`` as a Python float."""
    v = float(_concrete(value, what))
    if not 0 <= v < 1:
        raise ValueError(f"{what} must be a fraction in [0, 1), got {value!r}")
    return v


def flag(value: Any, what: str) -> bool:
    """``True`` or ``False`` (numpy bools too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def flags(**values: Any) -> None:
    """Each keyword argument is ``True`` or ``False`` (the message names the keyword)."""
    for what, value in values.items():
        flag(value, what)


def function(value: Any, what: str) -> Any:
    """A callable."""
    if not callable(value):
        raise TypeError(f"{what} must be callable, got {type(value).__name__}")
    return value


def choice(value: Any, what: str, options: Sequence[Any]) -> Any:
    """One of ``options`` (strings, or ``None``)."""
    if not ((value is None and None in options) or (isinstance(value, str) and value in options)):
        raise ValueError(f"{what} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def bool_scalar(value: Any, what: str) -> jax.Array:
    """A boolean scalar array (a predicate), as jmp requires."""
    value = jnp.asarray(value)
    if value.shape != () or value.dtype != jnp.bool_:
        raise ExpectedScalarError(
            f"{what}: expected boolean scalar, got dtype {value.dtype} shape {value.shape}"
        )
    return value


def gradient_transformation(value: Any, what: str) -> optax.GradientTransformation:
    """An optax transformation; an ``optax.MultiSteps`` object gives its transformation."""
    if hasattr(value, "gradient_transformation"):  # optax.MultiSteps
        value = value.gradient_transformation()
    if not isinstance(value, optax.GradientTransformation):
        raise TypeError(
            f"{what} must be an optax.GradientTransformation or optax.MultiSteps, got {type(value).__name__}"
        )
    return value


def policy(value: Any, what: str, *, optional: bool = False) -> Any:
    """A ``Policy``, from a ``Policy`` or a policy string (``None`` too when ``optional``): the one
    coercer every entry point that takes a policy uses."""
    from jmp_lite._src.policy import Policy, get_policy  # validate sits below policy in the layers

    if value is None and optional:
        return None
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return get_policy(value)
    accepted = "a jmp_lite.Policy or a policy string such as 'p=f32,c=bf16,o=f32'" + (" or None" * optional)
    raise TypeError(f"{what} must be {accepted}, got {type(value).__name__}: {value!r:.60}")


def rules(value: Any) -> Any:
    """``rules=``: a mapping, ``None``, or what ``suggest_rules`` returns (an object whose type has
    ``__jmp_lite_rules__``), given as the mapping it holds. The callers check the mapping itself."""
    own = getattr(type(value), "__jmp_lite_rules__", None)
    return value if own is None else own(value)
