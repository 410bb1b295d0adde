"""FP8 recipes, contractions and their state: jmp_lite.Fp8Recipe and jmp_lite.fp8."""

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _jaxpr import eqns
from jax import lax

import jmp_lite
from jmp_lite import Fp8Recipe, fp8, get_fp8_recipe

pytestmark = pytest.mark.unit

F32 = np.dtype(jnp.float32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
DTYPES = [F32, np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]
HALVES = DTYPES[1:]
MATMUL = (((1,), (0,)), ((), ()))


def rand(key, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def bits(tree):
    """Every leaf as raw bytes: equal bits, not merely equal values (0.0 vs -0.0, NaN payloads)."""
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def dots(jaxpr):
    """(operand dtypes, preferred_element_type) of every dot_general in the program."""
    return [
        (tuple(np.dtype(v.aval.dtype) for v in e.invars), e.params.get("preferred_element_type"))
        for e in eqns(jaxpr)
        if e.primitive.name == "dot_general"
    ]


# ---------------------------------------------------------------------------------------------------------
# The recipe


def test_recipe_defaults_equality_hash_immutability_and_pickle():
    r = Fp8Recipe()
    assert (r.formats, r.scaling, r.amax_history, r.margin, r.amax_reduce) == (
        "hybrid",
        "delayed",
        1024,
        0,
        "max",
    )
    assert (r.forward_dtype, r.backward_dtype, r.forward_max, r.backward_max) == (E4M3, E5M2, 448.0, 57344.0)
    e4 = Fp8Recipe("E4M3", " Current ")  # case and spaces are normalised
    assert (e4.backward_dtype, e4.backward_max, e4.history_length) == (E4M3, 448.0, 1)
    assert Fp8Recipe(amax_history=np.int64(16)) == Fp8Recipe("hybrid", "delayed", amax_history=16)
    assert hash(Fp8Recipe(margin=1)) == hash(Fp8Recipe(margin=1)) != hash(Fp8Recipe())
    assert len({Fp8Recipe(), Fp8Recipe(), Fp8Recipe(scaling="current")}) == 2
    assert Fp8Recipe() != "hybrid,delayed"
    with pytest.raises(dataclasses.FrozenInstanceError, match="margin"):
        r.margin = 2
    with pytest.raises(dataclasses.FrozenInstanceError, match="formats"):
        del r.formats
    assert pickle.loads(pickle.dumps(e4)) == e4
    assert b"_src" not in pickle.dumps(e4)  # pickles name the public class only
    assert r.replace(margin=2, scaling="current") == Fp8Recipe("hybrid", "current", margin=2)
    with pytest.raises(TypeError, match="no field"):
        r.replace(history=3)
    # hashable, so a valid static argument: one compile per recipe
    f = jax.jit(lambda x, recipe: x * recipe.forward_max, static_argnums=1)
    assert float(f(jnp.ones(()), Fp8Recipe())) == 448.0


ALL_RECIPES = [
    Fp8Recipe(f, s, amax_history=h, margin=m, amax_reduce=a)
    for f in ("hybrid", "e4m3")
    for s in ("current", "delayed")
    for h, m, a in ((1024, 0, "max"), (3, 2, "most_recent"))
]


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=str)
def test_recipe_string_and_repr_round_trip(recipe):
    assert get_fp8_recipe(str(recipe)) == recipe
    assert eval(repr(recipe), {"Fp8Recipe": Fp8Recipe}) == recipe
    assert repr(recipe).startswith("Fp8Recipe(formats=")


def test_recipe_strings():
    assert get_fp8_recipe("hybrid") == Fp8Recipe()
    assert get_fp8_recipe(" Current , e4m3 ") == Fp8Recipe("e4m3", "current")
    assert get_fp8_recipe("delayed,amax_history=16,reduce=most_recent,margin=1") == Fp8Recipe(
        amax_history=16, amax_reduce="most_recent", margin=1
    )
    assert get_fp8_recipe("formats=e4m3,scaling=current") == Fp8Recipe("e4m3", "current")
    bad = {
        "": "empty",
        "e5m2": "unknown part 'e5m2'",
        "hybrid,e4m3": "formats is given twice",
        "history=0": "amax_history must be an int >= 1",
        "margin=-1": "margin must be a non-negative integer",
        "history=1.5": "history must be a non-negative integer",
        "reduce=mean": "amax_reduce must be one of 'max', 'most_recent'",
        "speed=fast": "unknown part 'speed=fast'",
        "history=": "malformed",
    }
    for spec, message in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            get_fp8_recipe(spec)
        if spec not in ("history=0", "reduce=mean"):
            assert "'hybrid' or 'e4m3'" in str(info.value), "the message lists what is accepted"
    with pytest.raises(TypeError, match="expects a str"):
        get_fp8_recipe(Fp8Recipe())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"formats": "e5m2"}, "formats must be one of 'hybrid', 'e4m3'; got 'e5m2'"),
        ({"formats": 8}, "formats must be one of 'hybrid', 'e4m3'; got 8"),
        (
            {"scaling": "static"},
            "scaling must be one of 'current', 'delayed', 'block', 'mxfp8'; got 'static'",
        ),
        ({"amax_history": 0}, r"amax_history must be an int >= 1 \(steps of amax history\); got 0"),
        ({"amax_history": 4.0}, "amax_history must be an int >= 1"),
        ({"amax_history": True}, "amax_history must be an int >= 1"),
        ({"margin": -1}, r"margin must be an int >= 0 \(doublings of headroom\); got -1"),
        ({"amax_reduce": "sum"}, "amax_reduce must be one of 'max', 'most_recent'; got 'sum'"),
    ],
)
def test_bad_recipes_name_the_accepted_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fp8Recipe(**kwargs)


