"""scale_loss_fn: only the differentiated loss is scaled; aux outputs and the returned loss are not."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
from jmp_lite.flax import LossScaledOptimizer, TrainState
from jmp_lite.flax.nnx import snapshot

pytestmark = pytest.mark.unit


class Net(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, dtype=self.dtype)(x)
        return nn.BatchNorm(use_running_average=False)(x).astype(jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_batch_stats_and_logged_loss_are_not_scaled(dtype):
    model = Net(dtype)
    x = jax.random.normal(jax.random.key(1), (8, 3))
    variables = model.init(jax.random.key(0), x)
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**15))
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        model_state={"batch_stats": variables["batch_stats"]},
    )

    def loss_fn(params):
        y, updates = model.apply({"params": params, **state.model_state}, x, mutable=["batch_stats"])
        return jnp.mean(y**2), updates

    @functools.partial(jax.jit, static_argnums=0)
    def grads_of(scaled):
        return jax.grad(scaled, has_aux=True)(state.params)

    grads, (loss, updates) = grads_of(jmp_lite.scale_loss_fn(loss_fn, state.loss_scale, has_aux=True))
    (plain_loss, plain_updates) = loss_fn(state.params)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-2)
    np.testing.assert_allclose(updates["batch_stats"]["BatchNorm_0"]["mean"],
                               plain_updates["batch_stats"]["BatchNorm_0"]["mean"], rtol=1e-2)  # fmt: skip
    plain_grads = jax.grad(lambda p: loss_fn(p)[0])(state.params)
    for g, pg in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(plain_grads)):
        np.testing.assert_allclose(g, pg * 2.0**15, rtol=1e-2, atol=2.0**15 * 1e-4)
    # The recipe the old guide gave scales the aux outputs too: what the helper avoids.
    _, naive = grads_of(lambda p: jax.tree_util.tree_map(state.loss_scale.scale, loss_fn(p)))
    mean = plain_updates["batch_stats"]["BatchNorm_0"]["mean"]
    np.testing.assert_allclose(naive["batch_stats"]["BatchNorm_0"]["mean"], mean * 2.0**15, rtol=1e-2)


def test_without_aux_returns_the_unscaled_loss_as_aux():
    fn = jmp_lite.scale_loss_fn(lambda w, *, k: k * jnp.sum(w**2), jmp_lite.StaticLossScale(8.0))
    (scaled, loss), grads = jax.value_and_grad(fn, has_aux=True)(jnp.ones(2), k=3.0)
    assert (float(scaled), float(loss)) == (48.0, 6.0)
    np.testing.assert_array_equal(grads, [48.0, 48.0])


def test_nnx_form_with_rollback_skips_and_keeps_batch_stats():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    opt = LossScaledOptimizer(
        model, jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10))
    )

    def loss_fn(m, x):
        y = m(x)
        return jnp.mean(y**2), jnp.max(y)

    @nnx.jit
    def step(m, o, x):
        before = snapshot(m, nnx.BatchStat)
        scaled = jmp_lite.scale_loss_fn(loss_fn, o.loss_scale, has_aux=True)
        grads, (loss, peak) = nnx.grad(scaled, has_aux=True)(m, x)
        o.update(m, grads, rollback=before)
        return o.last_step_applied, loss, peak

    x = jax.random.normal(jax.random.key(2), (8, 3))
    finite, loss, _ = step(model, opt, x)
    assert bool(finite) and float(loss) < 10  # unscaled (the scaled loss would be ~1e3)
    stats = [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model, nnx.BatchStat))]
    finite, _, _ = step(model, opt, x.at[0, 0].set(jnp.inf))
    assert not bool(finite) and int(opt.step[...]) == 1
    after = [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model, nnx.BatchStat))]
    assert all((a == b).all() for a, b in zip(after, stats))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be callable"):
        jmp_lite.scale_loss_fn(3.0, jmp_lite.StaticLossScale(2.0))
    with pytest.raises(TypeError, match="loss_scale must be a NoOpLossScale"):
        jmp_lite.scale_loss_fn(jnp.sum, 2.0)
    fn = jmp_lite.scale_loss_fn(jnp.sum, jmp_lite.StaticLossScale(2.0), has_aux=True)
    with pytest.raises(TypeError, match=r"must return \(loss, aux\)"):
        fn(jnp.ones(2))
