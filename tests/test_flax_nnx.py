"""jmp_lite.flax.nnx: policy views of NNX models (inspected as jaxprs) and the skip-safe optimizer."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _jaxpr import in_dtypes
from flax import nnx

import jmp_lite
from jmp_lite import accumulate
from jmp_lite._src.flax.nnx_attention import attention  # deprecated public name: see the test below
from jmp_lite.flax.nnx import LossScaledOptimizer, apply_policy, policy_of, snapshot
from jmp_lite.fp8 import NoFp8ContractionWarning

pytestmark = pytest.mark.unit

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
HALVES = [BF16, F16]


class Net(nnx.Module):
    """Conv, BatchNorm, attention (fused or dropout path), LayerNorm, Linear."""

    def __init__(self, dropout=0.0, *, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            2, 4, 8, dropout_rate=dropout, deterministic=dropout == 0.0, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        h = self.bn(self.conv(x))
        h = h.reshape(h.shape[0], -1, 4)
        h = self.norm(self.attn(h))
        return self.head(h.mean(1))


def traced(view, x, grad=False):
    """The jaxpr of the jitted forward (or gradient) of ``view`` and its state."""
    graphdef, state = nnx.split(view)

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x)

    fn = jax.grad(lambda s, x: fwd(s, x).sum()) if grad else fwd
    return jax.make_jaxpr(jax.jit(fn))(state, x).jaxpr, state


X = jnp.ones((2, 4, 4, 1))


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["fused_attention", "dropout_attention"])
@pytest.mark.parametrize("compute", HALVES)
def test_dots_convs_in_compute_dtype_norms_and_softmax_in_float32(compute, dropout):
    model = Net(dropout, rngs=nnx.Rngs(0))
    view = apply_policy(model, jmp_lite.Policy(F32, compute, F32))
    jaxpr, state = traced(view, X)
    assert all(a.dtype == F32 for a in jax.tree_util.tree_leaves(nnx.state(view, nnx.Param, nnx.BatchStat)))
    dots = in_dtypes(jaxpr, {"dot_general", "conv_general_dilated"})
    assert len(dots) >= 7  # conv, q/k/v/out projections, the two attention matmuls, head
    assert all(d == (compute, compute) for d in dots), dots
    # every reduction (norm statistics, softmax max and sum), rsqrt and exp is float32
    reductions = in_dtypes(jaxpr, {"reduce_sum", "reduce_max", "exp", "rsqrt"})
    assert reductions and all(all(d == F32 for d in ds) for ds in reductions), reductions
    out = jax.jit(lambda s: nnx.merge(nnx.graphdef(view), s)(X))(state)
    assert out.dtype == F32
    # the model itself is untouched: same variables, its own dtypes
    assert view.head.kernel is model.head.kernel and model.head.dtype is None
    assert type(model) is Net and model(X).dtype == F32


@pytest.mark.parametrize("compute", HALVES)
def test_gradients_and_batch_stats_in_param_dtype(compute):
    view = apply_policy(Net(rngs=nnx.Rngs(0)), jmp_lite.Policy(F32, compute, F32))
    grads = nnx.grad(lambda m: m(X).sum())(view)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))
    stats = nnx.state(view, nnx.BatchStat)
    assert all(s.dtype == F32 for s in jax.tree_util.tree_leaves(stats))
    jaxpr, _ = traced(view, X, grad=True)
    dots = in_dtypes(jaxpr, {"dot_general", "conv_general_dilated"})
    assert dots and all(d == (compute, compute) for d in dots), dots


def test_param_dtype_is_the_models_storage_no_fork():
    class Tied(nnx.Module):
        def __init__(self, rngs, dtype=jnp.float32):
            self.a = nnx.Linear(4, 4, param_dtype=dtype, rngs=rngs)
            self.b = nnx.Linear(4, 4, param_dtype=dtype, rngs=rngs)
            self.b.kernel = self.a.kernel  # tied weights

        def __call__(self, x):
            return self.b(self.a(x))

    model = Tied(nnx.Rngs(0))
    # a bare "bf16" would store parameters in bfloat16: a view must not hold copies of its own
    with pytest.raises(ValueError, match="'compute=bf16'"):
        apply_policy(model, "bf16")
    assert model.a.kernel.dtype == F32  # nothing changed
    view = apply_policy(model, "compute=bf16")  # float32 parameters, bfloat16 compute and output
    assert view.model is model and view.a.kernel is model.a.kernel is model.b.kernel
    assert view(jnp.ones((1, 4))).dtype == BF16
    # training the view trains the model the user holds
    optimizer = nnx.Optimizer(view, optax.sgd(0.1), wrt=nnx.Param)
    before = np.asarray(model.a.kernel[...])
    optimizer.update(view, nnx.grad(lambda m: m(jnp.ones((1, 4))).sum())(view))
    assert not np.array_equal(np.asarray(model.a.kernel[...]), before)
    # a bfloat16 model under a bfloat16 policy: its own bfloat16 storage, ties kept
    half = Tied(nnx.Rngs(0), jnp.bfloat16)
    view = apply_policy(half, "bf16")
    assert view.a.kernel is view.b.kernel and view.a.kernel.dtype == BF16
    assert view(jnp.ones((1, 4))).dtype == BF16
    jaxpr, _ = traced(view, jnp.ones((1, 4)))
    assert all(d == (BF16, BF16) for d in in_dtypes(jaxpr, {"dot_general"}))


class Plain(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 16, 16, decode=False, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.attn(self.norm(nnx.relu(self.l1(x))))
        return self.l2(h)


class HandWritten(nnx.Module):
    """Plain with the policy written out by hand with Flax's own dtype arguments."""

    def __init__(self, compute, rngs):
        kw = dict(dtype=compute, param_dtype=jnp.float32, rngs=rngs)
        self.compute = compute
        acc = accumulate.dot_general  # 16-bit matmuls accumulate in float32
        self.l1 = nnx.Linear(8, 16, dot_general=acc, **kw)
        self.norm = nnx.LayerNorm(16, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        attention_fn = (
            nnx.dot_product_attention if compute == BF16 else attention
        )  # XLA:CPU: no f16 x f16 -> f32
        self.attn = nnx.MultiHeadAttention(
            2, 16, 16, decode=False, attention_fn=attention_fn, qkv_dot_general=acc, out_dot_general=acc, **kw
        )
        self.l2 = nnx.Linear(16, 4, dot_general=acc, **kw)

    def __call__(self, x):
        h = self.attn(self.norm(nnx.relu(self.l1(x))).astype(self.compute))
        return self.l2(h).astype(jnp.float32)


def relative_errors(values, reference):
    """Per leaf, |v - r| / |r|; leaves whose true value is 0 (an attention key bias gradient) are skipped."""
    pairs = zip(jax.tree_util.tree_leaves(values), jax.tree_util.tree_leaves(reference))
    return [float(jnp.linalg.norm(v - r) / jnp.linalg.norm(r)) for v, r in pairs if jnp.linalg.norm(r) > 1e-3]


@pytest.mark.numerics
@pytest.mark.parametrize("compute", HALVES)
def test_as_accurate_as_hand_written_dtypes(compute):
    """Outputs and gradients at least as close to the float32 model as Flax's own dtype arguments.

    Not bitwise: the engine runs the attention as a blockwise kernel (float32 statistics, no
    T x T array), and sums the backward pass of broadcasts in float32 where Flax's dtypes sum in 16 bits.
    """
    model = Plain(nnx.Rngs(0))
    view = apply_policy(model, jmp_lite.Policy(F32, compute, F32))
    hand = HandWritten(compute, nnx.Rngs(0))
    assert jax.tree_util.tree_structure(nnx.state(model)) == jax.tree_util.tree_structure(nnx.state(hand))
    tolerance = 0.05 if compute == BF16 else 0.005
    totals = np.zeros((2, 2))  # (outputs, grads) x (ours, hand), summed over inputs

    def outputs(m):
        graphdef = nnx.graphdef(m)
        return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))

    def grads(m):
        graphdef = nnx.graphdef(m)
        return jax.jit(lambda s, x: nnx.grad(lambda m: (m(x) ** 2).sum())(nnx.merge(graphdef, s)))

    # one program per model and measure, run on every input
    models = (model, view, hand)
    programs = [[measure(m) for m in models] for measure in (outputs, grads)]
    for seed in range(3):
        x = jax.random.normal(jax.random.key(seed), (2, 3, 8))
        for i, runs in enumerate(programs):
            reference, *got = (run(nnx.state(m), x) for run, m in zip(runs, models))
            errors = [relative_errors(g, reference) for g in got]
            assert max(errors[0]) < tolerance, (("outputs", "grads")[i], errors[0])
            totals[i] += [sum(e) for e in errors]
    # rounding differs in detail (the errors are those of 16-bit arithmetic either way)
    assert (totals[:, 0] <= 1.25 * totals[:, 1]).all(), totals


