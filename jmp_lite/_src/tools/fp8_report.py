"""``fp8_report``: how one contraction's tensors fare when quantized to fp8 (saturation, underflow,
headroom) with the scales a recipe would use. A tool: no training step depends on it."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmp_lite._src.base import reports, validate
from jmp_lite._src.fp8 import fp8_blocks
from jmp_lite._src.fp8.fp8 import (
    ROWS,
    Fp8Recipe,
    Fp8State,
    as_fp8_recipe,
    check_compute_dtype,
    repaired_scale,
    row_maxima,
    scale_from_amax,
)
from jmp_lite._src.fp8.fp8_ops import _canonical_dims, _check_state, contraction_shape
from jmp_lite._src.tools.diagnostics import cast_masks, gradient_diagnostics

__all__ = ["Fp8Report", "Fp8TensorReport", "fp8_report"]


class Fp8TensorReport(NamedTuple):
    """How one tensor fares when quantized to fp8 with a given scale (all float32 scalars).

    ``saturated``: the fraction of values that would overflow the format (``|x * scale|`` rounds past
    its maximum; the contraction clips them to it). ``underflow``: nonzero values that become zero.
    ``subnormal``: values kept with fewer mantissa bits. ``amax``, ``scale``, and ``headroom_bits``:
    ``log2(fp8_max / (amax * scale))``, negative when the scale is too large (saturation), large when
    it is too small (underflow).
    """

    saturated: jax.Array
    underflow: jax.Array
    subnormal: jax.Array
    amax: jax.Array
    scale: jax.Array
    headroom_bits: jax.Array


class Fp8Report(NamedTuple):
    """``fp8_report``'s result: an ``Fp8TensorReport`` for lhs, rhs and (when given) the output gradient."""

    lhs: Fp8TensorReport
    rhs: Fp8TensorReport
    grad: Fp8TensorReport | None

    def table(self) -> str:
        """One row per tensor: saturated, underflow and subnormal fractions, amax, scale, headroom."""
        lines = [f"{'tensor':<6}  {'saturated':>9}  {'underflow':>9}  {'subnormal':>9}  {'amax':>10}  "
                 f"{'scale':>10}  headroom"]  # fmt: skip
        for name, r in (("lhs", self.lhs), ("rhs", self.rhs), ("grad", self.grad)):
            if r is not None:
                lines.append(
                    f"{name:<6}  {float(r.saturated):9.3%}  {float(r.underflow):9.3%}  "
                    f"{float(r.subnormal):9.3%}  {float(r.amax):10.4g}  {float(r.scale):10.4g}  "
                    f"{float(r.headroom_bits):.1f} bits"
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Each tensor's report as JSON-ready values (``grad``: ``None`` when not given)."""
        return reports.plain(self)


def _tensor_report(x: jax.Array, dtype: np.dtype, scale: jax.Array) -> Fp8TensorReport:
    # gradient_diagnostics casts x * scale to the fp8 dtype: its overflow is what saturation clips.
    r = gradient_diagnostics(x, dtype, loss_scale=scale)
    return Fp8TensorReport(
        saturated=r.overflow,
        underflow=r.underflow,
        subnormal=r.subnormal,
        amax=r.max_abs,
        scale=jnp.asarray(scale, jnp.float32),
        headroom_bits=r.headroom_bits,
    )


def _dims(dimension_numbers: Any, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """The contraction's dimension numbers (default: ``lhs @ rhs``, lhs's last axis against rhs's
    first), normalised and checked by ``lax.dot_general``'s own shape rules."""
    if dimension_numbers is None:
        if lhs.ndim == 0 or rhs.ndim == 0:
            raise ValueError(
                f"fp8_report: lhs {lhs.shape} and rhs {rhs.shape} have no axes to contract; pass arrays "
                "contracted as lhs @ rhs (lhs's last axis against rhs's first), or dimension_numbers="
            )
        dimension_numbers = (((lhs.ndim - 1,), (0,)), ((), ()))
    try:
        dims = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("jmp_lite.fp8.dot_general", "fp8_report")) from None
    try:
        return dims, contraction_shape(lhs.shape, rhs.shape, dims)
    except TypeError as e:
        raise ValueError(
            f"fp8_report: lhs {lhs.shape} and rhs {rhs.shape} do not contract with dimension_numbers "
            f"{dims}: {e}"
        ) from None


def _uses(recipe: Fp8Recipe, lhs: jax.Array, rhs: jax.Array, grad: jax.Array | None, dims: tuple) -> tuple:
    """Each tensor's layouts in the block-scaled products, as ``(x (batch, R, C), rows)`` pairs: ``x``
    is quantized in tiles of ``rows`` x ``block_size`` along ``C``.

    lhs ``(b, M, K)``: the forward in 1 x B tiles along K, the rhs gradient in 1 x B tiles along M.
    rhs ``(b, N, K)``: B x B blocks, which the lhs gradient reuses transposed (``"block"``), or
    1 x 32 tiles along K and along N (``"mxfp8"``). grad ``(b, M, N)``: 1 x B tiles along N (the lhs
    gradient) and along M (the rhs gradient). As ``fp8.dot_general`` quantizes them."""
    (lc, rc), (lb, rb) = dims
    lhs3, _ = fp8_blocks.canonical(lhs, lb, lc)
    rhs3, _ = fp8_blocks.canonical(rhs, rb, rc)
    t = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    if recipe.power_of_two_scales:
        rhs_uses = ((rhs3, 1), (t(rhs3), 1))
    else:
        rhs_uses = ((rhs3, recipe.block_size),)
    uses = [((lhs3, 1), (t(lhs3), 1)), rhs_uses]
    if grad is not None:
        grad3 = grad.reshape(lhs3.shape[0], lhs3.shape[1], rhs3.shape[1])
        uses.append(((grad3, 1), (t(grad3), 1)))
    return tuple(uses)


def _block_report(recipe: Fp8Recipe, x: jax.Array, uses: tuple, dtype: np.dtype) -> Fp8TensorReport:
    # The tile holding the tensor's amax has that amax in every layout, hence this scale and headroom;
    # the amax of its finite values, as reported: a NaN elsewhere leaves that tile's scale alone.
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    power_of_two = recipe.power_of_two_scales
    magnitude = jnp.abs(x.astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(magnitude), magnitude, 0.0), initial=0.0)
    report = _tensor_report(x, dtype, fp8_blocks.tile_scales(amax, fp8_max, recipe.margin, power_of_two))
    fractions = []
    for y, rows in uses:
        scales = fp8_blocks.element_scales(y, recipe.block_size, rows, fp8_max, recipe.margin, power_of_two)
        # the product quantize_tiles forms, counted as the per-tensor report counts its cast
        under, sub, over = cast_masks(y.astype(jnp.float32), scales, dtype)
        # an empty tensor has no value in any class (jnp.mean would give NaN)
        fractions.append(
            jnp.stack([jnp.mean(m, dtype=jnp.float32) if m.size else 0.0 for m in (over, under, sub)])
        )
    worst = jnp.max(jnp.stack(fractions), axis=0)
    return Fp8TensorReport(*worst, report.amax, report.scale, report.headroom_bits)


