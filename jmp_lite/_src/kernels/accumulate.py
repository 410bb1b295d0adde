"""Float32 accumulation for 16-bit matmuls and convolutions, forward and backward.

``dot_general``, ``conv_general_dilated`` and ``einsum`` here take the same
arguments as their ``jax.lax`` / ``jax.numpy`` namesakes. When both operands are
bfloat16 or float16 (and no ``preferred_element_type`` is asked for), they
contract with ``preferred_element_type=float32`` and round the result once to
the operand dtype. The gradient contractions do the same: both take 16-bit
operands (the incoming cotangent stays 16-bit) and accumulate in float32.

Why: summing thousands of 16-bit products in 16 bits loses accuracy (NVIDIA's
tensor cores accumulate in float32 for this reason: Micikevicius et al., 2018,
"Mixed Precision Training", section 3.2), and XLA:CPU runs a
bfloat16 x bfloat16 -> bfloat16 dot by converting it to float32, slower than a
float32 dot, while bfloat16 x bfloat16 -> float32 uses the AVX512-BF16
instructions. JAX's own transpose of a float32-accumulating dot would hand the
backward pass a float32 cotangent (a mixed float32 x bfloat16 dot, float32
speed); a ``jax.custom_vjp`` keeps it 16-bit.

Any other operand dtypes (float32, float64, integers, fp8) go to ``jax.lax``
unchanged, so wrapping a float32 program changes nothing.

``dot_general`` and ``einsum`` are a primitive of their own (it prints as
``dot_general`` with ``preferred_element_type=float32`` and a ``result_dtype``)
whose derivatives, forward and reverse mode, are the same 16-bit contraction.
Limitation: convolutions go through a ``custom_vjp``, which has no forward-mode
derivative, so ``jax.jvp``, ``jax.linearize`` and ``jax.jacfwd``/``jax.hessian``
through a 16-bit accumulating convolution raise JAX's ``custom_vjp`` error;
reverse mode and ``vmap`` work. Turn accumulation off
(``apply_policy(..., accumulate=False)``) for forward mode through convolutions.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import accumulate
    >>> x, w = jnp.ones((8, 4096), jnp.bfloat16), jnp.ones((4096, 16), jnp.bfloat16)
    >>> y = jax.jit(accumulate.einsum, static_argnums=0)("ij,jk->ik", x, w)
    >>> y.dtype, float(y[0, 0])
    (dtype(bfloat16), 4096.0)
    >>> jaxpr = jax.make_jaxpr(accumulate.einsum, static_argnums=0)("ij,jk->ik", x, w)
    >>> "preferred_element_type=float32" in str(jaxpr)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, PartitionSpec

from jmp_lite._src import interpret
from jmp_lite._src.base import caches

__all__ = ["conv_general_dilated", "dot_general", "einsum", "is_accumulated"]

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32 = np.dtype(np.float32)
_CONTRACTIONS = (lax.dot_general_p, lax.conv_general_dilated_p)


def is_accumulated(lhs_dtype: Any, rhs_dtype: Any, preferred_element_type: Any = None) -> bool:
    """Whether a contraction of these operand dtypes accumulates in float32 here.

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite.accumulate import is_accumulated
        >>> is_accumulated(jnp.bfloat16, jnp.bfloat16), is_accumulated(jnp.float32, jnp.float32)
        (True, False)
    """
    lhs, rhs = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
    wanted = None if preferred_element_type is None else np.dtype(preferred_element_type)
    return lhs == rhs and lhs in _LOW and wanted in (None, lhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _contract(op: Callable[..., jax.Array], out: Any, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    # out=None: rounded once to the operand dtype; float32: the accumulator itself
    return op(lhs, rhs, preferred_element_type=jnp.float32).astype(out or lhs.dtype)


def _contract_fwd(op: Callable[..., jax.Array], out: Any, lhs: jax.Array, rhs: jax.Array) -> tuple:
    return _contract(op, out, lhs, rhs), (lhs, rhs)


def _contract_bwd(op: Callable[..., jax.Array], out: Any, residuals: tuple, g: jax.Array) -> tuple:
    lhs, rhs = residuals
    g = g.astype(lhs.dtype)
    key = (op.func, tuple(sorted(op.keywords.items())), *(jax.typeof(x) for x in (lhs, rhs, g)))
    return tuple(_eval_accumulating(_transpose(key, op, lhs, rhs, g), lhs, rhs, g))


_TRANSPOSES = caches.BoundedCache("accumulate.transposes", 512)


def _transpose(key: tuple, op: Callable[..., jax.Array], *args: jax.Array) -> jcore.ClosedJaxpr:
    """JAX's transpose rules give the gradient contractions (a dot's are dots, a conv's are
    dilated/reversed convs), traced at 16 bits once per signature (a model repeats its layers)."""
    try:
        found = _TRANSPOSES.get(key)
    except TypeError:  # an unhashable parameter: trace it every time
        key, found = None, None
    if found is None:
        found = jax.make_jaxpr(lambda a, b, ct: jax.vjp(op, a, b)[1](ct))(*args)
        if key is not None:
            _TRANSPOSES[key] = found
    return found


_contract.defvjp(_contract_fwd, _contract_bwd)


def _eval_accumulating(closed: jcore.ClosedJaxpr, *args: Any) -> list:
    """Evaluates a flat jaxpr, running 16-bit contractions with float32 accumulation."""

    def equation(i: int, eqn: Any, env: interpret.Env) -> list | None:
        if all(isinstance(v, jcore.DropVar) for v in eqn.outvars):
            return interpret.SKIP  # the forward contraction that jax.vjp traced along
        ins = [env.read(v) for v in eqn.invars]
        params = eqn.params
        # JAX's transpose of a float32-accumulating dot asks for float32 itself
        pet = params.get("preferred_element_type")
        if eqn.primitive not in _CONTRACTIONS or not is_accumulated(
            ins[0].dtype, ins[1].dtype, None if pet == _F32 else pet
        ):
            return None  # bound as written
        if eqn.primitive is lax.dot_general_p:
            *ins, dims = _canonical_dot(*ins, params["dimension_numbers"])
            params = {**params, "dimension_numbers": dims}
            ins = _pinned(*ins)
        out = eqn.primitive.bind(*ins, **{**params, "preferred_element_type": _F32})
        return [out.astype(eqn.outvars[0].aval.dtype)]

    return interpret.evaluate(closed.jaxpr, closed.consts, args, equation)


def _pinned(lhs: jax.Array, rhs: jax.Array) -> tuple:
    """The operands of a 16-bit x 16-bit -> float32 dot, as XLA:CPU must see them.

    XLA:CPU picks a kernel for such a dot (its YNNPACK fusion, or float32 operands)
    before its transpose-folding pass runs; a ``transpose`` folded in afterwards (as
    JAX's gradient of a ``vmap``-ped matrix-vector product writes) leaves a dot that
    contracts a major axis of its lhs, which no CPU kernel runs ("Unsupported element
    type for DotThunk::Execute: BF16 x BF16 = F32"). An optimization barrier keeps any
    transpose a separate copy, so the dot keeps the layout it was given. GPUs and TPUs
    take any layout.
    """
    if jax.default_backend() != "cpu":
        return lhs, rhs
    return tuple(lax.optimization_barrier((lhs, rhs)))


def _canonical_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> tuple:
    """On CPU, dots laid out (batch, free, contracting) x (batch, contracting, free).

    XLA:CPU without AMX has no 16-bit x 16-bit -> float32 kernel for some layouts (a
    batched dot whose lhs contracts a middle axis, as JAX's gradient of ``"bqd,bkd->bqk"``
    gives, or the gradient of a dot contracting two axes) and fails at run time;
    transposed operands let it choose a kernel it has. GPUs take any layout.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if jax.default_backend() != "cpu":
        return lhs, rhs, dimension_numbers
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    lhs = lax.transpose(lhs, (*lb, *lf, *lc))
    rhs = lax.transpose(rhs, (*rb, *rc, *rf))
    nb, nc = len(lb), len(lc)
    dims = (
        (tuple(range(nb + len(lf), lhs.ndim)), tuple(range(nb, nb + nc))),
        (tuple(range(nb)), tuple(range(nb))),
    )
    return lhs, rhs, dims


def _check_operands(name: str, lhs: Any, rhs: Any) -> None:
    # jax.lax refuses lists and tuples too ("Error interpreting argument ... as a JAX value")
    for position, x in enumerate((lhs, rhs)):
        if not hasattr(x, "dtype"):
            raise TypeError(
                f"jmp_lite.accumulate.{name}: operand {position} is a {type(x).__name__}; like "
                f"jax.lax.{name} it takes arrays (jax.Array, numpy.ndarray, numpy scalars). "
                "Convert it first, e.g. with jax.numpy.asarray."
            )


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """``jax.lax.dot_general``; 16-bit operands accumulate in float32 (forward and backward).

    In a jaxpr it is a ``dot_general`` with ``preferred_element_type=float32`` and the
    ``result_dtype`` it is rounded to; its derivatives are the same contraction of 16-bit
    operands (forward and reverse mode).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import accumulate
        >>> a = jnp.ones((2, 3), jnp.bfloat16)
        >>> accumulate.dot_general(a, a, (((1,), (1,)), ((), ()))).dtype
        dtype(bfloat16)
    """
    _check_operands("dot_general", lhs, rhs)
    if not is_accumulated(lhs.dtype, rhs.dtype, preferred_element_type) or kwargs.get("out_sharding"):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
    return _dot(lhs, rhs, dimension_numbers, precision, np.dtype(lhs.dtype))


def _dot(
    lhs: jax.Array, rhs: jax.Array, dims: Any, precision: Any, result: np.dtype, out_sharding: Any = None
) -> jax.Array:
    (lc, rc), (lb, rb) = dims
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    return dot_p.bind(
        lhs, rhs, dimension_numbers=dims, precision=precision, preferred_element_type=_F32,
        result_dtype=np.dtype(result), out_sharding=out_sharding,
    )  # fmt: skip


# A dot of 16-bit operands accumulating in float32, rounded once to ``result_dtype``. A primitive of
# its own (not a custom_vjp) so that its derivatives are the same kind of dot: JAX's transpose of a
# float32-accumulating dot would hand the backward pass a float32 cotangent (a mixed float32 x
# bfloat16 dot, float32 speed), and a custom_vjp has no forward mode.
dot_p = jcore.Primitive("dot_general")


def _dot_abstract(lhs: Any, rhs: Any, *, result_dtype: Any, **params: Any) -> Any:
    out, _ = lax.dot_general_p.abstract_eval(lhs, rhs, **params)
    return out.update(dtype=result_dtype)


def _dot_impl(
    lhs: Any, rhs: Any, *, dimension_numbers: Any, result_dtype: Any, cpu: bool, **params: Any
) -> Any:
    if cpu:  # the layout XLA:CPU has 16-bit x 16-bit -> float32 kernels for, kept by a barrier
        lhs, rhs, dimension_numbers = _canonical_dot(lhs, rhs, dimension_numbers)
        lhs, rhs = lax.optimization_barrier((lhs, rhs))
    return lax.dot_general(lhs, rhs, dimension_numbers, **params).astype(result_dtype)


_EAGER = caches.BoundedCache("accumulate.eager_dots", 512)


def _dot_eager(lhs: Any, rhs: Any, **params: Any) -> Any:
    """An eager ``dot_p`` (outside ``jit``, e.g. under an un-jitted ``jax.grad``): compiled through
    its lowering, as a built-in primitive is, so XLA:CPU gets the layout it has a kernel for."""
    key = tuple(sorted(params.items()))
    found = _EAGER.get(key)
    if found is None:
        found = _EAGER[key] = jax.jit(functools.partial(dot_p.bind, **params))
    return found(lhs, rhs)


def _explicit_spec(aval: Any) -> tuple | None:
    """``aval``'s partition spec, one entry per axis, where its mesh has Explicit axes; ``None`` elsewhere
    (Auto axes or no mesh: the compiler places results there)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return None
    return tuple(sharding.spec) + (None,) * (aval.ndim - len(sharding.spec))


def explicit_sharding(aval: Any, order: Sequence[int]) -> Any:
    """The sharding of ``aval`` with its axes in ``order``, where its mesh has Explicit axes (a gradient
    that contracts a sharded batch axis must name where its result lives there, as JAX's own transpose of
    ``dot_general`` does); ``None`` otherwise (the compiler places it)."""
    spec = _explicit_spec(aval)
    return None if spec is None else aval.sharding.update(spec=PartitionSpec(*(spec[d] for d in order)))


def contraction_sharding(lhs: Any, rhs: Any, dims: Any) -> Any:
    """Where ``dot_general(lhs, rhs, dims)``'s result lives on a mesh with Explicit axes: the operands'
    batch and free axes keep their mesh axes, a contracted one is reduced over (``None`` off such
    meshes). For contractions jmp_lite writes itself, which JAX's Explicit mode refuses to place when
    both contracted axes are sharded."""
    (lc, rc), (lb, rb) = dims
    ls, rs = _explicit_spec(lhs), _explicit_spec(rhs)
    if ls is None or rs is None:
        return None
    out, used = [], set()
    for entry in [*(ls[d] for d in lb), *(ls[d] for d in _free(lhs.ndim, lc, lb)),
                  *(rs[d] for d in _free(rhs.ndim, rc, rb))]:  # fmt: skip
        names = set(entry if isinstance(entry, tuple) else (entry,)) - {None}
        out.append(None if names & used else entry)  # a mesh axis shards one result axis at most
        used |= names
    return lhs.sharding.update(spec=PartitionSpec(*out))


def _free(ndim: int, contract: Any, batch: Any) -> list:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def _grad(ct: Any, other: Any, own: Any, dims: Any, precision: Any, own_is_lhs: bool) -> Any:
    """The cotangent of one operand of ``dot_p`` (its aval ``own``; the other is ``other``), as the same
    kind of dot."""
    own_ndim, dtype = own.ndim, own.dtype
    (lc, rc), (lb, rb) = dims
    own_c, other_c, own_b, other_b = (lc, rc, lb, rb) if own_is_lhs else (rc, lc, rb, lb)
    nb = len(lb)
    n_lhs_free = len(_free(own_ndim if own_is_lhs else other.ndim, lc, lb))
    other_free = _free(other.ndim, other_c, other_b)
    # the cotangent is laid out (batch, lhs free, rhs free): contract it with the other's free axes
    start = nb + (n_lhs_free if own_is_lhs else 0)
    ct_other_free = tuple(range(start, start + len(other_free)))
    grad_dims = ((ct_other_free, tuple(other_free)), (tuple(range(nb)), tuple(other_b)))
    # out is (batch, own free, other's remaining = other's contracted axes in axis order)
    order = sorted(range(len(other_c)), key=lambda i: other_c[i])
    laid = [*own_b, *_free(own_ndim, own_c, own_b), *(own_c[i] for i in order)]
    out = _dot(ct.astype(dtype), other, grad_dims, precision, dtype, explicit_sharding(own, laid))
    return lax.transpose(out, tuple(laid.index(d) for d in range(own_ndim)))


def _dot_lhs_rule(ct: Any, lhs: Any, rhs: Any, *, dimension_numbers: Any, precision: Any, **_: Any) -> Any:
    return _grad(ct, rhs, lhs.aval, dimension_numbers, precision, True)


def _dot_rhs_rule(ct: Any, lhs: Any, rhs: Any, *, dimension_numbers: Any, precision: Any, **_: Any) -> Any:
    return _grad(ct, lhs, rhs.aval, dimension_numbers, precision, False)


def _dot_batch(
    args: tuple, axes: tuple, *, dimension_numbers: Any, precision: Any, result_dtype: Any, **_: Any
) -> tuple:
    # out_sharding is left to the compiler here: a vmapped dot's result has an axis its spec does not name
    (lhs, rhs), (la, ra) = args, axes
    (lc, rc), (lb, rb) = dimension_numbers
    shift = lambda ds, on: tuple(d + 1 for d in ds) if on else tuple(ds)  # noqa: E731
    if la is not None:
        lhs = jnp.moveaxis(lhs, la, 0)
    if ra is not None:
        rhs = jnp.moveaxis(rhs, ra, 0)
    lmapped, rmapped = la is not None, ra is not None
    lc, lb, rc, rb = shift(lc, lmapped), shift(lb, lmapped), shift(rc, rmapped), shift(rb, rmapped)
    if lmapped and rmapped:  # a new batch dimension of the dot, first in the result
        out = _dot(lhs, rhs, ((lc, rc), ((0, *lb), (0, *rb))), precision, result_dtype)
        return out, 0
    if lmapped:  # a free axis of lhs: after the batch axes in the result
        return _dot(lhs, rhs, ((lc, rc), (lb, rb)), precision, result_dtype), len(lb)
    out = _dot(lhs, rhs, ((lc, rc), (lb, rb)), precision, result_dtype)  # a free axis of rhs
    return out, len(lb) + len(_free(lhs.ndim, lc, lb))


dot_p.def_abstract_eval(_dot_abstract)
dot_p.def_impl(_dot_eager)
ad.defbilinear(dot_p, _dot_lhs_rule, _dot_rhs_rule)
batching.primitive_batchers[dot_p] = _dot_batch
mlir.register_lowering(dot_p, mlir.lower_fun(functools.partial(_dot_impl, cpu=False), multiple_results=False))
mlir.register_lowering(
    dot_p, mlir.lower_fun(functools.partial(_dot_impl, cpu=True), multiple_results=False), platform="cpu"
)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """``jax.lax.conv_general_dilated``; 16-bit operands accumulate in float32 (forward and backward).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import accumulate
        >>> x, k = jnp.ones((1, 3, 8, 8), jnp.float16), jnp.ones((4, 3, 3, 3), jnp.float16)
        >>> accumulate.conv_general_dilated(x, k, (1, 1), "SAME").shape
        (1, 4, 8, 8)
    """
    _check_operands("conv_general_dilated", lhs, rhs)
    op = functools.partial(
        lax.conv_general_dilated,
        window_strides=window_strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        **kwargs,
    )
    if not is_accumulated(lhs.dtype, rhs.dtype, preferred_element_type):
        return op(lhs, rhs, preferred_element_type=preferred_element_type)
    return _contract(op, None, lhs, rhs)


def float32_result(
    contraction: Callable[..., jax.Array], lhs: jax.Array, rhs: jax.Array, **params: Any
) -> jax.Array:
    """``contraction`` (``dot_general``/``conv_general_dilated`` here) of 16-bit operands,
    returning the float32 accumulator unrounded; the gradient contractions stay 16-bit."""
    if contraction is dot_general:
        return _dot(lhs, rhs, params["dimension_numbers"], params.get("precision"), _F32)
    else:
        op = functools.partial(lax.conv_general_dilated, **params)
    return _contract(op, _F32, lhs, rhs)


def einsum(subscripts: str, /, *operands: Any, **kwargs: Any) -> jax.Array:
    """``jax.numpy.einsum`` whose 16-bit contractions accumulate in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import accumulate
        >>> q = jnp.ones((2, 5, 4), jnp.bfloat16)
        >>> accumulate.einsum("bqd,bkd->bqk", q, q).dtype
        dtype(bfloat16)
    """
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
