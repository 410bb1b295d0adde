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
  then skips;
* a restored state (a checkpoint) is checked where it enters: its structure,
  shapes and dtypes are static, so ``arrays_like`` checks them when the step
  is traced, under ``jit`` too; its values only when they are concrete
  (``finite_values``).

The check that a value is a loss scale lives next to the loss-scale classes
(``loss_scale.check_loss_scale``), which import this module.
"""

from __future__ import annotations

import warnings
from collections import Counter
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
    from jmp_lite._src.base.policy import Policy, get_policy  # validate sits below policy in the layers

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


def finite_number(value: Any, what: str) -> float:
    """A concrete real number, finite in float32 (a setting fixed when a kernel is traced, e.g. an
    attention scale), as the Python float it was given as (not rounded to float32)."""
    v = _real(value, what)
    if is_tracer(v):
        raise TypeError(
            f"{what} must be a concrete number (the kernel is built for it when traced), got a tracer; "
            "pass a Python or numpy number"
        )
    with np.errstate(over="ignore"):
        finite = np.isfinite(np.float32(v))
    if not finite:
        raise ValueError(f"{what}={value!r} is not a finite float32 (largest is {F32_MAX:.8g})")
    return float(v)


def array(value: Any, what: str, kind: Any = None) -> jax.Array:
    """An array argument (or what ``jnp.asarray`` takes: a number, a nested list) as a jax array; with
    ``kind`` (``jnp.floating``, ``jnp.integer``, ``jnp.bool_``) its dtype must be of that kind."""
    name = {None: "an", jnp.floating: "a floating", jnp.integer: "an integer", jnp.bool_: "a boolean"}[kind]
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be {name} array, got {type(value).__name__}: {value!r:.60}")
    try:
        arr = jnp.asarray(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be {name} array, got {type(value).__name__}: {value!r:.60}") from None
    if kind is not None and not jnp.issubdtype(arr.dtype, kind):
        raise TypeError(f"{what} has dtype {arr.dtype}; it must be {name} array")
    return arr


def prng_key(key: Any, what: str) -> tuple[jax.Array, Any]:
    """One PRNG key, typed or raw; returns a copy of its raw data and its implementation (``None``: the
    default). A copy: a donated state must not delete the caller's key."""
    accepted = "a single PRNG key: jax.random.key(seed), or jax.random.PRNGKey(seed) (raw uint32[2])"
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"{what} must be {accepted}, got a batch of keys of shape {key.shape}; pass one key "
                "(every replica must hold the same key for the replicas to round alike)"
            )
        return jnp.array(jax.random.key_data(key)), jax.random.key_impl(key)
    raw_shape = jax.random.key_data(jax.random.key(0)).shape
    if isinstance(key, (np.ndarray, jax.Array)) and key.dtype == np.uint32 and key.shape == raw_shape:
        return jnp.array(key, dtype=jnp.uint32), None
    got = f"{type(key).__name__}" + (f" of dtype {dtype} and shape {key.shape}" if dtype is not None else "")
    raise TypeError(f"{what} must be {accepted}; got {got}: {key!r}")


def _spec(x: Any) -> str:
    """``bfloat16[3]``: an array's (or a ``jax.ShapeDtypeStruct``'s) dtype and shape."""
    return f"{np.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"


def _is_none(x: Any) -> bool:
    return x is None


