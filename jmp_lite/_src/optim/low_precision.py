"""Training with 16-bit parameters and 16- or 8-bit optimizer state, without a float32 master copy.

Mixed precision (Micikevicius et al., 2018, "Mixed Precision Training") keeps a float32 master
copy of the weights because a bfloat16 weight ``w`` ignores any update smaller than about
``|w| / 2**8`` (``2**-11`` in float16): round to nearest sends ``w + u`` back to ``w``. With
float32 parameters and Adam's two float32 moments a parameter costs 16 bytes (weights, gradient
buffer aside). The three transformations here cut that to 8 or fewer:

- ``kahan_summation()``: 16-bit parameters plus a 16-bit compensation buffer that carries what
  each rounding lost into the next step (Kahan, 1965, "Further remarks on reducing truncation
  errors"; Zamirai et al., 2020, "Revisiting BFloat16 Training").
- ``stochastic_rounding(key)``: 16-bit parameters rounded up or down at random, with the
  probabilities that make the rounding exact on average (Gupta et al., 2015, "Deep Learning with
  Limited Numerical Precision").
- ``low_precision_state(inner, dtype)``: any optimizer's floating state (Adam's ``mu`` and ``nu``,
  momentum) stored in 16 bits between steps and computed in float32, or in 8 bits with a float32
  scale per block (``"int8"``, ``"float8_e4m3fn"``; the quantization is in ``quantized_state``).

Every rounding here is written as ``jax.lax.reduce_precision`` (plus an explicit branch for
float16 subnormals, which XLA:CPU's ``reduce_precision`` flushes), never as a pair of ``convert``
operations: XLA's ``SimplifyFPConversions`` pass (on GPU, and on CPU builds with oneDNN, whenever
``xla_allow_excess_precision`` is on, the default) deletes ``f32 -> bf16 -> f32`` chains, which
would erase the compensation. The casts that remain only ever convert values already on the
16-bit grid, so removing them changes nothing. The 8-bit state is rounded by a search of its
codebook, and its one cast (to float8_e4m3fn) converts a value already on the e4m3fn grid.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from jmp_lite._src.base import dtypes as _dtypes
from jmp_lite._src.base import validate
from jmp_lite._src.optim import quantized_state

WideParams = Literal["error", "pass"]
StateRounding = Literal["stochastic", "kahan", "nearest"]

_PARAM_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_STATE_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
# Distinct streams for the two users of a key, so passing the same key to both cannot correlate
# the rounding of a parameter with that of its own Adam moment.
_PARAM_STREAM, _STATE_STREAM = 0, 1


class KahanSummationState(NamedTuple):
    """State of ``kahan_summation``.

    Attributes:
        kahan_compensation: a pytree like the parameters: for each 16-bit parameter, a buffer of
            the same dtype holding what the last rounding of that parameter lost; ``None`` for
            parameters passed through with ``wide_params="pass"``.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> state = jmp_lite.kahan_summation().init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> state.kahan_compensation["w"]
        Array([0, 0], dtype=bfloat16)
    """

    kahan_compensation: Any


class StochasticRoundingState(NamedTuple):
    """State of ``stochastic_rounding``.

    Attributes:
        param_rounding_key: the raw ``uint32`` data of the PRNG key for the next step (raw data,
            not a typed key, so that orbax, ``pmap`` and ``jnp.where`` handle it as any array).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> state = jmp_lite.stochastic_rounding(jax.random.key(0)).init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> state.param_rounding_key.dtype, state.param_rounding_key.shape
        (dtype('uint32'), (2,))
    """

    param_rounding_key: jax.Array


class LowPrecisionState(NamedTuple):
    """State of ``low_precision_state``.

    Attributes:
        low_precision_inner_state: the inner optimizer's state, its floating arrays stored in the
            low-precision dtype.
        state_compensation: with ``rounding="kahan"``, a tuple with one buffer (same dtype) per
            stored array holding what its rounding lost; ``None`` with stochastic rounding.
        state_rounding_key: with ``rounding="stochastic"``, the raw ``uint32`` PRNG key data for
            the next step; ``None`` with Kahan compensation.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> state = jmp_lite.low_precision_state(optax.adam(1e-3)).init({"w": jnp.ones(2)})
        >>> state.low_precision_inner_state[0].mu["w"].dtype, state.low_precision_inner_state[0].count.dtype
        (dtype(bfloat16), dtype('int32'))
    """

    low_precision_inner_state: Any
    state_compensation: tuple | None
    state_rounding_key: jax.Array | None


def _wrap_key(data: jax.Array, impl: Any) -> jax.Array:
    return jax.random.wrap_key_data(data) if impl is None else jax.random.wrap_key_data(data, impl=impl)


def _key_spec(data: jax.Array) -> jax.ShapeDtypeStruct:
    """What a restored key field must be: the raw data of a key of the transformation's implementation."""
    return jax.ShapeDtypeStruct(data.shape, jnp.uint32)


_KEY_FIX = (
    "init makes it the raw uint32 data of the next step's PRNG key (jax.random.key_data): restore it "
    "with the rest of the state, or start afresh with tx.init(params)"
)


