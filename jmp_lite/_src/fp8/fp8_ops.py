"""FP8 contractions: ``dot_general`` and ``einsum`` with scaled, saturated fp8 operands, forward and backward.

``dot_general(lhs, rhs, dimension_numbers, recipe=..., state=...)`` takes the arguments of
``jax.lax.dot_general`` (bfloat16, float16 or float32 operands) and

1. measures each operand's amax (``max |x|`` in float32);
2. picks each operand's scale: from that amax (current scaling) or from ``state.fp8_scale``
   (delayed scaling);
3. quantizes: ``saturate(x * scale)`` cast to E4M3, values beyond the format's maximum clipped to it
   instead of becoming NaN (E4M3 has no infinity);
4. contracts the two fp8 operands with ``preferred_element_type=float32`` (XLA:GPU runs it as a
   cuBLASLt fp8 GEMM on Hopper and newer; XLA:CPU emulates it exactly in float32);
5. multiplies by the two inverse scales and rounds once to the operands' dtype.

Its ``custom_vjp`` backward quantizes the output gradient the same way (E5M2 for the hybrid recipe,
E4M3 for e4m3) and runs both gradient contractions with fp8 operands, reusing the quantized forward
operands (saved as 1-byte residuals). The amaxes of lhs, rhs and the output gradient leave the step
as the cotangent of ``state.fp8_amax``: ``jax.grad`` with respect to the state returns what this step
observed, and ``jmp_lite.fp8.update_fp8_state`` (not the optimizer) turns it into the next state.

Under ``jax.vmap`` a vmapped axis counts as part of the tensor when the state (or no state) is not
batched: the amax, and so the scale, covers the whole batch, as the same contraction with an explicit
batch dimension would. A state batched along with the operands (an ensemble of models) gives each
member its own amax.

Block scaling (``Fp8Recipe(scaling="block")``, ``"mxfp8"``; ``fp8_blocks``): the operands are laid out
as ``(batch, rows, K)`` (several contracting axes flatten into one ``K``, in the order of their pairs)
and quantized in tiles along ``K`` with one scale each: 1 x B tiles of the lhs, B x B blocks of the
rhs (1 x 32 tiles for MXFP8). Each block of ``K`` is contracted from the fp8 operands in float32,
multiplied by its two scales' inverses, and the blocks are summed in float32 (DeepSeek-AI, 2024,
"DeepSeek-V3 Technical Report"). The backward quantizes the output gradient in tiles along N for the
lhs gradient (which reuses the rhs's B x B blocks, transposed) and the gradient and the lhs in tiles
along M for the rhs gradient; the lhs's tiles along M are quantized in the forward from the unrounded
lhs and kept as the 1-byte residual. A state is optional, as for current scaling: it observes the
per-tensor amaxes. Tiles never cross a vmapped axis nor a ``shard_map`` shard (each example, each
shard, is its own contraction). The rhs
gets the B x B blocks: write the weight second (``x @ w``, as Flax's ``Dense`` does).

Limitation: a ``custom_vjp`` has no forward-mode derivative (``jax.jvp``, ``jax.jacfwd`` raise), and
a second derivative (``grad`` of ``grad``, ``jax.hessian``) raises ``_first_order_only``'s error;
reverse mode, ``jit``, ``vmap``, ``scan``, ``checkpoint``, ``pmap`` and ``shard_map`` work.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jmp_lite._src.fp8 import fp8_blocks
from jmp_lite._src.fp8.fp8 import (
    ROWS,
    Fp8Recipe,
    Fp8State,
    as_fp8_recipe,
    check_compute_dtype,
    check_field_dtypes,
    repaired_scale,
    scale_from_amax,
)
from jmp_lite._src.fp8.fp8_blocks import descale as _descale
from jmp_lite._src.fp8.fp8_blocks import quantize as _quantize
from jmp_lite._src.fp8.fp8_blocks import to_varying as _to_varying
from jmp_lite._src.fp8.fp8_blocks import varying as _varying
from jmp_lite._src.kernels.accumulate import explicit_sharding

__all__ = ["dot_general", "einsum"]

_F32 = np.dtype(np.float32)


@jax.custom_batching.custom_vmap
def _amax(x: jax.Array, anchor: jax.Array) -> jax.Array:
    """``max |x|`` in float32 over every axis of ``x`` except the leading ``anchor.ndim`` ones.

    ``anchor`` only lends its shape and, under ``vmap``, its batching: the vmap rule below reduces
    over a vmapped axis of ``x`` unless ``anchor`` (the state) is batched too. Without it, ``vmap``
    would give one amax per example, and JAX would sum them into an unbatched state's cotangent.
    """
    axes = tuple(range(anchor.ndim, x.ndim))
    out = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, initial=0.0)
    return jnp.broadcast_to(out, anchor.shape)


@_amax.def_vmap
def _amax_vmap(axis_size: int, in_batched: list, x: jax.Array, anchor: jax.Array) -> tuple:
    x_batched, anchor_batched = in_batched
    if anchor_batched:
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return _amax(x, anchor), True
    # The vmapped axis becomes one more reduced axis (moved behind the anchor's kept axes).
    return _amax(jnp.moveaxis(x, 0, anchor.ndim), anchor), False


@jax.custom_jvp
def _first_order_only(*xs: jax.Array) -> tuple:
    """``xs`` unchanged; differentiating them raises. The backward pass quantizes the output gradient
    to fp8 and keeps the forward's operands as fp8 bits: neither has a derivative, so an outer ``grad``
    would fail inside JAX or, once pushed through, give wrong mixed second derivatives."""
    return xs


@_first_order_only.defjvp
def _first_order_only_jvp(primals: tuple, tangents: tuple) -> tuple:
    raise NotImplementedError(
        "jmp_lite fp8 contractions have first derivatives only: a second derivative (jax.grad of a "
        "gradient, jax.hessian, a gradient penalty) would differentiate the fp8 quantization of the "
        "backward pass, which has none. Compute that term without fp8 (fp8=None), or exclude the "
        "contractions it differentiates twice with a rule"
    )


def _grad_lhs(g: jax.Array, rhs: jax.Array, dims: Any, lhs: Any) -> jax.Array:
    """The lhs cotangent of ``dot_general(lhs, rhs, dims)`` (float32; ``lhs`` its aval), as a dot of
    ``g`` and ``rhs``."""
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    nb, nlf = len(lb), len(lf)
    g_rf = tuple(range(nb + nlf, nb + nlf + len(rf)))
    # out's axes: batch, lhs free, then rhs's contracting axes in increasing order.
    origin = [*lb, *lf, *(lc[list(rc).index(r)] for r in sorted(rc))]
    out = lax.dot_general(
        g, rhs, ((g_rf, tuple(rf)), (tuple(range(nb)), tuple(rb))), preferred_element_type=jnp.float32,
        out_sharding=explicit_sharding(lhs, origin),
    )  # fmt: skip
    return lax.transpose(out, tuple(int(i) for i in np.argsort(origin)))


def _grad_rhs(g: jax.Array, lhs: jax.Array, dims: Any, rhs: Any) -> jax.Array:
    """The rhs cotangent of ``dot_general(lhs, rhs, dims)`` (float32; ``rhs`` its aval), as a dot of
    ``g`` and ``lhs``."""
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    nb, nlf = len(lb), len(lf)
    g_lf = tuple(range(nb, nb + nlf))
    # out's axes: batch, rhs free, then lhs's contracting axes in increasing order.
    origin = [*rb, *rf, *(rc[list(lc).index(c)] for c in sorted(lc))]
    out = lax.dot_general(
        g, lhs, ((g_lf, tuple(lf)), (tuple(range(nb)), tuple(lb))), preferred_element_type=jnp.float32,
        out_sharding=explicit_sharding(rhs, origin),
    )  # fmt: skip
    return lax.transpose(out, tuple(int(i) for i in np.argsort(origin)))


class _Static(NamedTuple):
    recipe: Fp8Recipe
    dims: tuple
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype


def _operand_scales(
    static: _Static, lhs: jax.Array, rhs: jax.Array, scale: jax.Array, probe: jax.Array
) -> tuple:
    anchor = probe[0]  # carries the state's vmap batching into the amaxes
    amax_l, amax_r = _amax(lhs, anchor), _amax(rhs, anchor)
    recipe = static.recipe
    if recipe.stateful:
        s_l, s_r = scale[0], scale[1]
    else:
        s_l = scale_from_amax(amax_l, recipe.forward_max, recipe.margin, 1.0)
        s_r = scale_from_amax(amax_r, recipe.forward_max, recipe.margin, 1.0)
    return anchor, amax_l, amax_r, s_l, s_r


def _forward(static: _Static, lhs: jax.Array, rhs: jax.Array, scale: jax.Array, probe: jax.Array) -> tuple:
    lhs, rhs, scale, probe = _first_order_only(lhs, rhs, scale, probe)  # under an outer grad
    anchor, amax_l, amax_r, s_l, s_r = _operand_scales(static, lhs, rhs, scale, probe)
    fwd = static.recipe.forward_dtype
    q_l, q_r = _quantize(lhs, s_l, fwd), _quantize(rhs, s_r, fwd)
    out = lax.dot_general(q_l, q_r, static.dims, preferred_element_type=jnp.float32)
    out = _descale(out, 1.0 / s_l, 1.0 / s_r).astype(static.out_dtype)
    # The 1-byte operands are kept as their bits (uint8): under jax.checkpoint, JAX rounds every
    # floating residual with reduce_precision(exponent_bits=4, mantissa_bits=3) for E4M3, which
    # follows IEEE rules and turns E4M3FN's top binade [256, 448] (no infinities there) into NaN.
    bits = lax.bitcast_convert_type(q_l, jnp.uint8), lax.bitcast_convert_type(q_r, jnp.uint8)
    return out, (*bits, s_l, s_r, amax_l, amax_r, anchor, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _contract(
    static: _Static, lhs: jax.Array, rhs: jax.Array, scale: jax.Array, probe: jax.Array
) -> jax.Array:
    return _forward(static, lhs, rhs, scale, probe)[0]


def _contract_bwd(static: _Static, residuals: tuple, g: jax.Array) -> tuple:
    bits_l, bits_r, s_l, s_r, amax_l, amax_r, anchor, scale = residuals
    g, s_l, s_r, amax_l, amax_r, scale = _first_order_only(g, s_l, s_r, amax_l, amax_r, scale)
    fwd = static.recipe.forward_dtype
    q_l, q_r = lax.bitcast_convert_type(bits_l, fwd), lax.bitcast_convert_type(bits_r, fwd)
    recipe = static.recipe
    amax_g = _amax(g, anchor)
    if recipe.stateful:
        s_g = scale[2]
    else:
        s_g = scale_from_amax(amax_g, recipe.backward_max, recipe.margin, 1.0)
    q_g = _quantize(g, s_g, recipe.backward_dtype)
    inv_g = 1.0 / s_g
    d_l = _descale(_grad_lhs(q_g, q_r, static.dims, jax.typeof(q_l)), inv_g, 1.0 / s_r)
    d_r = _descale(_grad_rhs(q_g, q_l, static.dims, jax.typeof(q_r)), inv_g, 1.0 / s_l)
    observed = jnp.stack([amax_l, amax_r, amax_g], axis=-1)
    # Inside shard_map, a state replicated over mesh axes the data is sharded over must get one
    # cotangent for all shards: the max of theirs (JAX's own rule, a psum, would add them).
    shared = tuple(sorted(_varying(observed) - _varying(anchor)))
    if shared:
        observed = lax.pmax(observed, shared)
    return d_l.astype(static.lhs_dtype), d_r.astype(static.rhs_dtype), jnp.zeros_like(scale), observed


_contract.defvjp(_forward, _contract_bwd)


class _BlockStatic(NamedTuple):
    recipe: Fp8Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype


def _length(recipe: Fp8Recipe, size: Any) -> int:
    """The tile length along an axis of ``size``: ``"block"``'s B, or the axis's own length where it is
    shorter (``fp8_blocks.tile_length``); MXFP8's 32 always (the format, and the native GEMM, fix it)."""
    if recipe.power_of_two_scales:
        return recipe.block_size
    return fp8_blocks.tile_length(size, recipe.block_size)


