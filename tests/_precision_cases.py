"""The two float16 failures of issue 21, from ordinary Flax layers (tests/test_report.py, docs/doctor.md).

(a) ``SensorTransformer``: a post-norm transformer (Vaswani et al., 2017) over readings in raw units
    (hundreds). Nothing normalizes them before the first attention, so its queries and keys are in the
    hundreds and their products, the logits, reach about 6e5 (measured: 6.4e5): past float16's 65504.
(b) ``ResidualMLP``: post-norm residual blocks whose feed-forward is gated (GLU, Shazeer 2020: the
    product of two projections). The first block reads the embedded readings, no normalization
    there, so the product squares their scale: about 1e5 again. The blocks after it read normalized
    values and are fine.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jmp_lite

F16 = "p=f32,c=f16,o=f32"
READING_SCALE = 300.0  # raw sensor units: nothing rescales them before the model


class PostNormBlock(nn.Module):
    heads: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(x))
        return nn.LayerNorm()(x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(x))))


class SensorTransformer(nn.Module):
    """Attention straight over the readings (each time step's channels are its features)."""

    depth: int = 2
    classes: int = 4

    @nn.compact
    def __call__(self, readings: jax.Array) -> jax.Array:
        x = readings  # [batch, time, channels], in the sensors' units
        for _ in range(self.depth):
            x = PostNormBlock()(x)
        return nn.Dense(self.classes)(x.mean(1))


class GatedBlock(nn.Module):
    """``x + down(gate(x) * up(x))``: a GLU feed-forward with its residual, no normalization inside."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(2 * x.shape[-1], name="gate")(x) * nn.Dense(2 * x.shape[-1], name="up")(x)
        return x + nn.Dense(x.shape[-1], name="down")(h)


class ResidualMLP(nn.Module):
    width: int = 32
    depth: int = 3
    classes: int = 4

    @nn.compact
    def __call__(self, readings: jax.Array) -> jax.Array:
        x = nn.Dense(self.width, name="embed")(readings)
        for i in range(self.depth):  # post-norm: each block's output is normalized (in float32)
            x = nn.LayerNorm(name=f"norm_{i}")(GatedBlock(name=f"block_{i}")(x))
        return nn.Dense(self.classes, name="head")(x)


def data(shape: tuple, classes: int = 4, noise: float = 0.3, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Readings in the hundreds, and labels a linear function of their (time-)mean decides, a fraction
    ``noise`` of them replaced by random ones (so that the loss settles well above zero)."""
    key = jax.random.key(seed)
    # whole counts (an ADC's output), exact in float16 up to 2048
    readings = jnp.round(READING_SCALE * jax.random.normal(key, shape, jnp.float32))
    pooled = readings.mean(axis=tuple(range(1, len(shape) - 1))) if len(shape) > 2 else readings
    teacher = jax.random.normal(jax.random.fold_in(key, 1), (shape[-1], classes))
    labels = jnp.argmax(pooled @ teacher, -1)
    flip = jax.random.bernoulli(jax.random.fold_in(key, 2), noise, labels.shape)
    random = jax.random.randint(jax.random.fold_in(key, 3), labels.shape, 0, classes)
    return readings, jnp.where(flip, random, labels)


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def train(loss_fn, params, x, y, steps: int, loss_scale=None, lr: float = 3e-3) -> tuple[list, int | None]:
    """``steps`` Adam steps on one batch through ``loss_scaling``: (losses, skipped steps)."""
    scale = jmp_lite.NoOpLossScale() if loss_scale is None else loss_scale
    tx = jmp_lite.loss_scaling(optax.adam(lr), scale)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jmp_lite.value_and_grad(loss_fn)(state, params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    skipped = state.skipped_total  # None without a finiteness check (NoOpLossScale)
    return losses, None if skipped is None else int(skipped)
