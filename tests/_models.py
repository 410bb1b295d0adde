"""Small models shared by the tests."""

import jax
import jax.numpy as jnp
import optax


def mlp_params(key, sizes=(8, 16, 16, 4), dtype=jnp.float32):
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"w": (jax.random.normal(k, (a, b)) / a**0.5).astype(dtype), "b": jnp.zeros(b, dtype)})
    return params


def mlp_loss(params, batch, compute=jnp.float32):
    x, y = batch
    h = x.astype(compute)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(compute) + layer["b"].astype(compute)
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logits = h.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(key, n, batch=16, features=8, classes=4):
    xs = jax.random.normal(key, (n, batch, features))
    ys = jax.random.randint(jax.random.fold_in(key, 1), (n, batch), 0, classes)
    return xs, ys