def _tiles(
    recipe: Fp8Recipe, x: jax.Array, dtype: np.dtype, square: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``x (batch, R, C)`` quantized in tiles along ``C``: 1 x B, or B x B blocks when ``square`` (each
    side ``_length``: shorter where the axis is)."""
    top = float(ml_dtypes.finfo(dtype).max)
    power_of_two = recipe.power_of_two_scales
    block, rows = _length(recipe, x.shape[2]), _length(recipe, x.shape[1]) if square else 1
    return fp8_blocks.quantize_tiles(x, block, rows, dtype, top, recipe.margin, power_of_two)


def _bits(q: jax.Array) -> jax.Array:
    # fp8 residuals travel as their bits: see _forward (jax.checkpoint's reduce_precision)
    return lax.bitcast_convert_type(q, jnp.uint8)


def _block_forward(static: _BlockStatic, lhs: jax.Array, rhs: jax.Array, probe: jax.Array) -> tuple:
    """``lhs (batch, M, K)`` times ``rhs (batch, N, K)`` contracted over K: 1 x B tiles of the lhs,
    B x B blocks (``"block"``) or 1 x 32 tiles (``"mxfp8"``) of the rhs."""
    lhs, rhs, probe = _first_order_only(lhs, rhs, probe)  # under an outer grad
    recipe = static.recipe
    fwd, mx = recipe.forward_dtype, recipe.power_of_two_scales
    # B x B weight blocks serve the forward and, transposed, the lhs gradient (which contracts over N)
    n = rhs.shape[1]
    rows = 1 if mx else _length(recipe, n)
    q_l, inv_l = _tiles(recipe, lhs, fwd)
    q_r, inv_r = _tiles(recipe, rhs, fwd, square=not mx)
    out = fp8_blocks.scaled_matmul(q_l, inv_l, q_r, fp8_blocks.per_row(inv_r, rows), mx)[:, :, :n]
    # The backward's rhs gradient contracts over M: the lhs again, in 1 x B tiles along M, quantized
    # here from the unrounded values (not from q_l, which would round twice). MXFP8's 1 x 32 weight
    # tiles run along K, so the lhs gradient (over N) needs the rhs in tiles along N as well.
    q_lt, inv_lt = _tiles(recipe, jnp.swapaxes(lhs, 1, 2), fwd)
    q_w, inv_w = _tiles(recipe, jnp.swapaxes(rhs, 1, 2), fwd) if mx else (q_r, inv_r)
    anchor = probe[0]  # carries the state's vmap batching into the amaxes
    amax_l, amax_r = _amax(lhs, anchor), _amax(rhs, anchor)
    residuals = (_bits(q_lt), inv_lt, _bits(q_w), inv_w, amax_l, amax_r, anchor)
    return out.astype(static.out_dtype), residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_contract(static: _BlockStatic, lhs: jax.Array, rhs: jax.Array, probe: jax.Array) -> jax.Array:
    return _block_forward(static, lhs, rhs, probe)[0]


def _block_backward(static: _BlockStatic, residuals: tuple, g: jax.Array) -> tuple:
    bits_lt, inv_lt, bits_w, inv_w, amax_l, amax_r, anchor = residuals
    g, inv_lt, inv_w, amax_l, amax_r = _first_order_only(g, inv_lt, inv_w, amax_l, amax_r)
    recipe = static.recipe
    fwd, bwd, mx = recipe.forward_dtype, recipe.backward_dtype, recipe.power_of_two_scales
    q_lt, q_w = lax.bitcast_convert_type(bits_lt, fwd), lax.bitcast_convert_type(bits_w, fwd)
    k = q_lt.shape[1]
    # d lhs (M, K) = g (M, N) . rhs (N, K): g in 1 x B tiles along N
    q_g, inv_g = _tiles(recipe, g, bwd)
    if mx:
        q_rt, inv_rt = q_w, inv_w  # (batch, K, N'): tiles along N already
    else:  # the forward's B x B blocks, transposed: (batch, K', N'), one scale per B rows
        q_rt = jnp.swapaxes(q_w, 1, 2)
        inv_rt = fp8_blocks.per_row(jnp.swapaxes(inv_w, 1, 2), _length(recipe, k))
    d_l = fp8_blocks.scaled_matmul(q_g, inv_g, q_rt, inv_rt, mx)[:, :, :k]
    # d rhs (N, K) = g^T (N, M) . lhs (M, K): both in 1 x B tiles along M
    q_gt, inv_gt = _tiles(recipe, jnp.swapaxes(g, 1, 2), bwd)
    d_r = fp8_blocks.scaled_matmul(q_gt, inv_gt, q_lt, inv_lt, mx)
    observed = jnp.stack([amax_l, amax_r, _amax(g, anchor)], axis=-1)
    shared = tuple(sorted(_varying(observed) - _varying(anchor)))
    if shared:  # as in _contract_bwd: one cotangent for a state replicated over these mesh axes
        observed = lax.pmax(observed, shared)
    return d_l.astype(static.lhs_dtype), d_r.astype(static.rhs_dtype), observed


_block_contract.defvjp(_block_forward, _block_backward)


def contraction_shape(lhs_shape: tuple, rhs_shape: tuple, dims: tuple) -> tuple[int, ...]:
    """The shape ``lax.dot_general`` gives these operands, raising its own errors (matching sizes,
    repeated axes) and messages where they do not contract; traced only, nothing runs."""
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32),
        jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
        jax.ShapeDtypeStruct(rhs_shape, jnp.float32),
    )
    return tuple(out.shape)


def _block_dot(
    lhs: jax.Array, rhs: jax.Array, dims: tuple, static: _BlockStatic, probe: jax.Array
) -> jax.Array:
    """The block-scaled ``dot_general``: both operands in the canonical ``(batch, free, contracted)``
    layout (several contracting axes flatten into one, in the order of their pairs), contracted, and
    the result laid out as ``lax.dot_general``'s (batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = dims
    contraction_shape(lhs.shape, rhs.shape, dims)
    lhs3, lhs_free = fp8_blocks.canonical(lhs, lb, lc)
    rhs3, rhs_free = fp8_blocks.canonical(rhs, rb, rc)
    out = _block_contract(static, lhs3, rhs3, probe)
    return out.reshape(*(lhs.shape[d] for d in lb), *lhs_free, *rhs_free)


def _canonical_dims(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> tuple:
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dims = ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))
    except (TypeError, ValueError):
        raise TypeError(
            "jmp_lite.fp8.dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)) as for jax.lax.dot_general; got {dimension_numbers!r}"
        ) from None
    (lc, rc), (lb, rb) = dims
    for side, ndim, axes in (("lhs", lhs_ndim, (*lc, *lb)), ("rhs", rhs_ndim, (*rc, *rb))):
        bad = [d for d in axes if not -ndim <= d < ndim]
        if bad:
            raise ValueError(
                f"jmp_lite.fp8.dot_general: dimension_numbers {dimension_numbers!r} name {side} axes {bad}, "
                f"but {side} has {ndim} dimensions (axes -{ndim} to {ndim - 1})"
            )
    # Negative axes as lax.dot_general would refuse them: normalise so the gradient dots agree.
    lc, lb = (tuple(d % lhs_ndim for d in ds) for ds in (lc, lb))
    rc, rb = (tuple(d % rhs_ndim for d in ds) for ds in (rc, rb))
    return ((lc, rc), (lb, rb))


