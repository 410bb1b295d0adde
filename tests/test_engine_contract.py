"""The engine keeps the program's math on programs nobody here wrote (issue 27): one named test per
defect that was found on main, and the open primitive model.

1. scatter-add in every form compiles under 16-bit policies;
2. eager (un-jitted) derivatives through 16-bit contractions run on every XLA:CPU kind;
3. collectives, sharding and naming primitives follow their operands; unknown primitives warn;
5. ``remat_float32`` changes memory only, not values;
6. nested ``autocast`` honours the inner policy; ``pmap`` bodies are rewritten like ``shard_map``;
7. compiled op names (profiles) show no engine marks; ``explain`` says what the engine did.
(Item 4, the attention kernel, is tests/test_attention_exact.py.)
"""

import functools
import re
import warnings

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite._src.engine import decisions
from jmp_lite.amp import UnknownPrimitiveWarning

pytestmark = pytest.mark.unit

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
POLICIES = {"bf16": "p=f32,c=bf16,o=f32", "f16": "p=f32,c=f16,o=f32"}


def _dtypes(jaxpr, name):
    return [tuple(np.dtype(v.aval.dtype) for v in e.invars) for e in eqns(jaxpr) if e.primitive.name == name]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --- 1. scatter-add ----------------------------------------------------------------------------------

_X = jax.random.normal(jax.random.key(0), (6, 5))
_W = jax.random.normal(jax.random.key(1), (5, 3))
_IDX = jnp.array([0, 2, 2, 1, 3, 0])

# Each scatter's result is returned or feeds a matmul: a result read only by float32 ops (a sum)
# would be computed in float32 anyway and hide the 16-bit scatter.
SCATTERS = {
    "at_add_constant": lambda x, w, i: jnp.zeros((4, 3)).at[i].add(x @ w),
    "segment_sum": lambda x, w, i: jax.ops.segment_sum(x @ w, i, num_segments=4) @ w.T,
    "bincount_weights": lambda x, w, i: jnp.bincount(i, weights=(x @ w)[:, 0], length=4),
    "at_mul_16_bit_operand": lambda x, w, i: (x @ w).at[i[:2]].mul(2.0) @ w.T,
    "at_max_16_bit_operand": lambda x, w, i: (x @ w).at[i[:2]].max(0.5) @ w.T,
    "at_min_16_bit_operand": lambda x, w, i: (x @ w).at[i[:2]].min(0.5) @ w.T,
}


@pytest.mark.numerics
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", SCATTERS)
def test_scatter_add_in_every_form_compiles_and_runs_under_16_bit_policies(name, policy):
    g = jmp_lite.autocast(SCATTERS[name], POLICIES[policy])
    fn = lambda x, w, i: jnp.sum(SCATTERS[name](x, w, i) ** 2)  # noqa: E731
    loss = lambda x, w, i: jnp.sum(g(x, w, i) ** 2)  # noqa: E731
    ref, ref_grad = fn(_X, _W, _IDX), jax.grad(fn, argnums=(0, 1))(_X, _W, _IDX)
    eager = loss(_X, _W, _IDX)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(_X, _W, _IDX)
    assert np.isfinite(float(eager)) and float(eager) == pytest.approx(float(value), rel=1e-5)
    tol = 0.05 if policy == "bf16" else 0.01  # 16-bit matmul operands; the sums run in float32
    assert _rel(value, ref) < tol
    for got, want in zip(grads, ref_grad):
        assert _rel(got, want) < 2 * tol


def test_scatter_add_sums_in_float32():
    # 4096 bf16 updates into one slot: summed in bf16 the total would stall at 256 (ulp 2 > 1)
    f = lambda u: jnp.zeros(2).at[jnp.zeros(4096, jnp.int32)].add(u)  # noqa: E731
    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, POLICIES["bf16"]))(jnp.ones(4096)).jaxpr
    assert _dtypes(jaxpr, "scatter-add") == [(F32, np.dtype(np.int32), F32)]
    out = jax.jit(jmp_lite.autocast(lambda u: f(u.astype(jnp.bfloat16)), POLICIES["bf16"]))(jnp.ones(4096))
    assert float(out[0]) == 4096.0


