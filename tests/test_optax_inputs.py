"""loss_scaling on awkward inputs: every gradient leaf type plain optax takes, and replica-stacked states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jmp_lite

pytestmark = pytest.mark.unit

LEAVES = ["f32", "f16", "bf16", "f64", "int32", "bool", "none", "pyfloat", "pyint"]


def make_leaf(kind, i):
    value = {"pyfloat": 0.5 + i, "pyint": 2 + i, "none": None}
    if kind in value:
        return value[kind]
    dtype = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "f64": jnp.float64,
             "int32": jnp.int32, "bool": jnp.bool_}[kind]  # fmt: skip
    return jnp.arange(1, 4).astype(dtype) if kind != "bool" else jnp.array([True, False, True])


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "inject_momentum": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
}


def bits(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).tobytes() for x in leaves]


def poison(g):
    if isinstance(g, jax.Array) and jnp.issubdtype(g.dtype, jnp.floating):
        return g.at[0].set(jnp.inf)
    return g


FLOAT_LEAVES = ["f32", "f16", "bf16", "f64"]


@st.composite
def leaf_kinds(draw):
    """1 to 4 leaf kinds, at least one floating (something that can overflow), anywhere in the list."""
    kinds = draw(st.lists(st.sampled_from(LEAVES), max_size=3))
    kinds.insert(draw(st.integers(0, len(kinds))), draw(st.sampled_from(FLOAT_LEAVES)))
    return kinds


def init_and_update(tx, params):
    return tx.update(params, tx.init(params), params)


# the first case is the fast tier's, the other CI's system tier's (a unit or property test's later cases)
@pytest.mark.property
@pytest.mark.parametrize("examples", [8, 25])
def test_every_leaf_type_plain_optax_takes_also_works_under_loss_scaling(examples):
    drawn = given(
        kinds=leaf_kinds(),
        opt=st.sampled_from(sorted(OPTIMIZERS)),
        skip=st.sampled_from(["cond", "select"]),
        jit=st.booleans(),
    )
    check = example(kinds=["f16", "int32", "bf16"], opt="inject_momentum", skip="cond", jit=False)(  # refused
        example(kinds=["bf16", "f32", "f16"], opt="inject_momentum", skip="cond", jit=False)(  # taken
            drawn(leaf_types_work_under_loss_scaling)
        )
    )
    settings(max_examples=examples, deadline=None)(check)()


def leaf_types_work_under_loss_scaling(kinds, opt, skip, jit):
    with jax.enable_x64("f64" in kinds):  # scoped: the rest of the suite stays 32-bit
        params = {f"p{i}": make_leaf(k, i) for i, k in enumerate(kinds)}
        try:
            plain_updates, _ = init_and_update(OPTIMIZERS[opt](), params)
        except ValueError as plain_error:
            # Plain optax refuses one kind of tree: inject_hyperparams folds the leaf dtypes (in key order)
            # into the highest one, and float16 and bfloat16 have no order, so it raises when the running
            # highest is one of them and the next leaf the other ([f16, bf16], or [f16, int32, bf16]; an
            # f32 leaf before them orders both). loss_scaling must refuse it the same way, not hide it.
            assert opt == "inject_momentum" and "Cannot compare dtype" in str(plain_error)
            tx = jmp_lite.loss_scaling(OPTIMIZERS[opt](), jmp_lite.StaticLossScale(1.0), skip=skip)
            with pytest.raises(ValueError) as ours:
                init_and_update(tx, params)
            assert str(ours.value) == str(plain_error)
            return
        tx = jmp_lite.loss_scaling(OPTIMIZERS[opt](), jmp_lite.StaticLossScale(1.0), skip=skip)
        update = jax.jit(tx.update) if jit else tx.update
        state = tx.init(params)
        updates, state = update(params, state, params)  # finite: the plain optimizer's updates
        for ours, theirs in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(plain_updates)):
            np.testing.assert_allclose(
                np.asarray(ours, np.float64), np.asarray(theirs, np.float64), rtol=1e-2
            )
        _, skipped = update(jax.tree_util.tree_map(poison, params), state, params)
        assert not bool(skipped.last_grads_finite)
        assert bits(skipped.scaled_inner_state) == bits(state.scaled_inner_state)


def ulps(a, b):
    """Elementwise distance in float32 units in the last place (same-sign values)."""
    as_int = lambda x: np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.abs(as_int(a) - as_int(b))


@pytest.mark.parametrize("opt", ["adam", "momentum"])
def test_eager_select_is_bitwise_the_plain_optimizer_and_cond_within_ulps_of_the_compiled_step(opt):
    # lax.cond compiles its branch even when called eagerly, so the cond path is one XLA program: within a
    # few ulps of the jitted transformation and of the jitted plain optimizer (how many depends on how XLA
    # fuses each program: 0 and 3 for Adam with XLA:CPU's fusion emitters, 2 and 3 with the loop emitters
    # the suite compiles with). From the *eager* plain optimizer it is as far as jit(plain) itself is (8 ulps
    # here): op-by-op versus fused rounding, not something loss_scaling adds.
    params = {"w": jax.random.normal(jax.random.key(0), (32, 16))}
    grads = {"w": params["w"] * 0.37 + 0.01}
    results = {}
    for mode in ("plain", "jit plain", "select", "jit select", "cond"):
        tx = OPTIMIZERS[opt]()
        scale = 1.0
        if "plain" not in mode:
            scale = 2.0**10  # a power of two: unscaling is exact
            tx = jmp_lite.loss_scaling(tx, jmp_lite.DynamicLossScale(scale), skip=mode.split()[-1])
        update = jax.jit(tx.update) if mode.startswith("jit") else tx.update
        p, s = params, tx.init(params)
        for _ in range(3):
            u, s = update({"w": grads["w"] * scale}, s, p)
            p = optax.apply_updates(p, u)
        results[mode] = p["w"]
    assert ulps(results["select"], results["plain"]).max() == 0
    assert ulps(results["cond"], results["jit select"]).max() <= 4
    assert ulps(results["cond"], results["jit plain"]).max() <= 4


def test_get_loss_scale_refuses_nested_loss_scaling():
    inner = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(2.0))
    tx = jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(8.0))
    with pytest.raises(ValueError, match="found 2 .*nested inside another"):
        jmp_lite.get_loss_scale(tx.init(jnp.ones(2)))


def test_raise_if_skip_limit_reached_works_per_replica_on_a_pmap_stacked_state():
    n = jax.local_device_count()
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0), max_consecutive_skips=1)
    params = jnp.ones((n, 2))
    state = jax.pmap(tx.init)(params)
    good = jax.pmap(tx.update)(params, state, params)[1]
    jmp_lite.raise_if_skip_limit_reached(good)  # no replica reached it
    grads = params.at[n - 1, 0].set(jnp.nan)  # only the last replica overflows (no axis_name)
    bad = jax.pmap(tx.update)(grads, state, params)[1]
    with pytest.raises(jmp_lite.SkipLimitReachedError, match=rf"replica\(s\) \[{n - 1}\]"):
        jmp_lite.raise_if_skip_limit_reached(bad)


def test_raise_if_skip_limit_reached_inside_jit_says_to_call_it_outside():
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0), max_consecutive_skips=1)
    state = tx.init(jnp.ones(2))
    with pytest.raises(TypeError, match="cannot run inside jax.jit.*call it outside, on the optimizer state"):
        jax.jit(jmp_lite.raise_if_skip_limit_reached)(state)
    with pytest.raises(TypeError, match="cannot run inside jax.jit"):
        jax.lax.scan(lambda s, _: (jmp_lite.raise_if_skip_limit_reached(s), None), state, None, length=1)
    jmp_lite.raise_if_skip_limit_reached(state)  # outside: fine


def test_max_consecutive_skips_takes_whole_numbers_and_refuses_what_int32_cannot_count():
    tx = jmp_lite.loss_scaling(
        optax.sgd(1.0), jmp_lite.StaticLossScale(1.0), max_consecutive_skips=np.int64(1)
    )
    state = tx.update(jnp.array([jnp.nan]), tx.init(jnp.zeros(1)))[1]
    assert bool(state.skip_limit_reached)
    for bad in (0, 2**31, True, 1.5, np.bool_(True)):
        with pytest.raises((TypeError, ValueError), match="max_consecutive_skips"):
            jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(1.0), max_consecutive_skips=bad)


@pytest.mark.parametrize(
    "case",
    ["int_leaf_adam", "int_leaf_momentum", "python_float_leaf", "inject_momentum_bf16", "mixed_f32_f64"],
)
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("jit", [False, True])
def test_cases_that_raised_under_cond(case, skip, jit):
    x64 = case == "mixed_f32_f64"
    with jax.enable_x64(x64):
        f = jnp.ones(2, jnp.bfloat16 if case == "inject_momentum_bf16" else jnp.float32)
        other = {
            "int_leaf_adam": lambda: jnp.ones(2, jnp.int32),
            "int_leaf_momentum": lambda: jnp.ones(2, jnp.int32),
            "python_float_leaf": lambda: 0.5,
            "mixed_f32_f64": lambda: jnp.ones(2, jnp.float64),  # built under x64 only
        }.get(case, lambda: None)()
        params = {"f": f, "x": other}
        inner = {
            "int_leaf_adam": optax.adam(1e-2),
            "inject_momentum_bf16": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
        }.get(case, optax.sgd(0.1, momentum=0.9))
        tx = jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(4.0), skip=skip)
        state = tx.init(params)
        update = jax.jit(tx.update) if jit else tx.update  # eager: Python scalars stay Python scalars
        _, state = update(params, state, params)
        _, skipped = update({**params, "f": params["f"].at[0].set(jnp.inf)}, state, params)
        assert int(skipped.skipped_total) == 1
        assert bits(skipped.scaled_inner_state) == bits(state.scaled_inner_state)