def fp8_report(
    lhs: jax.Array,
    rhs: jax.Array,
    recipe: Fp8Recipe | str,
    state: Fp8State | None = None,
    grad: jax.Array | None = None,
    *,
    dimension_numbers: Any = None,
) -> Fp8Report:
    """Saturation and underflow of one contraction's fp8 tensors, with the scales it would use.

    Give it a layer's input, its kernel, the layer's ``Fp8State`` (delayed scaling; current and block
    scaling need none) and optionally the gradient of the layer's output; it quantizes each like
    ``dot_general`` does (with ``jmp_lite.gradient_diagnostics``) and reports per tensor. A layer whose
    scale is wrong shows ``saturated > 0`` and negative ``headroom_bits`` (scale too large) or a high
    ``underflow`` (scale too small).

    Block recipes (``"block"``, ``"mxfp8"``) quantize in tiles along the contracted axes, so the
    report needs the contraction: ``dimension_numbers`` as for ``lax.dot_general``, by default
    ``lhs @ rhs`` (lhs's last axis against rhs's first). ``rhs`` gets the weight's tiles (B x B blocks
    under ``"block"``) and ``grad`` must have the contraction's output shape. A tensor quantized in two
    layouts (the lhs along K for the forward and along M for the kernel's gradient, the gradient along N
    and M) reports the larger fraction of the two for ``saturated``, ``underflow`` and ``subnormal``;
    ``scale`` and ``headroom_bits`` are those of the tile holding ``amax``. Tiles along M hold the
    tokens one device (or one ``vmap``'d example) holds: report on one device's slice, or write the
    split as a batch axis. Per-tensor recipes ignore the layout unless ``dimension_numbers`` is given:
    then too ``grad`` must have the output shape; without it, any ``grad`` shape a contraction of
    ``lhs`` and ``rhs`` has is accepted.

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import fp8
        >>> recipe = fp8.Fp8Recipe("hybrid", "delayed", amax_history=4)
        >>> state = fp8.init_fp8_state(recipe)  # scale 1: activations up to 1000 saturate
        >>> x = jnp.array([[1000.0, 1.0, 1e-4, 0.0]])
        >>> r = fp8.fp8_report(x, jnp.ones((4, 2)), recipe, state)
        >>> float(r.lhs.saturated), float(r.lhs.underflow), float(r.rhs.saturated)
        (0.25, 0.25, 0.0)
        >>> import jax
        >>> x = jnp.concatenate([jnp.full((1, 128), 1e4), jnp.full((1, 128), 1e-3)], axis=1)
        >>> lost = jax.jit(lambda x, w: [fp8.fp8_report(x, w, r).lhs.underflow for r in ("current", "block")])
        >>> [float(u) for u in lost(x, jnp.ones((256, 2)))]  # per tensor 1e-3 is lost; in its own tile not
        [0.5, 0.0]
    """
    recipe = as_fp8_recipe(recipe, "fp8_report's recipe")
    if state is not None:  # checked under every recipe, though only delayed scaling reads it
        _check_state(state, recipe, "fp8_report")
    if recipe.stateful:
        if state is None:
            raise ValueError("fp8_report: delayed scaling reads the scales from the state; pass state=")
        scales = repaired_scale(state, recipe)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if grad is not None:
        grad = jnp.asarray(grad)
    block = recipe.block_scaled
    if block or dimension_numbers is not None:
        dims, out_shape = _dims(dimension_numbers, lhs, rhs)
        if grad is not None and tuple(grad.shape) != tuple(out_shape):
            raise ValueError(
                f"fp8_report's grad has shape {tuple(grad.shape)}; the contraction of lhs {lhs.shape} and "
                f"rhs {rhs.shape} with dimension_numbers {dims} has output shape {tuple(out_shape)}: pass "
                "the gradient of this layer's output"
            )
    elif grad is not None:
        validate.contraction_output(jnp.shape(grad), jnp.shape(lhs), jnp.shape(rhs), "fp8_report's grad")
    tensors = (lhs, rhs, grad)
    dtypes = (recipe.forward_dtype, recipe.forward_dtype, recipe.backward_dtype)
    for i, x in enumerate(tensors):
        if x is not None:
            check_compute_dtype(x.dtype, f"fp8_report ({ROWS[i]})")
    if block:
        uses = _uses(recipe, lhs, rhs, grad, dims)
        reports = [_block_report(recipe, x, u, d) for x, u, d in zip(tensors, uses, dtypes)]
        return Fp8Report(*reports, *([None] if grad is None else []))
    maxima = row_maxima(recipe)
    reports = []
    for i, (x, dtype) in enumerate(zip(tensors, dtypes)):
        if x is None:
            reports.append(None)
            continue
        if recipe.stateful:
            scale = scales[i]
        else:
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0)
            scale = scale_from_amax(amax, maxima[i], recipe.margin, 1.0)
        reports.append(_tensor_report(x, dtype, scale))
    return Fp8Report(*reports)
