"""loss_scaling: skipping, bitwise equivalence, composition, compilation, devices."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_trees_bitwise_equal, batches, make_step, mlp_loss, mlp_params
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite import DynamicLossScale, NoOpLossScale, StaticLossScale, loss_scaling
from jmp_lite._src.optim.loss_scaling import skip_by_cond, skip_by_select

pytestmark = pytest.mark.unit

SKIPS = ["cond", "select"]


def inner_opt():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("poison", [jnp.inf, jnp.nan])
def test_injected_nonfinite_steps_equal_omitting_those_batches(skip, poison):
    key = jax.random.key(0)
    params = mlp_params(key)
    xs, ys = batches(jax.random.key(1), 12)
    bad = {2, 3, 7}
    xs_poisoned = xs.at[jnp.array(sorted(bad)), 0, 0].set(poison)

    tx = loss_scaling(inner_opt(), DynamicLossScale(2.0**15, period=2), skip=skip)
    step = jax.jit(make_step(tx))  # one compile for both runs

    def run(steps):
        p, s = params, tx.init(params)
        for x, y in steps:
            p, s = step(p, s, (x, y))
        return p, s

    p_a, s_a = run([(xs_poisoned[i], ys[i]) for i in range(12)])
    p_b, s_b = run([(xs[i], ys[i]) for i in range(12) if i not in bad])
    assert_trees_bitwise_equal(p_a, p_b)
    assert_trees_bitwise_equal(s_a.scaled_inner_state, s_b.scaled_inner_state)
    assert int(s_a.skipped_total) == 3 and int(s_b.skipped_total) == 0
    assert int(s_a.consecutive_skips) == 0 and bool(s_a.last_grads_finite)


@pytest.mark.parametrize("skip", SKIPS)
def test_skipped_step_returns_zero_updates_and_unchanged_state(skip):
    params = mlp_params(jax.random.key(0))
    tx = loss_scaling(optax.adam(1e-3), DynamicLossScale(2.0**15), skip=skip, max_consecutive_skips=2)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.inf), params)
    update = jax.jit(tx.update)
    updates, new = update(grads, state, params)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree_util.tree_leaves(updates))
    assert_trees_bitwise_equal(new.scaled_inner_state, state.scaled_inner_state)
    assert float(new.loss_scale.loss_scale) == 2.0**14
    assert (int(new.skipped_total), int(new.consecutive_skips)) == (1, 1)
    assert not bool(new.last_grads_finite) and not bool(new.skip_limit_reached)
    jmp_lite.raise_if_skip_limit_reached(new)
    _, new = update(grads, new, params)
    assert bool(new.skip_limit_reached)
    with pytest.raises(jmp_lite.SkipLimitReachedError, match="2 consecutive steps"):
        jmp_lite.raise_if_skip_limit_reached(new)
    finite = jax.tree_util.tree_map(jnp.ones_like, params)
    _, new = update(finite, new, params)
    assert not bool(new.skip_limit_reached) and int(new.skipped_total) == 2


@pytest.mark.parametrize("skip", SKIPS)
def test_float16_compute_real_overflow_backs_off(skip):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(2), 30)
    # 2**24 times float16 activation gradients overflows 65504: real overflow.
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**24, period=1000), skip=skip)
    step = jax.jit(make_step(tx, functools.partial(mlp_loss, compute=jnp.float16)))
    p, s = params, tx.init(params)
    for i in range(30):
        p, s = step(p, s, (xs[i], ys[i]))
    assert int(s.skipped_total) >= 1
    assert float(s.loss_scale.loss_scale) < 2.0**24
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(p))
    assert p[0]["w"].dtype == jnp.float32


@pytest.mark.numerics
@pytest.mark.parametrize("skip", SKIPS)
def test_bfloat16_compute_trains_without_skips(skip):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(2), 40)
    loss = functools.partial(mlp_loss, compute=jnp.bfloat16)
    tx = loss_scaling(optax.adam(1e-2), NoOpLossScale(), check_finite=True, skip=skip)
    step = jax.jit(make_step(tx, loss))
    p, s = params, tx.init(params)
    for i in range(40):
        p, s = step(p, s, (xs[i % 4], ys[i % 4]))
    assert int(s.skipped_total) == 0
    assert float(loss(p, (xs[0], ys[0]))) < 0.8 * float(loss(params, (xs[0], ys[0])))


def test_inner_sees_unscaled_gradients():
    params = mlp_params(jax.random.key(0))
    batch = tuple(b[0] for b in batches(jax.random.key(1), 1))
    true_grads = jax.jit(jax.grad(mlp_loss))(params, batch)  # one compile, not one per eager op
    tx = loss_scaling(optax.identity(), StaticLossScale(2.0**12))
    seen, _ = jax.jit(
        lambda p, s: tx.update(jax.grad(lambda q: s.loss_scale.scale(mlp_loss(q, batch)))(p), s, p)
    )(params, tx.init(params))
    assert_trees_bitwise_equal(seen, true_grads)  # power-of-two scaling is exact in float32
    clipped = loss_scaling(optax.clip_by_global_norm(0.01), StaticLossScale(2.0**12))

    @jax.jit
    def clip(g, s, p):
        out, _ = clipped.update(jax.tree_util.tree_map(lambda x: x * 2.0**12, g), s, p)
        return optax.tree.norm(g), optax.tree.norm(out)

    true_norm, out_norm = clip(true_grads, clipped.init(params), params)
    assert float(true_norm) > 0.02
    assert float(out_norm) == pytest.approx(0.01, rel=1e-5)


def test_unscale_keeps_gradient_dtype():
    params = {"w": jnp.ones(4, jnp.float16)}
    tx = loss_scaling(optax.sgd(1.0), StaticLossScale(2.0**10))
    grads = {"w": jnp.full(4, 2.0**-4, jnp.float16)}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_array_equal(updates["w"], jnp.full(4, -(2.0**-14), jnp.float16))


def test_init_gives_every_leaf_its_own_buffer():
    # A state passed with donate_argnums must not hold one buffer twice (XLA refuses, or crashes).
    ls = DynamicLossScale(2.0**15)
    state = loss_scaling(optax.adam(1e-3), ls).init({"w": jnp.ones(2)})
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves((state, ls))]
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("jit", [False, True])
def test_unscale_widens_to_float32_so_a_small_half_gradient_survives_a_large_scale(jit):
    # 1 / 2**26 is below float16's smallest subnormal (2**-24): multiplied in float16 it would be 0
    # and the update -0.0. Widened to float32, 64 / 2**26 = 2**-20 is a float16 subnormal, kept exactly.
    params = {"w": jnp.zeros(2, jnp.float16), "b": jnp.zeros(2, jnp.bfloat16)}
    tx = loss_scaling(optax.sgd(1.0), StaticLossScale(2.0**26))
    grads = {"w": jnp.full(2, 64.0, jnp.float16), "b": jnp.full(2, 2.0**-100, jnp.bfloat16)}
    update = jax.jit(tx.update) if jit else tx.update
    updates, _ = update(grads, tx.init(params), params)
    assert updates["w"].dtype == jnp.float16 and updates["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(updates["w"], jnp.full(2, -(2.0**-20), jnp.float16))
    np.testing.assert_array_equal(updates["b"], jnp.full(2, -(2.0**-126), jnp.bfloat16))


@pytest.mark.parametrize("skip_fn", ["cond", "select"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_skip_functions_apply_or_keep_the_old_state_in_the_new_dtypes(skip_fn, jit, half):
    # The state's dtypes change in the update (int count -> float, half -> float32), as inject_hyperparams'
    # do: a kept state comes back in the new dtypes with the old values, the updates as -0.0.
    old = {"count": jnp.int32(3), "m": jnp.array([1.5, -2.0], half)}
    grads = jnp.array([1.0, 2.0], half)

    def run(finite):
        apply = lambda: (grads * 2, {"count": jnp.float32(7.0), "m": jnp.array([9.0, 9.0], jnp.float32)})
        if skip_fn == "cond":
            return skip_by_cond(finite, apply, grads, old)
        return skip_by_select(finite, apply, old)

    run = jax.jit(run) if jit else run
    updates, state = run(jnp.bool_(True))
    np.testing.assert_array_equal(updates, grads * 2)
    assert float(state["count"]) == 7.0 and state["m"].tolist() == [9.0, 9.0]
    updates, state = run(jnp.bool_(False))
    assert updates.dtype == half and np.all(np.signbit(np.asarray(updates, np.float32)))
    np.testing.assert_array_equal(np.asarray(updates, np.float32), [-0.0, -0.0])
    assert state["count"].dtype == jnp.float32 and float(state["count"]) == 3.0
    assert state["m"].dtype == jnp.float32 and state["m"].tolist() == [1.5, -2.0]


@pytest.mark.composition
def test_skip_by_cond_gives_both_branches_one_type_inside_shard_map():
    # Inside shard_map lax.cond needs both branches to vary over the same mesh axes. Here the gradients
    # vary over "d" and the kept state does not, while the applied update is reduced (does not vary) and
    # the applied state mixes in the gradients (varies): the kept state is pcast to varying, and the
    # passed-through gradients cannot stand for the update, so the skipped branch makes zeros.
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def f(g, old):
        finite = jax.lax.pmin(jnp.all(jnp.isfinite(g)).astype(jnp.int32), "d").astype(jnp.bool_)
        return skip_by_cond(finite, lambda: (jax.lax.psum(g, "d"), old + g), g, old)

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P(), P("d"))))
    updates, state = step(jnp.arange(n, dtype=jnp.float32), jnp.ones(1))
    assert float(updates[0]) == sum(range(n)) and np.asarray(state).tolist() == [1.0 + i for i in range(n)]
    updates, state = step(jnp.arange(n, dtype=jnp.float32).at[3].set(jnp.inf), jnp.ones(1))
    assert np.asarray(updates).tolist() == [-0.0] and np.asarray(state).tolist() == [1.0] * n


def test_compiles_once_over_100_steps_with_scale_changes_and_no_transfers():
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 100)
    xs = xs.at[jnp.arange(0, 100, 9), 0, 0].set(jnp.inf)
    tx = loss_scaling(optax.adam(1e-3), DynamicLossScale(2.0**15, period=3))
    traces = []

    def step(p, s, b):
        traces.append(1)
        return make_step(tx)(p, s, b)

    jstep = jax.jit(step, donate_argnums=0)  # the test keeps each state's scale
    data = [(xs[i], ys[i]) for i in range(100)]  # slicing with a Python int is a transfer
    p, s = jstep(params, tx.init(params), data[0])
    scales = []
    with jax.transfer_guard("disallow"):
        for batch in data[1:]:
            p, s = jstep(p, s, batch)
            scales.append(s.loss_scale.loss_scale)
    assert len(traces) == 1
    assert jstep._cache_size() == 1  # one compiled executable, not only one trace
    assert len({float(x) for x in scales}) > 2
    assert int(s.skipped_total) == 12


@pytest.mark.composition
def test_composes_in_chain_multisteps_inject_hyperparams():
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 6)
    ls = DynamicLossScale(2.0**10)
    variants = {
        "element": optax.chain(loss_scaling(optax.scale_by_adam(), ls), optax.scale(-1e-2)),
        "around_chain": loss_scaling(optax.chain(optax.scale_by_adam(), optax.scale(-1e-2)), ls),
        "inject": loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), ls),
        "multisteps": loss_scaling(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), ls),
    }
    results = {}
    for name, tx in variants.items():
        step = jax.jit(make_step(tx))
        p, s = params, tx.init(params)
        for i in range(6):
            p, s = step(p, s, (xs[i], ys[i]))
        results[name] = p
        assert jmp_lite.get_loss_scaling_state(s).skipped_total == 0
    # The cond boundary may change XLA's fusion, so compare to rounding.
    np.testing.assert_allclose(results["element"][0]["w"], results["around_chain"][0]["w"], rtol=1e-4)
    np.testing.assert_allclose(results["inject"][0]["w"], results["element"][0]["w"], rtol=1e-4)
    assert optax.tree.get(variants["inject"].init(params), "learning_rate") == pytest.approx(1e-2)
    # MultiSteps(k=2): Adam applied every second step to the mean of the two unscaled micro-gradients.
    adam = optax.adam(1e-2)

    @jax.jit  # one compile, not one per eager op
    def reference_step(p, s, b0, b1):
        g0, g1 = jax.grad(mlp_loss)(p, b0), jax.grad(mlp_loss)(p, b1)
        u, s = adam.update(jax.tree_util.tree_map(lambda a, b: (a + b) / 2, g0, g1), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, adam.init(params)
    for i in (0, 2, 4):
        p, s = reference_step(p, s, (xs[i], ys[i]), (xs[i + 1], ys[i + 1]))
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), results["multisteps"], p
    )


def test_multisteps_inside_loss_scaling_survives_a_nonfinite_micro_batch():
    params = {"w": jnp.ones(3)}
    good = {"w": jnp.full(3, 4.0)}
    bad = {"w": jnp.array([jnp.nan, 4.0, 4.0])}
    tx = loss_scaling(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), DynamicLossScale(4.0))
    s = tx.init(params)
    _, s = tx.update(good, s, params)
    u, s = tx.update(bad, s, params)  # skipped: MultiSteps' accumulator untouched
    assert np.all(np.asarray(u["w"]) == 0) and float(jmp_lite.get_loss_scale(s).loss_scale) == 2.0
    good = {"w": jnp.full(3, 2.0)}  # same true gradient at the new scale
    u, s = tx.update(good, s, params)
    np.testing.assert_array_equal(u["w"], -jnp.ones(3))
    # The other nesting is poisoned by optax's accumulator, which is why the
    # docs put loss_scaling outside MultiSteps.
    poisoned = optax.MultiSteps(loss_scaling(optax.sgd(1.0), StaticLossScale(4.0)), every_k_schedule=2)
    s = poisoned.init(params)
    for g in ({"w": jnp.full(3, 4.0)}, bad, {"w": jnp.full(3, 4.0)}, {"w": jnp.full(3, 4.0)}):
        u, s = poisoned.update(g, s, params)
    assert np.all(np.asarray(u["w"]) == 0)


def test_extra_args_are_forwarded():
    seen = {}

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, value):
        seen["value"] = value
        return updates, state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = loss_scaling(inner, StaticLossScale(2.0))
    tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), value=jnp.float32(3))
    assert float(seen["value"]) == 3


def test_noop_loss_scale_adds_no_work():
    params = mlp_params(jax.random.key(0))
    batch = tuple(b[0] for b in batches(jax.random.key(1), 1))
    inner = optax.adam(1e-3)
    tx = loss_scaling(inner, NoOpLossScale())

    def plain(p, s, b):
        g = jax.grad(mlp_loss)(p, b)
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s

    ours_jaxpr = jax.make_jaxpr(make_step(tx))(params, tx.init(params), batch)
    plain_jaxpr = jax.make_jaxpr(plain)(params, inner.init(params), batch)
    assert str(ours_jaxpr) == str(plain_jaxpr)
    assert len(jax.tree_util.tree_leaves(tx.init(params))) == len(
        jax.tree_util.tree_leaves(inner.init(params))
    )


def count_copies(fn, *args):
    text = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    return len(re.findall(r"= \S+ copy\(", text))


@pytest.mark.compiled  # reads the compiled program
def test_cond_skip_adds_a_constant_number_of_copies():
    inner = optax.adam(1e-3)

    def plain(p, s, b):
        g = jax.grad(mlp_loss)(p, b)
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s

    extra = {"cond": [], "select": []}
    for sizes in [(8, 16, 4), (8, 16, 16, 16, 16, 4), (8,) + (16,) * 10 + (4,)]:
        params = mlp_params(jax.random.key(0), sizes)
        batch = tuple(b[0] for b in batches(jax.random.key(1), 1))
        base = count_copies(plain, params, inner.init(params), batch)
        for skip in extra:
            tx = loss_scaling(inner, DynamicLossScale(2.0**15), skip=skip)
            extra[skip].append(count_copies(make_step(tx), params, tx.init(params), batch) - base)
    # cond: at most the two loss-scale scalars more than plain Adam, whatever the size
    assert all(e <= 2 for e in extra["cond"]), extra
    # select: copies grow with the number of state leaves (6 -> 12 -> 24 parameter leaves)
    assert extra["select"][0] < extra["select"][1] < extra["select"][2], extra


@pytest.mark.parametrize("backend, mechanism", [("cpu", "cond"), ("tpu", "cond"), ("gpu", "select")])
def test_auto_picks_the_skip_mechanism_per_backend(monkeypatch, backend, mechanism):
    # on NVIDIA GPUs lax.cond moves its predicate to the host every step: a select never syncs
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    tx = loss_scaling(optax.sgd(1.0), StaticLossScale(2.0), skip="auto")
    program = str(jax.make_jaxpr(tx.update)({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)})))
    assert ("cond[" in program) == (mechanism == "cond")  # a select-skip program has no cond at all


def test_get_loss_scale_errors():
    with pytest.raises(ValueError, match="found 0"):
        jmp_lite.get_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(1)}))
    tx = loss_scaling(optax.sgd(1.0), StaticLossScale(2.0))
    two = (tx.init({"w": jnp.ones(1)}), tx.init({"w": jnp.ones(1)}))
    with pytest.raises(ValueError, match="found 2"):
        jmp_lite.get_loss_scale(two)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(inner=optax.sgd(1.0), loss_scale=2.0**15), TypeError, "loss_scale must be"),
        (dict(inner=lambda g: g, loss_scale=NoOpLossScale()), TypeError, "inner must be"),
        (dict(inner=optax.sgd(1.0), loss_scale=NoOpLossScale(), skip="where"), ValueError, "skip must be"),
        (
            dict(inner=optax.sgd(1.0), loss_scale=NoOpLossScale(), max_consecutive_skips=0),
            ValueError,
            r"max_consecutive_skips must be a whole number in \[1, ",
        ),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        loss_scaling(**kwargs)


@pytest.mark.parametrize("skip", SKIPS)
def test_skipped_step_keeps_negative_zero_params_bitwise(skip):
    params = {"w": jnp.array([-0.0, 0.0, 1.5, -2.0])}
    tx = loss_scaling(optax.adam(1e-3), StaticLossScale(2.0), skip=skip)
    updates, _ = jax.jit(tx.update)({"w": jnp.full(4, jnp.nan)}, tx.init(params), params)
    assert np.all(np.asarray(updates["w"]) == 0)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(
        np.asarray(new["w"]).view(np.uint32), np.asarray(params["w"]).view(np.uint32)
    )


def test_dynamic_scale_without_checks_is_an_error():
    with pytest.raises(ValueError, match="check_finite=False with a DynamicLossScale"):
        loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0), check_finite=False)


def test_odd_leaves_pass_through():
    """None, integer and Python-float gradient leaves, and a PRNG key in the inner state."""

    def init(params):
        return {"key": jax.random.key(0), "n": jnp.int32(0)}

    def update(updates, state, params=None):
        key, sub = jax.random.split(state["key"])
        return updates, {"key": key, "n": state["n"] + 1}

    tx = loss_scaling(optax.GradientTransformation(init, update), StaticLossScale(4.0))
    grads = {"w": jnp.full(2, 8.0), "none": None, "count": jnp.int32(3), "py": 2.0}
    state = tx.init(grads)
    updates, state = jax.jit(tx.update)(grads, state)
    assert updates["none"] is None and int(updates["count"]) == 3
    np.testing.assert_array_equal(updates["w"], [2.0, 2.0])
    assert float(updates["py"]) == 0.5 and int(state.scaled_inner_state["n"]) == 1
    bad = {**grads, "w": jnp.array([jnp.nan, 1.0])}
    _, skipped = jax.jit(tx.update)(bad, state)
    assert int(skipped.scaled_inner_state["n"]) == 1  # the key and counter did not advance
    assert jax.random.key_data(skipped.scaled_inner_state["key"]).tolist() == (
        jax.random.key_data(state.scaled_inner_state["key"]).tolist()
    )


@pytest.mark.parametrize("skip", SKIPS)
def test_vmap_over_independent_optimizers(skip):
    tx = loss_scaling(optax.adam(0.1), DynamicLossScale(8.0), skip=skip)
    params = {"w": jnp.ones((3, 2))}
    states = jax.vmap(tx.init)(params)
    grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.inf)}  # member 1 overflows
    updates, states = jax.vmap(tx.update)(grads, states, params)
    np.testing.assert_array_equal(np.asarray(states.skipped_total), [0, 1, 0])
    np.testing.assert_array_equal(np.asarray(states.loss_scale.loss_scale), [8.0, 4.0, 8.0])
    assert np.all(np.asarray(updates["w"][1]) == 0) and np.all(np.asarray(updates["w"][0]) != 0)


@functools.cache
def counters_over_30_steps(limit):
    """The loss_scaling state's counters after each of 30 steps, compiled once per limit."""
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0**10, period=3), max_consecutive_skips=limit)

    def body(s, g):
        _, s = tx.update({"w": g}, s)
        return s, (s.skipped_total, s.consecutive_skips, s.last_grads_finite, s.skip_limit_reached)

    run = jax.jit(lambda s, g: jax.lax.scan(body, s, g)[1])
    return lambda grads: [np.asarray(x) for x in run(tx.init({"w": jnp.zeros(2)}), grads)]