def _described(state: Any) -> str:
    """What a state that is not the expected one is, for an error: ``ScaleByAdamState``, ``tuple
    (ScaleByAdamState, EmptyState)``, ``dict with keys ['mu', 'nu']``."""
    name = type(state).__name__
    if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
        inside = ", ".join(type(x).__name__ for x in state[:4]) + (", ..." if len(state) > 4 else "")
        return f"{name} ({inside})"
    if isinstance(state, dict):
        keys = [str(k) for k in list(state)[:4]] + (["..."] if len(state) > 4 else [])
        return f"{name} with keys [{', '.join(keys)}]"
    return name


def _check_own_state(state: Any, cls: type, what: str) -> None:
    """Refuses a state that ``what``'s ``init`` did not make: another optimizer's (say a float32
    ``optax.adam``'s given to ``low_precision_state``), or a checkpoint restored without its target
    (plain dicts and lists), naming what it got and how such a state is restored."""
    if isinstance(state, cls):
        return
    raise TypeError(
        f"{what}.update expects a {cls.__name__}, got {_described(state)}: a state made by another "
        f"optimizer (e.g. the inner optimizer without {what}), or a checkpoint restored without its target. "
        "A saved state restores only into the structure of the optimizer that saved it: restore it with "
        "that optimizer's tx.init(params) (or jax.eval_shape(tx.init, params)) as the target and update "
        "with that optimizer; a change of optimizer starts from tx.init(params) (docs/checkpoints.md)"
    )


def _floating(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating)


