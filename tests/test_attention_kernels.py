"""jmp_lite.attention: the blockwise kernel against a float32 reference, its memory, and the dispatch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from jax._src.ad_checkpoint import saved_residuals  # behind jax.ad_checkpoint.print_saved_residuals

import jmp_lite
from jmp_lite._src.kernels import attention_kernels
from jmp_lite.attention import choose_implementation, dot_product_attention

pytestmark = pytest.mark.unit

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
# max |got - want| / max |want|, per array: a few units of the dtype's rounding (float32: summation order)
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def reference(q, k, v, bias=None, mask=None, is_causal=False, scale=None, q_len=None, kv_len=None):
    """Attention in float32 at highest precision, T x T; rows with no key to attend to give 0."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    groups = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...qhd,...khd->...hqk", q, k, precision="highest") * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    tq, tk = s.shape[-2:]
    keep = jnp.ones(s.shape, bool)
    if mask is not None:
        keep = keep & mask
    if is_causal:
        keep = keep & jnp.tril(jnp.ones((tq, tk), bool))
    if kv_len is not None:
        keep = keep & (jnp.arange(tk) < kv_len[..., None, None, None])
    if q_len is not None:
        keep = keep & (jnp.arange(tq)[:, None] < q_len[..., None, None, None])
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("...hqk,...khd->...qhd", p, v, precision="highest")


