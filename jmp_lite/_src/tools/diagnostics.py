"""How well a gradient pytree survives a cast to a half-precision dtype.

``gradient_diagnostics(grads, dtype, loss_scale)`` multiplies the gradients by
the loss scale, casts them to ``dtype`` the way the backward pass would, and
counts, per leaf and overall, the values that

* underflow: nonzero and finite, but zero in ``dtype`` (lost to training),
* become subnormal: ``0 < |x| < finfo(dtype).tiny`` (kept with fewer bits),
* overflow: finite, but infinite in ``dtype`` (the step would be skipped).

It also returns a histogram of ``floor(log2 |g|)`` of the unscaled gradients
(the paper's Figure 2) and a recommended static loss scale: the largest power of
two that keeps the largest gradient ``margin_bits`` doublings below
``finfo(dtype).max`` (Micikevicius et al., 2018, "Mixed Precision Training",
section 3.2: scale up as far as overflow allows). Everything is computed with
jax.numpy, so it runs under ``jit`` and costs one pass over the gradients.

XLA's CPU and GPU backends flush float32 denormals (below 2^-126) to zero, so such
gradients count as zeros, and bfloat16, whose subnormals are float32 denormals,
shows no subnormals under XLA: its values below 2^-126 underflow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.base import reports, validate
from jmp_lite._src.optim.loss_scale import LossScale

__all__ = ["GradientReport", "LeafReport", "gradient_diagnostics"]

_MAX_RECOMMENDED_LOG2 = 24  # DynamicLossScale's default ceiling
_F32_TINY = float(np.finfo(np.float32).tiny)


def replicated(x: jax.Array) -> jax.Array:
    """``x`` whole on every device of its mesh when its type carries a split layout (a mesh with
    Explicit axes, ``jax.make_mesh``'s default), otherwise as it is. The measurements concatenate and
    scatter values of several layouts (a batch-split activation, a replicated weight's gradient), which
    JAX refuses on Explicit axes ('All operands should have the same sharding')."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if (
        isinstance(sharding, jax.sharding.NamedSharding)
        and any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
        and any(entry is not None for entry in sharding.spec)
    ):
        return jax.sharding.reshard(x, sharding.update(spec=jax.sharding.PartitionSpec()))
    return x


def _flush(x: jax.Array) -> jax.Array:
    # Whether XLA flushes a denormal depends on which kernel touches it (fused or not);
    # treat everything below float32's smallest normal as the zero it usually becomes.
    return jnp.where(jnp.abs(x) < _F32_TINY, jnp.zeros_like(x), x)


def cast_masks(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Which values of ``x * scale`` (``x`` float32 or wider, its denormals taken as zeros; ``scale``
    a number or one per element) underflow, become subnormal and overflow when cast to ``dtype``."""
    x = _flush(x)
    scaled = _flush(x * scale)
    cast = scaled.astype(dtype).astype(x.dtype)
    finite = jnp.isfinite(x)
    lost = jnp.abs(cast) < _F32_TINY  # zero, or a float32 denormal XLA would flush
    under = finite & (x != 0) & lost
    sub = ~lost & (jnp.abs(cast) < float(jnp.finfo(dtype).tiny))
    over = jnp.isfinite(scaled) & ~jnp.isfinite(cast)
    over = over | (finite & ~jnp.isfinite(scaled))  # the scaling itself overflowed
    return under, sub, over


class LeafReport(NamedTuple):
    """Fractions of one leaf's values (of all its values, zeros included)."""

    underflow: jax.Array
    subnormal: jax.Array
    overflow: jax.Array


class GradientReport(NamedTuple):
    """What ``gradient_diagnostics`` returns; every field is an array (jit-friendly).

    ``underflow``, ``subnormal``, ``overflow``, ``zeros`` (exact zeros) and
    ``nonfinite`` (inf/NaN) are fractions of all gradient values; ``count`` is
    how many values there are (float32). ``histogram[i]`` counts the nonzero
    finite unscaled values with ``floor(log2 |g|) == log2_bins[i]`` (values
    outside the range go to the end bins). ``headroom_bits`` is how many
    doublings the largest scaled gradient has left before ``finfo(dtype).max``
    (negative: it already overflows; inf for all-zero gradients).
    ``recommended_scale`` is a power of two clipped to ``[1, 2**24]``.
    """

    count: jax.Array
    underflow: jax.Array
    subnormal: jax.Array
    overflow: jax.Array
    zeros: jax.Array
    nonfinite: jax.Array
    max_abs: jax.Array
    headroom_bits: jax.Array
    recommended_scale: jax.Array
    histogram: jax.Array
    log2_bins: jax.Array
    per_leaf: Any

    def table(self) -> str:
        """The fractions, the headroom and the recommended scale, one per line (values on the host)."""
        f = {
            k: float(v) for k, v in self._asdict().items() if k not in ("histogram", "log2_bins", "per_leaf")
        }
        return "\n".join(
            [
                f"{int(f['count']):,} gradient values: underflow {f['underflow']:.3%}, subnormal "
                f"{f['subnormal']:.3%}, overflow {f['overflow']:.3%}, zeros {f['zeros']:.3%}, "
                f"non-finite {f['nonfinite']:.3%}",
                f"largest |g * scale| {f['max_abs']:.4g}: {f['headroom_bits']:.1f} doublings of headroom; "
                f"recommended static scale {f['recommended_scale']:.4g}",
            ]
        )

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values; ``per_leaf`` keyed by each leaf's path."""
        flat = jax.tree_util.tree_flatten_with_path(
            self.per_leaf, is_leaf=lambda x: isinstance(x, LeafReport)
        )[0]
        leaves = {jax.tree_util.keystr(path): reports.plain(leaf) for path, leaf in flat}
        return {
            **{k: reports.plain(v) for k, v in self._asdict().items() if k != "per_leaf"},
            "per_leaf": leaves,
        }


def _scale_value(loss_scale: LossScale | float | jax.Array) -> jax.Array:
    if isinstance(loss_scale, LossScale):
        return jnp.asarray(loss_scale.loss_scale, jnp.float32)
    scale = validate.positive_scale(loss_scale, "gradient_diagnostics.loss_scale")
    # A traced scale cannot be checked in Python: an invalid one makes the report NaN.
    return validate.nan_unless_positive(scale) if validate.is_tracer(loss_scale) else scale


def gradient_diagnostics(
    grads: Any,
    dtype: Any,
    loss_scale: LossScale | float | jax.Array = 1.0,
    *,
    log2_range: tuple[int, int] = (-64, 32),
    margin_bits: int = 3,
) -> GradientReport:
    """Underflow, subnormal and overflow fractions of ``grads * loss_scale`` cast to ``dtype``.

    Args:
        grads: a pytree of unscaled gradients (any float dtype; float32 is exact).
        dtype: the half-precision dtype the backward pass runs in (float16, bfloat16, ...).
        loss_scale: a ``LossScale`` or a number; 1.0 means no loss scaling.
        log2_range: ``(lo, hi)``: histogram bins are the integers ``lo <= k < hi``.
        margin_bits: doublings the recommended static scale leaves below the dtype's max;
            the recommendation is clipped to ``[1, 2**24]`` (1 when the gradients
            already overflow unscaled, 2**24 when they are all zero).

    Returns:
        A ``GradientReport``; ``per_leaf`` has the structure of ``grads``, with a
        ``LeafReport`` per leaf.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> g = {"w": jnp.array([1e-9, 1e-6, 1e-2, 0.0])}
        >>> r = jmp_lite.gradient_diagnostics(g, jnp.float16)
        >>> float(r.underflow), float(r.subnormal)  # 1e-9 is lost, 1e-6 is subnormal
        (0.25, 0.25)
        >>> r = jmp_lite.gradient_diagnostics(g, jnp.float16, loss_scale=2.0**15)
        >>> float(r.underflow), float(r.subnormal), float(r.recommended_scale)
        (0.0, 0.25, 524288.0)
    """
    try:
        dtype = np.dtype(dtype)
        finfo = jnp.finfo(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"dtype must be a floating dtype such as jnp.float16, got {dtype!r}") from None
    if not (isinstance(log2_range, (tuple, list)) and len(log2_range) == 2):
        raise ValueError(f"gradient_diagnostics.log2_range must be a pair (lo, hi), got {log2_range!r}")
    lo, hi = (
        validate.whole_number(k, "gradient_diagnostics.log2_range", low=-1074, high=1024) for k in log2_range
    )
    if not lo < hi:
        raise ValueError(
            f"gradient_diagnostics.log2_range must be two whole numbers lo < hi, got {log2_range!r}"
        )
    margin_bits = validate.whole_number(margin_bits, "gradient_diagnostics.margin_bits", low=0, high=1024)
    scale = _scale_value(loss_scale)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    if not leaves:
        raise ValueError("grads has no leaves")
    bins = jnp.arange(lo, hi)
    per_leaf, totals = [], []
    hist = jnp.zeros(hi - lo, jnp.float32)
    max_abs = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        x = jnp.asarray(leaf)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"gradient leaves must be floating arrays, got {x.dtype}")
        x = _flush(replicated(x.astype(jnp.promote_types(x.dtype, jnp.float32))).ravel())
        under, sub, over = cast_masks(x, scale.astype(x.dtype), dtype)
        finite = jnp.isfinite(x)
        nonzero = finite & (x != 0)
        f32 = jnp.float32  # counts in float32: int32 would wrap past 2^31 values
        counts = jnp.stack([m.sum(dtype=f32) for m in (under, sub, over, x == 0, ~finite)])
        totals.append(counts)
        n = max(x.size, 1)
        per_leaf.append(LeafReport(*(counts[:3] / n)))
        k = jnp.frexp(jnp.where(nonzero, x, 1.0))[1] - 1  # exact floor(log2|x|), unlike a float log2
        idx = jnp.clip(k, lo, hi - 1) - lo
        hist = hist + jnp.zeros(hi - lo, jnp.float32).at[idx].add(nonzero.astype(jnp.float32))
        max_abs = jnp.maximum(max_abs, jnp.max(jnp.where(finite, jnp.abs(x), 0.0), initial=0.0))
    count = sum(int(np.size(leaf)) for leaf in leaves)
    under, sub, over, zeros, nonfinite = jnp.sum(jnp.stack(totals), 0) / max(count, 1)
    log2_max = jnp.log2(jnp.float32(float(finfo.max)))
    log2_top = jnp.log2(jnp.maximum(max_abs, jnp.finfo(jnp.float32).tiny))
    headroom = jnp.where(max_abs > 0, log2_max - (log2_top + jnp.log2(scale)), jnp.inf)
    best = jnp.clip(jnp.floor(log2_max - log2_top) - margin_bits, 0, _MAX_RECOMMENDED_LOG2)
    best = jnp.where(max_abs > 0, best, _MAX_RECOMMENDED_LOG2)
    return GradientReport(
        count=jnp.asarray(float(count), jnp.float32),
        underflow=under,
        subnormal=sub,
        overflow=over,
        zeros=zeros,
        nonfinite=nonfinite,
        max_abs=max_abs,
        headroom_bits=headroom,
        recommended_scale=jnp.ldexp(jnp.float32(1.0), best.astype(jnp.int32)),
        histogram=hist,
        log2_bins=bins,
        per_leaf=jax.tree_util.tree_unflatten(treedef, per_leaf),
    )
