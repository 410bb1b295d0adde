"""apply_policy on Linen models: inspect the traced program, not just output dtypes."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import in_dtypes

import jmp_lite
from jmp_lite import accumulate
from jmp_lite.flax.linen import apply_policy
from jmp_lite.fp8 import NoFp8ContractionWarning

pytestmark = pytest.mark.unit

F32 = np.dtype(jnp.float32)
HALVES = [np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]


class Net(nn.Module):
    """Conv, Dense, LayerNorm, BatchNorm and attention: every rule the defaults have."""

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Conv(4, (3, 3))(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = h.reshape(h.shape[0], -1, 4)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h)
        h = nn.LayerNorm()(h)
        return nn.Dense(3)(h.mean(1))


def setup_net(compute):
    model = apply_policy(Net(), jmp_lite.Policy(F32, compute, F32))
    x = jnp.ones((2, 4, 4, 1))
    variables = model.init(jax.random.key(0), x)
    return model, variables, x


@pytest.mark.parametrize("compute", HALVES)
def test_dots_and_convs_run_in_compute_dtype_params_in_param_dtype(compute):
    model, variables, x = setup_net(compute)
    assert all(a.dtype == F32 for a in jax.tree_util.tree_leaves(variables))
    jaxpr = jax.make_jaxpr(jax.jit(lambda v, x: model.apply(v, x)))(variables, x).jaxpr
    dots = in_dtypes(jaxpr, {"dot_general", "conv_general_dilated"})
    assert len(dots) >= 6  # conv, q/k/v/out projections, the two attention einsums, dense
    assert all(d == (compute, compute) for d in dots), dots
    assert jax.jit(model.apply)(variables, x).dtype == F32


@pytest.mark.parametrize("compute", HALVES)
def test_gradients_reach_the_optimizer_in_param_dtype(compute):
    model, variables, x = setup_net(compute)
    grads = jax.jit(jax.grad(lambda v: model.apply(v, x).sum()))(variables)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("compute", HALVES)
def test_norm_statistics_and_softmax_stay_float32(compute):
    model, variables, x = setup_net(compute)
    jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x).jaxpr
    # every reduction (norm statistics, softmax max and sum) and every exp (softmax) is float32
    reductions = in_dtypes(jaxpr, {"reduce_sum", "reduce_max", "exp", "rsqrt"})
    assert reductions and all(all(d == F32 for d in ds) for ds in reductions), reductions
    # batch statistics under training are float32 too
    _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert all(a.dtype == F32 for a in jax.tree_util.tree_leaves(updates))


def test_norm_defaults_can_be_turned_off_or_overridden():
    norm = nn.LayerNorm()
    on = apply_policy(Net(), "p=f32,c=bf16,o=f32")
    off = apply_policy(Net(), "p=f32,c=bf16,o=f32", defaults=False)
    ruled = apply_policy(Net(), "p=f32,c=bf16,o=f32", {nn.LayerNorm: "p=f32,c=bf16,o=bf16"})
    assert on.policy_of(norm) == jmp_lite.Policy(F32, F32, jnp.bfloat16)  # float32 inside, bf16 out
    assert off.policy_of(norm) == on.policy  # the model-wide policy
    assert ruled.policy_of(norm).compute == np.dtype(jnp.bfloat16)
    # (Flax's own norms also reduce in float32 via force_float32_reductions; the default
    # matters for their scale/bias dtype and for custom normalization modules.)


def hand_attention(query, key, value, **kwargs):
    """Float32 softmax; both matmuls in the compute dtype, accumulating in float32."""

    def weights_value(subscripts, weights, value):
        return accumulate.einsum(subscripts, weights.astype(value.dtype), value)

    kwargs.pop("precision", None)
    kwargs["force_fp32_for_softmax"] = True  # Flax passes only the kwargs a signature names
    return nn.dot_product_attention(
        query,
        key,
        value,
        qk_attn_weights_einsum=accumulate.einsum,
        attn_weights_value_einsum=weights_value,
        **kwargs,
    )


class HandWritten(nn.Module):
    """The same model with every dtype written by hand, as a Flax user would."""

    compute: object

    @nn.compact
    def __call__(self, x, train=False):
        c, f32, acc = self.compute, jnp.float32, accumulate.dot_general
        h = nn.relu(nn.Dense(16, dtype=c, param_dtype=f32, dot_general=acc)(x))
        h = nn.BatchNorm(use_running_average=not train, dtype=f32, param_dtype=f32)(h).astype(c)
        h = h.reshape(h.shape[0], 4, 4)
        h = nn.MultiHeadDotProductAttention(
            num_heads=2,
            dtype=c,
            param_dtype=f32,
            force_fp32_for_softmax=True,
            attention_fn=hand_attention,
            qkv_dot_general=acc,
            out_dot_general=acc,
        )(h)
        h = nn.LayerNorm(dtype=f32, param_dtype=f32)(h).astype(c)
        return nn.Dense(4, dtype=c, param_dtype=f32, dot_general=acc)(h.reshape(h.shape[0], -1)).astype(f32)


class Plain(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(16)(x))
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h.reshape(h.shape[0], 4, 4))
        h = nn.LayerNorm()(h)
        return nn.Dense(4)(h.reshape(h.shape[0], -1))


def relative_errors(values, reference):
    """Per leaf, |v - r| / |r|; leaves whose true value is 0 (an attention key bias gradient) are skipped."""
    pairs = zip(jax.tree_util.tree_leaves(values), jax.tree_util.tree_leaves(reference))
    return [float(jnp.linalg.norm(v - r) / jnp.linalg.norm(r)) for v, r in pairs if jnp.linalg.norm(r) > 1e-3]


@pytest.mark.numerics
@pytest.mark.parametrize("compute", HALVES)
def test_as_accurate_as_hand_written_dtypes(compute):
    """Dense, BatchNorm, attention and LayerNorm: what a Flax user would write by hand.

    Outputs (inference and training, with the updated batch statistics) and gradients are at
    least as close to the float32 model's as the hand-written model's. Not bitwise: the
    engine keeps attention logits in float32 for the float32 softmax (Flax rounds them to the
    compute dtype first) and sums the backward pass of broadcasts (bias gradients, norm
    statistics) in float32 where Flax's dtypes sum in 16 bits.
    """
    ours = apply_policy(Plain(), jmp_lite.Policy(F32, compute, F32))
    hand = HandWritten(compute)
    tolerance = 0.05 if compute == jnp.bfloat16 else 0.005
    totals = np.zeros((2, 2))  # (outputs, grads) x (ours, hand), summed over inputs

    def outputs(model):
        return jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))

    def grads(model):
        loss = lambda params, v, x: (model.apply({**v, "params": params}, x) ** 2).sum()
        return jax.jit(lambda v, x: jax.grad(loss)(v["params"], v, x))

    # one program per model and measure, run on every input
    programs = [[measure(m) for m in (Plain(), ours, hand)] for measure in (outputs, grads)]
    for seed in range(3):
        x = jax.random.normal(jax.random.key(seed), (8, 8))
        v = ours.init(jax.random.key(0), x)
        assert jax.tree_util.tree_structure(v) == jax.tree_util.tree_structure(
            hand.init(jax.random.key(0), x)
        )
        for i, (plain, *models) in enumerate(programs):
            reference = plain(v, x)
            errors = [relative_errors(m(v, x), reference) for m in models]
            assert max(errors[0]) < tolerance, (("outputs", "grads")[i], errors[0])
            totals[i] += [sum(e) for e in errors]
    # rounding differs in detail (the errors are those of 16-bit arithmetic either way)
    assert (totals[:, 0] <= 1.25 * totals[:, 1]).all(), totals
    jaxpr = jax.make_jaxpr(jax.grad(lambda v: ours.apply(v, x).sum()))(v).jaxpr
    assert all(d == (compute, compute) for d in in_dtypes(jaxpr, {"dot_general"}))


def test_rules_by_class_and_path_and_their_errors():
    x = jnp.ones((2, 8))
    seq = nn.Sequential([nn.Dense(8), nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    model = apply_policy(seq, "p=f32,c=bf16,o=f32", {nn.Dense: "p=f32,c=f16,o=f16", r"layers_3": "f32"})
    v = model.init(jax.random.key(0), x)
    bound = seq.bind(v)
    got = [model.policy_of(m) for m in bound.layers]
    assert [p.compute for p in got] == [np.dtype(jnp.float16)] * 2 + [F32, F32]
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(v).jaxpr
    assert [d[0] for d in in_dtypes(jaxpr, {"dot_general"})] == [np.dtype(jnp.float16)] * 2 + [F32]

    clash = apply_policy(seq, "f32", {r"layers_.": "bf16", r"layers_1": "f16"})
    with pytest.raises(ValueError, match="matches several path rules"):
        clash.init(jax.random.key(0), x)

    class A(nn.Dense):
        pass

    class Mixin:
        pass

    class B(A, Mixin):
        pass

    ok = apply_policy(B(3), "f32", {A: "bf16", nn.Dense: "f16"})  # most derived class wins
    assert ok.policy_of(B(3)).compute == np.dtype(jnp.bfloat16)
    with pytest.raises(TypeError, match="rule keys"):
        apply_policy(seq, "f32", {3: "bf16"})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        apply_policy(seq, "f32", {"layers_(": "bf16"})
    with pytest.raises(ValueError, match="unknown dtype"):
        apply_policy(seq, "p=f32,c=bf15")


def test_rules_that_match_no_module_warn():
    """Linen modules exist only while the model runs (and may depend on its inputs): a warning."""
    seq = nn.Sequential([nn.Dense(8), nn.Dense(2)])
    x = jnp.ones((2, 4))
    for rules, named in [({"Dense_9": "f32"}, "'Dense_9'"), ({"Layers_0": "f32"}, "'Layers_0'"),
                         ({nn.LayerNorm: "f32"}, "LayerNorm")]:  # fmt: skip
        model = apply_policy(seq, "p=f32,c=bf16,o=f32", rules)
        with pytest.warns(UserWarning, match=f"rules {named} match no module of Sequential.*'layers_0'"):
            model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule that matches stays silent, under jit too
        model = apply_policy(seq, "p=f32,c=bf16,o=f32", {"layers_1": "f32"})
        jax.jit(model.apply)(model.init(jax.random.key(0), x), x)


def test_policy_is_part_of_what_jit_traces():
    x = jnp.ones((2, 8))
    base = Plain()
    v = apply_policy(base, "f32").init(jax.random.key(0), x)
    apply = jax.jit(lambda m, v: m.apply(v, x), static_argnums=0)
    bf = apply(apply_policy(base, "p=f32,c=bf16,o=bf16"), v)
    f16 = apply(apply_policy(base, "p=f32,c=f16,o=f16"), v)
    assert bf.dtype == jnp.bfloat16 and f16.dtype == jnp.float16
    # the same module object applied plainly is untouched by earlier policy calls
    assert base.apply(v, x).dtype == jnp.float32


class ScanRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(8)(x)

        class Cell(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.Dense(8)(c), None

        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan()(x, None)  # the model as written for float32: its carry is float32
        return x


class SetupStyle(nn.Module):
    def setup(self):
        self.a = nn.Dense(8)
        self.norm = nn.LayerNorm()
        self.b = nn.Dense(2)

    def __call__(self, x):
        return self.b(self.norm(self.a(x)))


@pytest.mark.parametrize("net", [ScanRemat(), SetupStyle()], ids=["scan_remat", "setup"])
def test_scan_remat_and_setup_style(net):
    model = apply_policy(net, "p=f32,c=bf16,o=f32")
    x = jnp.ones((2, 8))
    v = model.init(jax.random.key(0), x)
    assert all(a.dtype == F32 for a in jax.tree_util.tree_leaves(v))
    jaxpr = jax.make_jaxpr(jax.jit(lambda v: model.apply(v, x)))(v).jaxpr
    dots = in_dtypes(jaxpr, {"dot_general"})
    assert dots and all(d == (np.dtype(jnp.bfloat16),) * 2 for d in dots), dots
    grads = jax.grad(lambda v: model.apply(v, x).sum())(v)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))


def test_public_methods_like_embed_attend_run_under_the_policy():
    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(16, 8)
            return embed.attend(nn.Dense(8)(embed(tokens)))  # output projection tied to the embedding

    model = apply_policy(TiedLM(), "p=f32,c=bf16,o=f32")
    tokens = jnp.arange(4)[None]
    v = model.init(jax.random.key(0), tokens)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, tokens))(v).jaxpr
    dots = in_dtypes(jaxpr, {"dot_general"})
    assert len(dots) == 2 and all(d == (np.dtype(jnp.bfloat16),) * 2 for d in dots), dots


class TiedHead(nn.Module):
    """Hugging Face GPT-2's and BERT's tied head: a setup submodule applied with ``.apply`` to the
    transposed embedding; ``Wrapped`` nests it (BERT's cls/predictions/decoder)."""

    def setup(self):
        self.embed = nn.Embed(16, 8)
        self.head = nn.Dense(16, use_bias=False)

    def __call__(self, tokens):
        return self.head.apply({"params": {"kernel": self.embed.embedding.T}}, self.embed(tokens))


class Wrapped(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return TiedHead(name="lm")(tokens)


class Unnamed(nn.Module):  # a module made with parent=None and applied: Flax gives it no name
    @nn.compact
    def __call__(self, tokens):
        table = self.param("table", nn.initializers.normal(), (16, 8))
        return nn.Dense(16, use_bias=False, parent=None).apply({"params": {"kernel": table.T}}, table[tokens])


def _head_dots(model, tokens):
    v = model.init(jax.random.key(0), tokens)
    return [d.ran for d in jmp_lite.explain(model)(v, tokens).find(primitive="dot_general")]


def test_a_module_applied_inside_the_model_has_the_path_of_its_attribute():
    tokens = jnp.arange(4)[None]
    bf16 = (np.dtype(jnp.bfloat16).name,) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each rule reaches the head: no "match no module"
        assert _head_dots(apply_policy(TiedHead(), "p=f32,c=bf16,o=f32"), tokens) == [bf16]
        for net, rules in [(TiedHead(), {"head": "f32"}), (Wrapped(), {"lm/head": "f32"}),
                           (TiedHead(), {nn.Dense: "f32"}), (Unnamed(), {nn.Dense: "f32"})]:  # fmt: skip
            model = apply_policy(net, "p=f32,c=bf16,o=f32", rules)
            assert _head_dots(model, tokens) == [("float32",) * 2], rules
    # the other paths are the model's own: the head's rule does not spill onto the embedding
    model = apply_policy(TiedHead(), "p=f32,c=bf16,o=f32", {"embed": "f16", "Dense.*": "f32"})
    with pytest.warns(UserWarning, match="rules 'Dense.\\*' match no module of TiedHead.*'embed', 'head'"):
        model.init(jax.random.key(0), tokens)
    # without a name there is no path: a path rule is told to be a class rule
    model = apply_policy(Unnamed(), "p=f32,c=bf16,o=f32", {"Dense.*": "f32"})
    without = r"without a path \(Dense applied with \.apply\(\) inside the model's top module\).*class rule"
    with pytest.warns(UserWarning, match=without):
        assert _head_dots(model, tokens) == [bf16]


class ConvOnly(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(2, (3, 3))(x).mean((1, 2))


@pytest.mark.parametrize("compute", HALVES)
def test_fp8_on_a_convolution_only_model_warns_at_init_and_applies_as_without_fp8(compute):
    # Hugging Face FlaxResNet: init made an empty "fp8" collection that apply then refused
    policy, x = jmp_lite.Policy(F32, compute, F32), jnp.ones((1, 4, 4, 1))
    model = apply_policy(ConvOnly(), policy, fp8="hybrid,delayed,history=4")
    with pytest.warns(NoFp8ContractionWarning, match="no contraction of this model reads a weight"):
        variables = model.init(jax.random.key(0), x)
    assert variables["fp8"] == {}
    plain = apply_policy(ConvOnly(), policy)
    got = jax.jit(model.apply)(variables, x)
    assert np.asarray(got).tobytes() == np.asarray(jax.jit(plain.apply)(variables, x)).tobytes()
    with pytest.raises(ValueError, match="which these variables lack"):  # no collection at all: still refused
        model.apply({"params": variables["params"]}, x)


def test_the_linen_names_at_jmp_lite_flax_still_work_and_say_where_they_moved():
    import jmp_lite.flax
    import jmp_lite.flax.linen as linen

    for name in ("apply_policy", "PolicyApplied", "DEFAULT_FLOAT32_MODULES"):
        with pytest.warns(DeprecationWarning, match=rf"use jmp_lite.flax.linen.{name} "):
            assert getattr(jmp_lite.flax, name) is getattr(linen, name)
    with pytest.raises(AttributeError, match="'jmp_lite.flax' has no attribute 'no_such_name'"):
        jmp_lite.flax.no_such_name  # noqa: B018
