"""NNX's LossScaledOptimizer next to nnx.Optimizer: what update returns, plain optax, NoOp, warnings."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
from jmp_lite.flax.nnx import LossScaledOptimizer

pytestmark = pytest.mark.unit


def model():
    return nnx.Linear(3, 2, rngs=nnx.Rngs(0))


@nnx.jit
def step(m, opt, x):
    loss_scale = getattr(opt, "loss_scale", jmp_lite.NoOpLossScale())  # nnx.Optimizer has none
    grads = nnx.grad(lambda m: loss_scale.scale(jnp.sum(m(x) ** 2)))(m)
    return opt.update(m, grads)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.as_pure(tree))]


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_update_returns_the_applied_updates_as_nnx_optimizer_does(half):
    ours, theirs = model(), model()
    ls = jmp_lite.StaticLossScale(2.0**10)  # a power of two: unscaling is exact
    opt = LossScaledOptimizer(ours, jmp_lite.loss_scaling(optax.sgd(0.1), ls))
    plain = nnx.Optimizer(theirs, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.ones((2, 3), half)
    updates = step(ours, opt, x)
    expected = nnx.jit(lambda m, o: o.update(m, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)))(theirs, plain)
    assert isinstance(updates, nnx.State)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(updates), leaves(expected), strict=True))
    assert bool(opt.last_step_applied) and int(opt.step[...]) == 1
    skipped = step(ours, opt, x.at[0, 0].set(jnp.inf))
    assert not bool(opt.last_step_applied) and int(opt.step[...]) == 1 and int(opt.skipped_total) == 1
    assert all(np.all(np.signbit(u)) and not np.any(u) for u in leaves(skipped))  # -0.0: nothing moved


def test_a_plain_optax_tx_works_as_in_nnx_optimizer():
    ours, theirs = model(), model()
    opt = LossScaledOptimizer(ours, optax.adam(1e-2))
    plain = nnx.Optimizer(theirs, optax.adam(1e-2), wrt=nnx.Param)
    assert opt.loss_scale == jmp_lite.NoOpLossScale() and int(opt.skipped_total) == 0
    x = jnp.ones((2, 3))
    for _ in range(2):
        step(ours, opt, x)
        step(theirs, plain, x)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(nnx.state(ours)), leaves(nnx.state(theirs))))
    assert int(opt.step[...]) == int(plain.step[...]) == 2 and bool(opt.last_step_applied)


def test_counters_read_as_plain_arrays_with_every_loss_scale():
    for ls, skipped in ((jmp_lite.NoOpLossScale(), 0), (jmp_lite.DynamicLossScale(2.0**4), 1)):
        m = model()
        opt = LossScaledOptimizer(m, jmp_lite.loss_scaling(optax.sgd(0.1), ls))
        step(m, opt, jnp.full((1, 3), jnp.inf))  # NoOp checks nothing: the step applies
        assert int(opt.skipped_total) == skipped and bool(opt.last_step_applied) == (skipped == 0)
        for shown in (opt.skipped_total, opt.last_step_applied, opt.loss_scale):
            assert "OptArray" not in repr(shown) and "OptArray" not in str(shown)
    assert repr(opt.skipped_total) == "Array(1, dtype=int32)"


def test_a_plain_nnx_optimizer_around_loss_scaling_warns_and_names_loss_scaled_optimizer():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**4))
    with pytest.warns(UserWarning, match="advances optimizer.step on skipped.*LossScaledOptimizer"):
        nnx.Optimizer(model(), tx, wrt=nnx.Param)
    with pytest.warns(UserWarning, match="LossScaledOptimizer"):  # also inside a chain
        nnx.Optimizer(model(), optax.chain(tx, optax.scale(1.0)), wrt=nnx.Param)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossScaledOptimizer(model(), tx)
        tx.init({"w": jnp.ones(2)})  # arrays, not a model's variables: no warning
