"""The demo's model: a deep plain MLP that predicts the next byte from the previous ones.

Deep, no normalization, Flax's default initialisation, a loss averaged over a large
batch: the setting in which activation gradients get small (each ReLU layer shrinks
them on the way back, and the mean divides them by the batch size) and float16
without loss scaling starts losing them, as in the seeds' Figure 2.
"""

from __future__ import annotations

import flax.linen as nn
import jax


class ByteMLP(nn.Module):
    depth: int = 6
    width: int = 256
    embed: int = 32

    @nn.compact
    def __call__(self, context: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.embed)(context).reshape(context.shape[0], -1)
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
            x = self.perturb(f"act_{i}", x)  # lets the demo record activation gradients
        return self.perturb("logits", nn.Dense(256)(x))
