"""A language model's cross-entropy computed from its hidden states and output weights, chunk by chunk,
so that no ``[tokens, vocabulary]`` array of logits exists, forward or backward.

For a vocabulary of 50257 and 8 x 1024 tokens, float32 logits are 1.65 GB per copy, and a training step
holds several (the logits, their softmax, their gradient): on a compiled GPT-2 small step they are the
largest buffers left under a 16-bit policy. Computing the loss blockwise from the last hidden states
(Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language Models"; the fused linear
cross-entropy of Liger Kernel, Hsu et al., 2024) keeps one chunk of logits at a time instead.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite._src.base import dtypes as _dtypes
from jmp_lite._src.base import validate

__all__ = ["fused_linear_cross_entropy"]

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _operand_dtype(hidden: Any, weights: Any) -> Any:
    # a 16-bit model's hidden states set the matmul's operand dtype (its compute dtype), as its
    # head would; otherwise the two promote as jnp.dot would
    if hidden.dtype in _LOW:
        return hidden.dtype
    return jnp.promote_types(hidden.dtype, weights.dtype)


def _logits(h: jax.Array, w: jax.Array, b: jax.Array | None, transposed: bool, dtype: Any) -> jax.Array:
    """One chunk's float32 logits ``h @ w`` (``h @ w.T`` when ``transposed``) plus ``b``."""
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    out = lax.dot_general(
        h.astype(dtype), w.astype(dtype), (contract, ((), ())), preferred_element_type=jnp.float32
    )
    return out if b is None else out + b.astype(jnp.float32)