def _check_state(state: Any, recipe: Fp8Recipe, what: str = "jmp_lite.fp8.dot_general") -> None:
    if not isinstance(state, Fp8State):
        raise TypeError(
            f"{what}: state must be an Fp8State (jmp_lite.fp8.init_fp8_state(recipe)) or "
            f"None; got {type(state).__name__}"
        )
    shapes = (jnp.shape(state.fp8_scale), jnp.shape(state.fp8_amax), jnp.shape(state.fp8_amax_history))
    want = ((len(ROWS),), (len(ROWS),), (len(ROWS), recipe.history_length))
    if shapes != want:
        raise ValueError(
            f"{what}: the state's fields have shapes {shapes}, expected {want} for "
            f"recipe {str(recipe)!r} (one contraction's state; scan or vmap over stacked states)"
        )
    check_field_dtypes(state, f"{what}: state")


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Fp8Recipe | str,
    state: Fp8State | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """``jax.lax.dot_general`` with fp8 operands: scaled, saturated, contracted in float32, descaled.

    Args:
        lhs, rhs: float32, bfloat16 or float16 arrays (float64 is refused: fp8 has no place in a
            float64 program).
        dimension_numbers: as for ``jax.lax.dot_general``.
        precision: accepted for ``jax.lax.dot_general`` compatibility and ignored: the operands are fp8.
        preferred_element_type: the result dtype; default the promoted operand dtype.
        recipe: an ``Fp8Recipe`` or its string form; ``"hybrid,block"`` and ``"hybrid,mxfp8"`` scale
            per tile instead of per tensor (module docstring).
        state: this contraction's ``Fp8State``; required for delayed scaling, optional for current
            and block scaling (where it only collects the observed amaxes). Pass it unchanged (not sliced,
            broadcast or reused by a second contraction): its ``fp8_amax`` cotangent carries the
            amaxes, and JAX adds the cotangents of a value used twice. Fields that are not float32 are
            refused; a scale that is not positive and finite is repaired on use, as
            ``update_fp8_state`` repairs it (see ``Fp8State``: the state is usually traced here).
        out_sharding: must be ``None`` (not supported).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> from jmp_lite import fp8
        >>> x = jax.random.normal(jax.random.key(0), (4, 64), jnp.bfloat16)
        >>> w = jax.random.normal(jax.random.key(1), (64, 8), jnp.bfloat16)
        >>> matmul = jax.jit(fp8.dot_general, static_argnums=2, static_argnames="recipe")
        >>> y = matmul(x, w, (((1,), (0,)), ((), ())), recipe="hybrid,current")
        >>> y.dtype, y.shape
        (dtype(bfloat16), (4, 8))
        >>> exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
        >>> bool(jnp.abs(y - exact).max() < 0.1 * jnp.abs(exact).max())
        True
        >>> big = x.at[0].multiply(2.0**16)  # one row 2**16 times the others: a scale per 1x128 tile
        >>> def error(recipe):  # on the other rows
        ...     y = matmul(big, w, (((1,), (0,)), ((), ())), recipe=recipe)
        ...     return float(jnp.abs(y[1:] - exact[1:]).max())
        >>> error("hybrid,block") < error("hybrid,current") / 4
        True
    """
    del precision
    recipe = as_fp8_recipe(recipe, "jmp_lite.fp8.dot_general's recipe")
    if out_sharding is not None:
        raise NotImplementedError("jmp_lite.fp8.dot_general does not take out_sharding; shard its operands")
    for position, x in enumerate((lhs, rhs)):
        if not hasattr(x, "dtype"):
            raise TypeError(
                f"jmp_lite.fp8.dot_general: operand {position} is a {type(x).__name__}; like "
                "jax.lax.dot_general it takes arrays. Convert it first, e.g. with jax.numpy.asarray."
            )
    lhs_dtype = check_compute_dtype(lhs.dtype, "jmp_lite.fp8.dot_general (lhs)")
    rhs_dtype = check_compute_dtype(rhs.dtype, "jmp_lite.fp8.dot_general (rhs)")
    if preferred_element_type is None:
        out_dtype = np.dtype(jnp.promote_types(lhs_dtype, rhs_dtype))
    else:
        out_dtype = check_compute_dtype(
            preferred_element_type, "jmp_lite.fp8.dot_general's preferred_element_type", result=True
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dims = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    if state is None:
        if recipe.stateful:
            raise ValueError(
                "jmp_lite.fp8.dot_general: delayed scaling needs this contraction's state "
                "(state=jmp_lite.fp8.init_fp8_state(recipe)); current scaling works without one"
            )
        scale, probe = jnp.ones(len(ROWS), jnp.float32), jnp.zeros(len(ROWS), jnp.float32)
    else:
        _check_state(state, recipe)
        scale, probe = state.fp8_scale, state.fp8_amax
        if recipe.stateful:
            scale = repaired_scale(state, recipe)  # a scale of 0, NaN, inf (a corrupt restore): see Fp8State
    # Inside shard_map: operands on a common set of varying mesh axes, so that JAX sums a replicated
    # operand's gradient over the shards (the transpose of this pcast) outside the custom_vjp.
    axes = _varying(lhs) | _varying(rhs)
    lhs, rhs = _to_varying(lhs, axes), _to_varying(rhs, axes)
    if recipe.block_scaled:
        return _block_dot(lhs, rhs, dims, _BlockStatic(recipe, out_dtype, lhs_dtype, rhs_dtype), probe)
    static = _Static(recipe, dims, out_dtype, lhs_dtype, rhs_dtype)
    return _contract(static, lhs, rhs, scale, probe)


def _einsum_dims(subscripts: str, lhs_shape: tuple, rhs_shape: tuple) -> tuple:
    """(lhs summed axes, rhs summed axes, dimension_numbers, output permutation) of a two-operand einsum."""
    text = "".join(subscripts.split())
    inputs, arrow, output = text.partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"jmp_lite.fp8.einsum takes exactly two operands; {subscripts!r} names {len(parts)}")
    used = set(text) - set(".,->")
    fresh = (chr(c) for c in range(0x100, 0x200) if chr(c) not in used)
    ellipsis = {}  # ellipsis axis counted from the right -> its letter
    names = []
    for part, shape in zip(parts, (lhs_shape, rhs_shape)):
        if part.count("...") > 1 or "." in part.replace("...", ""):
            raise ValueError(f"jmp_lite.fp8.einsum: malformed operand {part!r} in {subscripts!r}")
        head, dots, tail = part.partition("...")
        n = len(shape) - len(head) - len(tail)
        if n < 0 or (n and not dots):
            raise ValueError(f"jmp_lite.fp8.einsum: {part!r} does not match an operand of shape {shape}")
        mid = "".join(ellipsis.setdefault(n - i, next(fresh)) for i in range(n)) if dots else ""
        names.append(head + mid + tail)
    lhs_names, rhs_names = names
    if not arrow:  # implicit output: ellipsis axes, then the letters that occur once, sorted (as numpy)
        once = sorted(c for c in used if inputs.count(c) == 1)
        output = "..." * bool(ellipsis) + "".join(once)
    if "..." in output:
        mid = "".join(ellipsis[n] for n in sorted(ellipsis, reverse=True))
        output = output.replace("...", mid)
    for where, ns in (("lhs", lhs_names), ("rhs", rhs_names), ("output", output)):
        if len(set(ns)) != len(ns):
            raise NotImplementedError(
                f"jmp_lite.fp8.einsum({subscripts!r}): an index repeated within the {where} (a diagonal) "
                "is not a contraction; use jax.numpy.einsum"
            )
    if set(output) - set(lhs_names) - set(rhs_names):
        raise ValueError(f"jmp_lite.fp8.einsum({subscripts!r}): the output names an index no operand has")
    for c in set(lhs_names) & set(rhs_names):
        if lhs_shape[lhs_names.index(c)] != rhs_shape[rhs_names.index(c)]:
            raise ValueError(
                f"jmp_lite.fp8.einsum({subscripts!r}): index {c!r} has size {lhs_shape[lhs_names.index(c)]} "
                f"in lhs and {rhs_shape[rhs_names.index(c)]} in rhs (fp8 einsum does not broadcast)"
            )
    # Indices of one operand only that the output drops are summed before the contraction.
    lhs_sum = tuple(i for i, c in enumerate(lhs_names) if c not in rhs_names and c not in output)
    rhs_sum = tuple(i for i, c in enumerate(rhs_names) if c not in lhs_names and c not in output)
    lhs_names = "".join(c for i, c in enumerate(lhs_names) if i not in lhs_sum)
    rhs_names = "".join(c for i, c in enumerate(rhs_names) if i not in rhs_sum)
    batch = [c for c in output if c in lhs_names and c in rhs_names]
    contract = [c for c in lhs_names if c in rhs_names and c not in output]
    dims = (
        (tuple(lhs_names.index(c) for c in contract), tuple(rhs_names.index(c) for c in contract)),
        (tuple(lhs_names.index(c) for c in batch), tuple(rhs_names.index(c) for c in batch)),
    )
    produced = batch + [c for c in lhs_names if c not in batch and c not in contract]
    produced += [c for c in rhs_names if c not in batch and c not in contract]
    return lhs_sum, rhs_sum, dims, tuple(produced.index(c) for c in output)