def arrays_like(value: Any, expected: Any, what: str, *, fix: str = "") -> None:
    """``value`` (a state field, often restored from a checkpoint) has ``expected``'s structure and, leaf
    for leaf, an array of its shape and dtype; ``expected`` is a pytree of ``jax.ShapeDtypeStruct`` (or
    arrays) and ``None`` (where ``value`` must hold ``None`` too). Sequences compare by length and key
    paths, not container type (a checkpoint may give a list for a tuple). Static: it checks tracers too,
    so under ``jit`` it runs when the step is traced. ``fix`` says how to get a good value."""
    tail = f"; {fix}" if fix else ""
    want = jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_none)[0]
    if value is None and expected is not None:
        if not want:  # nothing to hold: a checkpoint may store an empty tuple as None
            return
        kind = (
            _spec(expected)
            if hasattr(expected, "dtype")
            else f"a {type(expected).__name__} of {len(want)} arrays"
        )
        raise TypeError(
            f"{what} is None, expected {kind} (the state was saved or restored without it?){tail}"
        )
    if (
        isinstance(expected, (tuple, list))
        and isinstance(value, (tuple, list))
        and len(value) != len(expected)
    ):
        raise ValueError(f"{what} has {len(value)} entries, expected {len(expected)}{tail}")
    got = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_none)[0]
    want_at = {jax.tree_util.keystr(p): x for p, x in want}
    got_at = {jax.tree_util.keystr(p): x for p, x in got}
    missing = [p for p in want_at if p not in got_at]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}{tail}")
    extra = [p for p in got_at if p not in want_at]
    if extra:
        expected_paths = ", ".join(want_at) or "nothing"
        raise ValueError(
            f"{what} has {', '.join(extra)}, which it should not (expected: {expected_paths}){tail}"
        )
    for path, w in want_at.items():
        x = got_at[path]
        if w is None:
            if x is not None:
                raise TypeError(f"{what}{path} is {type(x).__name__}, expected None{tail}")
            continue
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{what}{path} is {type(x).__name__}, expected {_spec(w)}{tail}")
        if np.dtype(x.dtype) != np.dtype(w.dtype):
            raise TypeError(
                f"{what}{path} has dtype {np.dtype(x.dtype).name}, expected {np.dtype(w.dtype).name}{tail}"
            )
        if tuple(x.shape) != tuple(w.shape):
            raise ValueError(f"{what}{path} has shape {tuple(x.shape)}, expected {tuple(w.shape)}{tail}")


def is_concrete(x: Any) -> bool:
    """``x`` is an array whose values exist now (numpy, or a jax array that is not a tracer): not a
    tracer, a ``jax.ShapeDtypeStruct`` or anything else that only has a shape and dtype."""
    return isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not is_tracer(x))


def finite_values(tree: Any, what: str, *, fix: str = "") -> None:
    """Every floating array of ``tree`` that is concrete holds only finite values (one device-to-host
    transfer for the whole tree). Traced arrays cannot be read in Python and pass unchecked: the caller
    documents what a non-finite value does there.

    A concrete array may reach here while a function is being traced (closed over by ``jax.eval_shape``,
    a ``lax.cond`` branch, or ``jit``): JAX then stages out every operation, so the check would be a
    tracer too. It is evaluated on the spot instead (``jax.ensure_compile_time_eval``)."""
    leaves = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if is_concrete(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not leaves:
        return
    with jax.ensure_compile_time_eval():
        ok = np.asarray(jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in leaves]))
    bad = [jax.tree_util.keystr(path) for (path, _), fine in zip(leaves, ok) if not fine]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        tail = f"; {fix}" if fix else ""
        raise ValueError(f"{what}{bad[0]}{more} holds values that are not finite (NaN or inf){tail}")


def contraction_output(shape: Any, lhs_shape: Any, rhs_shape: Any, what: str) -> None:
    """``shape`` is one a contraction of arrays of ``lhs_shape`` and ``rhs_shape`` can have: each of its
    axes is a distinct axis of one operand (a batch or free axis), so its sizes are among theirs."""
    shape, lhs_shape, rhs_shape = tuple(shape), tuple(lhs_shape), tuple(rhs_shape)
    if Counter(shape) - (Counter(lhs_shape) + Counter(rhs_shape)):
        example = lhs_shape[:-1] + rhs_shape[1:] if lhs_shape and rhs_shape else ()
        raise ValueError(
            f"{what} has shape {shape}, which no contraction of lhs {lhs_shape} and rhs {rhs_shape} "
            f"produces: each of its axes is a batch or free axis of lhs or rhs (e.g. {example} for "
            "lhs @ rhs); pass the gradient of this layer's output"
        )