def test_rules_by_class_and_path_and_their_errors():
    seq = nnx.Sequential(
        *[nnx.Linear(8, 8, rngs=nnx.Rngs(i)) for i in range(3)], nnx.LayerNorm(8, rngs=nnx.Rngs(3))
    )
    view = apply_policy(seq, "p=f32,c=bf16,o=f32", {nnx.Linear: "p=f32,c=f16,o=f16", r"layers/2": "f32"})
    got = [view.policy_of(m).compute for m in seq.layers]
    assert got == [F16, F16, F32, F32]
    assert policy_of(view, seq.layers[0]) == view.policy_of(seq.layers[0]) and policy_of(view) == view.policy
    jaxpr, _ = traced(view, jnp.ones((2, 8)))
    assert [d[0] for d in in_dtypes(jaxpr, {"dot_general"})] == [F16, F16, F32]
    assert view(jnp.ones((2, 8))).dtype == F32  # the root's output follows policy.output

    with pytest.raises(ValueError, match="matches several path rules"):
        apply_policy(seq, "f32", {r"layers/.": "bf16", r"layers/1": "f16"})
    # an NNX model's modules all exist before it runs: a rule that matches none is an error
    for rules, named in [({"layers/9": "f32"}, "'layers/9'"), ({"Layers/0": "f32"}, "'Layers/0'"),
                         ({nnx.BatchNorm: "f32"}, "BatchNorm")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"rules {named} match no module of Sequential.*'layers/0'"):
            apply_policy(seq, "f32", rules)
    with pytest.raises(TypeError, match="rule keys must be NNX module classes"):
        apply_policy(seq, "f32", {nn.Dense: "bf16"})  # a Linen class on an NNX model
    with pytest.raises(TypeError, match="flax.nnx Module"):
        apply_policy(nn.Dense(3), "f32")
    with pytest.raises(TypeError, match="jmp_lite.flax.nnx.apply_policy"):
        jmp_lite.flax.linen.apply_policy(seq, "f32")
    with pytest.raises(ValueError, match="already a policy view"):
        apply_policy(view, "f32")
    with pytest.raises(TypeError, match="policy_of\\(view, module\\)"):
        policy_of(seq)
    with pytest.raises(ValueError, match="not a module of this view"):
        view.policy_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    defaults_off = apply_policy(seq, "p=f32,c=bf16,o=f32", defaults=False)
    assert defaults_off.policy_of(seq.layers[3]).compute == BF16


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_view_under_nnx_jit_and_vmap():
    view = apply_policy(Plain(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
    x = jnp.ones((4, 2, 3, 8))
    out = nnx.jit(lambda m, x: m(x))(view, x[0])
    assert out.dtype == F32
    batched = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(view, x)
    assert batched.shape == (4, 2, 3, 4) and batched.dtype == F32
    np.testing.assert_allclose(batched[0], out, rtol=1e-2, atol=1e-2)


def test_the_pre_engine_attention_name_is_deprecated_and_still_works():
    with pytest.deprecated_call(match="jmp_lite.attention.dot_product_attention"):
        old = jmp_lite.flax.nnx.attention
    assert old is attention
    assert "attention" not in jmp_lite.flax.nnx.__all__
    with pytest.raises(AttributeError, match="no attribute 'atention'"):
        jmp_lite.flax.nnx.atention  # noqa: B018


@pytest.mark.numerics
def test_attention_dropout_path_matches_float32_reference_and_drops():
    q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8), jnp.bfloat16)
    k, v = jax.random.normal(jax.random.key(1), (2, 2, 5, 2, 8), jnp.bfloat16)  # 2 k/v heads: GQA
    ref = nnx.dot_product_attention(q.astype(F32), k.astype(F32), v.astype(F32), is_causal=True)
    slow = attention(q, k, v, is_causal=True, dropout_rate=0.5, deterministic=False,
                       dropout_rng=jax.random.key(2))  # fmt: skip
    kept = attention(q, k, v, is_causal=True, dropout_rate=0.5, deterministic=True)
    assert slow.dtype == kept.dtype == BF16
    np.testing.assert_allclose(kept.astype(F32), ref, atol=3e-2)
    assert not np.allclose(slow.astype(F32), ref, atol=3e-2)  # dropout did something
    # the sowing path (module given) computes the same values as the fused path
    m = nnx.Module()
    sown = attention(q, k, v, is_causal=True, module=m)
    np.testing.assert_allclose(sown.astype(F32), ref, atol=3e-2)
    assert m.attention_weights[0].dtype == BF16
    with pytest.raises(ValueError, match="dropout_rng"):
        attention(q, k, v, dropout_rate=0.5)


