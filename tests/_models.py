"""Small models shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite


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


def assert_trees_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8)
        )


def without_loss_scale(opt_state):
    """The state with each loss_scaling state replaced by its inner state (the scale and counters differ)."""
    is_ls = lambda n: isinstance(n, jmp_lite.LossScalingState)  # noqa: E731
    return jax.tree_util.tree_map(lambda n: n.scaled_inner_state if is_ls(n) else n, opt_state, is_leaf=is_ls)


def make_step(tx, loss_fn=mlp_loss):
    """A ``step(params, opt_state, batch)`` of ``tx`` on the loss-scaled gradient of ``loss_fn``."""

    def step(params, opt_state, batch):
        ls = jmp_lite.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, batch)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def quantized_arrays(tree):
    """How many ``QuantizedArray``s (8-bit optimizer state arrays) ``tree`` holds."""
    is_q = lambda x: isinstance(x, jmp_lite.QuantizedArray)  # noqa: E731
    return sum(map(is_q, jax.tree_util.tree_leaves(tree, is_leaf=is_q)))
