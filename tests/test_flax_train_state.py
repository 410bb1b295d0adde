"""jmp_lite.flax.TrainState: a skipped step leaves the whole train state bitwise unchanged."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.flax import TrainState
from jmp_lite.flax.linen import apply_policy

pytestmark = pytest.mark.unit


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x).mean((1, 2))
        return nn.Dense(10)(x)


def bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def make_state(compute):
    model = apply_policy(CNN(), jmp_lite.Policy(jnp.float32, compute, jnp.float32))
    x = jnp.ones((4, 8, 8, 1))
    variables = model.init(jax.random.key(0), x, train=False)
    schedule = optax.linear_schedule(1e-2, 0.0, 100)  # driven by the step count
    tx = jmp_lite.loss_scaling(optax.adam(schedule), jmp_lite.DynamicLossScale(2.0**15))
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        model_state={"batch_stats": variables["batch_stats"]},
    )
    return model, state


def train_step(model):
    @jax.jit
    def step(state, x, y):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, **state.model_state}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return state.loss_scale.scale(loss), updates

        grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, model_state=updates)

    return step


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
def test_skipped_step_changes_only_the_loss_scale(compute):
    model, state = make_state(compute)
    step = train_step(model)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    y = jnp.array([0, 1, 2, 3])
    state = step(state, x, y)  # one real step first: moments, step and batch_stats move
    assert int(state.step) == 1
    before = state
    after = step(state, x.at[0, 0, 0, 0].set(jnp.inf), y)
    assert bits(after.params) == bits(before.params)
    assert bits(after.model_state) == bits(before.model_state)
    assert bits(after.opt_state.scaled_inner_state) == bits(before.opt_state.scaled_inner_state)
    assert int(after.step) == 1
    assert float(after.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
    assert int(after.opt_state.skipped_total) == int(after.skipped_total) == 1
    moved = step(after, x, y)
    assert int(moved.step) == 2 and bits(moved.model_state) != bits(after.model_state)


def test_overwrite_with_gradient_collection_is_never_unscaled():
    params = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"amax": jnp.array([3.0])}}
    tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(8.0))
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    grads = {"params": {"w": jnp.full(2, 8.0)}, "_overwrite_with_gradient": {"amax": jnp.array([5.0])}}
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    np.testing.assert_array_equal(new.params["params"]["w"], [0.0, 0.0])  # 1 - 8/8
    np.testing.assert_array_equal(new.params["_overwrite_with_gradient"]["amax"], [5.0])  # not 5/8
    bad = {**grads, "params": {"w": jnp.array([jnp.nan, 1.0])}}
    kept = jax.jit(lambda s, g: s.apply_gradients(grads=g))(new, bad)
    np.testing.assert_array_equal(kept.params["_overwrite_with_gradient"]["amax"], [5.0])
    assert int(kept.step) == 1


def test_create_refuses_nested_loss_scaling():
    inner = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.StaticLossScale(2.0))
    tx = jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(8.0))
    with pytest.raises(ValueError, match="nested inside another"):
        TrainState.create(apply_fn=None, params={"w": jnp.ones(1)}, tx=tx)


def test_transformations_around_loss_scaling_do_not_advance_on_a_skipped_step():
    params = {"w": jnp.ones(2)}
    counted = optax.scale_by_schedule(optax.linear_schedule(1.0, 0.0, 10))
    tx = optax.chain(jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0)), counted)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.apply_gradients(grads={"w": jnp.ones(2)})
    skipped = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
    assert bits(skipped.opt_state[1]) == bits(state.opt_state[1])
    assert bits(skipped.params) == bits(state.params) and int(skipped.step) == 1


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_returned_state_says_whether_its_step_applied(half):
    params = {"w": jnp.ones(2, half)}
    tx = optax.chain(jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0)), optax.scale(1.0))
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    assert bool(state.last_step_applied)  # nothing skipped yet
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    skipped = step(state, {"w": jnp.array([jnp.inf, 1.0], half)})
    assert not bool(skipped.last_step_applied) and skipped.params["w"].dtype == half
    applied = step(skipped, {"w": jnp.ones(2, half)})
    assert bool(applied.last_step_applied) and int(applied.step) == 1
    plain = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))  # as Flax's TrainState
    assert bool(step(plain, {"w": jnp.ones(2, half)}).last_step_applied)


def test_skipped_total_reads_the_same_on_both_front_ends_when_nothing_is_checked():
    from flax import nnx

    from jmp_lite.flax.nnx import LossScaledOptimizer

    unchecked = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale())
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=unchecked)
    assert jmp_lite.get_loss_scaling_state(state.opt_state).skipped_total is None  # no arrays added
    optimizer = LossScaledOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), unchecked)
    assert int(state.skipped_total) == int(optimizer.skipped_total) == 0
    assert state.skipped_total.dtype == optimizer.skipped_total.dtype == jnp.int32
    checked = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(4.0))
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=checked)
    state = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 0.0])})
    assert int(state.skipped_total) == 1


def test_a_jitted_step_compiles_once():
    """Flax's TrainState starts at a Python 0 (weakly typed); the step after it returns an int32 array,
    so the second call of a jitted step traced and compiled again."""
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**10))
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
    traces = []

    @jax.jit
    def step(state):
        traces.append(1)
        return state.apply_gradients(grads={"w": state.params["w"] * state.loss_scale.loss_scale})

    for _ in range(3):
        state = step(state)
    assert len(traces) == 1 and int(state.step) == 3