class BNModel(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(4, 10, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.conv(x))).mean((1, 2))
        return self.head(self.drop(h))


def bits(tree):
    leaves = jax.tree_util.tree_leaves(nnx.as_pure(tree))
    raw = [jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in leaves]
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).tobytes() for x in raw]


def make(compute):
    model = BNModel(nnx.Rngs(0))
    view = apply_policy(model, jmp_lite.Policy(F32, compute, F32))
    schedule = optax.linear_schedule(1e-2, 0.0, 100)
    tx = jmp_lite.loss_scaling(optax.adam(schedule), jmp_lite.DynamicLossScale(2.0**15))
    return view, LossScaledOptimizer(view, tx)


@nnx.jit
def train_step(model, optimizer, x, y):
    before = snapshot(model, nnx.BatchStat, nnx.RngState)  # roll dropout's RNG back too

    def loss_fn(model):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return optimizer.loss_scale.scale(loss)

    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads, rollback=before)


@pytest.mark.parametrize("compute", HALVES)
def test_skipped_step_leaves_model_and_optimizer_bitwise_unchanged(compute):
    view, optimizer = make(compute)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    y = jnp.array([0, 1, 2, 3])
    train_step(view, optimizer, x, y)  # a real step first: moments, step, stats and rng move
    assert int(optimizer.step[...]) == 1
    model_before, opt_before = bits(nnx.state(view)), bits(optimizer.opt_state.scaled_inner_state)
    scale_before = float(optimizer.loss_scale.loss_scale)
    train_step(view, optimizer, x.at[0, 0, 0, 0].set(jnp.inf), y)
    assert bits(nnx.state(view)) == model_before
    assert bits(optimizer.opt_state.scaled_inner_state) == opt_before
    assert int(optimizer.step[...]) == 1
    assert float(optimizer.loss_scale.loss_scale) == scale_before / 2
    train_step(view, optimizer, x, y)
    assert int(optimizer.step[...]) == 2 and bits(nnx.state(view)) != model_before