# --- 2. eager derivatives ------------------------------------------------------------------------------


@pytest.mark.parametrize("subscripts", ["bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", "ij,kj->ik"])
def test_eager_grad_through_bf16_einsums_runs_without_jit(subscripts):
    # XLA:CPU without AMX (AMD EPYC with AVX512-BF16) has no BF16 x BF16 = F32 kernel for some layouts:
    # un-jitted, each dot used to be compiled alone in the layout JAX's transpose gives it and failed
    sizes = {"b": 2, "q": 6, "h": 2, "d": 8, "k": 5, "i": 3, "j": 4}
    lhs, rhs = subscripts.split("->")[0].split(",")
    a = jax.random.normal(jax.random.key(2), tuple(sizes[c] for c in lhs))
    b = jax.random.normal(jax.random.key(3), tuple(sizes[c] for c in rhs))
    g = jmp_lite.autocast(lambda a, b: jnp.einsum(subscripts, a, b), POLICIES["bf16"])
    loss = lambda a, b: jnp.sum(g(a, b) ** 2)  # noqa: E731
    eager = jax.grad(loss, argnums=(0, 1))(a, b)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    for x, y in zip(eager, jitted):
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2)


def test_eager_forward_over_reverse_through_bf16_autocast():
    w = jax.random.normal(jax.random.key(4), (6, 6)) / 3
    x = jax.random.normal(jax.random.key(5), (4, 6))
    f = lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))  # noqa: E731
    g = jmp_lite.autocast(f, "p=f32,c=bf16,o=f32")
    hess = jax.jacfwd(jax.grad(g))(w)  # un-jitted: dispatched op by op
    assert hess.shape == (6, 6, 6, 6)
    assert _rel(hess, jax.jacfwd(jax.grad(f))(w)) < 0.05


# --- 3. the open primitive model -----------------------------------------------------------------------


def _mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


@pytest.mark.composition
@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("policy", POLICIES)
def test_with_sharding_constraint_keeps_16_bit_activations_in_a_sharded_model(policy):
    mesh = _mesh()
    rows = NamedSharding(mesh, P("d", None))

    def mlp(params, x):  # a two-layer MLP, activations sharded over the batch
        h = jnp.tanh(x @ params["w1"])
        h = jax.lax.with_sharding_constraint(h, rows)
        return jnp.mean((h @ params["w2"]) ** 2)

    params = {"w1": jnp.ones((16, 32)) / 4, "w2": jnp.ones((32, 8)) / 8}
    x = jax.device_put(jax.random.normal(jax.random.key(6), (64, 16)), rows)
    g = jmp_lite.autocast(mlp, POLICIES[policy])
    jaxpr = jax.make_jaxpr(jax.grad(g))(params, x).jaxpr
    compute = BF16 if policy == "bf16" else F16
    constrained = _dtypes(jaxpr, "sharding_constraint")
    assert constrained and all(d == (compute,) for d in constrained), constrained  # forward and backward
    # no float32 copy of the activation next to the constraint
    for e in eqns(jaxpr):
        if e.primitive.name == "sharding_constraint":
            assert e.outvars[0].aval.dtype == compute
    value, grads = jax.jit(jax.value_and_grad(g))(params, x)
    assert _rel(value, mlp(params, x)) < 0.02
    assert grads["w1"].sharding.is_fully_replicated and grads["w1"].dtype == F32


