"""kahan_summation, stochastic_rounding, low_precision_state: bitwise references, bad input, composition."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import assert_trees_bitwise_equal, batches, make_step, mlp_loss, mlp_params, without_loss_scale
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite import DynamicLossScale, kahan_summation, loss_scaling, low_precision_state, stochastic_rounding
from jmp_lite._src.optim.low_precision import _round_nearest

pytestmark = pytest.mark.unit

HALF = [jnp.bfloat16, jnp.float16]
KEY = jax.random.key(7)


def bits(x):
    return np.asarray(x).view(np.uint16 if np.dtype(x.dtype).itemsize == 2 else np.uint32)


def half_values(rng, dtype, n):
    """16-bit parameters over five decades, both signs, zeros included (no float32 subnormals)."""
    p = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n)
    p[:8] = 0.0
    return p.astype(dtype)


def updates_for(rng, p):
    """float32 updates from 1e-7 to 10 times the parameter: most below half a 16-bit ulp, some that
    move it, some that cancel it (u = -p) or flip it."""
    p32 = p.astype(np.float32)
    scale = np.where(p32 == 0, 1e-3, np.abs(p32))
    u = scale * rng.choice([-1, 1], p.size) * 10.0 ** rng.uniform(-7, 1, p.size)
    u[8:16] = -p32[8:16]
    u[16:24] = -p32[16:24] * (1 + 2.0**-12)
    return u.astype(np.float32)


def kahan_reference(p, c, u, dtype):
    """One Kahan step in NumPy float32 arithmetic with ml_dtypes rounding: (update, new param, new c)."""
    p32 = p.astype(np.float32)
    y = u.astype(np.float32) + c.astype(np.float32)
    landed = (p32 + y).astype(dtype)
    c_new = (y - (landed.astype(np.float32) - p32)).astype(dtype)
    return y, landed, c_new


# --- rounding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_round_nearest_equals_the_cast_including_subnormals_and_overflow(dtype):
    rng = np.random.default_rng(0)
    info = ml_dtypes.finfo(dtype)
    x = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
            np.linspace(
                -2 * float(info.smallest_normal), 2 * float(info.smallest_normal), 20_001, dtype=np.float32
            ),
            np.float32([float(info.max), 65519.99, 65520.0, -65520.0, 3.4e38, np.inf, -np.inf, 0.0, -0.0]),
        ]
    )
    x = x[~np.isnan(x) & ~((np.abs(x) < np.finfo(np.float32).tiny) & (x != 0))]  # no float32 subnormals
    with np.errstate(over="ignore"):
        expected = x.astype(dtype).astype(np.float32)
    got = jax.jit(lambda v: _round_nearest(v, np.dtype(dtype)))(x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), expected.view(np.uint32))


# --- kahan_summation ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_kahan_step_is_bitwise_the_numpy_reference_under_jit(dtype):
    rng = np.random.default_rng(1)
    p = half_values(rng, dtype, 4096)
    c = (rng.standard_normal(p.size) * np.abs(p.astype(np.float32)) * 2.0**-10).astype(dtype)
    u = updates_for(rng, p)
    tx = kahan_summation()

    @jax.jit
    def step(p, c, u):
        updates, state = tx.update({"w": u}, jmp_lite.KahanSummationState({"w": c}), {"w": p})
        return updates["w"], optax.apply_updates({"w": p}, updates)["w"], state.kahan_compensation["w"]

    y, landed, c_new = step(p, c, u)
    y_ref, landed_ref, c_ref = kahan_reference(p, c, u, dtype)
    assert y.dtype == jnp.float32 and landed.dtype == dtype and c_new.dtype == dtype
    np.testing.assert_array_equal(bits(y), bits(y_ref))
    np.testing.assert_array_equal(bits(landed), bits(landed_ref))  # optax.apply_updates lands on p'
    np.testing.assert_array_equal(bits(c_new), bits(c_ref))
    assert np.count_nonzero(bits(c_ref)) > p.size // 2  # the compensation is not trivially zero


@pytest.mark.parametrize("dtype", HALF)
def test_kahan_trajectory_under_scan_is_bitwise_the_reference_and_keeps_small_updates(dtype):
    """300 compiled steps of updates below half an ulp: the compensation must survive XLA."""
    rng = np.random.default_rng(2)
    # From 0.01 up: below, a float16 compensation (a quarter of the weight's ulp) is subnormal.
    p0 = (rng.choice([-1, 1], 512) * 10.0 ** rng.uniform(-2, 1, 512)).astype(dtype)
    ulp = np.abs(p0.astype(np.float32)) * 2.0 ** -(ml_dtypes.finfo(dtype).nmant + 1)
    us = (rng.uniform(0.05, 0.45, (300, p0.size)) * np.where(ulp == 0, 1e-4, ulp)).astype(np.float32)
    tx = kahan_summation()

    def body(carry, u):
        params, state = carry
        updates, state = tx.update({"w": u}, state, params)
        return (optax.apply_updates(params, updates), state), None

    run = jax.jit(lambda p, us: jax.lax.scan(body, (p, tx.init(p)), us)[0])
    params, state = run({"w": p0}, us)
    assert "reduce-precision" in run.lower({"w": p0}, us).compile().as_text()

    p, c = p0, np.zeros_like(p0)
    for u in us:
        _, p, c = kahan_reference(p, c, u, dtype)
    np.testing.assert_array_equal(bits(params["w"]), bits(p))
    np.testing.assert_array_equal(bits(state.kahan_compensation["w"]), bits(c))
    nearest = p0
    for u in us:  # round to nearest, the same updates: each one is dropped
        nearest = (nearest.astype(np.float32) + u).astype(dtype)
    np.testing.assert_array_equal(bits(nearest), bits(p0))
    exact = p0.astype(np.float64) + us.astype(np.float64).sum(0)
    kahan_error = np.abs(p.astype(np.float64) + c.astype(np.float64) - exact)
    assert np.all(kahan_error < 0.05 * np.abs(p0.astype(np.float64) - exact))  # vs ~75 ulps dropped


def test_kahan_refuses_wide_parameters_or_passes_them_when_asked():
    params = {"a": jnp.ones(2, jnp.bfloat16), "norm": {"scale": jnp.ones(2, jnp.float32)}}
    with pytest.raises(
        TypeError,
        match=r"bfloat16 or float16.*\['norm'\]\['scale'\] is float32.*optax.masked.*wide_params='pass'",
    ):
        kahan_summation().init(params)
    with pytest.raises(TypeError, match="is int32"):
        kahan_summation().init({"step": jnp.zeros(2, jnp.int32)})
    with pytest.raises(ValueError, match="wide_params must be one of 'error', 'pass'; got 'skip'"):
        kahan_summation(wide_params="skip")
    tx = kahan_summation(wide_params="pass")
    state = tx.init(params)
    assert state.kahan_compensation["norm"]["scale"] is None
    u = {"a": jnp.full(2, 1e-3), "norm": {"scale": jnp.full(2, 1e-3)}}
    updates, _ = jax.jit(tx.update)(u, state, params)
    assert updates["norm"]["scale"] is not None
    np.testing.assert_array_equal(updates["norm"]["scale"], u["norm"]["scale"])
    sr = stochastic_rounding(KEY, wide_params="pass")
    updates, _ = jax.jit(sr.update)(u, sr.init(params), params)
    np.testing.assert_array_equal(updates["norm"]["scale"], u["norm"]["scale"])
    with pytest.raises(ValueError, match="needs the current parameters"):
        tx.update(u, state)
    with pytest.raises(TypeError, match="is float32"):  # parameters that changed dtype since init
        kahan_summation().update(
            u, kahan_summation().init({"a": jnp.ones(2, jnp.bfloat16)}), {"a": jnp.ones(2)}
        )


# --- stochastic_rounding --------------------------------------------------------------------------


def neighbours(s, dtype):
    r = s.astype(dtype)
    r32 = r.astype(np.float32)
    other = np.where(r32 < s, np.nextafter(r, dtype(np.inf)), np.nextafter(r, dtype(-np.inf)))
    return r32, np.where(r32 == s, r32, other.astype(np.float32))


@pytest.mark.numerics
@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_lands_on_a_neighbour_exactly_and_is_unbiased(dtype):
    rng = np.random.default_rng(3)
    p = np.repeat(half_values(rng, dtype, 64)[24:], 2000)
    u = np.repeat(updates_for(rng, half_values(rng, dtype, 64))[24:], 2000)
    p = p[np.abs(u) < np.abs(p.astype(np.float32))]  # no cancellation: the landing is then exact
    u = u[: p.size]
    u = (np.sign(u) * np.minimum(np.abs(u), 0.5 * np.abs(p.astype(np.float32)))).astype(np.float32)
    tx = stochastic_rounding(KEY)

    @jax.jit
    def step(p, u, state):
        updates, state = tx.update({"w": u}, state, {"w": p})
        return optax.apply_updates({"w": p}, updates)["w"], updates["w"], state

    landed, v, state = step(p, u, tx.init({"w": p}))
    p32 = p.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(landed).astype(np.float32), p32 + np.asarray(v))  # exact landing
    s = p32 + u
    near, far = neighbours(s, dtype)
    landed32 = np.asarray(landed).astype(np.float32)
    assert np.all((landed32 == near) | (landed32 == far))
    assert 0.02 < np.mean(landed32 != near) < 0.5  # both neighbours occur, the near one more often
    # Unbiased: per group of 2000 copies of one (p, u), the mean is s within 5 standard errors.
    for g in np.unique(s):
        sel = s == g
        gap = np.abs(far[sel][0] - near[sel][0])
        if gap and sel.sum() > 500:
            assert abs(landed32[sel].astype(np.float64).mean() - g) < 5 * gap / (2 * np.sqrt(sel.sum()))

    again, _, _ = step(p, u, tx.init({"w": p}))
    np.testing.assert_array_equal(bits(again), bits(landed))  # same key, same rounding
    other, _, _ = step(p, u, stochastic_rounding(jax.random.key(8)).init({"w": p}))
    assert not np.array_equal(bits(other), bits(landed))
    second, _, _ = step(p, u, state)  # the state carries the next key
    assert not np.array_equal(bits(second), bits(landed))


@pytest.mark.numerics
def test_stochastic_rounding_keeps_small_updates_on_average():
    params = {"w": jnp.ones(4000, jnp.bfloat16)}
    grads = {"w": jnp.ones(4000, jnp.bfloat16)}
    for tx, expected in [
        (optax.sgd(1e-3), 1.0),
        (optax.chain(optax.sgd(1e-3), stochastic_rounding(KEY)), 0.9),
    ]:
        p, s = params, tx.init(params)
        step = jax.jit(
            lambda p, s, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(grads, s, p))
        )
        for _ in range(100):
            p, s = step(p, s)
        assert abs(float(p["w"].astype(jnp.float32).mean()) - expected) < 2e-3


def test_keys_typed_raw_and_other_implementations_and_bad_keys():
    params = {"w": jnp.ones(8, jnp.float16)}
    grads = {"w": jnp.full(8, 1e-4, jnp.float16)}

    def run(key):
        tx = stochastic_rounding(key)
        return jax.jit(tx.update)(grads, tx.init(params), params)

    typed, raw = run(jax.random.key(0)), run(jax.random.PRNGKey(0))
    assert_trees_bitwise_equal(typed, raw)  # the same threefry key, typed or raw
    rbg = run(jax.random.key(0, impl="rbg"))
    assert rbg[1].param_rounding_key.shape == (4,)
    for bad, err, msg in [
        (0, TypeError, "got int: 0"),
        (1.5, TypeError, "got float"),
        (np.zeros(2, np.float32), TypeError, "dtype float32 and shape \\(2,\\)"),
        (np.zeros(3, np.uint32), TypeError, "dtype uint32 and shape \\(3,\\)"),
        ("seed", TypeError, "got str"),
        (jax.random.split(jax.random.key(0), 8), ValueError, "batch of keys of shape \\(8,\\)"),
    ]:
        with pytest.raises(err, match=f"stochastic_rounding key must be a single PRNG key.*{msg}"):
            stochastic_rounding(bad)
        with pytest.raises(err, match=f"low_precision_state key must be a single PRNG key.*{msg}"):
            low_precision_state(optax.adam(1e-3), key=bad)
    with pytest.raises(TypeError, match="16 bits.*\\['w'\\] is float32"):
        stochastic_rounding(KEY).init({"w": jnp.ones(2)})


# --- low_precision_state --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_state_is_stored_in_dtype_and_counts_and_scalars_are_untouched(dtype):
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
    tx = low_precision_state(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), dtype)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)
    _, state = jax.jit(tx.update)(grads, state, params)
    inner = state.low_precision_inner_state
    for moment in (inner.inner_state[0].mu, inner.inner_state[0].nu):
        assert {x.dtype for x in jax.tree_util.tree_leaves(moment)} == {np.dtype(dtype)}
    assert inner.inner_state[0].count.dtype == jnp.int32 and int(inner.inner_state[0].count) == 1
    assert inner.hyperparams["learning_rate"].dtype == jnp.float32
    assert float(inner.hyperparams["learning_rate"]) == np.float32(1e-3)
    momentum = low_precision_state(optax.sgd(0.1, momentum=0.9), dtype).init(params)
    assert momentum.low_precision_inner_state[0].trace["w"].dtype == dtype
    wider = low_precision_state(optax.adam(1e-3), jnp.float32).init(params)  # bf16 params, float32 state
    assert wider.low_precision_inner_state[0].nu["b"].dtype == jnp.float32


@pytest.mark.numerics
@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("dtype", HALF)
def test_kahan_state_runs_adam_in_float32_and_keeps_twice_the_bits(dtype):
    rng = np.random.default_rng(4)
    params = {"w": jnp.asarray(rng.standard_normal(1024), jnp.bfloat16)}
    tx = low_precision_state(optax.adam(1e-2), dtype, rounding="kahan")
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(3):
        grads = {"w": jnp.asarray(rng.standard_normal(1024), jnp.bfloat16)}
        before = state
        updates, state = update(grads, state, params)
    # The reference: optax's own Adam in float32 on the widened state hi + lo. Two programs may
    # fuse (and contract multiply-adds) differently, so float32 agreement is to a few ulps.
    adam = before.low_precision_inner_state[0]
    lo_mu, lo_nu = before.state_compensation
    wide = lambda hi, lo: hi["w"].astype(jnp.float32) + lo.astype(jnp.float32)  # noqa: E731
    ref_state = (
        adam._replace(mu={"w": wide(adam.mu, lo_mu)}, nu={"w": wide(adam.nu, lo_nu)}),
        optax.EmptyState(),
    )
    g32 = {"w": grads["w"].astype(jnp.float32)}
    ref_updates, ref_new = jax.jit(optax.adam(1e-2).update)(g32, ref_state, params)
    assert updates["w"].dtype == jnp.float32
    scale = np.abs(ref_updates["w"]).max()
    np.testing.assert_allclose(updates["w"], ref_updates["w"], rtol=1e-5, atol=1e-6 * scale)  # bf16: ~1e-2
    new = state.low_precision_inner_state[0]
    for hi, lo, ref in [
        (new.mu["w"], state.state_compensation[0], ref_new[0].mu["w"]),
        (new.nu["w"], state.state_compensation[1], ref_new[0].nu["w"]),
    ]:
        assert hi.dtype == lo.dtype == dtype
        pair = np.asarray(hi).astype(np.float32) + np.asarray(lo).astype(np.float32)  # exact
        mag = np.abs(np.asarray(hi))
        ulp = np.nextafter(mag, dtype(np.inf)).astype(np.float32) - mag.astype(np.float32)
        assert np.all(np.abs(np.asarray(lo).astype(np.float32)) <= ulp / 2)  # hi = rn(m): lo is the rest
        # About 16 significant bits, not 8 or 11 (cancellation in b * m + (1 - b) * g limits the rtol).
        np.testing.assert_allclose(pair, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert np.abs(np.asarray(hi).astype(np.float32) - ref).max() > 30 * np.abs(pair - ref).max()


def test_stochastic_state_lands_on_a_neighbour_of_the_float32_moment():
    params = {"w": jnp.ones(20_000)}
    tx = low_precision_state(optax.adam(1e-2), jnp.bfloat16)
    state = tx.init(params)
    g = {"w": jnp.full(20_000, 0.3)}
    updates, state = jax.jit(tx.update)(g, state, params)
    mu32 = np.float32(0.1) * np.float32(0.3)  # Adam's first moment after one step, in float32
    near, far = neighbours(np.full(1, mu32), jnp.bfloat16)
    stored = np.asarray(state.low_precision_inner_state[0].mu["w"]).astype(np.float32)
    assert set(np.unique(stored)) == {near[0], far[0]}
    assert abs(stored.astype(np.float64).mean() - mu32) < 5 * abs(far[0] - near[0]) / (
        2 * np.sqrt(stored.size)
    )
    assert updates["w"].dtype == jnp.float32


def test_low_precision_state_bad_input():
    adam = optax.adam(1e-3)
    for bad, err, msg in [
        (jnp.int16, ValueError, "must be a floating dtype or int8, got int16"),
        ("int32", ValueError, "must be a floating dtype or int8"),
        ("uint8", ValueError, "must be a floating dtype or int8, got 'uint8'"),
        (bool, ValueError, "must be a floating dtype or int8, got bool"),
        ("bf17", ValueError, "must be a floating dtype or int8, got 'bf17'"),
        (None, TypeError, "must be a floating dtype or int8, got None"),
        ("float8_e5m2", ValueError, "fp8 format this transformation does not store.*float8_e4m3fn"),
        (jnp.float64, ValueError, "wider than the float32"),
    ]:
        with pytest.raises(err, match=f"low_precision_state dtype.*{msg}.*accepted: bfloat16"):
            low_precision_state(adam, bad)
    with pytest.raises(
        ValueError, match="rounding must be 'stochastic' or 'kahan' with dtype bfloat16, got 'nearest'"
    ):
        low_precision_state(adam, rounding="nearest")
    with pytest.raises(ValueError, match="only used with rounding='stochastic'"):
        low_precision_state(adam, rounding="kahan", key=KEY)
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation.*got str"):
        low_precision_state("adam")
    with pytest.raises(TypeError, match="expects a LowPrecisionState, got ScaleByAdamState"):
        low_precision_state(adam).update({"w": jnp.ones(1)}, adam.init({"w": jnp.ones(1)})[0])
    assert (
        low_precision_state(adam, "bf16").init({"w": jnp.ones(1)}).low_precision_inner_state[0].mu["w"].dtype
        == jnp.bfloat16
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_state_made_by_another_optimizer_is_refused_naming_it_and_how_to_restore(jit):
    params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
    grads = {"w": jnp.full((64, 128), 0.1), "b": jnp.ones(128)}
    adam = optax.adam(1e-3)
    eight, sixteen = low_precision_state(optax.adam(1e-3), "int8"), low_precision_state(optax.adam(1e-3))
    restored_without_target = eight.init(params)._asdict()  # orbax without a target gives dicts
    how = r"restore it with that optimizer's tx.init\(params\) \(or jax.eval_shape\(tx.init, params\)\)"
    for tx, state, got in [
        (eight, adam.init(params), r"tuple \(ScaleByAdamState, EmptyState\)"),
        (sixteen, adam.init(params), r"tuple \(ScaleByAdamState, EmptyState\)"),
        (eight, restored_without_target, r"dict with keys \[low_precision_inner_state, state_compensation"),
        (kahan_summation(wide_params="pass"), adam.init(params), r"tuple \(ScaleByAdamState, EmptyState\)"),
        (stochastic_rounding(KEY, wide_params="pass"), None, "NoneType"),
    ]:
        update = jax.jit(tx.update) if jit else tx.update
        with pytest.raises(
            TypeError, match=rf"update expects a \w+State, got {got}.*: a state made by another.*{how}"
        ):
            update(grads, state, params)
    # inside a chain, as a float32 Adam's chain saved it
    chained = optax.chain(eight, kahan_summation(wide_params="pass"))
    update = jax.jit(chained.update) if jit else chained.update
    with pytest.raises(TypeError, match=r"low_precision_state.update expects a LowPrecisionState, got tuple"):
        update(grads, optax.chain(adam, kahan_summation(wide_params="pass")).init(params), params)
    # an 8-bit state given to a 16-bit one (was: "can't multiply sequence by non-int of type 'float'")
    update = jax.jit(sixteen.update) if jit else sixteen.update
    with pytest.raises(
        TypeError,
        match=r"low_precision_inner_state\[0\]\.mu\['w'\] is an 8-bit QuantizedArray.*stores bfloat16",
    ):
        update(grads, eight.init(params), params)


# --- composition: loss_scaling, MultiSteps, pmap, sharded jit, orbax --------------------------------

CONFIGS = {
    "kahan": lambda: optax.chain(optax.sgd(0.05, momentum=0.9), kahan_summation()),
    "stochastic": lambda: optax.chain(optax.sgd(0.05, momentum=0.9), stochastic_rounding(KEY)),
    "state+kahan": lambda: optax.chain(low_precision_state(optax.adam(1e-2)), kahan_summation()),
    "kahan-state+stochastic": lambda: optax.chain(
        low_precision_state(optax.adam(1e-2), rounding="kahan"), stochastic_rounding(KEY)
    ),
}


@pytest.mark.composition
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("skip,dtype", [("cond", jnp.bfloat16), ("select", jnp.float16)])
def test_injected_inf_steps_equal_omitting_those_batches(config, skip, dtype):
    params = mlp_params(jax.random.key(0), dtype=dtype)
    xs, ys = batches(jax.random.key(1), 8)
    bad = {2, 5}
    poisoned = xs.at[jnp.array(sorted(bad)), 0, 0].set(jnp.inf)

    tx = loss_scaling(CONFIGS[config](), DynamicLossScale(2.0**15, period=2), skip=skip)
    step = jax.jit(make_step(tx))

    def run(steps):
        p, s = params, tx.init(params)
        for x, y in steps:
            before = (p, without_loss_scale(s))
            p, s = step(p, s, (x, y))
            if not bool(
                jmp_lite.get_loss_scaling_state(s).last_grads_finite
            ):  # the skipped step: nothing moved
                assert_trees_bitwise_equal((p, without_loss_scale(s)), before)
        return p, s

    p_a, s_a = run([(poisoned[i], ys[i]) for i in range(8)])
    p_b, s_b = run([(xs[i], ys[i]) for i in range(8) if i not in bad])
    assert int(jmp_lite.get_loss_scaling_state(s_a).skipped_total) == 2
    assert_trees_bitwise_equal(p_a, p_b)
    assert_trees_bitwise_equal(without_loss_scale(s_a), without_loss_scale(s_b))
    assert p_a[0]["w"].dtype == dtype


@pytest.mark.composition
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_multisteps_of_identical_microbatches_equals_one_step(config):
    params = mlp_params(jax.random.key(0), dtype=jnp.bfloat16)
    xs, ys = batches(jax.random.key(1), 3)

    def run(tx, repeat):
        p, s = params, tx.init(params)

        @jax.jit
        def step(p, s, b):
            g = jax.grad(mlp_loss)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        for i in range(3):
            for _ in range(repeat):
                p, s = step(p, s, (xs[i], ys[i]))
        return p, s

    p_one, s_one = run(CONFIGS[config](), 1)
    p_multi, s_multi = run(optax.MultiSteps(CONFIGS[config](), every_k_schedule=2), 2)
    assert_trees_bitwise_equal(p_multi, p_one)
    assert_trees_bitwise_equal(s_multi.inner_opt_state, s_one)


def pmap_placement(n):
    """Where pmap(axis_name="d") puts its outputs, and a jitted stack of n copies of a tree put there.

    pmap compiles for the shardings of its inputs: inputs already where its outputs go (split over a mesh
    axis named after axis_name) compile the step once, not again at the second step, and are not split up
    by small eager programs at every call.
    """
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
    stack = lambda t: jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), t)  # noqa: E731
    return sharding, jax.jit(stack, out_shardings=sharding)


@pytest.mark.composition
@pytest.mark.parametrize("config", ["state+kahan", "kahan-state+stochastic"])  # all three, both roundings
def test_pmap_replicas_agree_and_match_one_device(config):
    n = jax.device_count()
    assert n == 8
    params = mlp_params(jax.random.key(0), dtype=jnp.bfloat16)
    xs, ys = batches(jax.random.key(1), 3 * n)
    xs, ys = np.asarray(xs).reshape(3, n, *xs.shape[1:]), np.asarray(ys).reshape(3, n, *ys.shape[1:])
    tx = loss_scaling(CONFIGS[config](), DynamicLossScale(2.0**15), axis_name="d")

    def step(p, s, b, reduce):
        ls = jmp_lite.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(mlp_loss(q, b)))(p)
        g = jax.lax.pmean(g, "d") if reduce else g
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    # Both runs in one program (one pmap compile, not two): replicas fed different batches with the
    # gradients reduced, and replicas fed the same batch with nothing reduced.
    pstep = jax.pmap(
        lambda a, b, batch_a, batch_b: (step(*a, batch_a, True), step(*b, batch_b, False)), axis_name="d"
    )
    sharding, rep = pmap_placement(n)
    runs = rep(((params, tx.init(params)),) * 2)
    for i in range(3):
        runs = pstep(*runs, jax.device_put((xs[i], ys[i]), sharding), rep((xs[i, 0], ys[i, 0])))
    for leaf in jax.tree_util.tree_leaves(runs):
        leaf = np.asarray(leaf)  # one transfer, not a dispatch per replica
        for r in range(1, n):
            np.testing.assert_array_equal(
                np.atleast_1d(leaf[r]).view(np.uint8), np.atleast_1d(leaf[0]).view(np.uint8)
            )
    # Every replica fed the same batch (the second run) equals a one-device run.
    tx_one = loss_scaling(CONFIGS[config](), DynamicLossScale(2.0**15))
    q, t = params, tx_one.init(params)
    step_one = jax.jit(make_step(tx_one))
    for i in range(3):
        q, t = step_one(q, t, (xs[i, 0], ys[i, 0]))
    assert_trees_bitwise_equal(jax.tree_util.tree_map(lambda x: np.asarray(x)[0], runs[1]), (q, t))


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_vmap_over_an_ensemble_equals_a_loop():
    rng = np.random.default_rng(6)
    params = {"w": jnp.asarray(rng.standard_normal((3, 16)), jnp.bfloat16)}  # three members
    grads = {"w": jnp.asarray(rng.standard_normal((3, 16)) * 1e-2, jnp.bfloat16)}
    for last in (kahan_summation(), stochastic_rounding(KEY)):
        tx = optax.chain(low_precision_state(optax.adam(1e-3)), last)

        def step(p, g, tx=tx):
            s = tx.init(p)
            for _ in range(2):
                u, s = tx.update(g, s, p)
                p = optax.apply_updates(p, u)
            return p, s

        batched = jax.jit(jax.vmap(step))(params, grads)
        one = jax.jit(step)
        for i in range(3):
            member = jax.tree_util.tree_map(lambda x, i=i: x[i], (params, grads, batched))
            assert_trees_bitwise_equal(member[2], one(*member[:2]))


@pytest.mark.composition
def test_sharded_jit_stochastic_rounding_matches_one_device():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    params = {"w": jnp.ones((64, 16), jnp.bfloat16)}
    grads = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((64, 16)) * 1e-3, jnp.bfloat16)}
    tx = optax.chain(low_precision_state(optax.adam(1e-3)), stochastic_rounding(KEY))

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    one = jax.jit(step)(params, tx.init(params), grads)
    p_sh, g_sh = jax.device_put((params, grads), sharded)
    many = jax.jit(step)(p_sh, tx.init(p_sh), g_sh)
    assert many[0]["w"].sharding.is_equivalent_to(sharded, 2)
    assert_trees_bitwise_equal(jax.device_get(many), jax.device_get(one))


@pytest.mark.composition
def test_orbax_restore_then_continue_is_bitwise_equal(tmp_path):
    params = mlp_params(jax.random.key(0), dtype=jnp.bfloat16)
    xs, ys = batches(jax.random.key(1), 8)
    tx = loss_scaling(
        optax.chain(
            low_precision_state(optax.adam(1e-2), rounding="kahan"),
            low_precision_state(optax.scale(1.0)),  # an inner state without arrays
            kahan_summation(),
        ),
        DynamicLossScale(2.0**15),
    )
    tx_sr = loss_scaling(
        optax.chain(low_precision_state(optax.adam(1e-2), key=jax.random.key(4)), stochastic_rounding(KEY)),
        DynamicLossScale(2.0**15),
    )
    step, step_sr = jax.jit(make_step(tx)), jax.jit(make_step(tx_sr))
    # Committed to a device, as the restored arrays come back: the steps compile once, not again for them.
    state = jax.device_put(((params, tx.init(params)), (params, tx_sr.init(params))), jax.devices()[0])
    for i in range(4):
        state = (step(*state[0], (xs[i], ys[i])), step_sr(*state[1], (xs[i], ys[i])))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()
    uninterrupted = state
    for i in range(4, 8):
        uninterrupted = (step(*uninterrupted[0], (xs[i], ys[i])), step_sr(*uninterrupted[1], (xs[i], ys[i])))
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
    assert_trees_bitwise_equal(restored, state)
    for i in range(4, 8):
        restored = (step(*restored[0], (xs[i], ys[i])), step_sr(*restored[1], (xs[i], ys[i])))
    assert_trees_bitwise_equal(restored, uninterrupted)