def test_optimizer_errors_are_clear():
    view, optimizer = make(BF16)
    grads = nnx.grad(lambda m: m(jnp.ones((1, 8, 8, 1))).sum())(view)
    before = bits(nnx.state(view))
    with pytest.raises(ValueError, match="rollback=jmp_lite.flax.nnx.snapshot"):
        optimizer.update(view, grads)
    with pytest.raises(TypeError, match="live variables"):
        optimizer.update(view, grads, rollback=nnx.state(view, nnx.BatchStat))
    assert bits(nnx.state(view)) == before and int(optimizer.step[...]) == 0  # nothing half-applied
    optimizer.update(view, grads, rollback=())  # explicit opt-out is allowed
    assert int(optimizer.step[...]) == 1


def test_whole_optimizer_state_is_kept_when_transformations_wrap_loss_scaling():
    view = apply_policy(BNModel(nnx.Rngs(0)), "p=f32,c=f16,o=f32")
    ls = jmp_lite.DynamicLossScale(2.0**15)
    counted = optax.scale_by_schedule(optax.linear_schedule(1.0, 0.0, 10))  # has its own step count
    optimizer = LossScaledOptimizer(view, optax.chain(jmp_lite.loss_scaling(optax.adam(1e-3), ls), counted))
    x, y = jax.random.normal(jax.random.key(1), (4, 8, 8, 1)), jnp.array([0, 1, 2, 3])
    train_step(view, optimizer, x, y)
    before = nnx.as_pure(optimizer.opt_state)
    train_step(view, optimizer, x.at[0, 0, 0, 0].set(jnp.inf), y)
    after = nnx.as_pure(optimizer.opt_state)
    assert bits(after[1]) == bits(before[1])  # the schedule's count did not advance
    assert bits(after[0].scaled_inner_state) == bits(before[0].scaled_inner_state)
    assert float(after[0].loss_scale.loss_scale) == float(before[0].loss_scale.loss_scale) / 2