def _round_nearest(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x`` (float32 or wider) rounded to nearest-even on ``dtype``'s grid, in ``x``'s dtype.

    Equal to ``x.astype(dtype).astype(x.dtype)`` (overflow to infinity and dtype's subnormals included),
    but written so that no XLA pass can remove the rounding.
    """
    info = ml_dtypes.finfo(dtype)
    if info.nmant >= jnp.finfo(x.dtype).nmant:
        return x
    out = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    tiny = float(info.smallest_subnormal)
    if tiny >= float(jnp.finfo(x.dtype).smallest_normal):
        # dtype's subnormals are normal numbers in x's dtype, evenly spaced by `tiny`: round them
        # explicitly (XLA:CPU's reduce_precision flushes them to zero, the cast does not).
        sub = jnp.round(x * (1 / tiny)) * tiny  # both products exact: powers of two, no overflow
        out = jnp.where(jnp.abs(x) < float(info.smallest_normal), sub, out)
    return out


def _grid_gap(r: jax.Array, toward_zero: jax.Array, dtype: np.dtype) -> jax.Array:
    """The distance from ``r`` (on ``dtype``'s grid) to its neighbour away from or toward zero."""
    info = ml_dtypes.finfo(dtype)
    _, exp = jnp.frexp(jnp.abs(r))  # |r| = f * 2**exp, f in [0.5, 1); r = 0 gives exp = 0
    binade = jnp.maximum(exp - 1, info.minexp)  # subnormals share the lowest normal binade's gap
    gap = jnp.ldexp(jnp.ones_like(r), binade - info.nmant)
    # Stepping down from a power of two enters the binade below, whose gap is half as wide.
    power_of_two = jnp.abs(r) == jnp.ldexp(jnp.ones_like(r), exp - 1)
    halve = toward_zero & power_of_two & (exp - 1 > info.minexp)
    gap = jnp.where(halve, gap / 2, gap)
    return jnp.where(r == 0, float(info.smallest_subnormal), gap)


def _round_stochastic(x: jax.Array, dtype: np.dtype, uniform: jax.Array) -> jax.Array:
    """``x`` rounded to one of its two neighbours on ``dtype``'s grid, the far one with probability
    (distance to the near one) / (gap between them), using ``uniform`` in [0, 1); in ``x``'s dtype.

    Exactly representable values stay; values that round to nearest to infinity become infinity,
    and no finite value rounds to infinity otherwise.
    """
    info = ml_dtypes.finfo(dtype)
    if info.nmant >= jnp.finfo(x.dtype).nmant:
        return x
    r = _round_nearest(x, dtype)
    diff = x - r  # exact: r is x's nearest neighbour on a coarser grid (Sterbenz)
    toward_zero = (diff != 0) & ((diff > 0) != (r > 0)) & (r != 0)
    gap = _grid_gap(r, toward_zero, dtype)
    other = r + jnp.sign(diff) * gap
    take_other = (uniform * gap < jnp.abs(diff)) & (jnp.abs(other) <= float(info.max))
    return jnp.where(jnp.isfinite(r) & take_other, other, r)


def _check_params(params: Any, what: str, wide_params: WideParams) -> list[bool]:
    """Which leaves get the 16-bit treatment; raises for the others unless ``wide_params="pass"``."""
    if params is None:
        raise ValueError(
            f"{what}.update needs the current parameters: call tx.update(updates, state, params) "
            "(it computes where optax.apply_updates will land)"
        )
    selected = []
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        dtype = np.dtype(jnp.result_type(p))
        if dtype in _PARAM_DTYPES:
            selected.append(True)
        elif wide_params == "pass":
            selected.append(False)
        else:
            raise TypeError(
                f"{what} is for parameters stored in 16 bits (bfloat16 or float16), but parameter "
                f"{jax.tree_util.keystr(path) or '(the root)'} is {dtype.name}. Keep wider parameters out of "
                f"it (optax.masked), or pass wide_params='pass' to apply their updates unchanged"
            )
    return selected


def _check_wide_params(wide_params: Any, what: str) -> WideParams:
    return validate.choice(wide_params, f"{what}: wide_params", ("error", "pass"))


def kahan_summation(*, wide_params: WideParams = "error") -> optax.GradientTransformation:
    """Kahan-compensated updates for parameters stored in bfloat16 or float16, placed last in a chain.

    With parameter ``p``, compensation ``c`` (both 16-bit) and incoming update ``u``, computed in
    float32 with one rounding ``rn`` to the parameter's dtype (round to nearest even)::

        y  = u + c                  # emitted as the update, in float32
        p' = rn(p + y)              # exactly what optax.apply_updates(p, y) computes
        c' = rn(y - (p' - p))       # what that rounding lost, stored in the parameter's dtype

    ``optax.apply_updates`` adds a float32 update to a 16-bit parameter in float32 and casts the sum
    once, ``(p + y).astype(p.dtype)``: the same float32 sum and the same rounding as ``p'`` above,
    so the parameter lands exactly on the value the compensation was computed for (the test
    checks this bitwise against NumPy and ml_dtypes under ``jax.jit``). ``p' - p`` is exact in
    float32 whenever ``p`` and ``p'`` are within a factor ``2**15`` of each other (``2**12`` in
    float16), so ``c'`` is then the rounding error of the step itself, rounded to 16 bits. An
    update below half a unit in the last place of ``p`` accumulates in ``c`` instead of vanishing,
    until it moves ``p``.

    A restored state is checked where ``update`` reads it: a compensation whose structure, shapes or
    dtypes differ from the parameters' (a missing entry, a checkpoint of another model) is refused
    with an error naming the entry, also under ``jax.jit`` (the check runs when the step is traced).
    A compensation that is not finite is refused when it is concrete (an eager ``update``); under
    ``jax.jit`` Python cannot see its values, and it makes that parameter's update, and so the
    parameter, NaN, as a NaN gradient would. It arises only from a corrupted checkpoint or from an
    overflowing update reaching this transformation, which ``loss_scaling`` outside it prevents.

    A parameter and its compensation cost 4 bytes, against 4 for a float32 master copy alone.
    Put it inside ``jmp_lite.loss_scaling`` (``loss_scaling(optax.chain(adam, kahan_summation()),
    ...)``): a skipped step then keeps the compensation bit for bit. (Outside, the zero update of a
    skipped step gives ``p' = rn(p + c)``, which is ``p`` because ``|c|`` is about half an ulp of
    ``p`` at most; only a rare tie moves it.) Kahan (1965), "Further remarks on reducing truncation
    errors"; Zamirai et al. (2020), "Revisiting BFloat16 Training".

    Args:
        wide_params: ``"error"`` (default) refuses a parameter that is not bfloat16 or float16;
            ``"pass"`` applies the updates of those parameters unchanged, without a buffer (a float32
            parameter is its own master copy), for models whose norms or embeddings stay float32.

    Returns:
        An ``optax.GradientTransformation`` whose ``update`` needs ``params`` and emits float32
        updates for the 16-bit parameters.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
        >>> tx = optax.chain(optax.sgd(1e-3), jmp_lite.kahan_summation())
        >>> state = tx.init(params)
        >>> for _ in range(100):  # 100 steps of -1e-3, each below half a bfloat16 ulp of 1.0
        ...     updates, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"]  # round to nearest alone would leave 1.0
        Array([0.898438, 0.898438, 0.898438], dtype=bfloat16)
    """
    what = "kahan_summation"
    wide_params = _check_wide_params(wide_params, what)

    def init_fn(params: Any) -> KahanSummationState:
        selected = iter(_check_params(params, what, wide_params))
        comp = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p) if next(selected) else None, params)
        return KahanSummationState(comp)

    def update_fn(
        updates: Any, state: KahanSummationState, params: Any = None
    ) -> tuple[Any, KahanSummationState]:
        _check_own_state(state, KahanSummationState, what)
        selected = iter(_check_params(params, what, wide_params))
        expected = jax.tree_util.tree_map(
            lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) if next(selected) else None,
            params,
        )
        field = f"{what}.update: state.kahan_compensation"
        fix = (
            "init makes it one buffer per 16-bit parameter, of its shape and dtype (None for a parameter "
            "passed with wide_params='pass'): restore it with the parameters it was saved with, or start "
            "afresh with tx.init(params) (zeros)"
        )
        validate.arrays_like(state.kahan_compensation, expected, field, fix=fix)
        validate.finite_values(state.kahan_compensation, field, fix=fix)

        def leaf(c: Any, p: jax.Array, u: Any) -> tuple[Any, Any]:
            if c is None:
                return u, None
            wide = jnp.promote_types(p.dtype, jnp.float32)
            p32 = p.astype(wide)
            y = jnp.asarray(u).astype(wide) + c.astype(wide)
            landed = _round_nearest(p32 + y, p.dtype)  # = optax.apply_updates(p, y), bit for bit
            c_new = _round_nearest(y - (landed - p32), p.dtype)
            return y, c_new.astype(p.dtype)  # an exact cast: c_new is on the 16-bit grid

        is_none = lambda x: x is None  # noqa: E731
        pairs = jax.tree_util.tree_map(leaf, state.kahan_compensation, params, updates, is_leaf=is_none)
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2  # noqa: E731
        new_updates = jax.tree_util.tree_map(lambda t: t[0], pairs, is_leaf=is_pair)
        comp = jax.tree_util.tree_map(lambda t: t[1], pairs, is_leaf=is_pair)
        return new_updates, KahanSummationState(comp)

    return optax.GradientTransformation(init_fn, update_fn)


