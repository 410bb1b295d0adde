"""autocast: the traced program's dtypes, accuracy, bitwise float32, caching, composition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _jaxpr import eqns
from jax import lax
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite import DynamicLossScale, loss_scaling
from jmp_lite._src.engine import dtype_rules

pytestmark = pytest.mark.unit

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
POLICIES = {BF16: "p=f32,c=bf16,o=f32", F16: "p=f32,c=f16,o=f32"}
D, HEADS, LAYERS, T, B, V = 16, 2, 2, 8, 4, 32


# --- a plain-JAX transformer: Dense, attention, LayerNorm, scan over layers, remat,
# nested jit, a custom_vjp activation and jax.nn.softmax.


@jax.custom_vjp
def _gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _gelu_fwd(x):
    return _gelu(x), x


def _gelu_bwd(x, g):
    s = jax.nn.sigmoid(1.702 * x)
    return (g * (s + 1.702 * x * s * (1 - s)),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


@jax.jit
def _mlp(x, w1, w2):
    return _gelu(x @ w1) @ w2


def _block(x, p):
    h = _layer_norm(x, p["ln1_s"], p["ln1_b"])
    q, k, v = (jnp.einsum("btd,dhe->bthe", h, p[n]) for n in ("wq", "wk", "wv"))
    logits = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(D // HEADS)
    mask = jnp.tril(jnp.ones((T, T), bool))
    att = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhe->bqhe", att, v).reshape(x.shape)
    x = x + o @ p["wo"]
    h = _layer_norm(x, p["ln2_s"], p["ln2_b"])
    return x + _mlp(h, p["w1"], p["w2"])


def init(key):
    ks = jax.random.split(key, 8)

    def n(k, shape, fan):
        return jax.random.normal(k, shape) / np.sqrt(fan)

    layers = {
        "wq": n(ks[0], (LAYERS, D, HEADS, D // HEADS), D),
        "wk": n(ks[1], (LAYERS, D, HEADS, D // HEADS), D),
        "wv": n(ks[2], (LAYERS, D, HEADS, D // HEADS), D),
        "wo": n(ks[3], (LAYERS, D, D), D),
        "w1": n(ks[4], (LAYERS, D, 4 * D), D),
        "w2": n(ks[5], (LAYERS, 4 * D, D), 4 * D),
        "ln1_s": jnp.ones((LAYERS, D)),
        "ln1_b": jnp.zeros((LAYERS, D)),
        "ln2_s": jnp.ones((LAYERS, D)),
        "ln2_b": jnp.zeros((LAYERS, D)),
    }
    return {"embed": n(ks[6], (V, D), 1.0), "layers": layers, "head": n(ks[7], (D, V), D)}


def loss_fn(params, tokens):
    x = params["embed"][tokens]
    body = jax.checkpoint(lambda h, p: (_block(h, p), None))
    x, _ = lax.scan(body, x, params["layers"])
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


@pytest.fixture(scope="module")
def data():
    params = init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    return params, tokens


@pytest.fixture(scope="module")
def reference(data):
    """float32 loss and grads of the function itself (compiled once for the module)."""
    return jax.jit(jax.value_and_grad(loss_fn))(*data)


def _dtypes_of(jaxpr, name):
    return [tuple(v.aval.dtype for v in e.invars) for e in eqns(jaxpr) if e.primitive.name == name]


def _rel_err(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum((x.astype(F32) - y) ** 2)) for x, y in zip(a, b))
    return np.sqrt(num / sum(float(jnp.sum(y**2)) for y in b))


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_traced_program_dtypes(data, compute):
    params, tokens = data
    f = jmp_lite.autocast(loss_fn, POLICIES[compute])
    fwd = jax.make_jaxpr(f)(params, tokens).jaxpr
    grad = jax.make_jaxpr(jax.grad(f))(params, tokens).jaxpr
    for jaxpr in (fwd, grad):
        dots = _dtypes_of(jaxpr, "dot_general")
        # 3 per layer body for qkv, 2 attention, wo, 2 MLP, + head (forward); more under grad
        assert len(dots) >= 9
        assert all(d == (compute, compute) for d in dots), dots
        for name in ("exp", "log", "rsqrt"):
            found = _dtypes_of(jaxpr, name)
            assert found and all(d == (F32,) for d in found), (name, found)
    # the nested bodies really are there (scan, remat, jit) and hold the 16-bit dots
    names = {e.primitive.name for e in eqns(fwd)}
    assert "scan" in names
    scan = next(e for e in eqns(fwd) if e.primitive.name == "scan")
    inner = {e.primitive.name for e in eqns(scan.params["jaxpr"].jaxpr)}
    assert {"remat2", "jit", "custom_vjp_call"} <= inner
    # float32 accumulation is visible in the program
    pets = [e.params["preferred_element_type"] for e in eqns(fwd) if e.primitive.name == "dot_general"]
    assert pets and all(np.dtype(p) == F32 for p in pets)


@pytest.mark.numerics
@pytest.mark.parametrize("compute", [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")])
def test_output_and_grads_float32_and_close(data, reference, compute):
    params, tokens = data
    f = jax.jit(jax.value_and_grad(jmp_lite.autocast(loss_fn, POLICIES[compute])))
    loss, grads = f(params, tokens)
    ref_loss, ref_grads = reference
    assert loss.dtype == F32
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 0.05
    assert _rel_err(grads, ref_grads) < 0.05
    assert _rel_err(grads, ref_grads) > 0  # it did compute in 16 bits


@pytest.mark.numerics
@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_no_accumulate_rule_16bit_grads_close_and_forward_mode(data, reference, compute):
    params, tokens = data
    rules = {"dot_general": "compute_no_accumulate"}
    f = jmp_lite.autocast(loss_fn, POLICIES[compute], rules=rules)
    grad_program = jax.make_jaxpr(jax.grad(f))(params, tokens).jaxpr
    dots = [e for e in eqns(grad_program) if e.primitive.name == "dot_general"]
    assert dots and all(tuple(v.aval.dtype for v in e.invars) == (compute, compute) for e in dots)
    assert all(e.params["preferred_element_type"] in (None, compute) for e in dots)
    loss, grads = jax.jit(jax.value_and_grad(f))(params, tokens)
    assert abs(float(loss) - float(reference[0])) / float(reference[0]) < 0.05
    assert 0 < _rel_err(grads, reference[1]) < 0.05
    # forward mode works (the model above has a user custom_vjp, so use a plain function)
    g = jmp_lite.autocast(lambda x, w: jnp.tanh(x @ w).sum(), POLICIES[compute], rules=rules)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4)) * 0.1
    _, out = jax.jvp(lambda a: g(a, w), (x,), (x,))
    np.testing.assert_allclose(out, jax.jvp(lambda a: jnp.tanh(a @ w).sum(), (x,), (x,))[1], rtol=2e-2)


def test_all_float32_policy_is_bitwise_the_function(data, reference):
    params, tokens = data
    f = jmp_lite.autocast(loss_fn, "p=f32,c=f32,o=f32")
    got = jax.jit(jax.value_and_grad(f))(params, tokens)
    want = reference
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rewritten_program_cached_per_signature():
    traces = []

    def f(x, w):
        traces.append(x.shape)
        return jnp.tanh(x @ w)

    g = jmp_lite.autocast(f, "p=f32,c=bf16,o=f32")
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    g(x, w)
    g(x + 1, w * 2)
    jax.jit(g)(x, w)
    jax.grad(lambda a: g(a, w).sum())(x)
    assert len(traces) == 1
    g(jnp.ones((5, 3)), w)  # a new shape retraces once
    g(jnp.ones((5, 3)), w)
    g(x.astype(jnp.bfloat16), w)  # so does a new dtype
    assert len(traces) == 3


def test_decorator_form_static_leaves_and_kwargs():
    @jmp_lite.autocast("p=f32,c=f16,o=f16")
    def f(x, *, scale, train):
        y = x @ x.T
        return y * scale if train else y

    x = jnp.ones((2, 3))
    assert f(x, scale=2.0, train=True).dtype == F16
    assert float(f(x, scale=2.0, train=True)[0, 0]) == 6.0
    assert float(f(x, scale=2.0, train=False)[0, 0]) == 3.0


def test_ints_bools_keys_untouched_and_top_k_follows_its_operand():
    def f(x, w, n, key):
        y = x @ w  # bf16 out
        vals, idx = lax.top_k(y, 2)  # selects values: runs in the dtype they arrive in
        ints = n @ n.T  # integer matmul stays integer
        noise = jax.random.normal(key, y.shape)
        return vals, idx, ints, (y > 0).sum(), noise

    g = jmp_lite.autocast(f, "p=f32,c=bf16,o=f32")
    args = (jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((2, 3), jnp.int32), jax.random.key(0))
    jaxpr = jax.make_jaxpr(g)(*args).jaxpr
    assert _dtypes_of(jaxpr, "top_k") == [(BF16,)]
    assert (np.dtype(jnp.int32), np.dtype(jnp.int32)) in _dtypes_of(jaxpr, "dot_general")
    vals, idx, ints, count, noise = g(*args)
    assert vals.dtype == F32 and idx.dtype == jnp.int32 and ints.dtype == jnp.int32
    assert count.dtype == jnp.int32 and noise.dtype == F32
    np.testing.assert_array_equal(noise, jax.random.normal(args[3], (2, 4)))


def test_weak_scalars_do_not_widen_and_widest_wins():
    def f(x, w, b):
        y = (x @ w) * 2.0 + 1  # stays bf16: the Python scalars are weak
        return y, y + b  # b is float32: the sum is float32

    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, "p=f32,c=bf16,o=bf16"))(
        jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones(4)
    ).jaxpr
    assert (BF16, BF16) in _dtypes_of(jaxpr, "mul")
    assert (F32, F32) in _dtypes_of(jaxpr, "add")


def test_rules_float32_region_and_named_scopes():
    def f(x, w):
        a = jnp.exp(x @ w)
        with jax.named_scope("head"):
            b = x @ w
        with jmp_lite.float32_region():
            c = x @ w
        return a, b, c

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    plain = jax.make_jaxpr(jmp_lite.autocast(f, "p=f32,c=bf16,o=f32"))(x, w).jaxpr
    assert _dtypes_of(plain, "dot_general").count((F32, F32)) == 1  # only the float32 region
    ruled = jmp_lite.autocast(f, "p=f32,c=bf16,o=f32", rules={"exp": "follow", "scope:head": "float32"})
    jaxpr = jax.make_jaxpr(ruled)(x, w).jaxpr
    assert _dtypes_of(jaxpr, "exp") == [(BF16,)]
    assert _dtypes_of(jaxpr, "dot_general").count((F32, F32)) == 2
    # the named scope survives in the rewritten program
    assert any("head" in str(e.source_info.name_stack) for e in eqns(jaxpr))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="Policy or a policy string"):
        jmp_lite.autocast(lambda x: x, 3)
    with pytest.raises(ValueError, match="accepted: compute, compute_no_accumulate, float32, follow, as_"):
        jmp_lite.autocast(lambda x: x, "p=f32,c=bf16,o=f32", rules={"exp": "bf16"})
    with pytest.raises(TypeError, match="policy is required"):
        jmp_lite.autocast(lambda x: x)
    with pytest.raises(TypeError, match="callable"):
        jmp_lite.autocast(3, "p=f32,c=bf16,o=f32")
    with pytest.raises(TypeError, match="hashable"):
        jmp_lite.autocast(lambda x, s: x, "p=f32,c=bf16,o=f32")(jnp.ones(2), {1, 2})


def test_control_flow_carries_and_branches():
    def f(x, w):
        def body(c):
            i, h = c
            return i + 1, h @ w  # the carry arrives float32 and leaves bf16

        _, h = lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        h = lax.cond(h.sum() > 0, lambda a: a @ w, lambda a: a * 2.0, h)
        h, ys = lax.scan(lambda c, wi: (c @ wi, jnp.log1p(jnp.abs(c)).sum()), h, jnp.stack([w, w]))
        return h, ys

    x, w = jnp.ones((2, 4)) * 0.1, jnp.eye(4) * 0.5
    g = jmp_lite.autocast(f, "p=f32,c=bf16,o=f32")
    h, ys = jax.jit(g)(x, w)
    rh, rys = f(x, w)
    np.testing.assert_allclose(h, rh, rtol=1e-2)
    np.testing.assert_allclose(ys, rys, rtol=1e-2)
    jaxpr = jax.make_jaxpr(g)(x, w).jaxpr
    assert all(d == (BF16, BF16) for d in _dtypes_of(jaxpr, "dot_general"))
    assert _dtypes_of(jaxpr, "log1p") == [(F32,)]


def test_custom_jvp_and_custom_vjp_rules_are_kept():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))  # deliberately not cos: is the rule used?

    @jax.custom_vjp
    def g(x):
        return x * 1.0

    g.defvjp(lambda x: (x, None), lambda _, ct: (5.0 * ct,))

    def h(x, w):
        y = x @ w
        return f(y).sum() + g(y).sum()

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    cast = jmp_lite.autocast(h, "p=f32,c=bf16,o=f32")
    got = jax.grad(cast, argnums=1)(x, w)
    want = jax.grad(h, argnums=1)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-2)
    np.testing.assert_allclose(got, jnp.full((3, 4), 16.0), rtol=1e-2)  # 2 rows x (3 + 5)
    jvp_out = jax.jvp(lambda a: jmp_lite.autocast(lambda b: f(b * 1.0), "p=f32,c=bf16,o=f32")(a), (x,), (x,))
    np.testing.assert_allclose(jvp_out[1], 3.0 * x)


@pytest.mark.composition
def test_composes_with_vmap_pmap_shard_map_and_inner_shard_map(data):
    params, tokens = data
    f = jmp_lite.autocast(loss_fn, POLICIES[BF16])
    per_example = jax.vmap(f, in_axes=(None, 0))(params, tokens[:, None])
    assert per_example.shape == (B,) and per_example.dtype == F32
    n = 2
    pm = jax.pmap(f, in_axes=(None, 0), devices=jax.devices()[:n])(params, tokens.reshape(n, B // n, T))
    assert pm.shape == (n,) and np.isfinite(pm).all()
    mesh = jax.sharding.Mesh(jax.devices()[:n], ("d",))
    sm = jax.shard_map(lambda p, t: f(p, t)[None], mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))(
        params, tokens
    )
    np.testing.assert_allclose(sm, pm, rtol=2e-2)  # bf16 rounding differs with the fusion

    def inner(x, w):  # shard_map inside the autocast function is rewritten too
        return jax.shard_map(lambda a: jnp.exp(a @ w), mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)

    jaxpr = jax.make_jaxpr(jmp_lite.autocast(inner, POLICIES[BF16]))(jnp.ones((4, 3)), jnp.ones((3, 2)))
    assert _dtypes_of(jaxpr.jaxpr, "dot_general") == [(BF16, BF16)]
    assert _dtypes_of(jaxpr.jaxpr, "exp") == [(F32,)]


@pytest.mark.composition
@pytest.mark.parametrize("compute", [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")])
def test_trains_with_loss_scaling_and_dynamic_loss_scale(data, compute):
    params, tokens = data
    f = jmp_lite.autocast(loss_fn, POLICIES[compute])
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**15, period=2))
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        ls = jmp_lite.get_loss_scale(s)
        loss, grads = jax.value_and_grad(lambda q: ls.scale(f(q, tokens)))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, ls.unscale(loss)

    losses = []
    for _ in range(6):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(p.dtype == F32 for p in jax.tree.leaves(params))


@pytest.mark.compiled  # reads the compiled program
def test_same_hlo_op_count_as_casting_by_hand(data):
    params, tokens = data
    from jmp_lite import accumulate

    def by_hand(p, t):
        c = jnp.bfloat16
        x = p["embed"][t]
        w = p["head"]
        h = jax.nn.relu(accumulate.dot_general(x.astype(c), w.astype(c), (((2,), (0,)), ((), ()))))
        return jnp.exp(h.astype(jnp.float32)).sum()

    def plain(p, t):
        return jnp.exp(jax.nn.relu(p["embed"][t] @ p["head"])).sum()

    def count(fn):
        text = jax.jit(jax.value_and_grad(fn)).lower(params, tokens).compile().as_text()
        return sum(1 for line in text.splitlines() if " = " in line and "ROOT" not in line)

    # keeping what casting by hand keeps: the same program
    assert count(jmp_lite.autocast(plain, POLICIES[BF16], remat_float32=False)) == count(by_hand)
    # by default the float32 exp is rebuilt in the backward pass instead of kept: a few more ops,
    # and only 16-bit values kept
    default = jmp_lite.autocast(plain, POLICIES[BF16])
    kept = jmp_lite.memory.residual_bytes(default, params, tokens, argnums=0)
    assert set(kept.by_dtype) <= {"bfloat16", "int32"}  # int32: the token indices' gather
    assert kept.total < jmp_lite.memory.residual_bytes(by_hand, params, tokens, argnums=0).total


def test_forward_mode_and_hessians_of_matmuls():
    def f(x, w):
        return jnp.tanh(x @ w).sum()

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    g = jmp_lite.autocast(f, POLICIES[BF16])
    _, tangent = jax.jvp(lambda a: g(a, w), (x,), (x,))
    np.testing.assert_allclose(tangent, jax.jvp(lambda a: f(a, w), (x,), (x,))[1], rtol=1e-2)
    assert jax.hessian(lambda a: g(a, w))(x).shape == (2, 3, 2, 3)
    # convolutions accumulate through a custom_vjp: no forward mode; their rule turns it off
    k = jnp.ones((4, 3, 3, 3))
    conv = lambda x: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME").sum()  # noqa: E731
    x4 = jnp.ones((1, 3, 8, 8))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(jmp_lite.autocast(conv, POLICIES[BF16]), (x4,), (x4,))
    written = jmp_lite.autocast(conv, POLICIES[BF16], rules={"conv_general_dilated": "compute_no_accumulate"})
    jax.jvp(written, (x4,), (x4,))


def test_float64_values_untouched():
    with jax.enable_x64(True):
        g = jmp_lite.autocast(lambda a, b: (a @ b, jnp.exp(a).sum()), POLICIES[BF16])
        a, b = jnp.ones((2, 3), jnp.float64), jnp.ones((3, 2), jnp.float64)
        jaxpr = jax.make_jaxpr(g)(a, b).jaxpr
        f64 = np.dtype(np.float64)
        assert _dtypes_of(jaxpr, "dot_general") == [(f64, f64)]
        assert _dtypes_of(jaxpr, "exp") == [(f64,)]
        assert [o.dtype for o in g(a, b)] == [f64, f64]


def test_trace_benchmark_measures_the_rewritten_program_at_a_tiny_size(tmp_path, capsys):
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "autocast_trace.py"
    spec = importlib.util.spec_from_file_location("autocast_trace", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "trace.json"
    bench.main(f"--layers 1 --d 16 --heads 2 --seq 8 --vocab 11 --repeats 1 --json {out}".split())
    result = json.loads(out.read_text())
    eqns = result["eqns"]
    # the autocast variants trace the rewritten program (casts, float32 regions): more equations
    assert eqns["autocast"] > eqns["plain"] and eqns["autocast_grad"] > eqns["plain_grad"]
    for ratio in result["ratio"].values():
        assert 0 < ratio < 100
    assert f"autocast/plain: {result['ratio']['autocast/plain']:.2f}x" in capsys.readouterr().out


# --- the rule table holds under differentiation; explicit precision; clear errors.


def _reduce_sum_operands(jaxpr):
    return [np.dtype(e.invars[0].aval.dtype) for e in eqns(jaxpr) if e.primitive.name == "reduce_sum"]


@jax.custom_jvp
def _scale_by_max(y):
    return y * y.max(-1, keepdims=True)


@_scale_by_max.defjvp
def _scale_by_max_jvp(primals, tangents):
    (y,), (t,) = primals, tangents
    m = y.max(-1, keepdims=True)
    return y * m, t * m + y * t[:, :1]  # a user's (rough) rule that broadcasts a 16-bit tangent


BACKWARD_SUMS = {
    "softmax": lambda y: jax.nn.softmax(y),
    "log_softmax": lambda y: jax.nn.log_softmax(y),
    "x_over_x_sum": lambda y: jnp.abs(y) / jnp.abs(y).sum(-1, keepdims=True),
    "minus_max": lambda y: y - y.max(-1, keepdims=True),
    "bias_in_compute_dtype": lambda y: y + y[0],  # a broadcast of a 16-bit row
    "gather": lambda y: y[jnp.array([0, 2, 2, 1])],  # transposes to a scatter-add
    "user_custom_jvp": lambda y: _scale_by_max(y),
}


@pytest.mark.numerics
@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(BACKWARD_SUMS))
def test_backward_sums_run_in_float32_under_grad(name, compute):
    op = BACKWARD_SUMS[name]

    def loss(w, x):
        return jnp.sum(jnp.tanh(op(x @ w)) * jnp.arange(8.0))

    x, w = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.normal(jax.random.key(1), (8, 8))
    cast = jmp_lite.autocast(loss, POLICIES[compute])
    jaxpr = jax.make_jaxpr(jax.grad(cast))(w, x).jaxpr
    sums = _reduce_sum_operands(jaxpr)
    assert sums and all(d == F32 for d in sums), sums
    adds = [e for e in eqns(jaxpr) if e.primitive.name == "scatter-add"]
    assert all(np.dtype(e.invars[0].aval.dtype) == F32 for e in adds)
    got, want = jax.jit(jax.grad(cast))(w, x), jax.grad(loss)(w, x)
    # (bfloat16 rounding can tie two maxima, moving a max's gradient: a loose bound)
    assert got.dtype == F32 and _rel_err(got, want) < (0.08 if compute == BF16 else 0.01)


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_a_gather_of_one_slice_per_row_differentiates_in_16_bits_with_the_float32_values(
    compute, monkeypatch
):
    # take_along_axis (a loss picking each row's label logit) scatters each cotangent into a place of its
    # own: no sum to round, so no float32 copy of the whole [rows, vocabulary] operand; the same bits
    labels = jnp.array([3, 0, 7, 3])

    def loss(w, x):
        logits = x @ w
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)
        return jnp.sum(picked * jnp.arange(1.0, 5.0)[:, None]) + jnp.sum(jax.nn.logsumexp(logits, -1))

    x, w = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.normal(jax.random.key(1), (8, 8))
    cast = jmp_lite.autocast(loss, POLICIES[compute])
    jaxpr = jax.make_jaxpr(jax.grad(cast))(w, x).jaxpr
    adds = [e for e in eqns(jaxpr) if e.primitive.name == "scatter-add"]
    assert adds and all(np.dtype(e.invars[0].aval.dtype) == np.dtype(compute) for e in adds), adds
    got = jax.jit(jax.grad(cast))(w, x)
    # the float32 route it replaces (the gather on a float32 copy, its scatter-add in float32, rounded
    # once): the same bits
    monkeypatch.setattr(dtype_rules, "_gathers_each_place_once", lambda eqn: False)
    routed = jmp_lite.autocast(loss, POLICIES[compute])
    adds = [
        e for e in eqns(jax.make_jaxpr(jax.grad(routed))(w, x).jaxpr) if e.primitive.name == "scatter-add"
    ]
    assert all(np.dtype(e.invars[0].aval.dtype) == F32 for e in adds)  # the switch above took effect
    assert got.dtype == F32 and np.isfinite(got).all()
    np.testing.assert_array_equal(got, jax.jit(jax.grad(routed))(w, x))


def test_equinox_attention_backward_sums_run_in_float32():
    eqx = pytest.importorskip("equinox")
    attention = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=jax.random.key(0))
    params, static = eqx.partition(attention, eqx.is_inexact_array)
    seq = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(p, s):
        return jnp.sum(eqx.combine(p, static)(s, s, s) ** 2)

    for compute in (BF16, F16):
        jaxpr = jax.make_jaxpr(jax.grad(jmp_lite.autocast(loss, POLICIES[compute])))(params, seq).jaxpr
        sums = _reduce_sum_operands(jaxpr)
        assert sums and all(d == F32 for d in sums), (compute, sums)


def test_backward_float32_sums_keep_forward_mode():
    def f(x, w):
        return jnp.sum(jax.nn.softmax(x @ w) * jnp.arange(4.0))

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4)) * 0.3
    g = jmp_lite.autocast(f, POLICIES[BF16], rules={"dot_general": "compute_no_accumulate"})
    _, tangent = jax.jvp(lambda a: g(a, w), (x,), (x,))
    np.testing.assert_allclose(tangent, jax.jvp(lambda a: f(a, w), (x,), (x,))[1], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize(
    "precision",
    ["highest", "float32", lax.Precision.HIGHEST, (lax.Precision.DEFAULT, lax.Precision.HIGHEST)],
    ids=["highest", "float32", "Precision.HIGHEST", "tuple"],
)
def test_explicit_precision_highest_runs_in_float32_under_grad(precision):
    def f(x, w, v):
        precise = jnp.matmul(x, w, precision=precision)  # honoured: float32
        return jnp.sum(jnp.tanh(precise @ v))  # the default: compute dtype

    x, w, v = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((4, 5))
    for compute in (BF16, F16):
        cast = jmp_lite.autocast(f, POLICIES[compute])
        for jaxpr in (
            jax.make_jaxpr(cast)(x, w, v).jaxpr,
            jax.make_jaxpr(jax.grad(cast, (0, 1, 2)))(x, w, v).jaxpr,
        ):
            found = [
                (e.invars[0].aval.shape, _dtypes_of_eqn(e))
                for e in eqns(jaxpr)
                if e.primitive.name == "dot_general"
            ]
            # every contraction touching w (3x4 operands or cotangents) runs in float32
            precise = [d for s, d in found if 3 in s and 4 in s or s == (2, 3)]
            assert precise and all(d == (F32, F32) for d in precise), found
            assert (compute, compute) in [d for _, d in found], found
        np.testing.assert_allclose(jax.grad(cast, 1)(x, w, v), jax.grad(f, 1)(x, w, v), rtol=2e-2)


def _dtypes_of_eqn(e):
    return tuple(np.dtype(v.aval.dtype) for v in e.invars)


def test_context_manager_form_gives_the_decorator_form():
    with pytest.raises(
        TypeError, match=r"not a context manager.*autocast\(fun, policy\).*@jmp_lite.autocast"
    ):
        with jmp_lite.autocast(POLICIES[BF16]):
            pass
    decorated = jmp_lite.autocast(POLICIES[BF16])(lambda x: x @ x)
    assert decorated(jnp.ones((2, 2))).dtype == F32


def test_float32_region_warns_outside_autocast_only():
    def f(x):
        with jmp_lite.float32_region():
            return x @ x

    with pytest.warns(UserWarning, match="outside jmp_lite.autocast"):
        f(jnp.ones((2, 2)))
    with pytest.warns(UserWarning, match="outside jmp_lite.autocast"):
        jax.jit(f)(jnp.ones((2, 3, 3)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp_lite.autocast(f, POLICIES[BF16])(jnp.ones((2, 2)))
        jax.grad(lambda x: jmp_lite.autocast(f, POLICIES[BF16])(x).sum())(jnp.ones((2, 2)))


def test_misspelled_rule_keys_are_refused_with_close_matches():
    with pytest.raises(ValueError, match=r"'expp' is not a JAX primitive name; did you mean 'exp'"):
        jmp_lite.autocast(lambda x: x, POLICIES[BF16], rules={"expp": "float32"})
    with pytest.raises(ValueError, match=r"did you mean 'dot_general'"):
        jmp_lite.autocast(POLICIES[BF16], rules={"dot_genral": "float32"})  # decorator form, at once
    with pytest.raises(ValueError, match=r"'scope:<jax.named_scope name>'"):
        jmp_lite.autocast(lambda x: x, POLICIES[BF16], rules={"Exp": "float32"})
    # real names, any scope, and primitives outside the tables are accepted
    jmp_lite.autocast(
        lambda x: x, POLICIES[BF16], rules={"exp": "follow", "scope:head": "float32", "cos": "float32"}
    )


def test_non_array_output_names_the_user_function():
    def my_model(x):
        return {"y": x * 2, "label": "cat"}

    with pytest.raises(TypeError, match=r"my_model returned a str .*must return arrays"):
        jmp_lite.autocast(my_model, POLICIES[BF16])(jnp.ones(2))
    out = jmp_lite.autocast(lambda x: (x, None, 3.0), POLICIES[BF16])(jnp.ones(2))
    assert out[1] is None and out[0].dtype == F32


def test_the_module_of_autocast_is_jmp_lite_amp_and_the_old_path_warns():
    import jmp_lite.amp as amp
    import jmp_lite.autocast  # the deprecated module path: the name stays the function's

    assert callable(jmp_lite.autocast) and jmp_lite.autocast is amp.autocast
    assert not hasattr(jmp_lite.autocast, "__path__") and amp.explain is jmp_lite.explain
    assert amp.Decision.__name__ == "Decision" and amp.Explanation is jmp_lite.Explanation
    with pytest.warns(DeprecationWarning, match="import explain from jmp_lite.amp"):
        from jmp_lite.autocast import explain
    assert explain is amp.explain
    with pytest.warns(DeprecationWarning, match="jmp_lite.autocast is the function"):
        from jmp_lite.autocast import UnknownPrimitiveWarning
    assert UnknownPrimitiveWarning is amp.UnknownPrimitiveWarning
    with pytest.raises(ImportError, match="no_such_name"):
        from jmp_lite.autocast import no_such_name  # noqa: F401