def test_bad_rollback_fails_before_anything_changes():
    view, optimizer = make(BF16)
    grads = nnx.grad(lambda m: m(jnp.ones((1, 8, 8, 1))).sum())(view)
    before, opt_before = bits(nnx.state(view)), bits(optimizer.opt_state)
    wrong = {"not_a_module": {"mean": jnp.zeros(4)}}
    with pytest.raises(ValueError, match="path the model does not"):
        optimizer.update(view, grads, rollback=nnx.State(wrong))
    assert bits(nnx.state(view)) == before and bits(optimizer.opt_state) == opt_before


def test_tied_and_shared_modules_must_agree_on_their_rules():
    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = self.a  # one module under two names

        def __call__(self, x):
            return self.b(self.a(x))

    model = Shared(nnx.Rngs(0))
    same = apply_policy(model, "p=f32,c=bf16,o=f32", {r"a|b": "f32"})
    assert same.a is same.b and same.policy_of(same.a).compute == F32
    with pytest.raises(ValueError, match="shared at paths"):
        apply_policy(model, "p=f32,c=bf16,o=f32", {r"a": "f32"})  # b would get the model-wide rule

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.b.kernel = self.a.kernel

    with pytest.raises(
        ValueError, match="stores a/.* in float32, but 'a' runs under your rule .* stores parameters in bfl"
    ):
        apply_policy(Tied(nnx.Rngs(0)), "f32", {r"a": "bf16"})  # one tied weight cannot be both


class NotAPytree(nnx.Module, pytree=False):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((3, 3), jnp.bfloat16))  # no param_dtype attribute: cast anyway

    def __call__(self, x):
        return x @ self.w[...].astype(x.dtype)


def test_custom_modules_pytree_false_pickling():
    import pickle

    view = apply_policy(NotAPytree(nnx.Rngs(0)), "p=bf16,c=f32,o=bf16")
    assert view.w.dtype == BF16  # the model's own storage
    out = nnx.jit(lambda m, x: m(x))(view, jnp.ones((2, 3)))
    assert out.dtype == BF16 and jax.tree_util.tree_leaves(nnx.state(view))
    jaxpr, _ = traced(view, jnp.ones((2, 3)))
    assert in_dtypes(jaxpr, {"dot_general"}) == [(F32, F32)]  # compute=f32: w is cast up where it is used
    lin = apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
    again = pickle.loads(pickle.dumps(lin))
    assert type(again) is type(lin) and again(jnp.ones((1, 2))).dtype == F32