def _chunks(x: jax.Array, size: int) -> jax.Array:
    """[N, ...] padded to whole chunks and reshaped to [chunks, size, ...]."""
    n = x.shape[0]
    count = -(-n // size)
    x = jnp.pad(x, [(0, count * size - n)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((count, size) + x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _loss(
    h: jax.Array,
    w: jax.Array,
    b: jax.Array | None,
    labels: jax.Array,
    transposed: bool,
    size: int,
    dtype: Any,
) -> jax.Array:
    return _loss_fwd(h, w, b, labels, transposed, size, dtype)[0]


def _loss_fwd(
    h: jax.Array, w: jax.Array, b: Any, labels: jax.Array, transposed: bool, size: int, dtype: Any
) -> tuple:

    def chunk(_: None, xs: tuple) -> tuple:
        hc, lc = xs
        logits = _logits(hc, w, b, transposed, dtype)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.maximum(lc, 0)[:, None], axis=-1)[:, 0]
        return None, (jnp.where(lc >= 0, lse - picked, 0.0), lse)

    n = h.shape[0]
    _, (loss, lse) = lax.scan(chunk, None, (_chunks(h, size), _chunks(labels, size)))
    loss, lse = loss.reshape(-1)[:n], lse.reshape(-1)[:n]
    return loss, (h, w, b, labels, lse)


def _loss_bwd(transposed: bool, size: int, dtype: Any, residuals: tuple, g: jax.Array) -> tuple:
    h, w, b, labels, lse = residuals
    n, vocab = h.shape[0], (w.shape[0] if transposed else w.shape[1])

    def chunk(carry: tuple, xs: tuple) -> tuple:
        dw, db = carry
        hc, lc, lsec, gc = xs
        logits = _logits(hc, w, b, transposed, dtype)
        # d loss / d logits = softmax - one_hot(label), per token times its cotangent; 0 where ignored
        scale = jnp.where(lc >= 0, gc, 0.0)[:, None]
        dlogits = (jnp.exp(logits - lsec[:, None]) - jax.nn.one_hot(lc, vocab, dtype=jnp.float32)) * scale
        d16 = dlogits.astype(dtype)
        dims_h = ((1,), (0,)) if transposed else ((1,), (1,))  # dh = dlogits @ w (or w.T)
        dh = lax.dot_general(d16, w.astype(dtype), (dims_h, ((), ())), preferred_element_type=jnp.float32)
        if transposed:  # dw [V, d] += dlogits.T @ h
            step = lax.dot_general(
                d16, hc.astype(dtype), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
        else:  # dw [d, V] += h.T @ dlogits
            step = lax.dot_general(
                hc.astype(dtype), d16, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
        db = None if db is None else db + dlogits.sum(0)
        return (dw + step, db), dh.astype(h.dtype)

    zeros_b = None if b is None else jnp.zeros(b.shape, jnp.float32)
    xs = (_chunks(h, size), _chunks(labels, size), _chunks(lse, size), _chunks(g.astype(jnp.float32), size))
    (dw, db), dh = lax.scan(chunk, (jnp.zeros(w.shape, jnp.float32), zeros_b), xs)
    dh = dh.reshape((-1, h.shape[1]))[:n]
    return dh, dw.astype(w.dtype), None if b is None else db.astype(b.dtype), None


_loss.defvjp(_loss_fwd, _loss_bwd)


def fused_linear_cross_entropy(
    hidden: jax.Array,
    weights: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    transposed: bool = False,
    chunk_size: int = 1024,
    dtype: Any = None,
) -> jax.Array:
    """The cross-entropy of ``softmax(hidden @ weights + bias)`` against integer ``labels``, per token,
    without a ``[tokens, vocabulary]`` array of logits, forward or backward.

    .. math::

        \\ell_i = \\log \\sum_v \\exp(z_{iv}) - z_{i y_i}, \\quad z_i = h_i W + b

    The tokens run in chunks of ``chunk_size``: each chunk's logits are computed (operands in the hidden
    states' dtype when it is 16-bit, accumulated in float32), reduced to its losses and float32
    log-sum-exp, and dropped; the backward pass recomputes each chunk's logits from ``hidden``,
    ``weights`` and the log-sum-exp (``softmax - one_hot``, times the cotangent) and accumulates the
    weights' gradient in float32 (Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language
    Models"). The largest array is one chunk of float32 logits, ``chunk_size x vocabulary``. The same
    as ``optax.softmax_cross_entropy_with_integer_labels(hidden @ weights + bias, labels)`` on float32
    logits, up to the order of float32 sums.

    Args:
        hidden: the last hidden states, ``[..., d]`` (a 16-bit model's: bfloat16 or float16).
        weights: the output layer's kernel, ``[d, vocabulary]``, or with ``transposed=True`` a tied
            embedding table, ``[vocabulary, d]`` (Flax's ``nn.Embed(...).attend``).
        labels: integer class indices, ``hidden``'s shape without its last axis; a negative label
            (e.g. Hugging Face's ``-100``) is ignored: loss 0 and no gradient.
        bias: an optional ``[vocabulary]`` bias of the output layer.
        transposed: ``weights`` is ``[vocabulary, d]``.
        chunk_size: tokens per chunk (memory: ``chunk_size x vocabulary`` float32 values at a time).
        dtype: the matmuls' operand dtype (``None``: ``hidden``'s when it is 16-bit, else the two
            inputs' promoted dtype); e.g. the policy's compute dtype when a model under a policy
            returns float32 hidden states (``o=f32``).

    Returns:
        The float32 loss of each token, ``labels``' shape (0 where ignored); take ``.mean()`` or a masked
        mean yourself.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jmp_lite.losses import fused_linear_cross_entropy
        >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))
        >>> w = jax.random.normal(jax.random.key(1), (16, 100))
        >>> y = jax.random.randint(jax.random.key(2), (2, 8), 0, 100)
        >>> loss = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_size=4).mean())
        >>> reference = optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()
        >>> bool(jnp.allclose(loss(h, w), reference, rtol=1e-5))
        True
    """
    hidden = validate.array(hidden, "fused_linear_cross_entropy: hidden", jnp.floating)
    weights = validate.array(weights, "fused_linear_cross_entropy: weights", jnp.floating)
    labels = validate.array(labels, "fused_linear_cross_entropy: labels", jnp.integer)
    if weights.ndim != 2:
        raise ValueError(
            f"fused_linear_cross_entropy: weights must be 2-D, [d, vocabulary] (or [vocabulary, d] with "
            f"transposed=True), got shape {weights.shape}"
        )
    d = weights.shape[1] if transposed else weights.shape[0]
    if hidden.ndim < 1 or hidden.shape[-1] != d:
        layout = "[vocabulary, d]" if transposed else "[d, vocabulary]"
        raise ValueError(
            f"fused_linear_cross_entropy: hidden's last axis ({hidden.shape[-1:]}) must be the weights' d = "
            f"{d} (weights {weights.shape} read as {layout}; transposed={transposed})"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: labels must have hidden's shape without its last axis, "
            f"{hidden.shape[:-1]}, got {labels.shape}"
        )
    vocab = weights.shape[0] if transposed else weights.shape[1]
    if bias is not None:
        bias = validate.array(bias, "fused_linear_cross_entropy: bias", jnp.floating)
        if bias.shape != (vocab,):
            raise ValueError(f"fused_linear_cross_entropy: bias must have shape ({vocab},), got {bias.shape}")
    size = validate.whole_number(chunk_size, "fused_linear_cross_entropy: chunk_size")
    flat = hidden.reshape((-1, d))
    tokens = labels.reshape(-1).astype(jnp.int32)
    size = max(1, min(size, flat.shape[0]))
    if dtype is None:
        dtype = _operand_dtype(hidden, weights)
    else:
        dtype = _dtypes.as_floating_dtype(dtype, "fused_linear_cross_entropy: dtype")
    return _loss(flat, weights, bias, tokens, bool(transposed), size, np.dtype(dtype)).reshape(labels.shape)