def test_float64_and_other_dtypes_are_refused_at_use():
    x = np.ones((2, 3), np.float64)  # numpy float64: no x64 mode needed to reach the check
    with pytest.raises(
        ValueError, match=r"float32, bfloat16 or float16, got float64 \(fp8 cannot serve a float64"
    ):
        fp8.dot_general(x, x.T, MATMUL, recipe="hybrid,current")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got float64"):
        fp8.dot_general(
            jnp.ones((2, 3)),
            jnp.ones((3, 2)),
            MATMUL,
            preferred_element_type=jnp.float64,
            recipe="hybrid,current",
        )
    with pytest.raises(ValueError, match="got int32"):
        fp8.dot_general(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)), MATMUL, recipe="hybrid,current")
    with pytest.raises(ValueError, match="got float8_e4m3fn"):
        fp8.einsum("ij,jk->ik", jnp.ones((2, 3), E4M3), jnp.ones((3, 2)), recipe="hybrid,current")
    with pytest.raises(TypeError, match="operand 0 is a list"):
        fp8.dot_general([[1.0]], jnp.ones((1, 1)), MATMUL, recipe="hybrid,current")
    with pytest.raises(TypeError, match="must be a jmp_lite.Fp8Recipe or a recipe string"):
        fp8.dot_general(jnp.ones((1, 1)), jnp.ones((1, 1)), MATMUL, recipe=None)


def test_state_errors_are_clear():
    recipe = Fp8Recipe(amax_history=4)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
    with pytest.raises(ValueError, match="delayed scaling needs this contraction's state"):
        fp8.dot_general(x, w, MATMUL, recipe=recipe)
    with pytest.raises(ValueError, match=r"expected \(\(3,\), \(3,\), \(3, 4\)\)"):
        fp8.dot_general(x, w, MATMUL, recipe=recipe, state=fp8.init_fp8_state(Fp8Recipe(amax_history=8)))
    with pytest.raises(TypeError, match="state must be an Fp8State"):
        fp8.dot_general(x, w, MATMUL, recipe=recipe, state={"scale": jnp.ones(3)})
    state = fp8.init_fp8_state(recipe)
    with pytest.raises(ValueError, match="keeps 4 step.* the recipe .* keeps 1024"):
        fp8.update_fp8_state(state, state, Fp8Recipe())
    with pytest.raises(ValueError, match="different structure"):
        fp8.update_fp8_state({"a": state}, {"b": state}, recipe)
    with pytest.raises(TypeError, match="pytree of them"):
        fp8.update_fp8_state({"w": jnp.ones(3)}, {"w": jnp.ones(3)}, recipe)
    with pytest.raises(ValueError, match="observed.fp8_amax has shape"):
        fp8.update_fp8_state(state, state._replace(fp8_amax=jnp.ones(2)), recipe)
    with pytest.raises(TypeError, match="finite must be a boolean scalar"):
        fp8.update_fp8_state(state, state, recipe, finite=jnp.ones(2, bool))
    with pytest.raises(ValueError, match="different structures"):
        fp8.accumulate_observed({"a": state}, {"a": state, "b": state})
    with pytest.raises(ValueError, match="exactly two operands"):
        fp8.einsum("ij,jk,kl->il", x, w, recipe=recipe, state=state)
    # a shape of stacked contractions is whole numbers (2.5 was truncated to 2)
    with pytest.raises(ValueError, match=r"init_fp8_state's shape\[0\] must be a whole number .* 2.5"):
        fp8.init_fp8_state(recipe, shape=(2.5,))
    with pytest.raises(TypeError, match="shape must be a tuple of whole numbers .* got 3"):
        fp8.init_fp8_state(recipe, shape=3)
    assert fp8.init_fp8_state(recipe, shape=(np.int64(2), 3.0)).fp8_scale.shape == (2, 3, 3)
    with pytest.raises(NotImplementedError, match="diagonal"):
        fp8.einsum("ii,ij->j", jnp.ones((3, 3)), w, recipe=recipe, state=state)