@pytest.mark.parametrize("identity", ["name", "constraint"])
def test_a_name_or_sharding_constraint_changes_no_value_under_a_16_bit_policy(identity):
    """Found by the fuzzer: an annotation between an elementwise op and the float32 ops that read it
    made the op round to 16 bits where the same program without it did not (a constraint), and a named
    16-bit result was kept for the backward pass, so rounded under grad only (a name)."""
    rows = NamedSharding(_mesh(), P(None, None))

    def f(w, x, annotate=True):
        h = jnp.tanh(jnp.tanh(x @ w))
        if annotate:
            h = (
                jax.ad_checkpoint.checkpoint_name(h, "h")
                if identity == "name"
                else jax.lax.with_sharding_constraint(h, rows)
            )
        return jnp.mean(h**2)

    w, x = jax.random.normal(jax.random.key(1), (8, 8)), jax.random.normal(jax.random.key(2), (4, 8))
    values = [
        jax.jit(jax.value_and_grad(jmp_lite.autocast(functools.partial(f, annotate=a), POLICIES["bf16"])))(
            w, x
        )[0]
        for a in (True, False)
    ]
    called = jax.jit(jmp_lite.autocast(f, POLICIES["bf16"]))(w, x)
    assert values[0] == values[1] == called, (values, called)


def test_checkpoint_name_follows_so_a_user_remat_policy_saves_the_16_bit_value():
    def f(w, x):
        h = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x @ w), "h")
        return jnp.sum(jnp.sin(h @ w.T))

    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("h"))
    g = jmp_lite.autocast(remat, POLICIES["bf16"], remat_float32=False)
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    assert _dtypes(jax.make_jaxpr(g)(w, x).jaxpr, "name") == [(BF16,)]
    kept = jmp_lite.memory.residual_bytes(g, w, x)
    named = [r for r in kept.residuals if r.kind == "computed" and r.primitive == "name"]
    assert [(r.dtype, r.shape) for r in named] == [("bfloat16", (4, 8))]


def test_top_k_device_put_and_psum_follow_their_operands():
    mesh = _mesh()

    def f(x, w):
        y = x @ w
        vals, _ = jax.lax.top_k(y, 2)
        moved = jax.device_put(vals)
        summed = jax.shard_map(
            lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False
        )(y)
        return moved.sum() + summed.sum()

    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, POLICIES["bf16"]))(jnp.ones((8, 4)), jnp.ones((4, 4))).jaxpr
    assert _dtypes(jaxpr, "top_k") == [(BF16,)]
    assert _dtypes(jaxpr, "device_put") == [(BF16,)]
    assert _dtypes(jaxpr, "psum") == [(BF16,)]


_custom_p = jcore.Primitive("jmp_lite_test_unknown")
_custom_p.def_impl(lambda x: x * 2)
_custom_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_custom_p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
ad.deflinear2(_custom_p, lambda ct, x: [ct * 2])
batching.defvectorized(_custom_p)


def test_unknown_primitive_runs_as_written_and_warns_once_under_a_16_bit_policy():
    decisions.WARNED.discard("jmp_lite_test_unknown")
    f = lambda x, w: jnp.sum(_custom_p.bind(x @ w) @ w.T)  # noqa: E731
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.warns(UnknownPrimitiveWarning) as record:
        jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, POLICIES["bf16"]))(x, w).jaxpr
    messages = [str(r.message) for r in record if "jmp_lite_test_unknown" in str(r.message)]
    assert len(messages) == 1 and "rules={'jmp_lite_test_unknown': 'follow'}" in messages[0]
    assert _dtypes(jaxpr, "jmp_lite_test_unknown") == [(F32,)]  # as traced: a visible round trip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per primitive
        jax.make_jaxpr(jmp_lite.autocast(lambda x, w: f(x, w) * 2, POLICIES["bf16"]))(x, w)
        # a float32 policy changes no dtype: no warning
        jax.make_jaxpr(jmp_lite.autocast(f, "f32"))(x, w)
    # a rule is the documented way to give it a class
    ruled = jmp_lite.autocast(f, POLICIES["bf16"], rules={"jmp_lite_test_unknown": "follow"})
    assert _dtypes(jax.make_jaxpr(ruled)(x, w).jaxpr, "jmp_lite_test_unknown") == [(BF16,)]


