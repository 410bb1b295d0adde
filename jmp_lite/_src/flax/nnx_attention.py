"""``attention``: NNX's dot-product attention with the softmax always in float32 (deprecated).

It predates the engine: under ``apply_policy`` NNX's own attention already runs with a float32
softmax, and the engine runs plain attention chains as ``jmp_lite.attention.dot_product_attention``.
Kept, behind a ``DeprecationWarning`` (``jmp_lite.flax.nnx.__getattr__``), for code that calls it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_lite._src.kernels import accumulate as _accumulate
from jmp_lite._src.kernels import attention_kernels as _kernels


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Any = nnx.nn.dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    accumulate: bool = True,
    fused: bool | None = None,
) -> jax.Array:
    """``nnx.dot_product_attention`` with the softmax always in float32.

    Same arguments, plus:

    * ``fused``: run ``jmp_lite.attention.dot_product_attention`` (no T x T array; cuDNN on GPU,
      the Pallas flash kernel on TPU). ``None`` (the default) takes it on GPU and TPU whenever the
      call has no dropout, no sown weights and no explicit ``precision``, and the hand-written path
      otherwise (always on CPU).
    * ``accumulate``: on the hand-written path, 16-bit matmuls accumulate in
      float32 forward and backward (``jmp_lite.accumulate``).

    On the hand-written path both matmuls, forward and backward, take
    compute-dtype operands; the logits are cast to float32 for the mask, softmax
    and dropout, and the weights back to the compute dtype for the
    weights-times-values matmul (the same as Linen's ``force_fp32_for_softmax``;
    Flax's own NNX function runs the softmax in the compute dtype on its dropout
    path).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite._src.flax.nnx_attention import attention
        >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)  # batch, length, heads, depth
        >>> attention(q, q, q, dropout_rate=0.1, deterministic=True).dtype
        dtype(bfloat16)
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    dtype = query.dtype
    dropout = not deterministic and dropout_rate > 0.0
    plain = not dropout and module is None and precision is None
    if fused or (fused is None and plain and jax.default_backend() != "cpu"):
        if not plain:
            raise ValueError("fused=True takes no dropout, sown weights (module=) or precision=")
        return _kernels.dot_product_attention(
            query, key, value, bias, None if mask is None else mask.astype(bool), is_causal=is_causal
        )
    einsum = _accumulate.einsum if accumulate else jnp.einsum
    if key.shape[-2] != query.shape[-2]:  # grouped-query attention: share each k/v head
        if query.shape[-2] % key.shape[-2]:
            raise ValueError(
                f"query heads ({query.shape[-2]}) must be a multiple of key heads ({key.shape[-2]})"
            )
        repeat = query.shape[-2] // key.shape[-2]
        key, value = jnp.repeat(key, repeat, axis=-2), jnp.repeat(value, repeat, axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    # Logits leave the matmul in the compute dtype (as Linen's force_fp32_for_softmax does), so the
    # backward matmuls get a compute-dtype cotangent; the softmax itself runs in float32.
    logits = einsum("...qhd,...khd->...hqk", query, key, precision=precision).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    keep = None if mask is None else mask.astype(bool)
    if is_causal:
        causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
        keep = causal if keep is None else keep & causal
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits)
    if module is not None:
        module.sow(nnx.Intermediate, "attention_weights", weights.astype(dtype))
    if dropout:
        shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        if dropout_rng is None:
            raise ValueError("attention dropout needs dropout_rng (or deterministic=True)")
        keep_mask = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
        weights = jnp.where(keep_mask, weights / (1.0 - dropout_rate), 0.0)
    return einsum("...hqk,...khd->...qhd", weights.astype(dtype), value, precision=precision)