# ---------------------------------------------------------------------------------------------------------
# The contraction


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_values_and_gradients_are_float32_up_to_fp8_rounding(dtype, scaling):
    recipe = Fp8Recipe("hybrid", scaling, amax_history=4)
    x, w = rand(0, (16, 256), dtype, 3.0), rand(1, (256, 32), dtype, 0.05)
    ct = rand(2, (16, 32), dtype, 1e-2)
    state = fp8.init_fp8_state(recipe)
    if scaling == "delayed":  # scales from a previous step that saw these amaxes
        seen = jnp.array([jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(ct).max()], jnp.float32)
        state = fp8.update_fp8_state(state, state._replace(fp8_amax=seen), recipe)

    f = jax.jit(lambda x, w, s: fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s))
    y, vjp = jax.vjp(f, x, w, state)
    dx, dw, observed = vjp(ct)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, dtype)
    x32, w32, ct32 = (a.astype(jnp.float32) for a in (x, w, ct))
    hi = lax.Precision.HIGHEST
    exact = (
        jnp.dot(x32, w32, precision=hi),
        jnp.dot(ct32, w32.T, precision=hi),
        jnp.dot(x32.T, ct32, precision=hi),
    )
    # forward: two E4M3 operands (3 mantissa bits each); backward: E5M2 (2 bits) times E4M3
    rel = (2 * 2.0**-4, 2.0**-3 + 2.0**-4, 2.0**-3 + 2.0**-4)
    out_ulp = {F32: 2.0**-24, np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11}[dtype]
    mags = (
        jnp.dot(jnp.abs(x32), jnp.abs(w32), precision=hi),
        jnp.dot(jnp.abs(ct32), jnp.abs(w32).T, precision=hi),
        jnp.dot(jnp.abs(x32).T, jnp.abs(ct32), precision=hi),
    )
    for got, want, r, mag in zip((y, dx, dw), exact, rel, mags):
        err = jnp.abs(got.astype(jnp.float32) - want)
        tiny = 1e-6 * float(mag.max())  # fp8 subnormals near zero: absolute, not relative, error
        assert bool(jnp.all(err <= (r + 2 * r * r) * mag + out_ulp * jnp.abs(want) + tiny)), float(
            (err / mag).max()
        )
        # and really fp8: far coarser than float32 (or the 16-bit dtype) alone would be
        assert float((err / mag).max()) > 2.0**-8
    np.testing.assert_array_equal(
        observed.fp8_amax, jnp.array([jnp.abs(x32).max(), jnp.abs(w32).max(), jnp.abs(ct32).max()])
    )
    assert not np.any(observed.fp8_scale) and not np.any(observed.fp8_amax_history)


@pytest.mark.parametrize("formats, grad_dtype", [("hybrid", E5M2), ("e4m3", E4M3)])
@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
def test_jaxpr_contracts_fp8_operands_forward_and_backward(formats, grad_dtype, dtype):
    recipe = Fp8Recipe(formats, "delayed", amax_history=2)
    x, w = rand(0, (4, 3, 16), dtype), rand(1, (16, 8), dtype)
    dims = (((2,), (0,)), ((), ()))

    def loss(x, w, s):
        return fp8.dot_general(x, w, dims, recipe=recipe, state=s).astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    found = dots(jax.make_jaxpr(grad)(x, w, fp8.init_fp8_state(recipe)).jaxpr)
    assert found[0] == ((E4M3, E4M3), F32), found  # the forward
    assert sorted(found[1:]) == sorted([((grad_dtype, E4M3), F32)] * 2), found  # dx and dw
    assert len(found) == 3
    plain = dots(jax.make_jaxpr(jax.grad(lambda x, w: (x @ w).astype(jnp.float32).sum()))(x, w).jaxpr)
    assert all(ops == (dtype, dtype) for ops, _ in plain)  # the reference program has no fp8


def test_einsum_is_one_fp8_dot_general_with_the_state_rows_in_operand_order():
    recipe = Fp8Recipe(amax_history=2)
    state = fp8.init_fp8_state(recipe)
    x, w = rand(0, (2, 5, 16), jnp.bfloat16, 4.0), rand(1, (16, 3), jnp.bfloat16)

    def observed(fn, *args):
        return jax.jit(jax.grad(lambda s: fn(s, *args).astype(jnp.float32).sum()))(state).fp8_amax

    by_einsum = lambda s, x, w: fp8.einsum("btd,df->btf", x, w, recipe=recipe, state=s)
    by_dot = lambda s, x, w: fp8.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=recipe, state=s)
    np.testing.assert_array_equal(jax.jit(by_einsum)(state, x, w), jax.jit(by_dot)(state, x, w))
    np.testing.assert_array_equal(observed(by_einsum, x, w), observed(by_dot, x, w))
    # jnp.einsum would contract "ij,jk->ki" as (rhs, lhs); the lhs row still describes the first operand
    a, b = rand(2, (4, 8), jnp.float32, 10.0), rand(3, (8, 6), jnp.float32, 0.1)
    seen = observed(lambda s, a, b: fp8.einsum("ij,jk->ki", a, b, recipe=recipe, state=s), a, b)
    assert (float(seen[0]), float(seen[1])) == (float(jnp.abs(a).max()), float(jnp.abs(b).max()))
    calls = []
    jnp.einsum(
        "ij,jk->ki",
        a,
        b,
        _dot_general=lambda p, q, *args, **kw: calls.append(p.shape) or lax.dot_general(p, q, *args, **kw),
    )
    assert calls == [b.shape]  # ...which is why fp8.einsum lays out the contraction itself
    # ellipses, batch axes, an output order of its own, an index summed out of one operand
    for sub, sa, sb in [
        ("...d,df->...f", (2, 3, 8), (8, 5)),
        ("bqd,bkd->bkq", (2, 3, 8), (2, 4, 8)),
        ("ij,k->ik", (3, 4), (5,)),
    ]:
        p, q = rand(4, sa), rand(5, sb)
        got = jax.jit(lambda p, q, sub=sub: fp8.einsum(sub, p, q, recipe="hybrid,current"))(p, q)
        want = jnp.einsum(sub, p, q, precision="highest")
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=0.15 * float(jnp.abs(want).max()))


