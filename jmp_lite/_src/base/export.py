"""``export_params``: 16-bit copies of trained weights for inference and shipping.

Mixed-precision training keeps float32 master parameters and float32 optimizer
state, so a *training* checkpoint is as large in a bfloat16 or float16 run as
in a float32 one. Only weights exported for inference halve, and this is the
step that exports them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.base import dtypes as _dtypes

T = TypeVar("T")

_WHAT = "export_params dtype"


_ACCEPTED = (
    "bfloat16 ('bf16'), float16 ('f16'), float32 ('f32'), float64 ('f64'), 'half', or the numpy/jax dtype"
)


def _export_dtype(dtype: Any) -> np.dtype:
    try:
        out = _dtypes.as_floating_dtype(dtype, _WHAT)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_WHAT} must be a floating dtype, got {dtype!r}; accepted: {_ACCEPTED}") from None
    if out in _dtypes.FP8_DTYPES:
        raise ValueError(
            f"{_WHAT} {out.name} is an fp8 format, which needs a per-tensor scale that a plain cast does not "
            f"keep; accepted: {_ACCEPTED}"
        )
    return out


def _is_concrete(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def export_params(params: T, dtype: Any = "bf16") -> T:
    """A copy of ``params`` with every floating array cast to ``dtype`` (bfloat16 by default).

    For inference and for shipping trained weights: a bfloat16 or float16 export
    is half the bytes of the float32 parameters. Training checkpoints do not
    shrink under mixed precision, since the float32 master parameters and the
    optimizer state (Adam's two moments) stay float32; save those as they are and
    export only for inference.

    Floating numpy and jax arrays are cast; everything else is returned as it
    is: integer and boolean arrays (step counters, token tables), PRNG keys,
    complex arrays, Python scalars and ``None``. The structure is kept, so a Linen
    params dict stays a dict and an NNX ``nnx.State`` (``nnx.state(model)``)
    stays an ``nnx.State`` of the same variables, ready for
    ``flax.serialization``/orbax or ``nnx.update``. Floating
    ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``, ``nnx.eval_shape``) get
    the export dtype too, so the same call turns an abstract model state into
    the restore target of an exported checkpoint.

    float16 holds magnitudes up to 65504 only. Outside ``jit`` a finite weight
    that would become ``inf`` in the export raises a ``ValueError`` naming the
    leaf (export bfloat16, which has float32's range, instead); inside ``jit``
    the values cannot be inspected and are cast as they are.

    Args:
        params: any pytree of parameters (Linen ``params``, ``nnx.State``, a list of arrays).
        dtype: the floating dtype to export to: ``"bf16"``/``"bfloat16"``,
            ``"f16"``/``"float16"``, ``"f32"``, ``"f64"``, ``"half"`` (jmp's rule: bfloat16 on
            TPU, else float16), or the numpy/jax dtype.

    Returns:
        ``params`` with its floating arrays in ``dtype``.

    Raises:
        TypeError, ValueError: ``dtype`` is not a floating dtype, or is an fp8
            format (which needs scaling, not a cast); a float16 export would
            turn a finite weight into ``inf``.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> params = {"w": jnp.ones((256, 256)), "step": jnp.array(7)}
        >>> half = jmp_lite.export_params(params, "bf16")
        >>> half["w"].dtype, half["step"].dtype
        (dtype(bfloat16), dtype('int32'))
        >>> half["w"].nbytes, params["w"].nbytes
        (131072, 262144)
    """
    target = _export_dtype(dtype)

    def cast(path: Any, x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract restore target: the export's dtypes
            if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
                return x
            return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
        if not _dtypes.is_floating_array(x) or x.dtype == target:
            return x
        out = x.astype(target)
        if (
            _is_concrete(x)
            and jnp.finfo(target).max < jnp.finfo(x.dtype).max
            and not np.array_equal(np.isfinite(np.asarray(x)), np.isfinite(np.asarray(out)))
        ):
            biggest = float(np.max(np.abs(np.asarray(x, np.float64)[np.isfinite(np.asarray(x))])))
            raise ValueError(
                f"export_params: {jax.tree_util.keystr(path) or 'the array'} has a weight of magnitude "
                f"{biggest:g}, beyond {target.name}'s largest {float(jnp.finfo(target).max):g}, so the "
                "export would hold inf; export bfloat16 (float32's range) instead: "
                "export_params(params, 'bf16')"
            )
        return out

    return jax.tree_util.tree_map_with_path(cast, params)