def test_explicitly_sharded_nested_jit_is_rewritten_with_its_shardings():
    mesh = _mesh()
    rows = NamedSharding(mesh, P("d", None))
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w), in_shardings=(rows, None), out_shardings=rows)
    f = lambda x, w: jnp.sum(inner(x, w) ** 2)  # noqa: E731
    x, w = jnp.ones((16, 4)) / 2, jnp.ones((4, 4)) / 4
    g = jmp_lite.autocast(f, POLICIES["bf16"])
    jaxpr = jax.make_jaxpr(g)(x, w).jaxpr
    assert (BF16, BF16) in _dtypes(jaxpr, "dot_general")
    calls = [e for e in eqns(jaxpr) if e.primitive.name == "jit" and e.params["out_shardings"][0] == rows]
    assert calls and calls[0].outvars[0].aval.dtype == BF16
    assert _rel(jax.jit(g)(x, w), f(x, w)) < 0.02


# --- 5. remat_float32 changes memory only ---------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_remat_float32_gives_the_same_value_inside_and_outside_grad(policy):
    x = jax.random.normal(jax.random.key(7), (64, 16))
    w = jax.random.normal(jax.random.key(8), (16, 16)) / 4

    def f(x, w):  # the bf16 add rounds at 300's ulp (2.0): only XLA's fusion skips that rounding
        return jnp.var(x @ w + 300.0)

    g = jax.jit(jmp_lite.autocast(f, POLICIES[policy]))
    vg = jax.jit(jax.value_and_grad(jmp_lite.autocast(f, POLICIES[policy]), argnums=1))
    called, (inside, grad) = g(x, w), vg(x, w)
    assert float(called) == pytest.approx(float(inside), rel=1e-6)
    without = jax.jit(
        jax.value_and_grad(jmp_lite.autocast(f, POLICIES[policy], remat_float32=False), argnums=1)
    )
    value, grad_without = without(x, w)
    assert float(inside) == pytest.approx(float(value), rel=1e-6)
    assert _rel(grad, grad_without) < 1e-2


# --- 6. nesting --------------------------------------------------------------------------------------


def test_nested_autocast_honours_the_inner_policy():
    inner = jmp_lite.autocast(lambda x, w: x @ w, "f32")
    outer = jmp_lite.autocast(lambda x, w: jnp.tanh(inner(x, w)) @ w, POLICIES["bf16"])
    x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    dots = _dtypes(jax.make_jaxpr(outer)(x, w).jaxpr, "dot_general")
    assert (F32, F32) in dots and (BF16, BF16) in dots and len(dots) == 2
    # the reverse nesting keeps the inner 16-bit policy
    inner16 = jmp_lite.autocast(lambda x, w: x @ w, POLICIES["bf16"])
    outer32 = jmp_lite.autocast(lambda x, w: jnp.tanh(inner16(x, w)) @ w, "f32")
    dots = _dtypes(jax.make_jaxpr(outer32)(x, w).jaxpr, "dot_general")
    assert (F32, F32) in dots and (BF16, BF16) in dots
    # as float32_region does
    region = jmp_lite.autocast(lambda x, w: jnp.tanh(_in_region(x, w)) @ w, POLICIES["bf16"])
    assert (F32, F32) in _dtypes(jax.make_jaxpr(region)(x, w).jaxpr, "dot_general")


def _in_region(x, w):
    with jmp_lite.float32_region():
        return x @ w


def test_pmap_inside_autocast_is_rewritten_like_shard_map():
    x = jax.random.normal(jax.random.key(9), (16, 8))
    w = jax.random.normal(jax.random.key(10), (8, 8)) / 3
    f = lambda w, x: jax.pmap(lambda xb: jnp.tanh(xb @ w).sum())(x.reshape(8, 2, 8)).sum()  # noqa: E731
    g = jmp_lite.autocast(f, POLICIES["bf16"])
    assert (BF16, BF16) in _dtypes(jax.make_jaxpr(g)(w, x).jaxpr, "dot_general")
    assert _rel(g(w, x), f(w, x)) < 0.02
    doc = open("docs/autocast.md").read()
    assert "pmap` (`xla_pmap`) and other primitives not listed inside the function run as written" not in doc


# --- 7. clean profiles and explain ----------------------------------------------------------------------


def _op_names(compiled_text):
    return set(re.findall(r'op_name="([^"]*)"', compiled_text))


