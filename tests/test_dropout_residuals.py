"""Dropout under a 16-bit policy: the backward pass keeps the 1-byte keep mask, as float32 JAX does,
not the 4-byte random bits (``uint32``) it was drawn from; masks built from iotas stay rebuilt, and the
gradients are the same with and without ``remat_float32``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax.nnx as jnnx
from jmp_lite.flax.linen import apply_policy
from jmp_lite.memory import residual_bytes

pytestmark = pytest.mark.unit

BF16 = "p=f32,c=bf16,o=f32"
ROWS, IN, HIDDEN = 256, 512, 1024
MASK = (ROWS, HIDDEN)  # the dropout mask of the (ROWS, HIDDEN) activation


def _masks(m, shape):
    """The computed non-floating residuals of ``shape``: (dtype, primitive) pairs."""
    return sorted((r.dtype, r.primitive) for r in m.find() if r.shape == shape and "float" not in r.dtype)


def _check_mask_kept_as_bool(f32, bf16, shape):
    """bf16 keeps the dropout mask as float32 does: one bool of the activation's shape, no random bits."""
    assert _masks(f32, shape) == [("bool", "lt")]  # jax.random.bernoulli's comparison
    assert [dtype for dtype, _ in _masks(bf16, shape)] == ["bool"]
    assert not bf16.find(dtype="uint32") and not bf16.find(dtype="int32")
    not_float = sum(r.bytes for r in bf16.find() if "float" not in r.dtype)
    assert not_float == int(np.prod(shape)) == sum(r.bytes for r in f32.find(dtype="bool"))
    # with the mask, only the 16-bit matmul result: 2 + 1 bytes per element
    assert bf16.total == 3 * int(np.prod(shape)) < f32.total


def dropout_mlp(w, x, key):
    h = x @ w
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0)
    return jnp.sum(jax.nn.gelu(h))


def test_plain_jax_dropout_keeps_a_bool_mask_and_the_same_gradient():
    w, x, key = jnp.ones((IN, HIDDEN)), jnp.ones((ROWS, IN)), jax.random.key(0)
    f32 = residual_bytes(dropout_mlp, w, x, key, argnums=0)
    bf16 = residual_bytes(jmp_lite.autocast(dropout_mlp, BF16), w, x, key, argnums=0)
    _check_mask_kept_as_bool(f32, bf16, MASK)  # before: a (256, 1024) uint32 from `or`, 1572864 bytes in all
    # the same key draws the same mask with and without the checkpoint: the gradients agree bit for bit
    w = jax.random.normal(jax.random.key(1), (16, 32)) / 4
    x = jax.random.normal(jax.random.key(2), (8, 16))
    grads = [
        jax.jit(jax.grad(jmp_lite.autocast(dropout_mlp, BF16, remat_float32=remat)))(w, x, key)
        for remat in (True, False)
    ]
    np.testing.assert_array_equal(*grads)
    # and the mask is the one float32 draws: the rows it zeroes have no gradient in either
    dropped = ~jax.random.bernoulli(key, 0.9, (8, 32))
    assert dropped.any() and not np.asarray(grads[0])[:, dropped.all(axis=0)].any()


class LinenMLP(nn.Module):
    train: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.1, deterministic=not self.train)(nn.Dense(HIDDEN)(x))
        return nn.Dense(10)(nn.gelu(h)).sum()


def test_linen_dropout_keeps_a_bool_mask_and_the_same_gradient():
    x = jax.ShapeDtypeStruct((ROWS, IN), jnp.float32)
    params = jax.eval_shape(apply_policy(LinenMLP(train=False), "f32").init, jax.random.key(0), x)
    key = jax.random.key(1)
    kept = {}
    for policy in ("f32", BF16):
        model = apply_policy(LinenMLP(), policy)
        loss = lambda p, x, k, model=model: model.apply(p, x, rngs={"dropout": k})  # noqa: E731
        kept[policy] = residual_bytes(loss, params, x, key, argnums=0)
    _check_mask_kept_as_bool(*kept.values(), MASK)  # before: uint32 from `or`, 1572864 bytes in all

    x = jax.random.normal(jax.random.key(2), (8, 16))
    params = apply_policy(LinenMLP(train=False), "f32").init(jax.random.key(0), x)
    grads = []
    for remat in (True, False):
        model = apply_policy(LinenMLP(), BF16, remat_float32=remat)
        grad = jax.jit(jax.grad(lambda p, model=model: model.apply(p, x, rngs={"dropout": key})))(params)
        grads.append(jax.tree_util.tree_leaves(grad))
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.dropout(self.dense(x)))).sum()


def test_nnx_dropout_keeps_a_bool_mask():
    x = jax.ShapeDtypeStruct((ROWS, IN), jnp.float32)
    kept = {}
    for policy in ("f32", BF16):
        view = jnnx.apply_policy(nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0, dropout=1))), policy)
        graphdef, params, rest = nnx.split(view, nnx.Param, ...)

        def loss(params, rest, x, graphdef=graphdef):
            return nnx.merge(graphdef, params, rest)(x)  # the RNG count moves inside this trace only

        kept[policy] = residual_bytes(loss, params, rest, x, argnums=0)
    _check_mask_kept_as_bool(*kept.values(), MASK)  # before: uint32 from `or`, 1572864 bytes in all


B, H, T, D = 2, 4, 64, 16


def attention_with_dropout(q, k, v, key):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]  # built from iotas: rebuilt, never kept
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    keep = jax.random.bernoulli(key, 0.9, weights.shape)
    weights = jnp.where(keep, weights / 0.9, 0.0)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v).sum()


def test_attention_weight_dropout_keeps_one_bool_t_by_t_mask():
    q = jax.ShapeDtypeStruct((B, H, T, D), jnp.float32)
    key = jax.random.key(0)
    f32 = residual_bytes(attention_with_dropout, q, q, q, key, argnums=(0, 1, 2))
    # float32 JAX keeps the causal mask (broadcast) and the dropout mask (lt), both bool
    assert _masks(f32, (B, H, T, T)) == [("bool", "broadcast_in_dim"), ("bool", "lt")]
    for options in ({}, {"attention": False}):  # dropout: the chain runs as written either way
        bf16 = residual_bytes(
            jmp_lite.autocast(attention_with_dropout, BF16, **options), q, q, q, key, argnums=(0, 1, 2)
        )
        # only the dropout mask (the causal one is rebuilt from iotas) and the 16-bit scores: before, a
        # (2, 4, 64, 64) uint32 from `or` took the mask's place (200704 bytes in all)
        assert [dtype for dtype, _ in _masks(bf16, (B, H, T, T))] == ["bool"]
        assert not bf16.find(dtype="uint32")
        assert sum(r.bytes for r in bf16.find(dtype="bool")) == B * H * T * T
        # and the softmax's float32 row statistics (max, sum)
        scores, mask, statistics = 2 * B * H * T * T, B * H * T * T, 2 * 4 * B * H * T
        assert bf16.by_dtype == {"bfloat16": scores, "bool": mask, "float32": statistics}
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 2, T, 8)) for i in (1, 2, 3))
    grads = [
        jax.jit(jax.grad(jmp_lite.autocast(attention_with_dropout, BF16, remat_float32=remat), (0, 1, 2)))(
            q, k, v, key
        )
        for remat in (True, False)
    ]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
