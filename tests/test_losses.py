"""``jmp_lite.losses.fused_linear_cross_entropy``: the values and gradients of optax's cross-entropy on
float32 logits, in chunks, under jit, vmap and grad, with 16-bit hidden states, tied (transposed)
weights, a bias and ignored labels; and no [tokens, vocabulary] array in the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.losses import fused_linear_cross_entropy
from jmp_lite.memory import compiled

pytestmark = pytest.mark.unit


def problem(seed: int, tokens: tuple = (3, 7), d: int = 16, vocab: int = 50, low: int = -1):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (*tokens, d))
    w = jax.random.normal(k[1], (d, vocab)) * 0.3
    b = jax.random.normal(k[2], (vocab,))
    y = jax.random.randint(k[3], tokens, low, vocab)
    return h, w, b, y


def reference(h, w, b, y):
    """optax on float32 logits, ignored (negative) labels contributing nothing."""
    logits = h.astype(jnp.float32) @ w.astype(jnp.float32) + b
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
    return jnp.where(y >= 0, loss, 0.0)


@pytest.mark.numerics
@pytest.mark.all_params  # chunks of one token, uneven chunks, one chunk past the tokens: each in CI
@pytest.mark.parametrize("seed, chunk", [(1, 5), (0, 1), (2, 21), (3, 1024)])
def test_values_and_gradients_are_optax_on_float32_logits(seed, chunk):
    h, w, b, y = problem(seed)

    def fused(h, w, b):
        return (fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk) * jnp.arange(7.0)).sum()

    def plain(h, w, b):
        return (reference(h, w, b, y) * jnp.arange(7.0)).sum()

    np.testing.assert_allclose(jax.jit(fused)(h, w, b), plain(h, w, b), rtol=2e-6)
    for got, want in zip(jax.jit(jax.grad(fused, (0, 1, 2)))(h, w, b), jax.grad(plain, (0, 1, 2))(h, w, b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # an ignored token has loss 0 and no gradient into its hidden state
    losses = fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk)
    assert bool(jnp.all(jnp.where(y < 0, losses == 0, True)))
    dh = jax.grad(fused)(h, w, b)
    assert bool(jnp.all(jnp.where((y < 0)[..., None], dh == 0, True)))


def test_a_tied_embedding_reads_as_transposed_weights():
    h, w, b, y = problem(4)
    table = w.T  # nn.Embed's [vocabulary, d], read by embed.attend

    def tied(h, table):
        return fused_linear_cross_entropy(h, table, y, transposed=True, chunk_size=4).sum()

    def plain(h, w):
        return fused_linear_cross_entropy(h, w, y, chunk_size=4).sum()

    dh_t, dtable = jax.jit(jax.grad(tied, (0, 1)))(h, table)
    dh, dw = jax.grad(plain, (0, 1))(h, w)
    # jitted against eager: float32 sums in another order (2e-7 of a 0.02 gradient with the loop emitters)
    np.testing.assert_allclose(dh_t, dh, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dtable, dw.T, rtol=1e-6, atol=1e-6)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_hidden_states_multiply_in_16_bits_and_accumulate_in_float32(dtype):
    h, w, b, y = problem(5, tokens=(4, 32), d=64, vocab=300, low=0)
    h16 = h.astype(dtype)
    loss = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_size=16))
    got = loss(h16, w)
    assert got.dtype == jnp.float32
    # the reference rounds the same operands to 16 bits and multiplies them exactly
    want = reference(h16.astype(jnp.float32), w.astype(dtype).astype(jnp.float32), 0.0, y)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    dh, dw = jax.jit(jax.grad(lambda h, w: loss(h, w).sum(), (0, 1)))(h16, w)
    assert dh.dtype == dtype and dw.dtype == jnp.float32
    dh32, dw32 = jax.grad(lambda h, w: reference(h, w, 0.0, y).sum(), (0, 1))(h, w)
    scale = float(jnp.abs(dw32).max())
    assert float(jnp.abs(dw - dw32).max()) < 0.02 * scale  # 16-bit operands, float32 sums
    # dtype= picks the operand dtype for float32 hidden states (a policy with o=f32)
    explicit = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_size=16, dtype=dtype))
    np.testing.assert_array_equal(explicit(h16.astype(jnp.float32), w), got)


@pytest.mark.composition
def test_vmap_and_an_autocast_step_give_the_same_losses():
    h, w, b, y = problem(6, low=0)
    per_row = jax.vmap(lambda h, y: fused_linear_cross_entropy(h, w, y, chunk_size=3))(h, y)
    np.testing.assert_allclose(per_row, reference(h, w, 0.0, y), rtol=2e-6)
    f = jmp_lite.autocast(
        lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_size=3).mean(), "p=f32,c=bf16,o=f32"
    )
    g = jax.jit(jax.grad(f, (0, 1)))(h, w)
    g32 = jax.grad(lambda h, w: reference(h, w, 0.0, y).mean(), (0, 1))(h, w)
    for got, want in zip(g, g32):
        assert got.dtype == jnp.float32
        assert float(jnp.abs(got - want).max()) < 0.05 * float(jnp.abs(want).max())


@pytest.mark.compiled
def test_no_tokens_by_vocabulary_array_is_compiled():
    n, d, vocab = 2048, 64, 8192  # logits: 64 MiB of float32; a chunk of 256: 8 MiB
    h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)

    def fused(h, w, y):
        return jax.grad(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_size=256).mean(), (0, 1))(h, w)

    def plain(h, w, y):
        loss = lambda h, w: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32), y
        ).mean()
        return jax.grad(loss, (0, 1))(h, w)

    lean, full = compiled(fused, h, w, y, target=None), compiled(plain, h, w, y, target=None)
    logits = n * vocab * 4
    assert full.temp_bytes >= logits
    assert lean.temp_bytes < logits / 2, (lean.temp_bytes, full.temp_bytes)


def test_bad_input_is_named():
    h, w, b, y = problem(7)
    with pytest.raises(ValueError, match=r"last axis \(\(16,\)\) must be the weights' d = 50"):
        fused_linear_cross_entropy(h, w, y, transposed=True)
    with pytest.raises(ValueError, match=r"labels must have hidden's shape without its last axis, \(3, 7\)"):
        fused_linear_cross_entropy(h, w, y[:, :3])
    with pytest.raises(TypeError, match="labels has dtype float32; it must be an integer array"):
        fused_linear_cross_entropy(h, w, y.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"weights must be 2-D"):
        fused_linear_cross_entropy(h, w[None], y)
    with pytest.raises(ValueError, match=r"bias must have shape \(50,\)"):
        fused_linear_cross_entropy(h, w, y, bias=b[:3])
    with pytest.raises(ValueError, match="chunk_size must be a whole number"):
        fused_linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises((TypeError, ValueError), match="fused_linear_cross_entropy: dtype"):
        fused_linear_cross_entropy(h, w, y, dtype="int8")