def test_overflow_saturates_but_non_finite_values_stay_non_finite():
    recipe = Fp8Recipe(amax_history=2)
    state = fp8.init_fp8_state(recipe)  # scale 1: 448 (E4M3) and 57344 (E5M2) are the limits
    x, w = jnp.array([[1000.0, 1.0], [1e30, -5e3]]), jnp.ones((2, 1))
    y = fp8.dot_general(x, w, MATMUL, recipe=recipe, state=state)
    np.testing.assert_array_equal(y, [[449.0], [0.0]])  # 448 + 1 and 448 - 448: saturated, not NaN
    assert np.isnan(np.asarray(x.astype(E4M3), np.float32)).any()  # a plain cast would have made NaN

    def loss(w, s, scale):
        return (fp8.dot_general(x[:1], w, MATMUL, recipe=recipe, state=s) * scale).sum()

    dw = jax.grad(loss)(w, state, 1e6)  # a 1e6 gradient saturates at E5M2's 57344
    np.testing.assert_array_equal(dw, [[57344.0 * 448.0], [57344.0]])
    dw = jax.grad(loss)(w, state, jnp.inf)  # an overflowing (float16) backward stays visible to loss scaling
    assert not np.isfinite(dw).all()
    y = fp8.dot_general(jnp.array([[jnp.inf, 1.0]]), w, MATMUL, recipe=recipe, state=state)
    assert not np.isfinite(y).all()


# ---------------------------------------------------------------------------------------------------------
# The state


def reference_update(history, scale, amax, fp8_max, margin, reduce):
    """A plain numpy transcription of the documented rule, one row at a time."""
    if not np.isfinite(amax):
        return history, scale
    history = np.concatenate([[amax], history[:-1]]).astype(np.float32)
    window = history.max() if reduce == "max" else history[0]
    if window > 0 and np.isfinite(window):
        scale = np.float32(fp8_max / (float(window) * 2.0**margin))
    return history, scale


@pytest.mark.parametrize("reduce", ["max", "most_recent"])
@pytest.mark.parametrize("formats", ["hybrid", "e4m3"])
def test_delayed_scaling_history_roll_and_scale_match_a_hand_reference(reduce, formats):
    recipe = Fp8Recipe(formats, "delayed", amax_history=4, margin=1, amax_reduce=reduce)
    maxima = [448.0, 448.0, 57344.0 if formats == "hybrid" else 448.0]
    steps = [
        [3.0, 0.5, 2.0],
        [7.0, 0.25, 0.0],  # a zero amax (no gradient this step) keeps the scale
        [1.0, 0.75, 8.0],
        [jnp.inf, 0.5, 1.0],  # a non-finite amax never enters the history
        [2.0, jnp.nan, 0.5],
        [5.0, 1.0, 4.0],
        [0.5, 1.0, 0.25],  # the 7.0 has left the 4-step window by now
    ]
    state = fp8.init_fp8_state(recipe)
    update = jax.jit(lambda s, o: fp8.update_fp8_state(s, o, recipe))
    hist = [np.zeros(4, np.float32) for _ in range(3)]
    scale = [np.float32(1.0)] * 3
    for amax in steps:
        observed = state._replace(fp8_amax=jnp.array(amax, jnp.float32))
        state = update(state, observed)
        for row in range(3):
            hist[row], scale[row] = reference_update(hist[row], scale[row], amax[row], maxima[row], 1, reduce)
            np.testing.assert_array_equal(state.fp8_amax_history[row], hist[row])
            assert np.float32(state.fp8_scale[row]) == scale[row], (amax, row)
    if reduce == "max":  # 448 / (max(2, 5, 0.5 and the 1.0 before) * 2**1)
        assert float(state.fp8_scale[0]) == np.float32(448 / (5.0 * 2))


def test_scales_stay_normal_for_extreme_amaxes():
    recipe = Fp8Recipe(scaling="current")
    state = fp8.init_fp8_state(recipe)
    tiny = state._replace(fp8_amax=jnp.array([1e-37, 3e38, 0.0], jnp.float32))
    new = fp8.update_fp8_state(state, tiny, recipe)
    np.testing.assert_array_equal(new.fp8_scale, np.array([2.0**126, 448 / 3e38, 1.0], np.float32))
    y = fp8.dot_general(jnp.full((1, 4), 1e-37), jnp.ones((4, 1)), MATMUL, recipe=recipe)
    np.testing.assert_allclose(y, [[4e-37]], rtol=2**-4)  # scale 2**126, and back


def mlp_loss(params, states, x, recipe):
    h = fp8.dot_general(x, params["w1"], MATMUL, recipe=recipe, state=states["l1"])
    h = jax.nn.relu(h)
    y = fp8.dot_general(h, params["w2"], MATMUL, recipe=recipe, state=states["l2"])
    return jnp.sum(y.astype(jnp.float32) ** 2)  # a sum: an example's gradient does not depend on the batch


def mlp(dtype=jnp.float32, recipe=None):
    recipe = recipe or Fp8Recipe(amax_history=4)
    params = {"w1": rand(10, (16, 32), dtype, 0.3), "w2": rand(11, (32, 4), dtype, 0.3)}
    states = {"l1": fp8.init_fp8_state(recipe), "l2": fp8.init_fp8_state(recipe)}
    return params, states, recipe