def stochastic_rounding(key: Any, *, wide_params: WideParams = "error") -> optax.GradientTransformation:
    """Rounds each updated bfloat16 or float16 parameter stochastically, placed last in a chain.

    With parameter ``p``, incoming update ``u`` and ``s = p + u`` computed in float32, let ``lo`` and
    ``hi`` be the two neighbours of ``s`` in the parameter's dtype. The new parameter is ``hi`` with
    probability ``(s - lo) / (hi - lo)`` and ``lo`` otherwise, so ``E[p'] = s``: an update far below
    a unit in the last place of ``p`` still moves ``p`` on average, where round to nearest drops it
    every time. The emitted float32 update is ``p' - p``, which ``optax.apply_updates`` turns back
    into exactly ``p'`` whenever ``|p'| >= 2**-15 |p|`` (bfloat16; ``2**-12`` in float16; a smaller
    ``p'`` than that means the step cancelled the weight, and it then lands within a float32 unit
    of ``p`` of ``p'``).

    The random numbers come from ``key``, split once per step (the state keeps the next key), one
    stream per parameter: the result is a function of the key, the step count and the values, so a
    run is reproducible and replicas that hold the same key and the same gradients round alike
    (``pmap`` with a replicated state, sharded ``jit``). The state is one key, 8 bytes in all.
    Put it inside ``jmp_lite.loss_scaling`` so a skipped step does not advance the key. Gupta et al.
    (2015), "Deep Learning with Limited Numerical Precision"; Zamirai et al. (2020), "Revisiting
    BFloat16 Training". ``update`` refuses a state whose key is not the raw ``uint32`` data ``init``
    made (``None`` or another dtype or shape, e.g. from a partial restore), also under ``jax.jit``.

    Args:
        key: one PRNG key, ``jax.random.key(seed)`` or ``jax.random.PRNGKey(seed)``; give every
            replica the same one.
        wide_params: ``"error"`` (default) refuses a parameter that is not bfloat16 or float16;
            ``"pass"`` applies the updates of those parameters unchanged.

    Returns:
        An ``optax.GradientTransformation`` whose ``update`` needs ``params`` and emits float32
        updates for the 16-bit parameters.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
        >>> tx = optax.chain(optax.sgd(1e-3), jmp_lite.stochastic_rounding(jax.random.key(0)))
        >>> state = tx.init(params)
        >>> for _ in range(100):  # 100 steps of -1e-3, each below half a bfloat16 ulp of 1.0
        ...     updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # round to nearest: 1.0
        0.9
    """
    what = "stochastic_rounding"
    data, impl = validate.prng_key(key, f"{what} key")
    wide_params = _check_wide_params(wide_params, what)

    def init_fn(params: Any) -> StochasticRoundingState:
        _check_params(params, what, wide_params)
        return StochasticRoundingState(jnp.array(data))

    def update_fn(
        updates: Any, state: StochasticRoundingState, params: Any = None
    ) -> tuple[Any, StochasticRoundingState]:
        _check_own_state(state, StochasticRoundingState, what)
        selected = _check_params(params, what, wide_params)
        field = f"{what}.update: state.param_rounding_key"
        validate.arrays_like(state.param_rounding_key, _key_spec(data), field, fix=_KEY_FIX)
        next_key, step_key = jax.random.split(_wrap_key(state.param_rounding_key, impl))
        step_key = jax.random.fold_in(step_key, _PARAM_STREAM)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        new = treedef.flatten_up_to(updates)
        for i, (p, u) in enumerate(zip(leaves, new)):
            if not selected[i]:
                continue
            wide = jnp.promote_types(p.dtype, jnp.float32)
            p32 = p.astype(wide)
            uniform = jax.random.uniform(jax.random.fold_in(step_key, i), p.shape, wide)
            rounded = _round_stochastic(p32 + jnp.asarray(u).astype(wide), p.dtype, uniform)
            new[i] = rounded - p32
        return treedef.unflatten(new), StochasticRoundingState(jax.random.key_data(next_key))

    return optax.GradientTransformation(init_fn, update_fn)


