"""The engine runs attention chains as the blockwise kernel under a 16-bit policy (issue 19 section 3):
when it does (no T x T residual, values and gradients close to float32), and when it runs the program
as written instead (attention=False, float32 policy, a float32 region, a user's rule on an op of the chain,
no float32 accumulation)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from flax import nnx

import jmp_lite
import jmp_lite.flax.nnx as jnnx
from jmp_lite.flax.linen import apply_policy
from jmp_lite.memory import residual_bytes

pytestmark = pytest.mark.unit

T, D = 64, 16
BF16 = "p=f32,c=bf16,o=f32"
F16 = "p=f32,c=f16,o=f32"


def attention(q, k, v):
    logits = q @ k.swapaxes(-1, -2) / np.sqrt(D)
    return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -1e9)) @ v


def loss(w, x):
    return jnp.sum(jnp.tanh(attention(x @ w[0], x @ w[1], x @ w[2])))


def square(fun, *args):
    """The [..., T, T] residuals the backward pass of ``fun`` keeps."""
    return residual_bytes(fun, *args, argnums=0).find(trailing_shape=(T, T))


def kernel(fun, *args):
    """Whether ``fun``'s program runs the blockwise attention kernel. (Residuals no longer tell: a chain
    run as written keeps no T x T array either, since the 16-bit checkpoint rebuilds its elementwise
    math from the logits.)"""
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    return any(e.primitive.name == "jit" and e.params["name"] == "_blockwise_attention" for e in eqns(jaxpr))


@pytest.fixture(scope="module")
def inputs():
    w = jax.random.normal(jax.random.key(0), (3, D, D)) / np.sqrt(D)
    return w, jax.random.normal(jax.random.key(1), (2, T, D))


@pytest.mark.numerics
@pytest.mark.parametrize("policy", [BF16, F16])
def test_kernel_keeps_no_t_by_t_and_matches_float32(inputs, policy):
    w, x = inputs
    fun = jmp_lite.autocast(loss, policy)
    assert not square(fun, w, x) and kernel(fun, w, x)
    assert not kernel(jmp_lite.autocast(loss, policy, attention=False), w, x)
    tol = 3e-2 if "bf16" in policy else 4e-3
    value, grads = jax.jit(jax.value_and_grad(fun))(w, x)
    want, want_grads = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, want, rtol=tol)
    assert float(jnp.linalg.norm(grads - want_grads) / jnp.linalg.norm(want_grads)) < tol


def test_float32_policy_runs_the_program_bitwise(inputs):
    w, x = inputs
    assert square(jmp_lite.autocast(loss, "f32"), w, x)
    assert jax.jit(jmp_lite.autocast(loss, "f32"))(w, x) == jax.jit(loss)(w, x)


@pytest.mark.parametrize(
    "rules",
    [{"exp": "follow"}, {"dot_general": "compute_no_accumulate"}, {"scope:attn": "float32"}],
    ids=["rule-on-exp", "no-accumulation", "float32-scope"],
)
def test_a_rule_on_the_chain_runs_it_as_written(inputs, rules):
    w, x = inputs

    def scoped(w, x):
        with jax.named_scope("attn"):
            return loss(w, x)

    assert kernel(jmp_lite.autocast(scoped, BF16), w, x)
    assert not kernel(jmp_lite.autocast(scoped, BF16, rules=rules), w, x)


def test_float32_region_runs_it_as_written(inputs):
    w, x = inputs

    def region(w, x):
        with jmp_lite.float32_region():
            return loss(w, x)

    assert not kernel(jmp_lite.autocast(region, BF16), w, x)


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2)(x, mask=nn.make_causal_mask(x[..., 0])).sum()


class NNXAttention(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(2, D, D, decode=False, rngs=rngs)

    def __call__(self, x):
        return self.attn(x, mask=nnx.make_causal_mask(x[..., 0])).sum()


@pytest.mark.parametrize("policy", [BF16, F16])
def test_flax_front_ends_take_the_option(inputs, policy):
    _, x = inputs
    module = LinenAttention()
    params = apply_policy(module, "f32").init(jax.random.key(0), x)
    for flag in (True, False):
        model = apply_policy(module, policy, attention=flag)
        assert kernel(model.apply, params, x) is flag
        if flag:
            assert not square(model.apply, params, x)
    for flag in (True, False):
        view = jnnx.apply_policy(NNXAttention(nnx.Rngs(0)), policy, attention=flag)
        graphdef, state = nnx.split(view)
        assert kernel(lambda s, g=graphdef: nnx.merge(g, s)(x), state) is flag
    with pytest.raises(TypeError, match="attention must be True or False"):
        apply_policy(module, policy, attention="yes")


def _loops(jaxpr):
    return sum(e.primitive.name in ("scan", "while") for e in eqns(jaxpr))


@pytest.mark.parametrize("policy", [BF16, F16])
def test_the_backward_pass_keeps_the_kernels_statistics_instead_of_running_its_loops_again(policy):
    # 512 positions: blocks of 128 in lax loops, a nest of two loops (scan over query blocks, while over
    # key blocks) forward and one backward. The engine's rematerialization (remat_float32) keeps the
    # kernel's float32 output and row statistics; without them the backward pass would run the forward
    # nest again (six loops instead of four) to rebuild its own residuals.
    t = 512

    def long_attention(w, x):
        q, k, v = (x @ w[i] for i in range(3))
        logits = q @ k.swapaxes(-1, -2) / np.sqrt(D)
        causal = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        return jnp.sum(jnp.tanh(jax.nn.softmax(causal) @ v))

    w = jax.random.normal(jax.random.key(0), (3, D, D)) / np.sqrt(D)
    x = jax.random.normal(jax.random.key(1), (2, t, D))
    remat = jmp_lite.autocast(long_attention, policy)
    plain = jmp_lite.autocast(long_attention, policy, remat_float32=False)
    assert _loops(jax.make_jaxpr(remat)(w, x).jaxpr) == 2
    assert _loops(jax.make_jaxpr(jax.grad(remat))(w, x).jaxpr) == 4
    assert _loops(jax.make_jaxpr(jax.grad(plain))(w, x).jaxpr) == 4
    kept = residual_bytes(remat, w, x, argnums=0)
    assert kept.find(dtype="float32", trailing_shape=(t,)), kept  # row statistics: numbers per row
    got, want = jax.jit(lambda w, x: (jax.grad(remat)(w, x), jax.grad(plain)(w, x)))(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