def test_microbatch_amaxes_are_max_accumulated_to_one_big_batch():
    params, states, recipe = mlp()
    states = fp8.update_fp8_state(  # nontrivial scales to start from
        states,
        jax.tree_util.tree_map(
            lambda s: s._replace(fp8_amax=jnp.array([4.0, 1.0, 30.0])),
            states,
            is_leaf=lambda s: isinstance(s, fp8.Fp8State),
        ),
        recipe,
    )
    x = rand(12, (32, 16), jnp.float32, 2.0) * jnp.linspace(0.1, 3.0, 32)[:, None]  # uneven microbatches
    grad = jax.jit(jax.grad(mlp_loss, argnums=(0, 1)), static_argnums=3)
    _, big = grad(params, states, x, recipe)
    acc, summed = None, None
    for micro in jnp.split(x, 4):
        _, observed = grad(params, states, micro, recipe)
        acc = fp8.accumulate_observed(acc, observed)
        summed = observed if summed is None else jax.tree_util.tree_map(jnp.add, summed, observed)
    assert bits(fp8.update_fp8_state(states, acc, recipe)) == bits(fp8.update_fp8_state(states, big, recipe))
    # a sum (what accumulating them as gradients does) would overstate every amax
    assert bits(fp8.update_fp8_state(states, summed, recipe)) != bits(
        fp8.update_fp8_state(states, big, recipe)
    )


@pytest.mark.composition
def test_skipped_step_leaves_the_state_bitwise_unchanged():
    params, states, recipe = mlp(jnp.float16)
    tx = jmp_lite.loss_scaling(optax.sgd(1e-3), jmp_lite.DynamicLossScale(2.0**4))
    opt_state = tx.init(params)
    x = rand(13, (8, 16), jnp.float16, 1.0)

    @jax.jit
    def step(params, states, opt_state, x, blowup=1.0):
        ls = jmp_lite.get_loss_scale(opt_state)
        loss = lambda p, s: ls.scale(mlp_loss(p, s, x, recipe) * blowup)
        grads, observed = jax.grad(loss, argnums=(0, 1))(params, states)
        updates, opt_state = tx.update(grads, opt_state, params)
        finite = jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite
        states = fp8.update_fp8_state(states, observed, recipe, finite=finite)
        return optax.apply_updates(params, updates), states, opt_state, observed

    params, states, opt_state, _ = step(params, states, opt_state, x)  # a finite step moves the state
    assert bool(jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite)
    before = states
    # The float16 output gradients overflow (saturation would hide a blowup of the forward activations:
    # they are clipped to 448 times the inverse scale; an overflowing backward stays inf).
    _, after, opt_state, observed = step(params, states, opt_state, x, 1e8)
    assert not np.isfinite(observed["l2"].fp8_amax[2])
    assert not bool(jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite)
    # the forward amaxes of that step were finite: only the finite flag keeps them out
    assert np.isfinite(observed["l1"].fp8_amax[:2]).all()
    assert bits(after) == bits(before)


@pytest.mark.composition
def test_checkpoint_layout_and_resume_are_bitwise(tmp_path):
    import orbax.checkpoint as ocp
    from flax import serialization

    params, states, recipe = mlp(jnp.bfloat16)

    @jax.jit
    def step(params, states, x):
        grads, observed = jax.grad(mlp_loss, argnums=(0, 1))(params, states, x, recipe)
        params = jax.tree_util.tree_map(lambda p, g: p - 1e-4 * g, params, grads)
        return params, fp8.update_fp8_state(states, observed, recipe)

    xs = [rand(40 + i, (8, 16), jnp.bfloat16) for i in range(6)]
    for x in xs[:3]:
        params, states = step(params, states, x)
    # the documented layout: three float32 arrays under their field names
    layout = serialization.to_state_dict(states["l1"])
    assert {k: (v.shape, v.dtype) for k, v in layout.items()} == {
        "fp8_scale": ((3,), F32),
        "fp8_amax_history": ((3, 4), F32),
        "fp8_amax": ((3,), F32),
    }
    blob = serialization.msgpack_serialize(serialization.to_state_dict((params, states)))
    fresh = (params, jax.tree_util.tree_map(jnp.zeros_like, states))
    from_msgpack = serialization.from_state_dict(fresh, serialization.msgpack_restore(blob))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "fp8", (params, states))
    ckpt.wait_until_finished()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, (params, states))
    from_orbax = ckpt.restore(tmp_path / "fp8", abstract)
    uninterrupted = (params, states)
    for x in xs[3:]:
        uninterrupted = step(*uninterrupted, x)
    for restored in (from_msgpack, from_orbax):
        assert isinstance(restored[1]["l1"], fp8.Fp8State)
        for x in xs[3:]:
            restored = step(*restored, x)
        assert bits(restored) == bits(uninterrupted)


@pytest.mark.composition
def test_replicas_hold_bitwise_equal_state_after_ten_pmap_steps():
    n = jax.local_device_count()
    assert n == 8
    params, states, recipe = mlp(jnp.bfloat16)
    params, states = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), (params, states))

    step = jax.pmap(lambda p, s, x: _pmap_step(p, s, x, recipe), axis_name="i")
    for i in range(10):
        x = rand(20 + i, (n, 4, 16), jnp.bfloat16) * jnp.arange(1, n + 1, dtype=jnp.bfloat16)[:, None, None]
        params, states, observed = step(params, states, x)
        local = np.asarray(observed["l1"].fp8_amax[:, 0])
        assert len(set(local.tolist())) > 1, "replica-local data: the replicas observed different amaxes"
    for leaf in jax.tree_util.tree_leaves((params, states)):
        leaf = np.asarray(leaf)
        for r in range(1, n):
            assert leaf[r].tobytes() == leaf[0].tobytes()
    assert float(states["l1"].fp8_amax_history[0, 0, 0]) == float(local.max())


