"""The demo's model: match each piece of Python source to what follows it (contrastive, CPC/CLIP-style).

Two small MLP encoders, one for the 16 bytes before a position and one for the 8
bytes after it, map both to unit vectors; the logits are all the batch's pairwise
similarities over a temperature. Trained with InfoNCE averaged over the batch, a
batch of ``N`` pairs gives each of the ``N * (N - 1)`` negative logits a gradient
of about ``p / N`` with ``p`` near ``1 / N``: ``1 / N**2``, which is ``2**-24`` (float16's
smallest subnormal) at ``N = 4096``. That is the honest underflow case of the demo.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

TEMPERATURE = 0.2
EMBED_DIM = 32


class _Encoder(nn.Module):
    depth: int
    width: int
    role: str

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(256, 16)(tokens).reshape(tokens.shape[0], -1)
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
            x = self.perturb(f"{self.role}_{i}", x)  # lets the demo record activation gradients
        x = nn.Dense(EMBED_DIM)(x)
        # The norm in float32: a sum of squares is a reduction, the rest stays in x's dtype.
        inv = jax.lax.rsqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-12)
        return x * inv.astype(x.dtype)


class ContextMatcher(nn.Module):
    """``logits[i, j]``: how well continuation ``j`` fits context ``i``; the diagonal is right."""

    depth: int = 2
    width: int = 64

    @nn.compact
    def __call__(self, context: jax.Array, continuation: jax.Array) -> jax.Array:
        q = _Encoder(self.depth, self.width, "context")(context)
        k = _Encoder(self.depth, self.width, "continuation")(continuation)
        return self.perturb("logits", (q @ k.T) / jnp.asarray(TEMPERATURE, q.dtype))
