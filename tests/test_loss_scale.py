"""Loss scales: semantics, pytree behaviour, a reference model, and jmp parity."""

import dataclasses

import flax.serialization
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec

import jmp_lite
import jmp_lite.flax  # noqa: F401  (registers the loss scales with flax.serialization)
from jmp_lite import DynamicLossScale, NoOpLossScale, StaticLossScale

pytestmark = pytest.mark.unit


def leaves_f32_i32(ls):
    assert ls.loss_scale.dtype == jnp.float32 and ls.loss_scale.shape == ()
    assert ls.counter.dtype == jnp.int32 and ls.counter.shape == ()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.int32])
@pytest.mark.filterwarnings("ignore:Expected floating type")  # the int32 case warns, as jmp
def test_scale_and_counter_dtypes_whatever_is_passed(dtype):
    ls = DynamicLossScale(jnp.asarray(2**10, dtype), counter=np.int64(3))
    leaves_f32_i32(ls)
    leaves_f32_i32(ls.adjust(jnp.bool_(True)))
    leaves_f32_i32(jax.jit(lambda s: s.adjust(jnp.bool_(False)))(ls))


def test_only_scale_and_counter_are_leaves():
    ls = DynamicLossScale(2.0**15, period=7, factor=4, min_loss_scale=2.0, max_loss_scale=2.0**20)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter"]
    assert jax.tree_util.tree_leaves(NoOpLossScale()) == []
    assert len(jax.tree_util.tree_leaves(StaticLossScale(4.0))) == 1


def test_hyperparameters_survive_jit_pmap_scan_tree_map():
    ls = DynamicLossScale(8.0, period=3, factor=4, min_loss_scale=2.0, max_loss_scale=64.0)
    hyper = lambda s: (s.period, s.factor, s.min_loss_scale, s.max_loss_scale)
    assert hyper(jax.jit(lambda s: s)(ls)) == hyper(ls)
    assert hyper(jax.tree_util.tree_map(lambda x: x, ls)) == hyper(ls)
    out, _ = jax.lax.scan(lambda s, _: (s.adjust(jnp.bool_(False)), None), ls, None, length=5)
    assert hyper(out) == hyper(ls)
    assert float(out.loss_scale) == 2.0  # jmp loses min_loss_scale here and reaches 1/128
    n = jax.device_count()
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), ls)
    pm = jax.pmap(lambda s: s.adjust(jnp.bool_(False)))(stacked)
    assert hyper(pm) == hyper(ls) and np.all(np.asarray(pm.loss_scale) == 2.0)


def test_unflatten_does_not_validate():
    ls = DynamicLossScale(2.0**15)
    assert jax.tree_util.tree_map(lambda _: None, ls).loss_scale is None
    specs = jax.tree_util.tree_map(lambda _: PartitionSpec(), ls)
    assert specs.counter == PartitionSpec()
    jax.jit(lambda s: s.adjust(jnp.bool_(True))).lower(ls)  # raises in jmp 0.0.4 on jax 0.10
    sds = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ls)
    assert jax.eval_shape(lambda s: s.adjust(jnp.bool_(True)), sds).counter.dtype == jnp.int32


def test_flax_serialization_round_trip():
    ls = DynamicLossScale(2.0**12, counter=2, period=9, factor=2, min_loss_scale=4.0, max_loss_scale=2.0**20)
    state = {"ls": ls, "static": StaticLossScale(3.0), "noop": NoOpLossScale()}
    raw = flax.serialization.to_bytes(state)
    # Saved and target values all differ, so the test tells which one each restored field came from:
    # the arrays (scale, counter) come from the bytes, the static hyperparameters from the target
    # (docs/checkpoints.md).
    target = {
        "ls": DynamicLossScale(2.0**15, period=5, factor=4, min_loss_scale=2.0, max_loss_scale=2.0**22),
        "static": StaticLossScale(1.0),
        "noop": NoOpLossScale(),
    }
    back = flax.serialization.from_bytes(target, raw)
    assert float(back["ls"].loss_scale) == 2.0**12 and int(back["ls"].counter) == 2
    assert float(back["static"].loss_scale) == 3.0
    hyper = lambda s: (s.period, s.factor, s.min_loss_scale, s.max_loss_scale)
    # none of the target's values is a default, so a restore falling back to defaults fails too
    assert hyper(back["ls"]) == hyper(target["ls"]) == (5, 4.0, 2.0, 2.0**22) != hyper(ls)
    leaves_f32_i32(back["ls"])


