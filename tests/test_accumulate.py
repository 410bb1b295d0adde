"""Float32 accumulation of 16-bit contractions: jmp_lite.accumulate and the Flax policies using it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from flax import nnx
from jax import lax

import jmp_lite
from jmp_lite import accumulate
from jmp_lite.flax import nnx as jnnx
from jmp_lite.flax.linen import apply_policy

pytestmark = pytest.mark.unit

F32 = np.dtype(jnp.float32)
HALVES = [np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]


def contractions(jaxpr):
    """(operand dtypes, preferred_element_type) of every dot_general and conv in the program."""
    return [
        (tuple(np.dtype(v.aval.dtype) for v in e.invars), e.params.get("preferred_element_type"))
        for e in eqns(jaxpr)
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]


def rand(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape).astype(dtype)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", HALVES)
def test_dot_and_conv_gradients_take_16_bit_operands_and_accumulate_in_float32(dtype):
    x, w = rand(0, (3, 4, 64), dtype), rand(1, (3, 64, 5), dtype)
    dims = (((2,), (1,)), ((0,), (0,)))  # batched matmul
    im, k = rand(2, (2, 3, 8, 8), dtype), rand(3, (4, 3, 3, 3), dtype)

    def loss(x, w, im, k):
        y = accumulate.dot_general(x, w, dims)
        z = accumulate.conv_general_dilated(im, k, (2, 2), "SAME", rhs_dilation=(2, 1))
        assert y.dtype == z.dtype == dtype
        return y.astype(jnp.float32).sum() + (z.astype(jnp.float32) ** 2).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, im, k).jaxpr
    found = contractions(jaxpr)
    # forward dot and conv, then two gradient contractions each (traced forward copies included)
    assert len(found) >= 6
    assert all(ops == (dtype, dtype) and pet == F32 for ops, pet in found), found

    def reference(x, w, im, k):
        x, w, im, k = (a.astype(jnp.float32) for a in (x, w, im, k))
        y = lax.dot_general(x, w, dims, precision="highest")
        z = lax.conv_general_dilated(im, k, (2, 2), "SAME", rhs_dilation=(2, 1), precision="highest")
        return y.sum() + (z.astype(dtype).astype(jnp.float32) ** 2).sum()

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, im, k)
    want = jax.grad(reference, argnums=(0, 1, 2, 3))(x, w, im, k)
    for g, r in zip(got, want):
        assert g.dtype == dtype
        tol = 2**-7 if dtype == jnp.bfloat16 else 2**-10
        np.testing.assert_allclose(
            g.astype(jnp.float32), r, rtol=4 * tol, atol=4 * tol * float(jnp.abs(r).max())
        )


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_other_dtypes_are_plain_lax_and_vmap_and_second_order_reverse_work():
    a, b = rand(0, (4, 8), jnp.float32), rand(1, (8, 3), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    plain = jax.make_jaxpr(lambda a, b: lax.dot_general(a, b, dims))(a, b)
    ours = jax.make_jaxpr(lambda a, b: accumulate.dot_general(a, b, dims))(a, b)
    assert str(plain) == str(ours)  # float32 programs are unchanged
    asked = accumulate.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, preferred_element_type=F32
    )
    assert asked.dtype == F32  # an explicit preferred_element_type is honoured
    h, hb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    batched = jax.vmap(lambda r: accumulate.einsum("j,jk->k", r, hb))(h)
    np.testing.assert_array_equal(batched, accumulate.einsum("ij,jk->ik", h, hb))
    f = lambda h: (accumulate.einsum("ij,jk->ik", h, hb).astype(jnp.float32) ** 2).sum()
    hess_vec = jax.grad(lambda h: jnp.vdot(jax.grad(f)(h).astype(jnp.float32), jnp.ones_like(a)))(h)
    assert hess_vec.dtype == jnp.bfloat16 and bool(jnp.isfinite(hess_vec.astype(F32)).all())
    # forward mode: the tangent contraction is the same 16-bit, float32-accumulating dot
    _, tangent = jax.jvp(f, (h,), (jnp.ones_like(h),))
    _, reference = jax.jvp(lambda h: (jnp.dot(h.astype(F32), b) ** 2).sum(), (h,), (jnp.ones_like(h),))
    np.testing.assert_allclose(tangent, reference, rtol=2e-2)
    x, k = rand(2, (1, 3, 8, 8), jnp.bfloat16), rand(3, (4, 3, 3, 3), jnp.bfloat16)
    conv = lambda x: accumulate.conv_general_dilated(x, k, (1, 1), "SAME").astype(F32).sum()
    with pytest.raises(TypeError, match="custom_vjp"):  # convolutions: the documented limitation
        jax.jvp(conv, (x,), (x,))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3,))(x)
        for _ in range(2):
            x = nn.LayerNorm()(nn.relu(nn.Dense(16)(x)))
        x = nn.MultiHeadDotProductAttention(num_heads=2)(x)
        return nn.Dense(2)(x.mean(1))


@pytest.mark.parametrize("compute", HALVES)
@pytest.mark.parametrize("accumulated", [True, False])
def test_linen_policy_accumulates_in_float32_forward_and_backward(compute, accumulated):
    model = apply_policy(MLP(), jmp_lite.Policy(F32, compute, F32), accumulate=accumulated)
    x = jnp.ones((4, 6, 3))
    variables = model.init(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(jax.jit(jax.grad(lambda v: model.apply(v, x).sum())))(variables).jaxpr
    found = contractions(jaxpr)
    assert len(found) >= 3 * 8  # conv, 3 dense, q/k/v/out, 2 attention einsums; each forward + 2 grads
    assert all(ops == (compute, compute) for ops, _ in found), found
    assert all((pet == F32) == accumulated for _, pet in found), found


@pytest.mark.parametrize("compute", HALVES)
def test_nnx_policy_accumulates_in_float32_and_can_be_turned_off(compute):
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Conv(3, 8, (3,), rngs=rngs),
        nnx.Linear(8, 16, rngs=rngs),
        nnx.LinearGeneral(16, (2, 8), rngs=rngs),
        nnx.Einsum("btnd,ndf->btf", (2, 8, 4), rngs=rngs),
    )
    x = jnp.ones((4, 6, 3))
    for accumulated in (True, False):
        view = jnnx.apply_policy(model, jmp_lite.Policy(F32, compute, F32), accumulate=accumulated)
        graphdef, state = nnx.split(view)
        grad = jax.grad(lambda s, g=graphdef: nnx.merge(g, s)(x).sum())
        found = contractions(jax.make_jaxpr(grad)(state).jaxpr)
        assert len(found) >= 4 + 7  # 4 forward, 7 gradient contractions (x needs none)
        assert all(ops == (compute, compute) for ops, _ in found), found
        assert all((pet == F32) == accumulated for _, pet in found), found
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        jnnx.apply_policy(model, "p=f32,c=bf16,o=f32", accumulate="yes")
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        apply_policy(MLP(), "p=f32,c=bf16,o=f32", accumulate=1)


def test_a_model_s_own_fp8_contraction_is_kept():
    def mine(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        e4m3 = jnp.float8_e4m3fn
        return lax.dot_general(lhs.astype(e4m3), rhs.astype(e4m3), dimension_numbers, precision, jnp.float32)

    model = apply_policy(nn.Dense(4, dot_general=mine), "p=f32,c=bf16,o=f32")
    v = model.init(jax.random.key(0), jnp.ones((2, 3)))
    found = contractions(jax.make_jaxpr(lambda v: model.apply(v, jnp.ones((2, 3))))(v).jaxpr)
    assert found == [((np.dtype(jnp.float8_e4m3fn),) * 2, F32)]  # as the model wrote it


@pytest.mark.parametrize("mask", [False, True])
def test_fused_attention_path_matches_the_hand_written_one(mask):
    from jmp_lite._src.flax.nnx_attention import attention  # deprecated: jmp_lite.flax.nnx.attention

    q, k, v = (rand(i, (2, 8, 4, 16), jnp.bfloat16) for i in range(3))
    m = jnp.tril(jnp.ones((8, 8), bool))[None, None] if mask else None
    hand = jax.jit(lambda q, k, v: attention(q, k, v, mask=m, fused=False))(q, k, v)
    fused = jax.jit(lambda q, k, v: attention(q, k, v, mask=m, fused=True))(q, k, v)
    assert fused.dtype == hand.dtype == jnp.bfloat16
    np.testing.assert_allclose(fused.astype(F32), hand.astype(F32), atol=2e-2, rtol=2e-2)
    # fused: jmp_lite.attention.dot_product_attention (its own backward pass), not the hand-written softmax
    jaxprs = [
        str(jax.make_jaxpr(lambda q, f=f: attention(q, k, v, mask=m, fused=f))(q)) for f in (True, False)
    ]
    assert "custom_vjp_call" in jaxprs[0] and "custom_vjp_call" not in jaxprs[1]
    with pytest.raises(ValueError, match="fused=True takes no dropout"):
        attention(q, k, v, fused=True, dropout_rate=0.5, dropout_rng=jax.random.key(0))
