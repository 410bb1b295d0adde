"""When policy attention can take ``jax.nn.dot_product_attention`` (cuDNN/fused kernels)."""

from __future__ import annotations

from typing import Any

import jax


def fused_ok(query: jax.Array, key: jax.Array, value: jax.Array, fused: bool | None, **plain: Any) -> bool:
    """Whether ``jax.nn.dot_product_attention`` can run this call.

    ``plain`` holds the features that path has no argument for (dropout, a precision, sown
    weights); any truthy value there means the hand-written path. ``fused=None`` picks by
    backend: on XLA:CPU the fused path has no kernel, and its XLA fallback hands the backward
    matmuls a float32 cotangent (float32 speed) and rejects float16 with float32 logits, so
    there the hand-written path with float32-accumulating 16-bit matmuls is both faster and
    the one that runs.
    """
    if fused is False or any(plain.values()):
        return False
    shapes_ok = query.ndim == 4 and key.shape == value.shape and query.dtype == key.dtype == value.dtype
    if fused is None:
        return shapes_ok and jax.default_backend() != "cpu"
    if not shapes_ok:
        raise ValueError(
            "fused attention needs 4-d [batch, length, heads, depth] query/key/value of one dtype, got "
            f"{query.shape} {query.dtype}, {key.shape} {key.dtype}, {value.shape} {value.dtype}"
        )
    return True


def fused(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    is_causal: bool = False,
) -> jax.Array:
    """``jax.nn.dot_product_attention``: logits accumulate and softmax runs in float32 on every path."""
    if mask is not None:
        mask = mask.astype(bool)
    if bias is not None:
        bias = bias.astype(query.dtype)
    return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal)
