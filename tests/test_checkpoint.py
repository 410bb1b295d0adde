"""Save the whole train state with orbax, restore, continue: bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from _models import batches, mlp_loss, mlp_params

import jmp_lite
from jmp_lite import DynamicLossScale, loss_scaling


def test_orbax_restore_then_continue_is_bitwise_equal(tmp_path):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 10)
    xs = xs.at[3, 0, 0].set(jnp.inf)  # a skip before the save
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**15, period=2, min_loss_scale=2.0))

    @jax.jit
    def step(p, s, b):
        ls = jmp_lite.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(mlp_loss(q, b)))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = (params, tx.init(params))
    for i in range(5):
        state = step(*state, (xs[i], ys[i]))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()

    uninterrupted = state
    for i in range(5, 10):
        uninterrupted = step(*uninterrupted, (xs[i], ys[i]))

    # A target whose hyperparameters differ from the saved ones tells which side each field comes from:
    # arrays from the file, static hyperparameters from the target (docs/checkpoints.md).
    other_tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10, period=5, min_loss_scale=1.0))
    other = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, (params, other_tx.init(params)))
    ls = ckpt.restore(tmp_path / "ckpt", other)[1].loss_scale
    assert (ls.period, ls.min_loss_scale) == (5, 1.0)
    saved = state[1].loss_scale
    assert float(saved.loss_scale) != 2.0**10 and int(saved.counter) != 0  # unlike the target's
    assert float(ls.loss_scale) == float(saved.loss_scale) and int(ls.counter) == int(saved.counter)
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32

    fresh = (mlp_params(jax.random.key(9)), tx.init(params))
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh)
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
    assert (restored[1].loss_scale.period, restored[1].loss_scale.min_loss_scale) == (2, 2.0)
    assert int(restored[1].skipped_total) == 1
    for i in range(5, 10):
        restored = step(*restored, (xs[i], ys[i]))

    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(uninterrupted)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(uninterrupted)):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