@pytest.mark.property
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_skip_counters_match_a_reference(finite_seq, limit):
    # Padded to 30 steps with finite ones (one compile per limit, not per length): later steps of the
    # scan cannot change the counters after the earlier ones, which are the ones checked.
    grads = np.ones((30, 2), np.float32)
    grads[: len(finite_seq)][~np.array(finite_seq), 1] = np.nan
    total, in_a_row, last, limit_hit = counters_over_30_steps(limit)(grads)
    ref_total = ref_row = 0
    for i, f in enumerate(finite_seq):
        ref_total += not f
        ref_row = 0 if f else ref_row + 1
        assert (int(total[i]), int(in_a_row[i]), bool(last[i]), bool(limit_hit[i])) == (
            ref_total,
            ref_row,
            f,
            ref_row >= limit,
        )


def test_noop_with_check_finite_skips_bf16_steps():
    tx = loss_scaling(optax.sgd(1.0), NoOpLossScale(), check_finite=True)
    s = tx.init({"w": jnp.ones(2)})
    u, s = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan])}, s)
    assert np.all(np.asarray(u["w"]) == 0) and int(s.skipped_total) == 1


# --- multiple devices -------------------------------------------------------


def replicated_setup(n):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 5, batch=8 * n)
    return params, xs.reshape(5, n, 8, -1), ys.reshape(5, n, 8)


