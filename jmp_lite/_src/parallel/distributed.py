"""Cross-replica gradient reduction with a chosen communication dtype.

Data-parallel training averages gradients over replicas with an all-reduce.
The dtype of that collective is a bandwidth/accuracy trade-off (FSDP2 calls it
``reduce_dtype``): reducing in bfloat16 or float16 halves the bytes on the wire,
reducing in float32 keeps the sum exact to float32 rounding.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, TypeVar

import jax
import numpy as np

from jmp_lite._src.base import dtypes as _dtypes
from jmp_lite._src.base import validate

T = TypeVar("T")
ReduceOp = Literal["mean", "sum"]


def reduce_gradients(
    grads: T,
    axis_name: Any,
    *,
    reduce_dtype: Any = None,
    reduce: ReduceOp = "mean",
    op: ReduceOp | None = None,
) -> T:
    """All-reduces every floating leaf over ``axis_name`` in ``reduce_dtype``.

    Each leaf is cast to ``reduce_dtype`` (default: its own dtype), summed or
    averaged over the replicas of ``axis_name`` (a ``pmap``/``shard_map`` axis
    name or tuple of names), and cast back to its own dtype. Non-floating
    leaves are returned unchanged. ``reduce`` is ``"mean"`` or ``"sum"``, the
    same argument as ``loss_scaling(reduce=)``; ``op=`` is its deprecated old
    spelling.

    Reduce loss-*scaled* gradients in float16 with care: the sum of ``n``
    replicas can overflow where each term does not. ``loss_scaling`` then sees
    inf, skips the step and lowers the scale, so training stays correct.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jmp_lite
        >>> n = jax.local_device_count()
        >>> reduce = lambda g: jmp_lite.reduce_gradients(g, "d", reduce_dtype=jnp.bfloat16)
        >>> f = jax.pmap(reduce, axis_name="d")
        >>> out = f({"w": jnp.arange(n, dtype=jnp.float32)[:, None]})
        >>> float(out["w"][0, 0]) == (n - 1) / 2
        True
    """
    if op is not None:
        warnings.warn(
            "reduce_gradients(op=) is deprecated; use reduce=, as loss_scaling does",
            DeprecationWarning,
            stacklevel=2,
        )
        reduce = op
    validate.choice(reduce, "reduce_gradients.reduce", ("mean", "sum"))
    wire = None if reduce_dtype is None else _dtypes.as_floating_dtype(reduce_dtype, "reduce_dtype")
    collective = jax.lax.pmean if reduce == "mean" else jax.lax.psum

    def leaf(g: Any) -> Any:
        if not _dtypes.is_floating_array(g):
            return g
        dtype = np.dtype(g.dtype)
        return collective(g.astype(wire or dtype), axis_name).astype(dtype)

    return jax.tree_util.tree_map(leaf, grads)
