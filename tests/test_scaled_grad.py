"""jmp_lite.value_and_grad: the loss scale comes from the optimizer state that unscales."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
from jmp_lite.flax import TrainState
from jmp_lite.flax.nnx import LossScaledOptimizer
from tests._models import batches, mlp_loss, mlp_params

pytestmark = pytest.mark.unit

HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}
SCALES = {
    "noop": jmp_lite.NoOpLossScale,
    "static": lambda: jmp_lite.StaticLossScale(2.0**10),
    "dynamic": lambda: jmp_lite.DynamicLossScale(2.0**15),
}


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def setup(scale, compute):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 1)
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), SCALES[scale]())
    return params, (xs[0], ys[0]), tx, tx.init(params), lambda p, b: mlp_loss(p, b, compute)


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("scale", SCALES)
def test_same_loss_and_grads_as_the_manual_path_under_jit(scale, half):
    params, batch, tx, opt_state, loss_fn = setup(scale, HALF[half])

    @jax.jit
    def manual(opt_state, params, batch):
        ls = jmp_lite.get_loss_scale(opt_state)
        return loss_fn(params, batch), jax.grad(lambda p: ls.scale(loss_fn(p, batch)))(params)

    loss, grads = jax.jit(jmp_lite.value_and_grad(loss_fn))(opt_state, params, batch)
    want_loss, want_grads = manual(opt_state, params, batch)
    assert bits((loss, grads)) == bits((want_loss, want_grads))
    assert loss.dtype == jnp.float32 and grads[0]["w"].dtype == jnp.float32
    if scale != "noop":  # the gradients really are scaled: loss_scaling divides them
        plain = jax.grad(loss_fn)(params, batch)
        assert not np.allclose(grads[0]["w"], plain[0]["w"])
    apply = jax.jit(lambda g, s, p: jmp_lite.apply_scaled_gradients(tx, g, s, p))
    new_params, _, finite = apply(grads, opt_state, params)
    assert bool(finite)
    assert bits(new_params) == bits(apply(want_grads, opt_state, params)[0])


def test_noop_scale_is_exactly_jax_value_and_grad():
    params, batch, _, opt_state, loss_fn = setup("noop", jnp.bfloat16)
    got = jax.jit(jmp_lite.value_and_grad(loss_fn))(opt_state, params, batch)
    assert bits(got) == bits(jax.jit(jax.value_and_grad(loss_fn))(params, batch))


def test_has_aux_and_argnums_keep_aux_and_loss_unscaled():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    opt_state = tx.init((w, x))

    def fun(w, x, *, offset):
        loss = jnp.sum(w * x) + offset
        return loss, {"loss_copy": loss}

    vg = jax.jit(jmp_lite.value_and_grad(fun, argnums=(0, 1), has_aux=True))
    (loss, aux), (gw, gx) = vg(opt_state, w, x, offset=1.0)
    assert float(loss) == 12.0 and float(aux["loss_copy"]) == 12.0  # neither is scaled
    np.testing.assert_array_equal(gw, 8.0 * x)
    np.testing.assert_array_equal(gx, 8.0 * w)


def test_dynamic_scale_read_each_step_under_scan():
    # The scale moves (halves on the non-finite step); every step must read the current one.
    tx = jmp_lite.loss_scaling(optax.sgd(0.0), jmp_lite.DynamicLossScale(2.0**4, period=1000))
    w = jnp.array(1.0)

    def body(opt_state, x):
        _, g = jmp_lite.value_and_grad(lambda w, x: w * x)(opt_state, w, x)
        _, opt_state = tx.update(g, opt_state, w)
        return opt_state, g

    _, grads = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))(tx.init(w), jnp.array([1.0, jnp.inf, 1.0]))
    np.testing.assert_array_equal(grads, [16.0, jnp.inf, 8.0])


def test_vmap_over_examples():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0))
    w = jnp.array([1.0, 2.0])
    opt_state = tx.init(w)
    xs = jnp.arange(6.0).reshape(3, 2)
    vg = jmp_lite.value_and_grad(lambda w, x: jnp.sum(w * x))
    losses, grads = jax.jit(jax.vmap(vg, in_axes=(None, None, 0)))(opt_state, w, xs)
    np.testing.assert_array_equal(losses, xs @ w)
    np.testing.assert_array_equal(grads, 4.0 * xs)


@pytest.mark.composition
@pytest.mark.parametrize("half", HALF)
def test_pmap_with_loss_scaling_reduce_matches_one_device(half):
    n = 4
    params, _, _, _, loss_fn = setup("dynamic", HALF[half])
    xs, ys = batches(jax.random.key(2), 1, batch=4 * n)
    tx = jmp_lite.loss_scaling(
        optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**10), axis_name="d", reduce="mean"
    )
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        loss, grads = jmp_lite.value_and_grad(loss_fn)(opt_state, params, batch)
        new_params, opt_state, _ = jmp_lite.apply_scaled_gradients(tx, grads, opt_state, params)
        return jax.lax.pmean(loss, "d"), new_params

    rep = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), t)  # noqa: E731
    shard = lambda a: a.reshape(n, -1, *a.shape[1:])  # noqa: E731
    loss, new_params = jax.pmap(step, axis_name="d")(
        rep(params), rep(opt_state), (shard(xs[0]), shard(ys[0]))
    )

    one_tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**10))

    def mean_loss(p):  # the mean over devices of each device's mean loss
        return jnp.mean(jnp.stack([loss_fn(p, (a, b)) for a, b in zip(shard(xs[0]), shard(ys[0]))]))

    want_loss, grads = jmp_lite.value_and_grad(mean_loss)(one_tx.init(params), params)
    want, _, _ = jmp_lite.apply_scaled_gradients(one_tx, grads, one_tx.init(params), params)
    np.testing.assert_allclose(loss[0], want_loss, rtol=1e-5)
    for got, ref in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(got[0], ref, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(got[0], got[-1])  # the replicas agree


@pytest.mark.composition
@pytest.mark.parametrize("half", HALF)
def test_linen_train_state(half):
    model = nn.Dense(3, dtype=HALF[half])
    x, y = jax.random.normal(jax.random.key(0), (8, 5)), jnp.arange(8) % 3
    tx = jmp_lite.loss_scaling(optax.sgd(0.5), jmp_lite.DynamicLossScale(2.0**15))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(1), x)["params"], tx=tx)

    def loss_fn(params, x, y):
        logits = state.apply_fn({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(state, x, y):
        loss, grads = jmp_lite.value_and_grad(loss_fn)(state, state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    state, first = step(state, x, y)
    manual = jax.grad(lambda p: state.loss_scale.scale(loss_fn(p, x, y)))(state.params)
    assert bits(jmp_lite.value_and_grad(loss_fn)(state, state.params, x, y)[1]) == bits(
        jax.jit(lambda: manual)()
    )
    for _ in range(10):
        state, loss = step(state, x, y)
    assert int(state.step) == 11 and float(loss) < 0.8 * float(first)


@pytest.mark.composition
@pytest.mark.parametrize("half", HALF)
def test_nnx_loss_scaled_optimizer(half):
    model = nnx.Linear(5, 3, dtype=HALF[half], rngs=nnx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(0), (8, 5)), jnp.arange(8) % 3
    optimizer = LossScaledOptimizer(
        model, jmp_lite.loss_scaling(optax.sgd(0.5), jmp_lite.DynamicLossScale(2.0**15))
    )

    def loss_fn(model, x, y):
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    (loss, logits), grads = nnx.jit(jmp_lite.value_and_grad(loss_fn, has_aux=True))(optimizer, model, x, y)
    manual = nnx.grad(lambda m: optimizer.loss_scale.scale(loss_fn(m, x, y)[0]))(model)
    assert isinstance(grads, nnx.State) and logits.shape == (8, 3)
    assert bits(grads) == bits(manual)

    @nnx.jit
    def step(model, optimizer, x, y):
        (loss, _), grads = jmp_lite.value_and_grad(loss_fn, has_aux=True)(optimizer, model, x, y)
        optimizer.update(model, grads)
        return loss

    first = step(model, optimizer, x, y)
    for _ in range(10):
        loss = step(model, optimizer, x, y)
    assert int(optimizer.step[...]) == 11 and float(loss) < 0.8 * float(first)


def test_nnx_diff_state_and_negative_argnums():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = LossScaledOptimizer(
        model, jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0))
    )
    x = jnp.ones((3, 2))

    def loss_fn(x, model):
        return jnp.sum(model(x))

    plain = nnx.grad(lambda m: loss_fn(x, m))(model)
    _, by_negative = jmp_lite.value_and_grad(loss_fn, argnums=-1)(optimizer, x, model)
    _, by_filter = jmp_lite.value_and_grad(loss_fn, argnums=nnx.DiffState(1, nnx.PathContains("bias")))(
        optimizer, x, model
    )
    np.testing.assert_array_equal(by_negative["kernel"][...], 4.0 * plain["kernel"][...])
    assert set(by_filter) == {"bias"}
    np.testing.assert_array_equal(by_filter["bias"][...], 4.0 * plain["bias"][...])


@pytest.mark.numerics
def test_float16_sgd_trains_with_value_and_grad_and_stalls_when_the_scale_is_forgotten():
    # loss_scaling divides by the scale whatever the loss was multiplied by: forgetting to scale
    # makes every SGD update 2**15 times too small, and nothing reports it.
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 1, batch=64)
    batch = (xs[0], ys[0])
    loss_fn = lambda p, b: mlp_loss(p, b, jnp.float16)  # noqa: E731
    tx = jmp_lite.loss_scaling(optax.sgd(0.5), jmp_lite.DynamicLossScale(2.0**15))

    def train(grad_fn):
        def body(carry, _):
            params, opt_state = carry
            loss, grads = grad_fn(opt_state, params)
            params, opt_state, _ = jmp_lite.apply_scaled_gradients(tx, grads, opt_state, params)
            return (params, opt_state), loss

        (_, opt_state), losses = jax.jit(lambda c: jax.lax.scan(body, c, None, length=30))(
            (params, tx.init(params))
        )
        assert int(jmp_lite.get_loss_scaling_state(opt_state).skipped_total) == 0
        return np.asarray(losses)

    entry = train(lambda s, p: jmp_lite.value_and_grad(loss_fn)(s, p, batch))
    forgotten = train(lambda s, p: jax.value_and_grad(loss_fn)(p, batch))  # the half-done step
    assert entry[-1] < 0.7 * entry[0]
    assert entry[0] == forgotten[0]
    assert abs(forgotten[-1] - forgotten[0]) < 1e-3 * forgotten[0]  # stalled, silently


def test_underflow_steps_warns_when_the_loss_was_never_scaled_and_not_otherwise():
    # The opt-in check: a device-side count of steps whose unscaled gradients all sit below float16's
    # smallest normal; the host check reads it (one sync, where the user already syncs).
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 1, batch=64)
    batch = (xs[0], ys[0])
    loss_fn = lambda p, b: mlp_loss(p, b, jnp.float16)  # noqa: E731
    tx = jmp_lite.loss_scaling(optax.sgd(0.5), jmp_lite.DynamicLossScale(2.0**15), underflow_steps=5)

    def train(grad_fn, steps):
        def step(params, opt_state):
            _, grads = grad_fn(opt_state, params)
            return jmp_lite.apply_scaled_gradients(tx, grads, opt_state, params)[:2]

        step = jax.jit(step)
        state = (params, tx.init(params))
        for _ in range(steps):
            state = step(*state)
        return state[1]

    correct = train(lambda s, p: jmp_lite.value_and_grad(loss_fn)(s, p, batch), 8)
    forgotten = lambda steps: train(lambda s, p: jax.value_and_grad(loss_fn)(p, batch), steps)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp_lite.raise_if_skip_limit_reached(correct)
        jmp_lite.raise_if_skip_limit_reached(forgotten(4))  # 4 < 5 steps: not yet
    assert int(optax.tree.get(correct, "tiny_grad_steps")) == 0
    with pytest.warns(
        UserWarning, match=r"last 8 applied steps all sat below float16's smallest normal.*value_and_grad"
    ):
        jmp_lite.raise_if_skip_limit_reached(forgotten(8))


def test_errors_name_what_is_accepted():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
    w = jnp.ones(2)
    vg = jmp_lite.value_and_grad(lambda w: jnp.sum(w))
    with pytest.raises(
        TypeError, match=r"must be the optimizer state of a tx that contains jmp_lite.loss_scaling"
    ):
        vg(w, w)  # params passed where the optimizer state belongs
    with pytest.raises(TypeError, match=r"no loss_scaling state in it"):
        vg(optax.sgd(0.1).init(w), w)  # a plain optax state
    with pytest.raises(TypeError, match=r"bare StaticLossScale: pass the state that holds it"):
        vg(jmp_lite.StaticLossScale(8.0), w)
    with pytest.raises(ValueError, match=r"exactly one jmp_lite.loss_scaling state"):
        vg((tx.init(w), tx.init(w)), w)
    with pytest.raises(
        TypeError, match=r"no arguments for fun after state; call it as vg\(opt_state, params"
    ):
        vg(tx.init(w))
    with pytest.raises(TypeError, match=r"with has_aux=True fn must return \(loss, aux\)"):
        jmp_lite.value_and_grad(lambda w: jnp.sum(w), has_aux=True)(tx.init(w), w)
    with pytest.raises(TypeError, match=r"argnums must be an int or a non-empty sequence of ints"):
        jmp_lite.value_and_grad(lambda w: w, argnums="0")
    with pytest.raises(TypeError, match=r"argnums must be an int or a non-empty sequence of ints"):
        jmp_lite.value_and_grad(lambda w: w, argnums=())
    with pytest.raises(TypeError, match=r"fun must be callable"):
        jmp_lite.value_and_grad(3.0)


def test_training_states_with_a_plain_tx_take_the_same_step_unscaled():
    """A TrainState or LossScaledOptimizer built with a plain optax tx reports NoOpLossScale, and
    value_and_grad takes it: the same step code runs in every precision (docs/flax.md)."""
    x = jnp.ones((3, 4))
    module = nn.Dense(2)
    variables = module.init(jax.random.key(0), x)
    state = TrainState.create(apply_fn=module.apply, params=variables, tx=optax.sgd(0.1))
    loss = lambda p: jnp.mean(module.apply(p, x) ** 2)  # noqa: E731
    value, grads = jax.jit(jmp_lite.value_and_grad(loss))(state, state.params)
    want_value, want_grads = jax.value_and_grad(loss)(state.params)
    assert value == want_value and bits(grads) == bits(want_grads)

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.sgd(0.1))
    nnx_loss = lambda m: jnp.mean(m(x) ** 2)  # noqa: E731
    value, grads = jmp_lite.value_and_grad(nnx_loss)(optimizer, model)
    assert value == nnx_loss(model) and bits(grads) == bits(nnx.grad(nnx_loss)(model))
    # a plain nnx.Optimizer has no scale to read: the message names what was passed
    with pytest.raises(TypeError, match="got Optimizer with no loss_scaling state"):
        jmp_lite.value_and_grad(nnx_loss)(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), model)