@pytest.mark.composition
def test_shard_map_max_reduces_the_state_and_matches_sharded_jit():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    params, states, recipe = mlp()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = rand(30, (32, 16)) * jnp.linspace(0.5, 4.0, 32)[:, None]  # every shard a different amax
    x = jax.device_put(x, NamedSharding(mesh, P("d")))

    def step(params, states, x, axis_name=None):
        grads, observed = jax.grad(mlp_loss, argnums=(0, 1))(params, states, x, recipe)
        return grads, fp8.update_fp8_state(states, observed, recipe, axis_name=axis_name)

    # out_specs=P() makes shard_map check that the gradients and the new state are the same on every
    # shard: the replicated weights' gradients are summed over "d" and the replicated states' observed
    # amaxes max-reduced, with or without axis_name
    def sharded(axis_name):
        local = lambda p, s, x: step(p, s, x, axis_name)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P()))

    got = sharded("d")(params, states, x)
    assert bits(sharded(None)(params, states, x)) == bits(got)
    want = jax.jit(step)(params, states, x)  # sharded jit: reductions over the sharded batch are global
    np.testing.assert_array_equal(got[1]["l1"].fp8_amax[0], jnp.abs(x).max())
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5)  # up to summation order


def _pmap_step(params, states, x, recipe):
    grads, observed = jax.grad(mlp_loss, argnums=(0, 1))(params, states, x, recipe)
    grads = lax.pmean(grads, "i")
    params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads)
    return params, fp8.update_fp8_state(states, observed, recipe, axis_name="i"), observed


# ---------------------------------------------------------------------------------------------------------
# Transformations


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.composition  # with a JAX transformation or another front-end
def test_vmap_over_a_shared_state_is_the_explicit_batch(dtype, scaling):
    recipe = Fp8Recipe("hybrid", scaling, amax_history=2)
    state = fp8.init_fp8_state(recipe)
    if scaling == "delayed":
        state = fp8.update_fp8_state(state, state._replace(fp8_amax=jnp.array([6.0, 2.0, 3.0])), recipe)
    x = rand(0, (5, 3, 16), dtype) * jnp.arange(1, 6, dtype=dtype)[:, None, None]  # per-example amaxes differ
    w = rand(1, (16, 4), dtype)

    def one(x, w, s):  # one example
        return (fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s).astype(jnp.float32) ** 2).sum()

    def batched(x, w, s):  # the same contraction with the batch axis written out
        y = fp8.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=recipe, state=s)
        return (y.astype(jnp.float32) ** 2).sum()

    vmapped = lambda x, w, s: jax.vmap(one, (0, None, None))(x, w, s).sum()
    got = jax.jit(jax.value_and_grad(vmapped, argnums=(0, 1, 2)))(x, w, state)
    want = jax.jit(jax.value_and_grad(batched, argnums=(0, 1, 2)))(x, w, state)
    assert bits(got[0]) == bits(want[0])
    # the observed amaxes are the whole batch's (a per-example amax would have been summed by JAX),
    # so the scales and hence the quantized values and dx agree bit for bit
    assert bits((got[1][0], got[1][2])) == bits((want[1][0], want[1][2]))
    np.testing.assert_array_equal(got[1][2].fp8_amax[0], jnp.abs(x.astype(jnp.float32)).max())
    # dw: vmap rounds each example's dw to the 16-bit dtype before summing them
    dw = want[1][1].astype(F32)
    np.testing.assert_allclose(got[1][1].astype(F32), dw, rtol=0, atol=2**-5 * float(jnp.abs(dw).max()))

    # a state batched with the data (an ensemble) gives each member its own amaxes
    states = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 5), state)
    per_member = jax.jit(jax.grad(lambda x, s: jax.vmap(one, (0, None, 0))(x, w, s).sum(), argnums=1))(
        x, states
    )
    alone_grad = jax.jit(jax.grad(one, argnums=2))
    for i in range(5):
        alone = alone_grad(x[i], w, state)
        assert bits(jax.tree_util.tree_map(lambda a, i=i: a[i], per_member)) == bits(alone)


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_scan_over_stacked_layer_states_remat_and_jit_match_the_unrolled_loop():
    recipe = Fp8Recipe(amax_history=2)
    ws = rand(0, (3, 16, 16), jnp.float32, 0.3)
    states = fp8.init_fp8_state(recipe, shape=(3,))
    x = rand(1, (4, 16), jnp.float32)

    def layer(h, ws_s):
        w, s = ws_s
        return jnp.tanh(fp8.dot_general(h, w, MATMUL, recipe=recipe, state=s)), None

    def scanned(ws, states):
        return lax.scan(jax.checkpoint(layer), x, (ws, states))[0].astype(jnp.float32).sum()

    def unrolled(ws, states):
        h = x
        for i in range(3):
            h, _ = layer(h, (ws[i], jax.tree_util.tree_map(lambda a, i=i: a[i], states)))
        return h.astype(jnp.float32).sum()

    got = jax.jit(jax.grad(scanned, argnums=(0, 1)))(ws, states)
    want = jax.grad(unrolled, argnums=(0, 1))(ws, states)
    # each layer saw its own slice of the stacked state: the same amaxes as the unrolled loop (the
    # gradient's only up to XLA fusing tanh's derivative differently under jit)
    np.testing.assert_array_equal(got[1].fp8_amax[:, :2], want[1].fp8_amax[:, :2])
    np.testing.assert_allclose(got[1].fp8_amax[:, 2], want[1].fp8_amax[:, 2], rtol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1].fp8_amax[:, 1], jnp.abs(ws).max(axis=(1, 2)))  # layer i saw ws[i]
    assert float(got[1].fp8_amax[0, 0]) == float(jnp.abs(x).max())
    new = fp8.update_fp8_state(states, got[1], recipe)  # stacked states update in one call
    assert new.fp8_amax_history.shape == (3, 3, 2) and (new.fp8_scale != 1).all()