@pytest.mark.composition
@pytest.mark.parametrize("skip", SKIPS)
def test_pmap_replicas_agree_when_one_overflows(skip):
    n = jax.device_count()
    assert n == 8
    params, xs, ys = replicated_setup(n)
    xs = xs.at[2, 3, 0, 0].set(jnp.inf)  # only replica 3, step 2
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**15, period=2), axis_name="d", skip=skip)

    def step(p, s, b):
        ls = jmp_lite.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(mlp_loss(q, b)))(p)
        g = jax.lax.pmean(g, "d")
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    # pmap compiles for the shardings of its inputs: inputs already where its outputs go (split over a
    # mesh axis named after axis_name) compile the step once, not again at the second step.
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
    stack = lambda t: jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), t)
    p, s = jax.jit(stack, out_shardings=sharding)((params, tx.init(params)))
    xs, ys = np.asarray(xs), np.asarray(ys)
    pstep = jax.pmap(step, axis_name="d")
    for i in range(5):
        p, s = pstep(p, s, jax.device_put((xs[i], ys[i]), sharding))
    for leaf in jax.tree_util.tree_leaves((p, s)):
        leaf = np.asarray(leaf)
        for r in range(1, n):
            np.testing.assert_array_equal(leaf[r], leaf[0])
    assert np.all(np.asarray(s.skipped_total) == 1)