def _eight_bit_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as one of the 8-bit storage dtypes (``"int8"``, ``jnp.int8``, ``"float8_e4m3fn"``, ...),
    or ``None`` for anything else."""
    if isinstance(dtype, bytes):
        dtype = dtype.decode("ascii", errors="replace")
    if isinstance(dtype, str):
        dtype = dtype.strip().lower()
    if dtype is None or isinstance(dtype, (bool, int, float, complex)):
        return None
    try:
        out = np.dtype(dtype)
    except TypeError:
        return None
    return out if out in quantized_state.DTYPES else None


def _state_dtype(dtype: Any) -> np.dtype:
    what = "low_precision_state dtype"
    accepted = (
        "bfloat16 ('bf16'), float16 ('f16') or float32 ('f32'), or the numpy/jax dtype; or 8 bits with a "
        "float32 scale per block: 'int8' or 'float8_e4m3fn'"
    )
    eight_bit = _eight_bit_dtype(dtype)
    if eight_bit is not None:
        return eight_bit
    try:
        out = _dtypes.as_floating_dtype(dtype, what)
    except (TypeError, ValueError) as e:
        try:  # name a dtype (int16), not its class (<class 'jax.numpy.int16'>)
            got = repr(dtype) if isinstance(dtype, (str, bytes)) or dtype is None else np.dtype(dtype).name
        except TypeError:
            got = repr(dtype)
        raise type(e)(f"{what} must be a floating dtype or int8, got {got}; accepted: {accepted}") from None
    if out in _dtypes.FP8_DTYPES:
        raise ValueError(
            f"{what} {out.name} is an fp8 format this transformation does not store (of the fp8 formats it "
            f"stores float8_e4m3fn, with a float32 scale per block); accepted: {accepted}"
        )
    if out not in _STATE_DTYPES:
        raise ValueError(
            f"{what} {out.name} is wider than the float32 the update runs in; accepted: {accepted}"
        )
    return out


def _stored(x: Any) -> bool:
    # Scalars (hyperparameters, loss scales) keep their dtype: they cost nothing and must stay exact.
    return _floating(x) and x.ndim >= 1


def is_accumulator(path: Any) -> bool:
    """A state leaf under ``optax.MultiSteps``' ``acc_grads`` (by its key path): a running mean of
    micro-batch gradients, which rounding to the state's dtype at every micro-step drifts 50x further
    from float32 than the same ``MultiSteps`` outside the wrapper (bfloat16 and int8 alike), so it stays
    float32; ``memory.state_bytes`` counts it as accumulated gradients."""
    return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name == "acc_grads" for k in path)


def low_precision_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    rounding: StateRounding | None = None,
    key: Any = None,
    block_size: int | None = None,
    min_quantized_size: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps ``inner``'s floating state in ``dtype`` between steps; the update math runs in float32.

    Every floating array of ``inner``'s state with at least one dimension (Adam's ``mu`` and ``nu``,
    momentum traces, any optimizer's accumulators) is stored in ``dtype``. Integer arrays (Adam's
    ``count``) and scalars (hyperparameters) keep their own dtype, and so does, in float32, the
    gradient accumulator (``acc_grads``) of an ``optax.MultiSteps`` given as ``inner``: a mean of
    gradients rounded at every micro-step drifts about 50x further from float32 than the same
    ``MultiSteps`` outside the wrapper. Each ``update``

    1. widens the stored state ``m`` to float32 (``m + c`` with Kahan compensation ``c``; an 8-bit
       array is dequantized) and the incoming gradients to float32;
    2. runs ``inner.update`` on them, so the moments are computed in float32 whatever the
       parameters' dtype;
    3. writes each new state array ``m'`` back in ``dtype``.

    **16 bits** (bfloat16, float16; or float32, which keeps a 16-bit parameter's state in float32):

    - ``rounding="stochastic"`` (default): ``m'`` rounded up or down at random, the far
      neighbour with probability proportional to its closeness, so ``E[stored] = m'``; the
      state adds one key, 8 bytes in all. A key defaults to ``jax.random.key(0)``: the rounding
      noise need not differ between runs, and every replica must use the same one;
    - ``rounding="kahan"``: ``hi = rn(m')`` and ``lo = rn(m' - hi)`` (``m' - hi`` is exact), so
      the pair keeps about twice ``dtype``'s significand bits, at twice the bytes.

    **8 bits** (``"int8"``, ``"float8_e4m3fn"``), block-wise as in Dettmers et al. (2022), "8-bit
    Optimizers via Block-wise Quantization": each array of at least ``min_quantized_size`` elements
    becomes a ``QuantizedArray``, one byte per element plus one float32 scale per block of
    ``block_size`` elements along its last axis (shape ``(*shape[:-1], ceil(last / block_size))``,
    so a block never straddles two shards of a leading axis and the scales shard like the values).
    Each block stores ``z = m' / a`` (``a`` its absmax): a block with a negative value in a signed
    codebook, a block without one in an unsigned codebook (twice the codes per binade, down to
    ``2**-30``) that stores no positive value as 0, so Adam's ``nu``, which is divided by, keeps
    values ``1e-8`` below its block's maximum instead of rounding them to 0 (which makes
    ``mu / (sqrt(0) + eps)`` explode). ``"int8"`` stores the nearest entry of a 256-entry
    non-linear (tapered, exponent-like) codebook, ``"float8_e4m3fn"`` the e4m3fn value of
    ``z * 448``. The sign of each block's scale records which codebook it used;
    ``jmp_lite.low_precision.QuantizedArray`` gives the formats. Smaller arrays (biases, norm
    scales) are kept in float32, as bitsandbytes does: they are a small share of the parameters, and
    they are the ones a coarse state hurts most. The block size is a power of two, so a state's shapes
    tell it (``jmp_lite.low_precision.dequantized`` reads a state so).

    - ``rounding="stochastic"`` (default): the upper codebook neighbour with probability ``(z - lo) /
      (hi - lo)``, so ``E[stored] = m'`` (except below the smallest positive code of a block without
      negative values, raised to it); adds one key as above;
    - ``rounding="nearest"`` (what bitsandbytes does): drops every change smaller than half a code,
      and Adam's ``nu`` moves by ``1 - b2 = 0.1%`` of its gap to ``g**2`` a step. On the tiny decoder
      of ``benchmarks/lm.py`` (docs/memory.md) int8 moments rounded to nearest end 1.2% away from
      float32 Adam's held-out loss, rounded stochastically within 0.1%.

    With bfloat16 Adam moments, stochastic rounding and bfloat16 parameters under
    ``kahan_summation``, a parameter costs 8 bytes (2 parameter + 2 compensation + 2 + 2 moments)
    against 16 for float32 parameters and moments; with int8 moments about 6 (2 + 2 + 1 + 1 and
    ``8 / block_size`` of scales), and about 4 under ``stochastic_rounding``
    (``jmp_lite.memory.state_bytes`` counts them). Optax keeps a dtype option for Adam's first moment
    only (``mu_dtype``); the second moment follows the parameters (optax issue #1552). Prefer
    bfloat16 to float16 here: Adam's ``nu`` holds squared gradients, which float16's range
    (smallest subnormal ``6e-8``) flushes to zero. Place ``loss_scaling`` outside, so that a skipped
    step keeps the stored state, scales, compensation and key bit for bit. ``update`` refuses a
    state restored without its compensation (or with a different number, shape or dtype of buffers)
    or without its key, or an 8-bit state whose arrays, scales or small float32 arrays do not match
    the settings, with an error naming the field, also under ``jax.jit`` (the checks run when it is
    traced); a state another optimizer made (a plain optax state, an 8-bit state given to a 16-bit
    one) or a checkpoint restored without its target is refused naming what it is (docs/checkpoints.md).

    Args:
        inner: any optax transformation (``optax.adam(1e-3)``, a chain, ``optax.MultiSteps``).
        dtype: the storage dtype: bfloat16 (default), float16, float32, ``"int8"`` or
            ``"float8_e4m3fn"``.
        rounding: ``"stochastic"`` (the default) or ``"kahan"`` for 16 bits; ``"stochastic"`` (the
            default) or ``"nearest"`` for 8 bits.
        key: with ``rounding="stochastic"``, one PRNG key (default ``jax.random.key(0)``).
        block_size: 8 bits only: elements per scale along the last axis, a power of two (default
            256, the block of bitsandbytes' current 8-bit optimizer kernels; smaller blocks confine
            an outlier to fewer values and cost ``4 / block_size`` bytes per element).
        min_quantized_size: 8 bits only: arrays with fewer elements stay float32 (default 4096,
            bitsandbytes' ``min_8bit_size``).

    Returns:
        An ``optax.GradientTransformationExtraArgs``; extra keyword arguments go to ``inner``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.low_precision_state(optax.adam(1e-3), jnp.bfloat16)
        >>> params = {"w": jnp.ones(3)}
        >>> state = tx.init(params)
        >>> updates, state = jax.jit(tx.update)({"w": jnp.full(3, 0.1)}, state, params)
        >>> adam_state = state.low_precision_inner_state[0]
        >>> adam_state.mu["w"].dtype, adam_state.nu["w"].dtype, updates["w"].dtype
        (dtype(bfloat16), dtype(bfloat16), dtype('float32'))
        >>> tx8 = jmp_lite.low_precision_state(optax.adam(1e-3), "int8")
        >>> params = {"w": jnp.ones((64, 512)), "b": jnp.zeros(512)}
        >>> grads = {"w": jnp.full((64, 512), 0.1), "b": jnp.ones(512)}
        >>> updates, state = jax.jit(tx8.update)(grads, jax.jit(tx8.init)(params), params)
        >>> nu = state.low_precision_inner_state[0].nu
        >>> nu["w"].quantized_values.dtype, nu["w"].block_scales.shape, nu["b"].dtype  # b: < 4096 elements
        (dtype('int8'), (64, 2), dtype('float32'))
    """
    what = "low_precision_state"
    if hasattr(inner, "gradient_transformation"):  # optax.MultiSteps
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"{what}: inner must be an optax.GradientTransformation or optax.MultiSteps, "
            f"got {type(inner).__name__}"
        )
    store = _state_dtype(dtype)
    eight_bit = store in quantized_state.DTYPES
    roundings = ("stochastic", "nearest") if eight_bit else ("stochastic", "kahan")
    if rounding is None:
        rounding = roundings[0]
    if rounding not in roundings:
        kind = f"an 8-bit dtype ({store.name})" if eight_bit else f"dtype {store.name}"
        why = (
            "; 'kahan' keeps a second buffer of the state's dtype, which 8 bits with a block scale cannot"
            if eight_bit and rounding == "kahan"
            else ""
        )
        raise ValueError(
            f"{what}: rounding must be {roundings[0]!r} or {roundings[1]!r} with {kind}, "
            f"got {rounding!r}{why}"
        )
    if rounding != "stochastic" and key is not None:
        raise ValueError(f"{what}: a key is only used with rounding='stochastic'; drop it or change rounding")
    if not eight_bit:
        for name, value in (("block_size", block_size), ("min_quantized_size", min_quantized_size)):
            if value is not None:
                raise ValueError(
                    f"{what}: {name} is for the 8-bit dtypes ('int8', 'float8_e4m3fn'); dtype is {store.name}"
                )
    data, impl = (None, None)
    if rounding == "stochastic":
        data, impl = validate.prng_key(jax.random.key(0) if key is None else key, f"{what} key")
    inner = optax.with_extra_args_support(inner)
    if not eight_bit:
        return _sixteen_bit_state(inner, store, rounding, data, impl)
    block = validate.whole_number(256 if block_size is None else block_size, f"{what}: block_size")
    if block & (block - 1):
        # Two powers of two cut any row they differ on into different numbers of blocks, so a state
        # restored with another block_size always fails the shape check instead of being misread.
        raise ValueError(
            f"{what}: block_size must be a power of two (e.g. 64, 128, 256, 2048), got {block}: a "
            "state's block size is then known from its shapes, and one restored with another size is refused"
        )
    smallest = validate.whole_number(
        4096 if min_quantized_size is None else min_quantized_size, f"{what}: min_quantized_size", low=0
    )
    return _eight_bit_state(inner, store, data, impl, block, smallest)