@pytest.mark.compiled  # reads the compiled program
def test_compiled_op_names_carry_no_engine_marks():
    def f(x, w):
        with jax.named_scope("block"):
            h = jnp.tanh(x @ w)
        with jmp_lite.float32_region():
            return jnp.sum(jax.nn.softmax(h @ w))

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    g = jmp_lite.autocast(f, POLICIES["bf16"])
    names = _op_names(jax.jit(jax.grad(g, argnums=1)).lower(x, w).compile().as_text())
    assert any("block/" in n for n in names), names
    assert not any("#jmp" in n for n in names), sorted(n for n in names if "#jmp" in n)


@pytest.mark.compiled  # reads the compiled program
def test_linen_module_names_in_compiled_ops_are_the_users():
    nn = pytest.importorskip("flax.linen")
    from jmp_lite.flax.linen import apply_policy

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.LayerNorm()(nn.Dense(8)(x)))

    model = apply_policy(Net(), POLICIES["bf16"])
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    text = jax.jit(lambda v: model.apply(v, x).sum()).lower(variables).compile().as_text()
    names = _op_names(text)
    assert any("Dense_0" in n for n in names) and any("LayerNorm_0" in n for n in names)
    assert not any("#jmp" in n for n in names)


def test_explain_names_each_decision_and_its_reason():
    def f(x, w, i):
        with jmp_lite.float32_region():
            h = jnp.tanh(x @ w)
        s = jnp.zeros((4, 8)).at[i].add(h @ w.T)
        precise = jnp.matmul(h, w, precision="highest")
        q = (h @ w).reshape(2, 2, 4, 2)
        return jnp.sum(jax.nn.dot_product_attention(q, q, q)) + s.sum() + precise.sum()

    x, w, i = jnp.ones((4, 8)), jnp.ones((8, 8)) / 8, jnp.array([0, 1, 2, 3])
    e = jmp_lite.explain(f, POLICIES["bf16"])(x, w, i)
    dots = e.find(primitive="dot_general", kind="op")
    reasons = {d.reason for d in dots}
    assert "inside float32_region" in reasons
    assert "precision=HIGHEST asked for float32" in reasons
    assert any(d.ran == ("bfloat16", "bfloat16") and "accumulated in float32" in d.reason for d in dots)
    (scatter,) = e.find(primitive="scatter-add")
    assert scatter.mode == "float32" and scatter.ran[0] == "float32"
    (attention,) = e.find(kind="attention")
    assert "the blockwise attention kernel" in attention.reason  # this CPU; cuDNN on a CUDA GPU
    assert e.residuals is not None and e.residuals.total > 0
    text = str(e)
    for part in ("Contractions", "float32", "Attention chains", "kernel", "Kept for the backward pass"):
        assert part in text
    # the reported dtypes are the program's: as many bf16 contractions as the jaxpr has
    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, POLICIES["bf16"]))(x, w, i).jaxpr
    bf16_dots = sum(1 for d in _dtypes(jaxpr, "dot_general") if d == (BF16, BF16))
    explained = sum(n for d, n in zip(e.events, e.counts) if d.kind == "op" and d.ran == ("bfloat16",) * 2)
    assert explained + 2 == bf16_dots  # + the attention kernel's two contractions


def test_explain_reports_unknown_primitives_and_a_linen_model():
    nn = pytest.importorskip("flax.linen")
    from jmp_lite.flax.linen import apply_policy

    decisions.WARNED.add("jmp_lite_test_unknown")  # the warning is the other test's subject
    e = jmp_lite.explain(lambda x: jnp.sum(_custom_p.bind(x @ x)), POLICIES["bf16"])(jnp.ones((3, 3)))
    assert e.unknown_primitives == ("jmp_lite_test_unknown",)
    assert "Primitives without a rule" in str(e)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.LayerNorm()(nn.Dense(8)(x)))

    model = apply_policy(Net(), POLICIES["bf16"])
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    e = jmp_lite.explain(model)(variables, x)
    norm = e.find(scope="LayerNorm_0", mode="float32")
    assert norm and all("float32" in d.reason for d in norm)
    assert {d.ran for d in e.find(primitive="dot_general")} == {("bfloat16", "bfloat16")}
    assert e.residuals.total > 0
    with pytest.raises(ValueError, match="own policy"):
        jmp_lite.explain(model, "f32")
    with pytest.raises(TypeError, match="needs a policy"):
        jmp_lite.explain(lambda x: x)


