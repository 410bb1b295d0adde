"""jmp_lite.apply_scaled_gradients: one apply-or-keep decision for plain optax, Linen and NNX."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite
from jmp_lite.flax import LossScaledOptimizer, TrainState

pytestmark = pytest.mark.unit

SCALE = 16.0


def bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def without_loss_scale(opt_state):
    """The optimizer state with the loss scale and skip counters blanked (the parts a skip may move)."""
    is_ls = lambda x: isinstance(x, jmp_lite.LossScalingState)  # noqa: E731
    blank = lambda s: s._replace(
        loss_scale=None,
        skipped_total=None,
        consecutive_skips=None,  # noqa: E731
        last_grads_finite=None,
        skip_limit_reached=None,
    )
    return jax.tree_util.tree_map(lambda x: blank(x) if is_ls(x) else x, opt_state, is_leaf=is_ls)


POST = {
    "decay": lambda: optax.add_decayed_weights(0.1),  # stateless, moves updates by the params
    "schedule": lambda: optax.scale_by_schedule(optax.linear_schedule(1.0, 0.5, 10)),  # stateful count
    "trace": lambda: optax.trace(0.5),  # stateful, array state
}
INNER = {
    "adam": optax.scale_by_adam,
    "momentum": lambda: optax.trace(0.9),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam()),
}


def build(position, inner, post, skip):
    ls = lambda t: jmp_lite.loss_scaling(t, jmp_lite.DynamicLossScale(SCALE), skip=skip)  # noqa: E731
    tail = [POST[name]() for name in post] + [optax.scale(-0.1)]
    if position == "outer":
        return ls(optax.chain(INNER[inner](), *tail)), optax.chain(INNER[inner](), *tail)
    return optax.chain(ls(INNER[inner]()), *tail), optax.chain(INNER[inner](), *tail)


class Weights(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(w)


@pytest.mark.property
@settings(max_examples=10, deadline=None)
@given(
    position=st.sampled_from(["outer", "inner"]),
    inner=st.sampled_from(sorted(INNER)),
    post=st.lists(st.sampled_from(sorted(POST)), max_size=3),
    skip=st.sampled_from(["cond", "select"]),
    finite=st.lists(st.booleans(), min_size=3, max_size=4),
)
def test_skipped_steps_never_move_params_or_state_in_optax_linen_and_nnx(position, inner, post, skip, finite):
    tx, plain = build(position, inner, post, skip)
    w0 = jnp.array([0.5, -1.0, 2.0])
    params, opt_state = {"w": w0}, tx.init({"w": w0})
    ref_params, ref_state = {"w": w0}, plain.init({"w": w0})
    linen = TrainState.create(apply_fn=None, params={"w": w0}, tx=tx)
    model = Weights(w0)
    nnx_opt = LossScaledOptimizer(model, tx, wrt=nnx.Param)
    for i, ok in enumerate(finite):
        g = jnp.array([0.25 * (i + 1), -0.5, 1.0])
        if not ok:
            g = g.at[1].set(jnp.inf if i % 2 else jnp.nan)
        scale = float(jmp_lite.get_loss_scale(opt_state).loss_scale)
        before = (params, without_loss_scale(opt_state))
        # Eager throughout (jit is tested below): compiles little per example, same ops everywhere.
        params, opt_state, was_finite = jmp_lite.apply_scaled_gradients(
            tx, {"w": g * scale}, opt_state, params
        )
        linen = linen.apply_gradients(grads={"w": g * scale})
        nnx_grads = nnx.grad(lambda m, g=g, scale=scale: jnp.sum(m.w[...] * g * scale))(model)
        nnx_updates = nnx_opt.update(model, nnx_grads)
        assert bool(was_finite) == ok == bool(nnx_opt.last_step_applied) == bool(linen.last_step_applied)
        if not ok:  # the updates applied: -0.0, as nnx.Optimizer.update returns them
            assert np.all(np.signbit(nnx_updates["w"])) and not np.any(nnx_updates["w"])
        if ok:  # the plain optimizer's step on the unscaled gradients (the scale is a power of two)
            updates, ref_state = plain.update({"w": g}, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
            np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6, atol=1e-7)
        else:
            assert bits((params, without_loss_scale(opt_state))) == bits(before)
        # The three integrations run the same function: bitwise the same state.
        assert bits(linen.params) == bits(params) == bits(nnx.state(model, nnx.Param))
        assert bits(linen.opt_state) == bits(opt_state) == bits(nnx.as_pure(nnx_opt.opt_state))
        assert int(linen.step) == int(nnx_opt.step[...]) == sum(finite[: i + 1])
    assert int(jmp_lite.get_loss_scaling_state(opt_state).skipped_total) == finite.count(False)


def test_issue_repro_decay_after_loss_scaling_keeps_params_in_train_state():
    tx = optax.chain(
        jmp_lite.loss_scaling(optax.scale_by_adam(), jmp_lite.DynamicLossScale(16.0)),
        optax.add_decayed_weights(0.1),
        optax.scale(-1.0),
    )
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, {"w": jnp.array([jnp.inf, 1.0])})
    assert int(new.step) == 0 and bits(new.params) == bits(state.params)
    assert float(new.loss_scale.loss_scale) == 8.0


def test_outermost_loss_scaling_adds_no_select():
    # Copy-free: with loss_scaling outermost the step selects nothing over params or state.
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(8.0), skip="cond")
    params = {"w": jnp.ones((64, 64))}
    state = tx.init(params)
    count = lambda f: str(jax.make_jaxpr(f)(params, state, params)).count("name=_where")  # noqa: E731
    ours = count(lambda g, s, p: jmp_lite.apply_scaled_gradients(tx, g, s, p))

    def by_hand(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    assert ours == count(by_hand)
    chained = optax.chain(tx, optax.scale(1.0))
    cstate = chained.init(params)
    n = str(
        jax.make_jaxpr(lambda g, s, p: jmp_lite.apply_scaled_gradients(chained, g, s, p))(
            params, cstate, params
        )
    )
    assert n.count("name=_where") > ours  # not outermost: params and the chain's state are selected


@pytest.mark.parametrize(
    "tx, match",
    [
        (
            optax.MultiSteps(jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0)), 2),
            r"inside optax.MultiSteps.*jmp_lite.loss_scaling\(optax.MultiSteps",
        ),
        (
            optax.apply_if_finite(jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0)), 3),
            "inside optax.ApplyIfFinite",
        ),
        (
            jmp_lite.loss_scaling(
                jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0)),
                jmp_lite.StaticLossScale(4.0),
            ),
            "nested inside another",
        ),
        (optax.sgd(0.1), "found 0"),
    ],
)
def test_unsafe_chains_are_refused_with_the_right_nesting(tx, match):
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=match):
        jmp_lite.apply_scaled_gradients(tx, params, tx.init(params), params)
    if match != "found 0":
        with pytest.raises(ValueError, match=match):
            TrainState.create(apply_fn=None, params=params, tx=tx)
        with pytest.raises(ValueError, match=match):
            LossScaledOptimizer(Weights(jnp.ones(2)), tx, wrt=nnx.Param)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_train_state_with_a_plain_tx_matches_flax(dtype):
    model = nn.Dense(3, dtype=dtype, param_dtype=dtype)
    params = model.init(jax.random.key(0), jnp.ones((1, 2), dtype))["params"]
    tx = optax.adam(1e-2)
    ours = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    theirs = flax_train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    assert isinstance(ours.loss_scale, jmp_lite.NoOpLossScale)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)
    for _ in range(2):
        ours = jax.jit(lambda s, g: s.apply_gradients(grads=g))(ours, grads)
        theirs = jax.jit(lambda s, g: s.apply_gradients(grads=g))(theirs, grads)
    assert bits(ours.params) == bits(theirs.params) and bits(ours.opt_state) == bits(theirs.opt_state)
    assert int(ours.step) == int(theirs.step) == 2


def test_flax_style_batch_stats_field_is_kept_on_a_skipped_step():
    class WithStats(TrainState):
        batch_stats: dict = None

    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0))
    state = WithStats.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=tx, batch_stats={"mean": jnp.ones(2)}
    )
    bad = {"w": jnp.array([jnp.nan, 1.0])}
    new = jax.jit(lambda s: s.apply_gradients(grads=bad, batch_stats={"mean": jnp.full(2, jnp.nan)}))(state)
    np.testing.assert_array_equal(new.batch_stats["mean"], [1.0, 1.0])
    good = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.ones(2)}, batch_stats={"mean": jnp.zeros(2)}))(
        new
    )
    np.testing.assert_array_equal(good.batch_stats["mean"], [0.0, 0.0])


def test_requires_a_gradient_transformation():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jmp_lite.apply_scaled_gradients(lambda g: g, {}, None, {})


def test_static_fields_passed_to_apply_gradients_are_replaced_not_selected():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0))
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    new = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0])}, apply_fn=jnp.sum)
    assert new.apply_fn is jnp.sum and int(new.step) == 0


def count_copies(fn, *args):
    text = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    return len(re.findall(r"= \S+ copy\(", text))


@pytest.mark.compiled  # reads the compiled program
def test_outermost_loss_scaling_step_has_the_copies_of_tx_update_and_apply_updates():
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(8.0), skip="cond")
    params = {f"w{i}": jnp.ones((32, 32)) for i in range(6)}

    def ours(p, s, g):
        return jmp_lite.apply_scaled_gradients(tx, g, s, p)[:2]

    def by_hand(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    args = (params, tx.init(params), params)
    assert count_copies(ours, *args) == count_copies(by_hand, *args)


def test_scan_over_steps_matches_the_eager_loop():
    tx = optax.chain(
        jmp_lite.loss_scaling(optax.scale_by_adam(), jmp_lite.DynamicLossScale(8.0)),
        optax.add_decayed_weights(0.1),
        optax.scale(-0.1),
    )
    params = {"w": jnp.array([1.0, -2.0])}
    grads = jnp.array([[1.0, 2.0], [jnp.inf, 0.0], [0.5, 0.5], [jnp.nan, 1.0]])

    def body(carry, g):
        p, s = carry
        p, s, finite = jmp_lite.apply_scaled_gradients(tx, {"w": g}, s, p)
        return (p, s), finite

    (p_scan, s_scan), finite = jax.lax.scan(body, (params, tx.init(params)), grads)
    p, s = params, tx.init(params)
    for g in grads:
        p, s, _ = jmp_lite.apply_scaled_gradients(tx, {"w": g}, s, p)
    np.testing.assert_array_equal(np.asarray(finite), [True, False, True, False])
    np.testing.assert_allclose(p_scan["w"], p["w"], rtol=1e-6)
    assert int(jmp_lite.get_loss_scaling_state(s_scan).skipped_total) == 2