def _sixteen_bit_state(
    inner: optax.GradientTransformationExtraArgs, store: np.dtype, rounding: str, data: Any, impl: Any
) -> optax.GradientTransformationExtraArgs:
    what = "low_precision_state"
    compute = np.dtype(jnp.promote_types(store, jnp.float32))

    def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x.astype(compute)
        hi = _round_nearest(x, store)
        return hi.astype(store), _round_nearest(x - hi, store).astype(store)

    def stored(path: Any, x: Any) -> bool:
        return _stored(x) and not is_accumulator(path)

    def init_fn(params: Any) -> LowPrecisionState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(inner.init(params))
        leaves, comps = [x for _, x in flat], []
        for i, (path, x) in enumerate(flat):
            if stored(path, x):
                leaves[i], lo = split(x)
                comps.append(lo)
            elif _stored(x):  # an accumulator
                leaves[i] = x.astype(compute)
        return LowPrecisionState(
            treedef.unflatten(leaves),
            tuple(comps) if rounding == "kahan" else None,
            None if data is None else jnp.array(data),
        )

    def update_fn(
        updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LowPrecisionState]:
        _check_own_state(state, LowPrecisionState, what)
        eight_bit = jax.tree_util.tree_flatten_with_path(
            quantized_state.rebuilt(state.low_precision_inner_state), is_leaf=quantized_state.is_quantized
        )[0]
        eight_bit = [path for path, x in eight_bit if quantized_state.is_quantized(x)]
        if eight_bit:
            raise TypeError(
                f"{what}.update: state.low_precision_inner_state{jax.tree_util.keystr(eight_bit[0])} is an "
                "8-bit QuantizedArray, made by low_precision_state(..., 'int8' or 'float8_e4m3fn'); this "
                f"one stores {store.name}: restore the state into the optimizer that saved it, or start "
                "afresh with tx.init(params) (docs/checkpoints.md)"
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(state.low_precision_inner_state)
        leaves = [x for _, x in flat]
        where = [i for i, (path, x) in enumerate(flat) if stored(path, x)]
        if rounding == "kahan":
            expected = tuple(jax.ShapeDtypeStruct(leaves[i].shape, store) for i in where)
            fix = (
                f"with rounding='kahan' init makes it one {store.name} buffer per stored state array, of "
                "its shape: restore it with the rest of the state, or start afresh with tx.init(params)"
            )
            validate.arrays_like(
                state.state_compensation, expected, f"{what}.update: state.state_compensation", fix=fix
            )
        else:
            field = f"{what}.update: state.state_rounding_key"
            validate.arrays_like(state.state_rounding_key, _key_spec(data), field, fix=_KEY_FIX)
        for i, x in enumerate(leaves):
            if _stored(x):  # an accumulator is only widened
                leaves[i] = x.astype(compute)
        for j, i in enumerate(where):
            if rounding == "kahan":
                leaves[i] = leaves[i] + state.state_compensation[j].astype(compute)
        grads = jax.tree_util.tree_map(lambda g: g.astype(compute) if _floating(g) else g, updates)
        new_updates, new_inner = inner.update(grads, treedef.unflatten(leaves), params, **extra_args)
        new_flat, new_treedef = jax.tree_util.tree_flatten_with_path(new_inner)
        new_leaves = [x for _, x in new_flat]
        if new_treedef != treedef or [i for i, (p, x) in enumerate(new_flat) if stored(p, x)] != where:
            raise ValueError(f"{what}: the inner optimizer changed the structure of its state in update")
        rounded = set(where)
        for i, x in enumerate(new_leaves):
            if _stored(x) and i not in rounded:
                new_leaves[i] = x.astype(compute)
        key_data, comps = None, []
        if rounding == "stochastic":
            next_key, step_key = jax.random.split(_wrap_key(state.state_rounding_key, impl))
            step_key = jax.random.fold_in(step_key, _STATE_STREAM)
            key_data = jax.random.key_data(next_key)
        for j, i in enumerate(where):
            x = new_leaves[i].astype(compute)
            if rounding == "kahan":
                new_leaves[i], lo = split(x)
                comps.append(lo)
            else:
                uniform = jax.random.uniform(jax.random.fold_in(step_key, j), x.shape, compute)
                new_leaves[i] = _round_stochastic(x, store, uniform).astype(store)
        return new_updates, LowPrecisionState(
            treedef.unflatten(new_leaves), tuple(comps) if rounding == "kahan" else None, key_data
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _eight_bit_state(
    inner: optax.GradientTransformationExtraArgs,
    store: np.dtype,
    data: Any,
    impl: Any,
    block_size: int,
    min_quantized_size: int,
) -> optax.GradientTransformationExtraArgs:
    """``low_precision_state`` with ``dtype`` int8 or float8_e4m3fn: large state arrays become
    ``QuantizedArray``s in place, small ones float32 (``data`` is the key, ``None`` for round to nearest)."""
    what = "low_precision_state"
    is_q = quantized_state.is_quantized

    def large(path: Any, x: Any) -> bool:
        return _stored(x) and x.size >= min_quantized_size and not is_accumulator(path)

    def wide(x: jax.Array) -> jax.Array:  # a small array: float32 (float64 stays, under jax_enable_x64)
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))

    def init_fn(params: Any) -> LowPrecisionState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(inner.init(params))
        leaves = [x for _, x in flat]
        for i, (path, x) in enumerate(flat):
            if large(path, x):  # round to nearest: init's state is zeros for every optax optimizer but a few
                # The barrier keeps XLA from constant-folding the quantization of those zeros under
                # jax.jit(tx.init), which takes seconds for a large array.
                leaves[i] = quantized_state.quantize(jax.lax.optimization_barrier(x), store, block_size)
            elif _stored(x):
                leaves[i] = wide(x)
        return LowPrecisionState(treedef.unflatten(leaves), None, None if data is None else jnp.array(data))

    def check(path: Any, x: Any) -> None:
        """A restored leaf is what init made of it: a QuantizedArray for a large array, float32 else."""
        field = f"{what}.update: state.low_precision_inner_state{jax.tree_util.keystr(path)}"
        settings = f"dtype={store.name!r}, block_size={block_size}, min_quantized_size={min_quantized_size}"
        fix = (
            f"init ({settings}) stores each floating state array of at least {min_quantized_size} "
            f"elements as a QuantizedArray ({store.name} values, float32 scales per block of {block_size}) "
            "and smaller ones in float32: restore the state with the settings it was saved with, or start "
            "afresh with tx.init(params)"
        )
        if is_q(x):
            values = x.quantized_values
            shape = tuple(getattr(values, "shape", ()))
            if len(shape) < 1 or math.prod(shape) < min_quantized_size or is_accumulator(path):
                raise ValueError(
                    f"{field} is a QuantizedArray of shape {shape}, which init keeps in float32; {fix}"
                )
            validate.arrays_like(x, quantized_state.spec(shape, store, block_size), field, fix=fix)
        elif large(path, x):
            raise TypeError(
                f"{field} is a {np.dtype(x.dtype).name} array of {x.size} elements, expected a "
                f"QuantizedArray; {fix}"
            )
        elif _stored(x) and np.dtype(x.dtype) != np.dtype(jnp.promote_types(x.dtype, jnp.float32)):
            raise TypeError(f"{field} has dtype {np.dtype(x.dtype).name}, expected float32; {fix}")

    def update_fn(
        updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LowPrecisionState]:
        _check_own_state(state, LowPrecisionState, what)
        # nnx.Optimizer hands an 8-bit array back as a mapping of its fields: read it, and return it,
        # in that form, so that wrappers comparing the input and output state (loss_scaling,
        # MultiSteps) see one structure
        inner_state = quantized_state.rebuilt(state.low_precision_inner_state)
        flat, treedef = jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=is_q)
        forms = treedef.flatten_up_to(state.low_precision_inner_state)
        for path, x in flat:
            check(path, x)
        if data is not None:
            field = f"{what}.update: state.state_rounding_key"
            validate.arrays_like(state.state_rounding_key, _key_spec(data), field, fix=_KEY_FIX)
        leaves = [x for _, x in flat]
        where = [i for i, x in enumerate(leaves) if is_q(x)]
        widened = [
            quantized_state.dequantize(x, block_size) if is_q(x) else wide(x) if _stored(x) else x
            for x in leaves
        ]
        grads = jax.tree_util.tree_map(lambda g: wide(g) if _floating(g) else g, updates)
        new_updates, new_inner = inner.update(grads, treedef.unflatten(widened), params, **extra_args)
        new_flat, new_treedef = jax.tree_util.tree_flatten_with_path(new_inner)
        new_leaves = [x for _, x in new_flat]
        if new_treedef != treedef or [i for i, (p, x) in enumerate(new_flat) if large(p, x)] != where:
            raise ValueError(f"{what}: the inner optimizer changed the structure of its state in update")
        key_data, step_key = None, None
        if data is not None:
            next_key, step_key = jax.random.split(_wrap_key(state.state_rounding_key, impl))
            step_key = jax.random.fold_in(step_key, _STATE_STREAM)
            key_data = jax.random.key_data(next_key)
        for j, i in enumerate(where):
            x = new_leaves[i]
            uniform = None
            if step_key is not None:
                uniform = jax.random.uniform(jax.random.fold_in(step_key, j), x.shape, jnp.float32)
            new_leaves[i] = quantized_state.in_form_of(
                forms[i], quantized_state.quantize(x, store, block_size, uniform)
            )
        quantized = set(where)
        for i, x in enumerate(new_leaves):
            if i not in quantized and _stored(x):  # a small array: back in its stored dtype
                new_leaves[i] = x.astype(widened[i].dtype)
        return new_updates, LowPrecisionState(treedef.unflatten(new_leaves), None, key_data)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