@pytest.mark.composition
def test_pmap_replicas_agree_without_any_gradient_reduction():
    """Only the finiteness flag is shared: remove the pmin and this fails."""
    n = jax.device_count()
    grads = jnp.ones((4, n, 2)).at[1, 5, 0].set(jnp.inf)  # step 1, replica 5 only
    tx = loss_scaling(optax.adam(0.1), DynamicLossScale(2.0**4, period=2), axis_name="d")

    def run(g_steps):
        s = tx.init({"w": jnp.zeros(2)})

        def body(s, g):
            u, s = tx.update({"w": g}, s, {"w": jnp.zeros(2)})
            return s, (u["w"], s.loss_scale.loss_scale, s.skipped_total)

        return jax.lax.scan(body, s, g_steps)[1]

    updates, scales, skipped = jax.pmap(run, axis_name="d", in_axes=1)(grads)
    scales, skipped, updates = np.asarray(scales), np.asarray(skipped), np.asarray(updates)
    assert np.all(scales == scales[0]) and np.all(skipped == skipped[0])  # every replica agrees
    assert skipped[0].tolist() == [0, 1, 1, 1] and scales[0].tolist() == [16.0, 8.0, 8.0, 16.0]
    assert np.all(updates[:, 1] == 0)  # every replica skipped step 1, not only replica 5