def rand(seed, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def value_and_grads(attention, argnums, w, *args):
    """Under one jit: the output, and the gradients of <output, w> w.r.t. ``args[argnums]``."""

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(attention, *args)
        grads = vjp(w.astype(out.dtype))
        return out, [grads[i] for i in argnums]

    return run(*args)


def padding_mask(seed, batch, tk):
    keep = jax.random.bernoulli(jax.random.key(seed), 0.7, (batch, 1, 1, tk))
    return keep.at[..., 0].set(True)  # every row keeps a key


# name: (B, Tq, Tk, Hq, Hk, D, is_causal, bias shape or None, mask kind or None)
CASES = {
    "causal": (2, 64, 64, 4, 4, 16, True, None, None),
    "padding_mask": (2, 64, 64, 4, 4, 16, False, None, "padding"),
    "bias": (2, 64, 64, 4, 4, 16, False, (1, 4, 64, 64), None),
    "gqa_causal_broadcast_bias": (2, 64, 64, 4, 2, 16, True, (2, 1, 1, 64), None),
    "ragged_causal_padding_bias": (2, 75, 75, 4, 1, 16, True, (1, 4, 75, 75), "padding"),
    "cross_full_mask": (2, 40, 75, 2, 2, 16, False, None, "full"),
    "cross_causal": (2, 40, 75, 2, 2, 16, True, None, None),
}


@pytest.mark.numerics
@pytest.mark.parametrize("blocks", [(32, 16), (None, None)], ids=["loops", "one-block"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_float32_reference_under_jit(case, dtype, blocks):
    b, tq, tk, hq, hk, d, causal, bias_shape, mask_kind = CASES[case]
    q, k, v = rand(0, (b, tq, hq, d), dtype), rand(1, (b, tk, hk, d), dtype), rand(2, (b, tk, hk, d), dtype)
    bias = rand(3, bias_shape, dtype) if bias_shape else None
    mask = {None: None, "padding": padding_mask(4, b, tk)}.get(mask_kind)
    if mask_kind == "full":
        mask = jax.random.bernoulli(jax.random.key(4), 0.7, (b, 1, tq, tk)).at[..., 0].set(True)
    w = rand(5, (b, tq, hq, d), dtype)  # a random cotangent, exact in every dtype used

    def ours(q, k, v, bias):
        # blocks of 32 queries and 16 keys: several of each, ragged at 75 and 40, in lax loops; or the
        # default, which runs lengths up to ONE_BLOCK as one block without loops
        return dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            is_causal=causal,
            implementation="blockwise",
            block_q=blocks[0],
            block_k=blocks[1],
        )

    def ref(q, k, v, bias):
        return reference(q, k, v, bias, mask, causal)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    out, grads = value_and_grads(ours, argnums, w, q, k, v, bias)
    want, want_grads = value_and_grads(ref, argnums, w, q, k, v, bias)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, want) < TOL[dtype], rel_err(out, want)
    for name, g, r, x in zip("q k v bias".split(), grads, want_grads, (q, k, v, bias)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


def test_lengths_up_to_one_block_run_without_loops():
    def loops(t, **blocks):
        q = jnp.zeros((2, t, 4, 16), jnp.bfloat16)

        def loss(q):
            out = dot_product_attention(q, q, q, is_causal=True, implementation="blockwise", **blocks)
            return jnp.sum(out.astype(jnp.float32))

        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(q).jaxpr
        return sum(e.primitive.name in ("scan", "while") for e in eqns(jaxpr))

    one = attention_kernels.ONE_BLOCK
    assert loops(one) == 0  # forward and backward: straight-line code
    assert loops(one + 1) == 4  # three blocks each way: a nest of two loops forward and one backward
    assert loops(one, block_q=one // 2, block_k=one // 2) == 4  # blocks the caller asked for


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_vmap_grad_and_any_number_of_batch_axes():
    q = rand(0, (3, 2, 50, 4, 16), jnp.bfloat16)
    k, v = rand(1, (3, 2, 50, 2, 16), jnp.bfloat16), rand(2, (3, 2, 50, 2, 16), jnp.bfloat16)
    mask = padding_mask(3, 3 * 2, 50).reshape(3, 2, 1, 1, 50)

    def attend(q, k, v, mask):
        return dot_product_attention(q, k, v, mask=mask, is_causal=True, block_q=16, block_k=16)

    def loss(q, k, v, mask):
        return jnp.sum(attend(q, k, v, mask).astype(jnp.float32) ** 2)

    @jax.jit
    def run(q, k, v, mask):
        grad = jax.grad(loss, argnums=(0, 1, 2))
        return (
            attend(q, k, v, mask),  # two batch axes
            jax.vmap(attend)(q, k, v, mask),
            jax.vmap(jax.vmap(attend))(q, k, v, mask),  # each call sees [T, heads, depth]
            jax.vmap(grad)(q, k, v, mask),  # per-example gradients
            grad(q, k, v, mask),
        )

    two_batch_axes, vmapped, unbatched, per_example, batched = run(q, k, v, mask)
    for other in (vmapped, unbatched):
        np.testing.assert_allclose(np.asarray(other, np.float32), np.asarray(two_batch_axes, np.float32))
    assert rel_err(two_batch_axes, reference(q, k, v, mask=mask, is_causal=True)) < TOL[jnp.bfloat16]
    for a, b in zip(per_example, batched):
        assert a.shape == b.shape == q.shape[:2] + a.shape[2:]
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2)


@pytest.mark.numerics
def test_float16_does_not_overflow_where_float32_is_finite():
    # logits in the thousands: q.k before scaling is beyond float16's 65504, after scaling it is not
    d = 64
    q, k = rand(0, (2, 96, 2, d), jnp.float16, 48.0), rand(1, (2, 96, 2, d), jnp.float16, 48.0)
    v, w = rand(2, (2, 96, 2, d), jnp.float16), rand(3, (2, 96, 2, d), jnp.float16)
    raw = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    assert float(jnp.abs(raw).max()) > 65504 and 1000 < float(jnp.abs(raw).max()) / np.sqrt(d) < 20000

    def ours(q, k, v):
        return dot_product_attention(
            q, k, v, is_causal=True, implementation="blockwise", block_q=32, block_k=32
        )

    def ref(q, k, v):
        return reference(q, k, v, is_causal=True)

    out, grads = value_and_grads(ours, (0, 1, 2), w, q, k, v)
    want, want_grads = value_and_grads(ref, (0, 1, 2), w, *(x.astype(jnp.float32) for x in (q, k, v)))
    assert bool(jnp.isfinite(out).all()) and all(bool(jnp.isfinite(g).all()) for g in grads)
    assert rel_err(out, want) < TOL[jnp.float16]
    assert rel_err(grads[2], want_grads[2]) < TOL[jnp.float16]
    # near one-hot rows: dS = p (dP - sum p dP) cancels, and q, k are large; measured 4e-3 and 5e-3
    assert rel_err(grads[0], want_grads[0]) < 1e-2 and rel_err(grads[1], want_grads[1]) < 1e-2


T, BLOCK = 512, 128


def long_inputs(t=T, dtype=jnp.bfloat16):
    q = rand(0, (2, t, 4, 64), dtype)
    k, v = rand(1, (2, t, 2, 64), dtype), rand(2, (2, t, 2, 64), dtype)
    return q, k, v, padding_mask(3, 2, t)


def blockwise_loss(q, k, v, mask, float32_probabilities=False):
    out = dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation="blockwise", block_q=BLOCK, block_k=BLOCK,
        float32_probabilities=float32_probabilities,
    )  # fmt: skip
    return jnp.sum(out.astype(jnp.float32))  # linear: the loss itself keeps nothing


@pytest.mark.parametrize("float32_probabilities", [False, True])
def test_residuals_are_q_k_v_the_output_and_float32_row_statistics(float32_probabilities):
    q, k, v, mask = long_inputs()
    loss = functools.partial(blockwise_loss, float32_probabilities=float32_probabilities)
    res = [aval for aval, _ in saved_residuals(loss, q, k, v, mask)]
    shapes = [(a.shape, np.dtype(a.dtype).name) for a in res]
    assert not any(a.ndim >= 2 and a.shape[-2:] == (T, T) for a in res), shapes
    assert not any(sum(n >= T for n in a.shape) >= 2 for a in res), shapes
    f32 = sorted((a for a in res if a.dtype == jnp.float32), key=lambda a: a.size)
    # per query row its logit maximum and log-sum: [batch, kv heads, groups, T]; several key blocks: the
    # output for delta = dO . O, in bfloat16 (FlashAttention's) or, from float32 weights, in float32
    stats = [2 * 4 * T, 2 * 4 * T]
    assert [a.size for a in f32] == stats + [q.size] * float32_probabilities, shapes
    assert all(a.shape[-1] == T for a in f32[:2]), shapes
    kept16 = sum(a.size for a in res if a.dtype == jnp.bfloat16)
    assert kept16 == q.size + k.size + v.size + q.size * (not float32_probabilities), shapes
    masks = [a for a in res if a.dtype == jnp.bool_]
    assert all(a.size == mask.size for a in masks), shapes  # the padding mask, never broadcast over heads

    # today's T x T path keeps [..., T, T] arrays: the check above can see them
    from jmp_lite._src.flax.nnx_attention import attention  # deprecated: jmp_lite.flax.nnx.attention

    def plain_loss(q, k, v, mask):
        return jnp.sum(attention(q, k, v, mask=mask, is_causal=True).astype(jnp.float32) ** 2)

    plain = [aval for aval, _ in saved_residuals(plain_loss, q, k, v, mask)]
    assert any(a.ndim >= 2 and a.shape[-2:] == (T, T) for a in plain)


def avals(jaxpr):
    for e in eqns(jaxpr):
        for var in (*e.invars, *e.outvars):
            if hasattr(var, "aval") and hasattr(var.aval, "shape"):
                yield var.aval


def test_no_t_by_t_intermediate_forward_or_backward_and_program_size_does_not_grow_with_t():
    q, k, v, mask = long_inputs()
    forward = jax.make_jaxpr(blockwise_loss)(q, k, v, mask).jaxpr
    backward = jax.make_jaxpr(jax.grad(blockwise_loss, argnums=(0, 1, 2)))(q, k, v, mask).jaxpr
    for jaxpr in (forward, backward):
        seen = list(avals(jaxpr))
        assert seen, "no equations walked"
        big = [a.str_short() for a in seen if sum(n >= T for n in a.shape) >= 2]
        assert not big, big
        assert max(a.size for a in seen) <= 2 * 4 * T * 64 * 4  # O(T): the largest is a few q-sized arrays
    # the same loops at four times the length: the same number of equations (loops, not unrolled)
    longer = jax.make_jaxpr(jax.grad(blockwise_loss, argnums=(0, 1, 2)))(*long_inputs(4 * T)).jaxpr
    assert len(list(eqns(longer))) == len(list(eqns(backward)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block", [BLOCK, None], ids=["loops", "one-block"])
@pytest.mark.parametrize("float32_probabilities", [False, True], ids=["p16", "p32"])
def test_16_bit_matmuls_accumulate_in_float32_forward_and_backward(dtype, block, float32_probabilities):
    q, k, v, mask = (x if x.dtype == jnp.bool_ else x.astype(dtype) for x in long_inputs(256))

    def loss(q, k, v, mask):
        out = dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="blockwise", block_q=block, block_k=block,
            float32_probabilities=float32_probabilities,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask).jaxpr
    dots = [e for e in eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) >= 7  # forward: 2; backward: logits again, dv, dp, dk, dq
    operands = [[v.aval.dtype for v in e.invars] for e in dots]
    assert all(e.params["preferred_element_type"] == jnp.float32 for e in dots)
    # by default P is rounded to the input dtype before P.V (FlashAttention's); asked for, the forward's
    # P.V takes float32 weights and values at HIGHEST precision, and nothing else does
    f32_weights = [jnp.float32, jnp.float32]
    assert operands.count(f32_weights) == float32_probabilities, operands
    assert all(o == [dtype, dtype] for o in operands if o != f32_weights), operands
    highest = [e for e in dots if e.params["precision"] not in (None, (None, None))]
    assert [[v.aval.dtype for v in e.invars] for e in highest] == [f32_weights] * float32_probabilities


@pytest.mark.parametrize("block", [16, None], ids=["loops", "one-block"])
def test_rows_with_no_key_give_zero_and_lengths_equal_masks(block):
    q, k, v = rand(0, (3, 40, 2, 16)), rand(1, (3, 40, 2, 16)), rand(2, (3, 40, 2, 16))
    kv_len, q_len = jnp.array([40, 17, 0]), jnp.array([40, 30, 5])
    kw = {"implementation": "blockwise", "block_q": block, "block_k": block}
    keep = (jnp.arange(40) < kv_len[:, None])[:, None, None, :] & (jnp.arange(40) < q_len[:, None])[
        :, None, :, None
    ]

    @jax.jit
    def both(q, k, v):
        by_lengths = dot_product_attention(
            q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **kw
        )
        return by_lengths, dot_product_attention(q, k, v, mask=keep, **kw)

    by_lengths, by_mask = both(q, k, v)
    np.testing.assert_allclose(by_lengths, by_mask, atol=1e-6)
    np.testing.assert_allclose(by_lengths, reference(q, k, v, q_len=q_len, kv_len=kv_len), atol=1e-5)
    assert float(jnp.abs(by_lengths[2]).max()) == 0.0 and float(jnp.abs(by_lengths[1, 30:]).max()) == 0.0

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, is_causal=True, **kw)
        return jnp.sum(out**2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert float(jnp.abs(grads[0][2]).max()) == 0.0  # batch 2 attends to nothing
    assert float(jnp.abs(grads[1][1, 17:]).max()) == 0.0  # keys beyond the length get no gradient


def test_xla_implementation_is_jax_and_blockwise_matches_it_in_float32():
    q, k, v = rand(0, (2, 48, 4, 16)), rand(1, (2, 48, 2, 16)), rand(2, (2, 48, 2, 16))
    bias, mask = rand(3, (2, 4, 48, 48)), padding_mask(4, 2, 48)
    kw = {"bias": bias, "mask": mask, "is_causal": True, "scale": 0.3}

    @jax.jit
    def three(q, k, v):
        return (
            dot_product_attention(q, k, v, implementation="xla", **kw),
            jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw),
            dot_product_attention(q, k, v, implementation="blockwise", block_q=16, block_k=16, **kw),
        )

    xla, jax_xla, blockwise = three(q, k, v)
    np.testing.assert_array_equal(xla, jax_xla)
    np.testing.assert_allclose(blockwise, xla, atol=1e-5)


def test_choose_implementation_by_backend():
    q16 = jnp.zeros((2, 256, 4, 64), jnp.bfloat16)
    kv16 = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    pad, full = jnp.ones((2, 1, 1, 256), bool), jnp.ones((2, 1, 256, 256), bool)
    pick = choose_implementation
    for backend in ("cpu", "rocm", "METAL"):
        assert pick(q16, q16, q16, is_causal=True, backend=backend) == "blockwise"
    # CUDA: cuDNN when its constraints hold
    assert pick(q16, q16, q16, is_causal=True, backend="gpu") == "cudnn"
    assert pick(q16, kv16, kv16, mask=full, backend="cuda") == "cudnn"  # grouped heads, full mask
    assert pick(q16, q16, q16, key_value_seq_lengths=jnp.full((2,), 9), backend="gpu") == "cudnn"
    assert pick(q16, q16, q16, mask=pad, backend="gpu") == "blockwise"  # would be materialized T x T
    f32 = q16.astype(jnp.float32)
    assert pick(f32, f32, f32, backend="gpu") == "blockwise"  # cuDNN is 16-bit only
    deep = jnp.zeros((2, 256, 4, 136), jnp.bfloat16)
    assert pick(deep, deep, deep, backend="gpu") == "blockwise"  # depth > 128
    assert pick(q16[None], q16[None], q16[None], backend="gpu") == "blockwise"  # 5-d
    assert pick(q16[:, :100], q16, q16, is_causal=True, backend="gpu") == "blockwise"  # causal, Tq != Tk
    # TPU: the blockwise kernel (it compiles to fewer temporaries than the Pallas kernel, on request)
    assert pick(q16, kv16, kv16, mask=pad, is_causal=True, backend="tpu") == "blockwise"
    assert pick(f32, f32, f32, bias=jnp.zeros((2, 4, 256, 256)), backend="tpu") == "blockwise"
    # a fill that gives masked keys weight 0 anyway (Flax's and Hugging Face's finfo.min, -inf) keeps
    # cuDNN when nothing but causality masks (no row is empty); a mask array or a higher fill does not
    low = float(jnp.finfo(jnp.float32).min)
    for fill in (low, -jnp.inf, -1e30):
        assert pick(q16, q16, q16, is_causal=True, mask_value=fill, backend="cuda") == "cudnn", fill
    assert pick(q16, q16, q16, is_causal=True, mask_value=-1e9, backend="cuda") == "blockwise"
    assert pick(q16, q16, q16, mask=full, mask_value=low, backend="cuda") == "blockwise"
    kv_len = jnp.full((2,), 9)
    assert pick(q16, q16, q16, key_value_seq_lengths=kv_len, mask_value=low, backend="cuda") == "blockwise"
    assert pick(q16, q16, q16, is_causal=True, mask_value=low, backend="cpu") == "blockwise"
    with pytest.raises(TypeError, match="backend must be a platform name"):
        pick(q16, q16, q16, backend=3)


def test_dispatch_on_a_tpu_runs_the_pallas_kernel_with_padding_as_segment_ids(monkeypatch):
    """No TPU here: the backend name and the kernel are replaced, to test what reaches the kernel."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    calls = []

    def fake_flash(q, k, v, ab=None, segment_ids=None, *, causal=False, sm_scale=1.0, **_):
        calls.append((q.shape, k.shape, causal, sm_scale))  # [B, H, T, D], heads repeated
        mask = (
            None
            if segment_ids is None
            else (segment_ids.q[:, None, :, None] == segment_ids.kv[:, None, None])
        )
        out = reference(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), ab, mask, causal, sm_scale)
        return jnp.swapaxes(out, 1, 2)

    monkeypatch.setattr(attention_kernels, "_backend_name", lambda: "tpu")
    monkeypatch.setattr(tpu_flash, "flash_attention", fake_flash)
    q, k, v = rand(0, (2, 128, 4, 16)), rand(1, (2, 128, 2, 16)), rand(2, (2, 128, 2, 16))
    mask, kv_len = padding_mask(3, 2, 128), jnp.array([128, 70])
    out = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, mask=mask, is_causal=True, key_value_seq_lengths=kv_len, implementation="tpu_flash"
        )
    )(q, k, v)
    assert calls == [((2, 4, 128, 16), (2, 4, 128, 16), True, 0.25)]
    np.testing.assert_allclose(out, reference(q, k, v, mask=mask, is_causal=True, kv_len=kv_len), atol=1e-5)
    # not asked for by name, a TPU runs the blockwise kernel
    jax.eval_shape(lambda: dot_product_attention(q, k, v, mask=mask))
    assert len(calls) == 1


def test_dispatch_on_a_gpu_falls_back_when_cudnn_declines_at_trace_time(monkeypatch):
    asked = []

    def declining(*args, implementation=None, **kwargs):
        asked.append(implementation)
        raise NotImplementedError("cuDNN not available")

    monkeypatch.setattr(attention_kernels, "_backend_name", lambda: "cuda")
    monkeypatch.setattr(jax.nn, "dot_product_attention", declining)
    q = rand(0, (2, 64, 2, 16), jnp.bfloat16)
    out = jax.jit(lambda q: dot_product_attention(q, q, q, is_causal=True))(q)
    assert asked == ["cudnn"]
    assert rel_err(out, reference(q, q, q, is_causal=True)) < TOL[jnp.bfloat16]
    with pytest.raises(NotImplementedError, match="cuDNN not available"):
        dot_product_attention(q, q, q, implementation="cudnn")  # asked for by name: the error stands


def test_bad_input_gets_a_clear_error():
    q = jnp.zeros((2, 16, 4, 8))
    attend = dot_product_attention
    with pytest.raises(TypeError, match="boolean mask"):
        attend(q, q, q, mask=jnp.ones((2, 1, 1, 16)), implementation="blockwise")
    with pytest.raises(ValueError, match="does not broadcast"):
        attend(q, q, q, mask=jnp.ones((2, 1, 1, 15), bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        attend(q, q, q, bias=jnp.ones((3, 4, 16, 16)))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attend(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(TypeError, match="share one dtype"):
        attend(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(ValueError, match="at least 3 axes"):
        attend(q[0, 0], q[0, 0], q[0, 0])
    with pytest.raises(ValueError, match="empty sequence"):
        attend(q, q[:, :0], q[:, :0])
    with pytest.raises(ValueError, match="depth"):
        attend(q, q[..., :4], q[..., :4])
    with pytest.raises(ValueError, match="implementation must be one of None, 'blockwise'.*; got 'flash'"):
        attend(q, q, q, implementation="flash")
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        attend(q, q, q, block_q=0, implementation="blockwise")
    with pytest.raises(ValueError, match="key_value_seq_lengths must be an integer array"):
        attend(q, q, q, key_value_seq_lengths=jnp.ones((3,), jnp.int32), implementation="blockwise")
    with pytest.raises(TypeError, match="floating"):
        attend(q.astype(jnp.int32), q.astype(jnp.int32), q.astype(jnp.int32))
    for bad in (float("nan"), float("inf"), "big", jnp.ones(2), True):
        with pytest.raises(ValueError, match="mask_value must be a number below"):
            attend(q, q, q, mask_value=bad)
    with pytest.raises(ValueError, match="mask_value is computed by the blockwise kernel only"):
        attend(q, q, q, mask_value=-1e9, implementation="xla")
    assert choose_implementation(q, q, q, is_causal=True, mask_value=-1e9, backend="gpu") == "blockwise"


def test_public_names():
    assert jmp_lite.attention.dot_product_attention is dot_product_attention
    assert dot_product_attention.__module__ == "jmp_lite.attention"
    assert choose_implementation.__module__ == "jmp_lite.attention"


@pytest.mark.composition
@pytest.mark.all_params  # a causal mask, and a bias with lengths: both in CI
@pytest.mark.parametrize("extras", ["causal", "bias_lengths"])
def test_the_kernel_runs_inside_shard_map_with_per_device_operands(extras):
    """FSDP runs a model inside ``shard_map``, where q, k and v vary over the mesh axis: the kernel's loops
    carry per-device values (a zero accumulator would start typed as the same on every device)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(5)
    args = [jnp.asarray(rng.normal(size=(8, 40, 2, 8)), jnp.bfloat16) for _ in range(3)]
    if extras != "causal":
        args += [
            jnp.asarray(rng.normal(size=(8, 2, 40, 40)), jnp.float32),
            jnp.asarray(rng.integers(1, 41, size=8), jnp.int32),
        ]
    options = dict(is_causal=extras == "causal", block_q=16, block_k=16, implementation="blockwise")

    def loss(q, k, v, bias=None, lengths=None):
        out = dot_product_attention(q, k, v, bias, key_value_seq_lengths=lengths, **options)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    placed = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]
    per_device = jax.shard_map(grad, mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=(P("data"),) * 3)
    got = jax.jit(per_device)(*placed)
    want = jax.jit(grad)(*args)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        # The same arithmetic per example; XLA:CPU may pick another bf16 x bf16 -> f32 kernel for one
        # example than for eight (on CPUs with bf16 instructions it does), which can move a float32 sum's
        # last bits: a bfloat16 result by one unit in its last place (2^-7 of its magnitude), a sum that
        # cancels to about zero by float32 noise (2^-15 of the array's scale). Rarely: most stay bitwise.
        # A loop carry typed alike on every device would be wrong by far more.
        bound = 2.0**-7 * np.abs(w) + 2.0**-15 * np.abs(w).max()
        assert np.all(np.abs(g - w) <= bound), np.abs(g - w).max()
        assert np.mean(g == w) >= 0.95, np.mean(g == w)
