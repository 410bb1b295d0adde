"""Every contraction layout runs under autocast in bf16 and f16: forward, jax.grad, jit, vmap.

XLA:CPU without AMX has no kernel for some 16-bit x 16-bit -> float32 dot layouts (it
fails at run time with "Unsupported element type for DotThunk::Execute"); these tests run
the layouts JAX, Flax and Equinox produce and check the program keeps 16-bit operands
with float32 accumulation (no silent float32 fallback).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from jax import lax

import jmp_lite

pytestmark = pytest.mark.numerics

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
POLICIES = {BF16: "p=f32,c=bf16,o=f32", F16: "p=f32,c=f16,o=f32"}
DTYPES = pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])


def _rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape) / np.sqrt(shape[-1])


def _vmapped_matvec(w, x):
    return jax.vmap(lambda v: w.T @ v)(x)  # as equinox.nn.Linear computes under vmap


# name: (function of (a, b), shape of a, shape of b)
LAYOUTS = {
    "matmul": (lambda a, b: a @ b, (8, 24), (24, 16)),
    "matvec": (lambda a, b: a @ b, (8, 24), (24,)),
    "vmapped_matvec": (_vmapped_matvec, (24, 16), (8, 24)),
    "vector_matrix": (lambda a, b: a @ b, (24,), (24, 16)),
    "vector_vector": (lambda a, b: a @ b, (24,), (24,)),
    "lhs_transposed": (lambda a, b: a.T @ b, (24, 8), (24, 16)),
    "rhs_transposed": (lambda a, b: a @ b.T, (8, 24), (16, 24)),
    "both_transposed": (lambda a, b: a.T @ b.T, (24, 8), (16, 24)),
    "batched": (lambda a, b: a @ b, (3, 8, 24), (3, 24, 16)),
    "batched_lhs_middle": (lambda a, b: jnp.einsum("bkm,bkn->bmn", a, b), (3, 24, 8), (3, 24, 16)),
    "batched_matvec": (lambda a, b: jnp.einsum("bmk,bk->bm", a, b), (3, 8, 24), (3, 24)),
    "einsum_two_batch_dims": (
        lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b),
        (2, 3, 8, 24),
        (2, 3, 16, 24),
    ),
    "einsum_batch_last": (lambda a, b: jnp.einsum("qdh,kdh->hqk", a, b), (8, 24, 3), (16, 24, 3)),
    "einsum_two_contracting": (lambda a, b: jnp.einsum("mkl,kln->mn", a, b), (8, 6, 4), (6, 4, 16)),
    "outer": (lambda a, b: lax.dot_general(a, b, (((), ()), ((), ()))), (8,), (16,)),
    "outer_matrix_vector": (lambda a, b: jnp.einsum("ij,k->ijk", a, b, optimize=False), (8, 4), (16,)),
    "rank3_x_matrix": (lambda a, b: a @ b, (3, 8, 24), (24, 16)),
    "conv1d": (lambda a, b: lax.conv_general_dilated(a, b, (1,), "SAME"), (2, 4, 16), (6, 4, 3)),
    "conv2d": (lambda a, b: lax.conv_general_dilated(a, b, (2, 1), "SAME"), (2, 4, 8, 8), (6, 4, 3, 3)),
    "conv2d_groups": (
        lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "VALID", feature_group_count=2),
        (2, 4, 8, 8),
        (6, 2, 3, 3),
    ),
}


def _contractions(jaxpr):
    return [
        (tuple(np.dtype(v.aval.dtype) for v in e.invars), e.params.get("preferred_element_type"))
        for e in eqns(jaxpr)
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]


def _close(got, want, compute):
    # relative error of the whole result: 16-bit operands round each input once (2^-8 in
    # bfloat16, 2^-11 in float16), and float32 accumulation keeps sums from adding more
    eps = 2**-8 if compute == BF16 else 2**-11
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype == F32
        err = float(jnp.linalg.norm((g - w).ravel()) / (jnp.linalg.norm(w.ravel()) + 1e-30))
        assert err < 16 * eps, (err, g.shape)


@DTYPES
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_forward_grad_jit_vmap(layout, compute):
    f, sa, sb = LAYOUTS[layout]
    a, b = _rand(0, sa), _rand(1, sb)

    def loss(a, b):
        y = f(a, b)
        return jnp.sum(jnp.tanh(y) * y)  # a cotangent that is not all ones

    cast = jmp_lite.autocast(loss, POLICIES[compute])
    grad = jax.jit(jax.grad(cast, argnums=(0, 1)))
    _close(jax.jit(cast)(a, b), loss(a, b), compute)
    _close(grad(a, b), jax.grad(loss, argnums=(0, 1))(a, b), compute)
    # a batch of problems under vmap, forward and backward
    a2, b2 = jnp.stack([a, 2 * a]), jnp.stack([b, b])
    _close(jax.jit(jax.vmap(grad))(a2, b2), jax.vmap(jax.grad(loss, argnums=(0, 1)))(a2, b2), compute)
    # forward and gradient contractions: 16-bit operands, float32 accumulation, never float32 operands
    found = _contractions(jax.make_jaxpr(jax.grad(cast, argnums=(0, 1)))(a, b).jaxpr)
    assert len(found) >= 3, found
    assert all(ops == (compute, compute) and pet == F32 for ops, pet in found), found


def _relu_matvec_mlp(params, x):
    def one(v):
        for i, (w, b) in enumerate(params):
            v = w.T @ v + b
            v = jax.nn.relu(v) if i < len(params) - 1 else v
        return v

    return jax.vmap(one)(x)


@DTYPES
def test_vmapped_matvec_mlp_trains_under_jit_grad(compute):
    # The layout that crashed XLA:CPU: JAX's gradient of a vmapped matvec transposes the
    # cotangent, and XLA folded that transpose into a bf16 x bf16 -> f32 dot it had no kernel for.
    sizes = [16, 64, 64, 4]
    params = [(_rand(i, (m, n)), jnp.zeros(n)) for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]
    x = _rand(9, (512, 16))

    def loss(params, x):
        return jnp.mean(_relu_matvec_mlp(params, x) ** 2)

    cast = jmp_lite.autocast(loss, POLICIES[compute])
    got = jax.jit(jax.grad(cast))(params, x)
    _close(got, jax.grad(loss)(params, x), compute)
    found = _contractions(jax.make_jaxpr(jax.grad(cast))(params, x).jaxpr)
    assert found and all(ops == (compute, compute) and pet == F32 for ops, pet in found), found


@pytest.mark.composition
@DTYPES
def test_equinox_mlp_attention_and_matvec_mlp_under_autocast_grad(compute):
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.key(0), 4)
    mlp = eqx.nn.MLP(16, 4, width_size=64, depth=2, key=keys[0])
    attention = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=keys[1])
    x = _rand(2, (64, 16))
    seq = _rand(3, (4, 8, 16))

    def loss(models, x, seq):
        mlp, attention = models
        a = jax.vmap(mlp)(x)
        b = jax.vmap(lambda s: attention(s, s, s))(seq)
        return jnp.sum(a**2) + jnp.sum(b**2)  # sums: float16 cotangents stay normal numbers

    models = (mlp, attention)
    params, static = eqx.partition(models, eqx.is_inexact_array)

    def by_params(p, x, seq):
        return loss(eqx.combine(p, static), x, seq)

    cast = jmp_lite.autocast(by_params, POLICIES[compute])
    got = jax.jit(jax.grad(cast))(params, x, seq)
    want = jax.grad(by_params)(params, x, seq)
    _close(got, want, compute)
    found = _contractions(jax.make_jaxpr(jax.grad(cast))(params, x, seq).jaxpr)
    assert found and all(ops == (compute, compute) and pet == F32 for ops, pet in found), found


@pytest.mark.unit
def test_accumulate_refuses_python_lists_like_lax_with_a_clear_message():
    from jmp_lite import accumulate

    dims = (((0,), (0,)), ((), ()))
    with pytest.raises(TypeError, match=r"accumulate.dot_general: operand 0 is a list.*jax.numpy.asarray"):
        accumulate.dot_general([1.0, 2.0], jnp.ones(2, jnp.bfloat16), dims)
    with pytest.raises(TypeError, match=r"operand 1 is a tuple"):
        accumulate.conv_general_dilated(jnp.ones((1, 1, 4)), (1.0, 2.0), (1,), "SAME")
    with pytest.raises(TypeError, match="as a JAX value"):  # jax.lax refuses lists as well
        lax.dot_general([1.0, 2.0], jnp.ones(2), dims)
    np_operand = np.ones(2, np.float32)  # numpy arrays are arrays: accepted, as by lax
    assert accumulate.dot_general(np_operand, np_operand, dims) == 2.0