def einsum(
    subscripts: str,
    lhs: jax.Array,
    rhs: jax.Array,
    /,
    *,
    recipe: Fp8Recipe | str,
    state: Fp8State | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``jax.numpy.einsum`` of two operands, as one fp8 ``dot_general`` of ``lhs`` and ``rhs``.

    The state's ``lhs`` row always describes the first operand and ``rhs`` the second (the
    contraction is laid out here, not by ``jnp.einsum``, which may swap them), so a checkpointed
    state keeps its meaning. Ellipses are supported; an index of one operand that the output drops
    is summed (in float32) before quantizing; diagonals (an index repeated in one operand) and
    broadcasting of size-1 axes are not.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite import fp8
        >>> x = jax.random.normal(jax.random.key(0), (2, 5, 16), jnp.bfloat16)
        >>> w = jax.random.normal(jax.random.key(1), (16, 4), jnp.bfloat16)
        >>> state = fp8.init_fp8_state("hybrid,delayed,history=4")
        >>> fp8.einsum("btd,df->btf", x, w, recipe="hybrid,delayed,history=4", state=state).shape
        (2, 5, 4)
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"jmp_lite.fp8.einsum: subscripts must be a str, got {type(subscripts).__name__}")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lhs_sum, rhs_sum, dims, perm = _einsum_dims(subscripts, lhs.shape, rhs.shape)
    if lhs_sum:
        lhs = lhs.astype(jnp.float32).sum(lhs_sum).astype(lhs.dtype)
    if rhs_sum:
        rhs = rhs.astype(jnp.float32).sum(rhs_sum).astype(rhs.dtype)
    out = dot_general(lhs, rhs, dims, precision, preferred_element_type, recipe=recipe, state=state)
    return out if perm == tuple(range(out.ndim)) else lax.transpose(out, perm)