# ---------------------------------------------------------------------------------------------------------
# Diagnostics


@pytest.mark.numerics
def test_fp8_report_counts_saturation_and_underflow_per_tensor():
    recipe = Fp8Recipe(amax_history=2)
    state = fp8.init_fp8_state(recipe)._replace(fp8_scale=jnp.array([1.0, 4.0, 1.0]))
    x = jnp.array([[1000.0, 500.0, 1.0, 1e-4], [0.0, 2.0, 3.0, 4.0]])  # 2 saturate, 1 underflows
    w = jnp.full((4, 2), 0.5)  # * 4 = 2: fine
    g = jnp.array([[1e5, 1.0], [1e-9, 1.0]])  # E5M2: 1e5 saturates, 1e-9 underflows
    r = jax.jit(lambda x, w, g, s: fp8.fp8_report(x, w, recipe, s, grad=g))(x, w, g, state)
    assert (float(r.lhs.saturated), float(r.lhs.underflow)) == (2 / 8, 1 / 8)
    assert (float(r.rhs.saturated), float(r.rhs.underflow), float(r.rhs.scale)) == (0.0, 0.0, 4.0)
    assert (float(r.grad.saturated), float(r.grad.underflow)) == (1 / 4, 1 / 4)
    assert float(r.lhs.headroom_bits) == pytest.approx(np.log2(448 / 1000))  # negative: scale too large
    assert float(r.lhs.amax) == 1000.0
    # with current scaling nothing saturates: the scale follows the amax
    cur = fp8.fp8_report(x, w, "hybrid,current", grad=g)
    assert float(cur.lhs.saturated) == float(cur.grad.saturated) == 0.0
    assert float(cur.lhs.scale) == np.float32(448 / 1000)
    assert fp8.fp8_report(x, w, "hybrid,current").grad is None
    with pytest.raises(ValueError, match="pass state="):
        fp8.fp8_report(x, w, recipe)


# ---------------------------------------------------------------------------------------------------------
# Flax Linen's fp8 op, side by side


def _flax_step(x, w, ct, hist, flax_fp8):
    """Flax's fp8_scaled_dot_general (what Fp8DirectDotGeneralOp calls): outputs, gradients, new meta."""
    ones = jnp.ones((1,), jnp.float32)

    def f(x, w, ls, rs, gs, lh, rh, gh):
        return flax_fp8.fp8_scaled_dot_general(
            x, w, MATMUL, preferred_element_type=x.dtype, lhs_scale=ls, rhs_scale=rs, grad_scale=gs,
            lhs_amax_history=lh, rhs_amax_history=rh, grad_amax_history=gh, quantize_compute_type=x.dtype,
        )  # fmt: skip

    y, vjp = jax.vjp(f, x, w, ones, ones, ones, *hist)
    dx, dw, *meta = vjp(ct)
    return y, dx, dw, meta


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [F32, np.dtype(jnp.bfloat16)], ids=lambda d: d.name)
@pytest.mark.parametrize("power_of_two", [True, False])
def test_matches_flax_fp8_direct_dot_general(dtype, power_of_two):
    flax_fp8 = pytest.importorskip("flax.linen.fp8_ops")
    recipe = Fp8Recipe("hybrid", "delayed", amax_history=4)
    x, w = rand(0, (16, 64), dtype, 3.0), rand(1, (64, 8), dtype, 0.2)
    ct = rand(2, (16, 8), dtype, 0.01)
    # the amaxes of an earlier step, from which both derive this step's scales
    previous = [56.0, 224.0, 229376.0] if power_of_two else [10.0, 0.7, 3.0]  # 448/56 = 8 ... or not
    # Flax keeps its history as a ring whose newest entry is at index 0; jmp_lite keeps it newest first.
    flax_hist = [jnp.zeros(4, jnp.float32).at[0].set(a) for a in previous]
    y_f, dx_f, dw_f, meta = _flax_step(x, w, ct, flax_hist, flax_fp8)
    state = fp8.init_fp8_state(recipe)
    state = fp8.update_fp8_state(state, state._replace(fp8_amax=jnp.array(previous)), recipe)
    y, vjp = jax.vjp(lambda x, w, s: fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s), x, w, state)
    dx, dw, observed = vjp(ct)

    # Same scales: Flax stores 1 / scale (it divides, jmp_lite multiplies).
    flax_scales = np.array([1 / float(m[0]) for m in meta[:3]], np.float32)
    np.testing.assert_allclose(state.fp8_scale, flax_scales, rtol=1e-6)
    # Same observations: the new history holds the same amaxes (in its own order).
    new = fp8.update_fp8_state(state, observed, recipe)
    for row in range(3):
        np.testing.assert_array_equal(np.sort(new.fp8_amax_history[row]), np.sort(np.asarray(meta[3 + row])))
    if dtype == F32 or power_of_two:
        # float32, or scales that are powers of two: bit for bit the same outputs and gradients
        assert bits((y, dx, dw)) == bits((y_f, dx_f, dw_f))
    else:
        # Documented difference: with bfloat16 operands Flax scales in bfloat16 (the scale itself rounded
        # to 8 bits, then x / scale rounded again before the fp8 cast) and lets the GEMM and the descale
        # round to bfloat16; jmp_lite scales in float32 and rounds once. Both are fp8-accurate.
        exact = jnp.dot(x.astype(F32), w.astype(F32), precision="highest")
        mag = jnp.dot(jnp.abs(x.astype(F32)), jnp.abs(w.astype(F32)), precision="highest")
        for out in (y, y_f):
            assert bool(
                jnp.all(jnp.abs(out.astype(F32) - exact) <= (2**-3 + 2**-6) * mag + 2**-7 * jnp.abs(exact))
            )
        assert bits(y) != bits(y_f)