def test_bfloat16_parameters_and_a_norm_rule_name_the_rule_and_its_fix():
    """The error blamed the model-wide policy (which said p=bf16) for float32 storage; the cause is the
    float32 rule of the norm layer, and the fix it names runs."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, param_dtype=jnp.bfloat16, rngs=rngs)
            self.bn = nnx.BatchNorm(4, param_dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    with pytest.raises(ValueError, match=r"'bn' runs under the built-in float32 rule for BatchNorm") as e:
        apply_policy(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
    assert "rules={nnx.BatchNorm: 'p=bf16,c=f32,o=bf16'}" in str(e.value)
    with pytest.raises(ValueError, match=r"your rule for 'lin' \(Linear\).* rules=\{nnx.Linear: 'p=bf16,c="):
        apply_policy(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32", rules={nnx.Linear: "f32"}, defaults=False)
    fixed = apply_policy(
        Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32", rules={nnx.BatchNorm: "p=bf16,c=f32,o=bf16"}
    )
    assert fixed(jnp.ones((2, 4))).dtype == F32


def test_bfloat16_parameters_under_several_float32_rules_are_named_in_one_error():
    """A model with BatchNorm and LayerNorm failed on bn, and after its rule on norm: one error names
    every module whose storage its rule does not fit, and one rules= dict (the user's own rules fixed,
    plus one per norm class) that runs."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, param_dtype=jnp.bfloat16, rngs=rngs)
            self.bn = nnx.BatchNorm(4, param_dtype=jnp.bfloat16, rngs=rngs)
            self.norm = nnx.LayerNorm(4, param_dtype=jnp.bfloat16, rngs=rngs)
            self.out = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return self.out(self.norm(self.bn(self.lin(x))))

    for rules in [None, {"out": "f32"}]:
        with pytest.raises(ValueError) as e:
            apply_policy(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32", rules)
        message = str(e.value)
        assert "bn/bias, bn/scale in bfloat16, but 'bn' runs under the built-in float32 rule for" in message
        assert "'norm' runs under the built-in float32 rule for LayerNorm" in message
        assert ("'out' runs under your rule 'out' (Linear)" in message) == bool(rules)
        suggested = message.split("rules=", 1)[1].split("}", 1)[0] + "}"
        fixed = eval(suggested, {"nnx": nnx})  # noqa: S307 -- the dict the message spells out
        assert list(fixed) == (["out"] if rules else []) + [nnx.BatchNorm, nnx.LayerNorm]
        view = apply_policy(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32", fixed)
        assert view(jnp.ones((2, 4))).dtype == F32
        assert [view.policy_of(m).compute for m in (view.bn, view.norm, view.lin)] == [F32, F32, BF16]


class ConvOnly(nnx.Module):
    def __init__(self):
        self.conv = nnx.Conv(1, 2, (3, 3), rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.conv(x).mean((1, 2))


@pytest.mark.parametrize("compute", HALVES)
def test_fp8_on_a_convolution_only_model_warns_once_and_runs_as_without_fp8(compute):
    # the view is built before the model runs: its first call finds that fp8 reads no weight
    policy, x = jmp_lite.Policy(F32, compute, F32), jnp.ones((1, 4, 4, 1))
    model = ConvOnly()
    view = apply_policy(model, policy, fp8="hybrid,current")
    with pytest.warns(NoFp8ContractionWarning, match="no contraction of this model reads a weight"):
        got = nnx.jit(lambda v, x: v(x))(view, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoFp8ContractionWarning)
        view(x)  # once per model structure and config
    want = nnx.jit(lambda v, x: v(x))(apply_policy(model, policy), x)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