def test_flax_serialization_round_trip_of_a_pmap_replicated_loss_scaling_state():
    n = jax.local_device_count()
    tx = jmp_lite.loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10, period=3), axis_name="d")
    state = tx.init({"w": jnp.ones(3)})
    state = state._replace(loss_scale=state.loss_scale.adjust(jnp.bool_(True)))  # counter 1: not the default
    replicate = jax.pmap(lambda s: s, axis_name="d")
    replicated = replicate(jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state))
    back = flax.serialization.from_bytes(replicated, flax.serialization.to_bytes(replicated))
    assert back.loss_scale.loss_scale.shape == (n,) and back.loss_scale.counter.shape == (n,)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), back, replicated))
    step = jax.pmap(lambda g, s: tx.update(g, s, {"w": jnp.ones(3)}), axis_name="d")
    step({"w": jnp.ones((n, 3))}, back)  # the restored state runs under pmap
    # replicas that disagree, and a layout other than the target's, are refused by name
    split = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.arange(1.0, n + 1.0) if "loss_scale" in jax.tree_util.keystr(path[-1:]) else a,
        replicated,
    )
    with pytest.raises(ValueError, match="different values across its"):
        flax.serialization.from_bytes(replicated, flax.serialization.to_bytes(split))
    with pytest.raises(ValueError, match=r"has shape \(\), but the restore target's has shape"):
        flax.serialization.from_bytes(replicated, flax.serialization.to_bytes(state))
    rep_static = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n,)), {"s": StaticLossScale(4.0)})
    back_static = flax.serialization.from_bytes(rep_static, flax.serialization.to_bytes(rep_static))["s"]
    assert back_static.loss_scale.shape == (n,) and float(back_static.loss_scale[0]) == 4.0


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(loss_scale=0.0), ValueError, "positive"),
        (dict(loss_scale=float("inf")), ValueError, "not a finite float32"),
        (dict(loss_scale=float("nan")), ValueError, "not a finite float32"),
        (dict(loss_scale=1e39), ValueError, "not a finite float32"),
        (dict(loss_scale=1 + 5j), TypeError, "real number"),
        (dict(loss_scale="2"), TypeError, "real number"),
        (dict(loss_scale=jnp.complex64(2)), TypeError, "real number"),
        (dict(loss_scale=2.0**30), ValueError, "outside"),
        (dict(loss_scale=0.5), ValueError, "outside"),
        (dict(loss_scale=jnp.ones(2)), ValueError, "scalar"),
        (dict(loss_scale=True), TypeError, "real number"),
        (dict(loss_scale=8.0, period=2**31), ValueError, r"period must be a whole number in \[1, 2147"),
        (dict(loss_scale=8.0, period="7"), TypeError, "period must be a real number"),
        (dict(loss_scale=8.0, factor="2"), TypeError, "factor must be a real number"),
        (dict(loss_scale=8.0, factor=2 + 0j), TypeError, "factor must be a real number"),
        (dict(loss_scale=8.0, factor=1 + 1e-9), ValueError, "1.0 in float32"),
        (dict(loss_scale=8.0, min_loss_scale=1e-45), ValueError, "subnormal"),
        (dict(loss_scale=8.0, min_loss_scale=1e-46), ValueError, "subnormal"),
        (dict(loss_scale=8.0, min_loss_scale=-1.0), ValueError, "negative"),
        (dict(loss_scale=1.3, min_loss_scale=1.3, max_loss_scale=1.3), ValueError, "float32 value between"),
        (dict(loss_scale=8.0, period=0), ValueError, "period"),
        (dict(loss_scale=8.0, period=2.5), ValueError, "period"),
        (dict(loss_scale=8.0, factor=1), ValueError, "factor"),
        (dict(loss_scale=8.0, min_loss_scale=16.0, max_loss_scale=8.0), ValueError, "max_loss_scale"),
        (dict(loss_scale=8.0, max_loss_scale=float("inf")), ValueError, "finite"),
        (dict(loss_scale=8.0, counter=1.5), ValueError, "counter"),
        (dict(loss_scale=8.0, counter=-1), ValueError, r"counter must be a whole number in \[0, 1999\]"),
        (
            dict(loss_scale=8.0, counter=5, period=5),
            ValueError,
            r"counter must be a whole number in \[0, 4\]",
        ),
    ],
)
def test_bad_construction_is_a_clear_error(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        DynamicLossScale(**kwargs)


def test_static_rejects_bad_scale_and_adjust_rejects_non_scalar():
    with pytest.raises(ValueError, match="positive"):
        StaticLossScale(-1.0)
    with pytest.raises(ValueError, match="boolean scalar"):
        DynamicLossScale(2.0).adjust(jnp.array([True, False]))
    with pytest.raises(ValueError, match="boolean scalar"):
        jmp_lite.select_tree(jnp.array([True]), jnp.ones(1), jnp.zeros(1))


# --- reference model --------------------------------------------------------


def reference(scale, counter, period, factor, lo, hi, finite_seq):
    """Plain-Python dynamic loss scaling, written from the documented math."""
    out = []
    for finite in finite_seq:
        if finite:
            if counter == period - 1:
                grown = scale * factor
                scale = min(grown, hi) if np.isfinite(np.float32(grown)) else scale
            counter = (counter + 1) % period
        else:
            scale = max(scale / factor, lo)
            counter = 0
        out.append((scale, counter))
    return out


# the first case is the fast tier's, the other CI's system tier's (a unit or property test's later cases)
@pytest.mark.property
@pytest.mark.parametrize("examples", [40, 150])
def test_trajectory_matches_reference_and_stays_in_bounds(examples):
    drawn = given(
        seq=st.lists(st.booleans(), min_size=1, max_size=60),
        period=st.integers(1, 5),
        factor=st.sampled_from([2, 3, 4, 1.5]),
        lo_exp=st.integers(-3, 4),
        span=st.integers(0, 12),
        start=st.floats(0, 1),
    )
    settings(max_examples=examples, deadline=None)(drawn(trajectory_matches_reference))()


def trajectory_matches_reference(seq, period, factor, lo_exp, span, start):
    lo, hi = 2.0**lo_exp, 2.0 ** (lo_exp + span)
    init = float(np.float32(lo * (hi / lo) ** start))
    ls = DynamicLossScale(init, period=period, factor=factor, min_loss_scale=lo, max_loss_scale=hi)

    def step(s, finite):
        s = s.adjust(finite)
        return s, (s.loss_scale, s.counter)

    _, (scales, counters) = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(ls, jnp.array(seq))
    expected = reference(init, 0, period, factor, lo, hi, seq)
    np.testing.assert_allclose(np.asarray(scales), [e[0] for e in expected], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(counters), [e[1] for e in expected])
    scales = np.asarray(scales)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert np.all(scales >= np.float32(lo)) and np.all(scales <= np.float32(hi))


def test_scale_stays_finite_at_float32_limit():
    big = float(np.finfo(np.float32).max)
    ls = DynamicLossScale(big / 2, period=1, max_loss_scale=big)
    for _ in range(3):
        ls = ls.adjust(jnp.bool_(True))
    assert np.isfinite(float(ls.loss_scale)) and float(ls.loss_scale) <= big


# --- jmp parity -------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)


def run_both(seq, period, factor, start):
    ours = DynamicLossScale(jnp.float32(start), period=period, factor=factor, max_loss_scale=F32_MAX)
    theirs = jmp.DynamicLossScale(jnp.float32(start), period=period, factor=factor)
    out = []
    for f in seq:
        ours, theirs = ours.adjust(jnp.bool_(f)), theirs.adjust(jnp.bool_(f))
        out.append(
            ((float(ours.loss_scale), int(ours.counter)), (float(theirs.loss_scale), int(theirs.counter)))
        )
    return out


@pytest.mark.property
@given(seq=st.lists(st.booleans(), max_size=150), period=st.integers(1, 4), factor=st.sampled_from([2, 4]))
@settings(max_examples=60, deadline=None)
def test_adjust_matches_jmp(seq, period, factor):
    for ours, theirs in run_both(seq, period, factor, 2.0**15):
        assert ours == theirs


@pytest.mark.parametrize("cls", ["StaticLossScale", "DynamicLossScale"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_scale_unscale_match_jmp_bitwise(cls, dtype):
    tree = {"a": jnp.linspace(-3, 3, 11).astype(dtype), "b": jnp.float32(0.1)}
    ours = getattr(jmp_lite, cls)(2.0**13)
    theirs = getattr(jmp, cls)(2.0**13)
    strong = getattr(jmp_lite, cls)(jnp.float32(2.0**13)), getattr(jmp, cls)(jnp.float32(2.0**13))
    # A Python float keeps half leaves half (weak typing), a float32 array promotes them: as jmp.
    dtypes = lambda t: jax.tree_util.tree_map(lambda x: x.dtype, t)
    for mine, jmps in ((ours, theirs), strong):
        for fn in ("scale", "unscale"):
            a, b = getattr(mine, fn)(tree), getattr(jmps, fn)(tree)
            jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
            assert dtypes(a) == dtypes(b)
    assert getattr(jmp_lite, cls)(2.0**13).scale(tree)["a"].dtype == dtype
    assert strong[0].scale(tree)["a"].dtype == jnp.float32
    noop_tree = NoOpLossScale().scale(tree)
    assert noop_tree is jmp.NoOpLossScale().scale(tree)
    assert NoOpLossScale().loss_scale == jmp.NoOpLossScale().loss_scale


def test_all_finite_and_select_tree_match_jmp():
    trees = [
        {"a": jnp.ones(3), "b": jnp.arange(2)},
        {"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)},
        {"a": jnp.array([jnp.inf], jnp.float16)},
        {},
    ]
    for t in trees:
        assert bool(jmp_lite.all_finite(t)) == bool(jmp.all_finite(t))
        assert bool(jax.jit(jmp_lite.all_finite)(t)) == bool(jmp.all_finite(t))
    a, b = {"x": jnp.ones(2)}, {"x": jnp.zeros(2)}
    for pred in (True, False):
        np.testing.assert_array_equal(
            jmp_lite.select_tree(jnp.bool_(pred), a, b)["x"], jmp.select_tree(jnp.bool_(pred), a, b)["x"]
        )


def test_documented_fixes_over_jmp():
    # 1. f16/bf16 scales: jmp raises in adjust; we store float32.
    with pytest.raises(TypeError):
        jmp.DynamicLossScale(jnp.float16(2**15)).adjust(jnp.bool_(False))
    assert float(DynamicLossScale(jnp.float16(2**15)).adjust(jnp.bool_(False)).loss_scale) == 2.0**14
    # 2. min_loss_scale survives jit (jmp resets it to 1.0).
    f = jax.jit(lambda s: s)
    assert float(f(jmp.DynamicLossScale(jnp.float32(8), min_loss_scale=jnp.float32(4))).min_loss_scale) == 1.0
    assert f(DynamicLossScale(8.0, min_loss_scale=4.0)).min_loss_scale == 4.0
    # 3. a max: the scale stops growing at max_loss_scale.
    ls = DynamicLossScale(2.0**23, period=1)
    for _ in range(3):
        ls = ls.adjust(jnp.bool_(True))
    assert float(ls.loss_scale) == 2.0**24


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_vmap_over_finiteness(dtype):
    ls = DynamicLossScale(jnp.asarray(2**10, dtype), period=1)
    out = jax.vmap(lambda f: ls.adjust(f).loss_scale)(jnp.array([True, False]))
    np.testing.assert_array_equal(out, [2.0**11, 2.0**9])


def test_scale_of_half_loss_promotes_like_jmp():
    loss = jnp.float16(3.0)  # 3 * 2**15 overflows float16 but not float32
    weak = DynamicLossScale(2.0**15)  # as jmp: a Python float keeps a float16 loss float16
    assert weak.scale(loss).dtype == jnp.float16 and not np.isfinite(float(weak.scale(loss)))
    assert weak.adjust(jnp.bool_(True)).scale(loss).dtype == jnp.float32  # as jmp after adjust
    ls = DynamicLossScale(jnp.float32(2.0**15))
    assert ls.scale(loss).dtype == jnp.float32 and np.isfinite(float(ls.scale(loss)))
    grad = jax.grad(lambda x: ls.scale(x.astype(jnp.float16) ** 2))(jnp.float32(0.001))
    assert np.isfinite(float(grad)) and float(ls.unscale(grad)) == pytest.approx(0.002, rel=1e-3)


def test_repr_and_replace():
    ls = DynamicLossScale(4.0, period=3)
    assert "period=3" in repr(ls)
    assert dataclasses.replace(ls, period=5).period == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        ls.period = 4  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_matches_numpy_on_edge_values(dtype):
    info = jnp.finfo(dtype)
    edges = [
        0.0,
        -0.0,
        float(info.tiny),
        float(info.smallest_subnormal),
        float(info.max),
        -float(info.max),
        1.0,
    ]
    rng = np.random.default_rng(0)
    for bad in (None, np.inf, -np.inf, np.nan):
        for pos in range(3):
            values = np.array(rng.permutation(edges), np.float32)
            if bad is not None:
                values[pos] = bad
            tree = {"x": jnp.asarray(values, dtype), "i": jnp.arange(3), "n": None}
            expected = bool(np.all(np.isfinite(values)))
            assert bool(jmp_lite.all_finite(tree)) is expected
            assert bool(jax.jit(jmp_lite.all_finite)(tree)) is expected
    # many max-magnitude values: a plain sum would overflow, the check must not
    assert bool(jmp_lite.all_finite(jnp.full(10_000, info.max, dtype)))
    assert bool(jmp_lite.all_finite({"only_ints": jnp.arange(4)}))


def test_bounds_hold_in_float32_the_dtype_the_scale_lives_in():
    # 100000005 is not a float32; the nearest one (100000008) would be crossed.
    ls = DynamicLossScale(2.0**26, period=1, max_loss_scale=100000005)
    assert ls.max_loss_scale == 1e8 and ls.max_loss_scale <= 100000005
    for _ in range(3):
        ls = ls.adjust(jnp.bool_(True))
    assert float(ls.loss_scale) == 1e8
    ls = DynamicLossScale(1.3, min_loss_scale=1.3, period=1)  # equal bounds as written are accepted
    assert float(ls.loss_scale) >= 1.3 and ls.min_loss_scale == float(ls.loss_scale)
    assert float(ls.adjust(jnp.bool_(False)).loss_scale) >= 1.3
    assert DynamicLossScale(2.0, factor=1 + 2**-23).factor == 1 + 2**-23


@pytest.mark.parametrize("min_loss_scale", [0, 0.0, np.float32(0)])
@pytest.mark.filterwarnings("ignore:Expected floating type")  # the int 0 warns, as in jmp
def test_min_zero_stops_at_the_smallest_normal_float32_never_zero(min_loss_scale):
    step = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
    ls = DynamicLossScale(1.0, min_loss_scale=min_loss_scale)
    for _ in range(200):
        ls = step(ls)
    assert float(ls.loss_scale) == float(np.finfo(np.float32).tiny)
    assert float(ls.loss_scale * 2**10) > 0  # still recovers: growth multiplies a nonzero scale


def test_python_ints_and_numpy_ints_are_accepted_where_jmp_accepts_them():
    assert float(StaticLossScale(2**32).loss_scale) == 2.0**32  # a Python int is not an int32
    with pytest.raises(ValueError, match="not representable"):
        StaticLossScale(10**400)
    ls = DynamicLossScale(8.0, period=np.int64(5), factor=np.int32(2), counter=np.int16(4))
    assert (ls.period, ls.factor, int(ls.counter)) == (5, 2, 4)
    assert DynamicLossScale(8.0, period=5.0).period == 5  # jmp's own tests pass period=5.
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        DynamicLossScale(2**15)  # as jmp: an int scale warns and is used as float32


def test_construction_checks_hold_under_jit_and_pmap():
    with pytest.raises(ValueError, match="positive"):
        jax.jit(lambda: StaticLossScale(-4.0))()
    with pytest.raises(ValueError, match="outside"):
        jax.pmap(lambda x: DynamicLossScale(2.0**30).loss_scale)(jnp.ones(jax.local_device_count()))
    with pytest.raises(ValueError, match="counter must be a whole number in"):
        jax.jit(lambda: DynamicLossScale(2.0, counter=7, period=3))()
    # Traced values cannot be checked in Python: a dynamic scale and counter are clamped with jnp,
    # an invalid static scale becomes NaN (every step's loss is NaN and is skipped).
    dyn = jax.jit(lambda x, c: DynamicLossScale(x, counter=c, period=3))
    for x, want in ((2.0**30, 2.0**24), (-1.0, 1.0), (jnp.nan, 2.0**24), (8.0, 8.0)):
        out = dyn(jnp.float32(x), jnp.int32(9))
        assert float(out.loss_scale) == want and int(out.counter) == 2
    static = jax.jit(lambda x: StaticLossScale(x).loss_scale)
    assert np.isnan(static(-4.0)) and np.isnan(static(jnp.inf)) and float(static(4.0)) == 4.0


def test_equality_is_by_value_as_in_jmp():
    a = DynamicLossScale(jnp.float32(8.0), period=3)
    assert jax.tree_util.tree_map(lambda x: x, a) == a
    assert a != DynamicLossScale(jnp.float32(8.0), period=4)
    assert a != a.adjust(jnp.bool_(True))
    assert StaticLossScale(2.0) == StaticLossScale(jnp.float32(2.0)) != StaticLossScale(4.0)
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)
    with pytest.raises(ValueError, match="expected boolean scalar") as info:
        jmp_lite.select_tree(jnp.ones([1]), None, None)
    assert isinstance(info.value, AssertionError)  # the type jmp raises, too


def _grows_after(period):
    """DynamicLossScale(period=...) observed: how many finite steps until the scale doubles."""
    ls = DynamicLossScale(8.0, period=period)
    for step in range(1, 10):
        ls = ls.adjust(jnp.bool_(True))
        if float(ls.loss_scale) == 16.0:
            return step


def _skip_limit_after(max_consecutive_skips):
    """loss_scaling(max_consecutive_skips=...) observed: how many skips in a row reach the limit."""
    tx = jmp_lite.loss_scaling(
        optax.sgd(1.0), StaticLossScale(1.0), max_consecutive_skips=max_consecutive_skips
    )
    state = tx.init(jnp.zeros(1))
    for step in range(1, 10):
        state = tx.update(jnp.array([jnp.nan]), state)[1]
        if bool(state.skip_limit_reached):
            return step


COUNTS = {"DynamicLossScale.period": _grows_after, "loss_scaling.max_consecutive_skips": _skip_limit_after}


@pytest.mark.parametrize("what", sorted(COUNTS))
def test_count_arguments_take_python_and_numpy_ints_and_refuse_the_rest_by_name(what):
    # A whole float is the same count everywhere: jmp's own tests pass period=5.
    for ok in (3, np.int64(3), np.int32(3), np.uint8(3), 3.0, np.float32(3.0)):
        assert COUNTS[what](ok) == 3, (what, ok)
    # 2**31: the counters these are compared with are int32
    for bad in (0, -1, 2.5, 2**31, True, np.bool_(True), "3", None):
        with pytest.raises((TypeError, ValueError), match=what.rsplit(".", 1)[1]):
            COUNTS[what](bad)
