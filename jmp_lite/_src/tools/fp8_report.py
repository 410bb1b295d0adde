"""``fp8_report``: how one contraction's tensors fare when quantized to fp8 (saturation, underflow,
headroom) with the scales a recipe would use. A tool: no training step depends on it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import validate
from jmp_lite._src.fp8 import (
    ROWS,
    Fp8Recipe,
    Fp8State,
    as_fp8_recipe,
    check_compute_dtype,
    repaired_scale,
    row_maxima,
    scale_from_amax,
)
from jmp_lite._src.fp8_ops import _check_state
from jmp_lite._src.tools.diagnostics import gradient_diagnostics

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


def fp8_report(
    lhs: jax.Array,
    rhs: jax.Array,
    recipe: Fp8Recipe | str,
    state: Fp8State | None = None,
    grad: jax.Array | None = None,
) -> Fp8Report:
    """Saturation and underflow of one contraction's fp8 tensors, with the scales it would use.

    Give it a layer's input, its kernel, the layer's ``Fp8State`` (delayed scaling; current scaling
    needs none) and optionally the gradient of the layer's output (a shape no contraction of ``lhs``
    and ``rhs`` has is refused); it quantizes each like ``dot_general`` does (with
    ``jmp_lite.gradient_diagnostics``) and reports per tensor. A layer whose scale is wrong shows
    ``saturated > 0`` and negative ``headroom_bits`` (scale too large) or a high ``underflow`` (scale
    too small).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import fp8
        >>> recipe = fp8.Fp8Recipe("hybrid", "delayed", amax_history=4)
        >>> state = fp8.init_fp8_state(recipe)  # scale 1: activations up to 1000 saturate
        >>> x = jnp.array([[1000.0, 1.0, 1e-4, 0.0]])
        >>> r = fp8.fp8_report(x, jnp.ones((4, 2)), recipe, state)
        >>> float(r.lhs.saturated), float(r.lhs.underflow), float(r.rhs.saturated)
        (0.25, 0.25, 0.0)
    """
    recipe = as_fp8_recipe(recipe, "fp8_report's recipe")
    if recipe.scaling == "delayed":
        if state is None:
            raise ValueError("fp8_report: delayed scaling reads the scales from the state; pass state=")
        _check_state(state, recipe, "fp8_report")
        scales = repaired_scale(state, recipe)
    if grad is not None:
        validate.contraction_output(jnp.shape(grad), jnp.shape(lhs), jnp.shape(rhs), "fp8_report's grad")
    tensors = (lhs, rhs, grad)
    dtypes = (recipe.forward_dtype, recipe.forward_dtype, recipe.backward_dtype)
    maxima = row_maxima(recipe)
    reports = []
    for i, (x, dtype) in enumerate(zip(tensors, dtypes)):
        if x is None:
            reports.append(None)
            continue
        x = jnp.asarray(x)
        check_compute_dtype(x.dtype, f"fp8_report ({ROWS[i]})")
        if recipe.scaling == "delayed":
            scale = scales[i]
        else:
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0)
            scale = scale_from_amax(amax, maxima[i], recipe.margin, 1.0)
        reports.append(_tensor_report(x, dtype, scale))
    return Fp8Report(*reports)