# --- typed PRNG keys (new-style jax.random.key) pass through every entry point ------------------------


@pytest.mark.composition
def test_typed_random_keys_pass_through_autocast_fp8_and_the_report():
    def f(w, x, key):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.9, h.shape)  # dropout
        return jnp.sum(jnp.where(keep, h / 0.9, 0.0) @ w.T)

    w, x, key = jnp.ones((8, 8)) / 8, jnp.ones((4, 8)), jax.random.key(0)
    for options in ({}, {"fp8": "hybrid,current"}):
        out = jmp_lite.autocast(f, POLICIES["bf16"], **options)(w, x, key)
        assert np.isfinite(float(out))
    report = jmp_lite.precision_report(f, "p=f32,c=f16,o=f32")(w, x, key)
    assert report.activations.count.size > 0 and np.isfinite(np.asarray(report.loss)).all()


def test_custom_jvp_rule_closing_over_a_traced_value_is_differentiated_not_crashed():
    # found by the differential fuzzer: the rule's closure holds a tracer of the finished trace
    # (jax.extend.core.jaxpr_as_fun fails the same way); the body is differentiated instead, and said so
    def f(x, w):
        v = w[0]

        @jax.custom_jvp
        def g(y):
            return jnp.sin(y) * v

        @g.defjvp
        def g_jvp(primals, tangents):
            (y,), (ty,) = primals, tangents
            return g(y), jnp.cos(y) * v * ty

        return g(x @ w).sum()

    x, w = jax.random.normal(jax.random.key(11), (2, 3)), jax.random.normal(jax.random.key(12), (3, 3))
    decisions.WARNED.discard("custom_jvp_closure")
    # (w itself is not differentiated: plain JAX cannot differentiate a rule's closure either)
    with pytest.warns(UserWarning, match="closes over a value computed inside the function"):
        got = jax.jit(jax.grad(jmp_lite.autocast(f, "f32")))(x, w)
    want = jax.grad(f)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert _rel(jax.grad(jmp_lite.autocast(f, POLICIES["bf16"]))(x, w), want) < 0.03


def test_rules_naming_no_scope_and_a_report_without_arrays_are_refused_clearly():
    with pytest.raises(ValueError, match="names no scope"):
        jmp_lite.autocast(lambda x: x, POLICIES["bf16"], rules={"scope:": "float32"})
    with pytest.raises(ValueError, match="no array argument"):
        jmp_lite.precision_report(lambda: jnp.float32(1.0), "p=f32,c=f16,o=f32")()


def test_explain_says_why_an_attention_chain_runs_as_written():
    def f(q, k, v):
        precise = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest")
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(precise), v)
        over_queries = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-2)  # not attention
        b = jnp.einsum("bhqk,bkhd->bqhd", over_queries, v)
        return a.sum() + b.sum() + jax.nn.dot_product_attention(q, k, v, is_causal=True).sum()

    q = jax.random.normal(jax.random.key(13), (2, 16, 4, 8))
    e = jmp_lite.explain(f, POLICIES["bf16"])(q, q, q)
    reasons = [d.reason for d in e.find(kind="attention_declined")]
    assert any("precision=HIGHEST" in r for r in reasons) and len(reasons) == 2, reasons
    assert len(e.find(kind="attention")) == 1
    assert "declined" in str(e) and "precision=HIGHEST" in str(e)
    # under a float32 policy the kernel never runs, and explain says so
    f32 = jmp_lite.explain(jax.nn.dot_product_attention, "f32")(q, q, q)
    (declined,) = f32.find(kind="attention_declined")
    assert "16-bit policies only" in declined.reason