# ---------------------------------------------------------------------------------------------------------
# GPU: the compiled program must run cuBLASLt fp8 GEMMs


@pytest.mark.compiled
@pytest.mark.gpu  # NVIDIA Hopper or newer
def test_gpu_compiles_fp8_matmuls_to_cublaslt_fp8_gemms():
    recipe = Fp8Recipe(amax_history=16)
    x = rand(0, (1024, 1024), jnp.bfloat16)
    w = rand(1, (1024, 1024), jnp.bfloat16)
    state = fp8.init_fp8_state(recipe)

    def loss(x, w, s):
        # squared: a data-dependent output gradient, which XLA cannot fold into a reduction
        return (fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s).astype(jnp.float32) ** 2).sum()

    forward = jax.jit(loss).lower(x, w, state).compile().as_text()
    # value_and_grad keeps the forward GEMM alive next to the two gradient GEMMs
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    backward = step.lower(x, w, state).compile().as_text()
    # XLA's GEMM rewriter names it kCublasLtMatmulF8CallTarget; a 16-bit fallback would be
    # "__cublas$lt$matmul" or "__cublas$gemm" without the $f8 suffix.
    fp8_gemm = '"__cublas$lt$matmul$f8"'
    assert forward.count(fp8_gemm) == 1, forward
    assert backward.count(fp8_gemm) == 3, backward
    for text in (forward, backward):
        assert '"__cublas$lt$matmul"' not in text and '"__cublas$gemm"' not in text, text
    assert "f8e5m2" in backward
    value, (dx, dw, observed) = step(x, w, state)
    assert bool(jnp.isfinite(value)) and bool(jnp.isfinite(dx.astype(F32)).all())
    assert bool(jnp.all(observed.fp8_amax > 0))


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_checkpoint_that_saves_the_fp8_operands_keeps_e4m3s_top_binade(scaling):
    # jax.checkpoint rounds saved floating residuals with reduce_precision, which maps E4M3FN's
    # [256, 448] to NaN; scaled operands land there by design (current scaling puts the amax at 448)
    recipe = Fp8Recipe("hybrid", scaling, amax_history=4)
    state = fp8.init_fp8_state(recipe)._replace(fp8_scale=jnp.array([300.0, 400.0, 1.0]))
    x, w = rand(80, (8, 16), jnp.bfloat16), rand(81, (16, 4), jnp.bfloat16)

    def loss(x, w, s):
        return fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s).astype(jnp.float32).sum()

    saving = jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, state)
    got = jax.jit(jax.value_and_grad(saving, argnums=(0, 1, 2)))(x, w, state)
    assert np.isfinite(float(got[0])) and bits(got) == bits(want)


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1.0, float("inf")])
def test_a_corrupt_restored_scale_is_repaired_by_the_next_update_skipped_or_not(bad):
    """A restored scale of 0 or NaN made every step non-finite, and the skipped steps kept it: the run
    never recovered and the skip-limit error blamed the model or data."""
    recipe = Fp8Recipe(amax_history=4)
    state = fp8.init_fp8_state(recipe, shape=(2,))
    state = state._replace(
        fp8_scale=state.fp8_scale.at[0, 1].set(bad),
        fp8_amax_history=state.fp8_amax_history.at[0, 1, 0].set(2.0),  # row (0, 1) saw |w| = 2
    )
    for finite in (jnp.bool_(False), jnp.bool_(True)):
        new = jax.jit(fp8.update_fp8_state, static_argnums=2)(
            state, fp8.init_fp8_state(recipe, (2,)), recipe, finite=finite
        )
        assert float(new.fp8_scale[0, 1]) == recipe.forward_max / 2.0  # from its history
        np.testing.assert_array_equal(np.delete(np.asarray(new.fp8_scale).ravel(), 1), 1.0)  # the rest kept
    empty = fp8.init_fp8_state(recipe)._replace(fp8_scale=jnp.array([bad, 1.0, 1.0]))
    assert float(fp8.update_fp8_state(empty, empty, recipe, finite=jnp.bool_(False)).fp8_scale[0]) == 1.0