@pytest.mark.composition
def test_shard_map_with_a_tuple_of_mesh_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0**4), axis_name=("a", "b"))
    grads = jnp.ones((8, 2)).at[6, 1].set(jnp.nan)

    def upd(g):
        u, s = tx.update({"w": g}, tx.init({"w": jnp.zeros((1, 2))}))
        return u["w"], s.loss_scale.loss_scale[None]

    f = jax.jit(
        jax.shard_map(upd, mesh=mesh, in_specs=P(("a", "b")), out_specs=(P(("a", "b")), P(("a", "b"))))
    )
    u, scale = f(grads)
    assert np.all(np.asarray(u) == 0) and np.all(np.asarray(scale) == 8.0)


@pytest.mark.composition
def test_shard_map_replicas_agree_without_gradient_pmean():
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0**4), axis_name="d")
    grads = jnp.ones((n, 2)).at[5, 1].set(jnp.nan)  # only shard 5 is non-finite

    def upd(g):
        params = {"w": jnp.zeros((1, 2))}
        u, s = tx.update({"w": g}, tx.init(params), params)
        return u["w"], s.loss_scale.loss_scale[None], s.skipped_total[None]

    f = jax.jit(jax.shard_map(upd, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"), P("d"))))
    u, scale, skipped = f(grads)
    assert np.all(np.asarray(u) == 0)
    np.testing.assert_array_equal(np.asarray(scale), np.full(n, 8.0))
    np.testing.assert_array_equal(np.asarray(skipped), np.ones(n))
