"""attention_pattern: attention found in traced programs, and re-emitted as one call of the blockwise kernel.

Each program is traced with ``jax.make_jaxpr``; the match is checked, then the program is run again with
the matched equations replaced by ``attention_kernels.dot_product_attention`` (the interpreter below,
which is how the engine uses a match) and compared with the original program, both under ``jax.jit``.
"""

import importlib.util
import sys
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from jmp_lite._src.engine.attention_pattern import find_attention
from jmp_lite._src.kernels.attention_kernels import dot_product_attention

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# jax.nn.dot_product_attention's XLA path (and NNX through it) asks for F16_F16_F32 dots: none on XLA:CPU
NO_F16 = [jnp.float32, jnp.bfloat16]
# max |got - want| / max |want|: the kernel's float32 softmax against the program's own (bf16: its rounding)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


def run_with_kernel(closed, matches, *args):
    """Evaluates ``closed`` with every match that the kernel can serve replaced by one kernel call."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args), strict=True))

    def read(v):
        return np.asarray(v.val, v.aval.dtype) if isinstance(v, jcore.Literal) else env[v]

    served = [m for m in matches if m.fallback is None]
    skip = {i for m in served for i in m.eqns}
    emit = {m.emit_at: m for m in served}
    for i, eqn in enumerate(jaxpr.eqns):
        if i in emit:
            m = emit[i]
            out = dot_product_attention(
                **m.kernel_arguments(read), implementation="blockwise", block_q=8, block_k=8
            )
            env[m.out] = m.output(out).astype(m.out.aval.dtype)
        elif i not in skip:
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
            env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]


def check(fun, *args, count=1, causal=None, tol=None):
    """Traces ``fun``, checks its matches, and compares the kernel re-emission with ``fun`` under jit
    (every query row, those with no key to attend to included)."""
    closed = jax.make_jaxpr(fun)(*args)
    matches = find_attention(closed)
    assert len(matches) == count, matches
    for m in matches:
        assert m.fallback is None and not m.dropout, m.fallback
        if causal is not None:
            assert m.is_causal == causal
        assert m.emit_at == max(m.eqns)
    want = jax.tree.leaves(jax.jit(fun)(*args))
    got = jax.jit(lambda *a: run_with_kernel(closed, matches, *a))(*args)
    for w, g in zip(want, got, strict=True):
        assert w.dtype == g.dtype and w.shape == g.shape
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        floats = [a.dtype for a in jax.tree.leaves(args) if jnp.issubdtype(a.dtype, jnp.floating)]
        dtype = tol or max(floats, key=lambda d: jnp.finfo(d).eps)
        err = np.max(np.abs(w - g)) / np.max(np.abs(w))
        assert err < TOL[jnp.dtype(dtype).type], err
    return matches


def qkv(shape, dtype, kv_heads=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    kv_shape = shape if kv_heads is None else (*shape[:-2], kv_heads, shape[-1])
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, (shape, kv_shape, kv_shape))]


def padding(batch, length, valid):
    return jnp.arange(length)[None, :] < jnp.asarray(valid)[:, None]


# ------------------------------------------------------------------------------------------------------
# 1. Flax Linen MultiHeadDotProductAttention
# ------------------------------------------------------------------------------------------------------


def linen_mha(dtype, **kwargs):
    model = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, dtype=dtype, **kwargs)
    x = jax.random.normal(jax.random.key(1), (2, 16, 24), dtype)
    return model, model.init(jax.random.key(0), x), x


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal", "key_padding", "causal_and_padding"])
def test_linen_mha(dtype, mask):
    model, params, x = linen_mha(dtype)
    pad = padding(2, 16, [16, 11])
    masks = {
        "none": lambda x: None,
        "causal": lambda x: nn.make_causal_mask(x[..., 0]),
        "key_padding": lambda x: nn.make_attention_mask(jnp.ones((2, 16), bool), pad),
        "causal_and_padding": lambda x: nn.combine_masks(
            nn.make_causal_mask(x[..., 0]), nn.make_attention_mask(jnp.ones((2, 16), bool), pad)
        ),
    }
    (m,) = check(
        lambda p, x: model.apply(p, x, mask=masks[mask](x)), params, x, causal=mask.startswith("causal")
    )
    assert m.scale == pytest.approx(1 / np.sqrt(8)) and m.scale_sites == ("query",)
    assert len(m.masks) == (1 if "padding" in mask else 0)
    # Flax fills masked logits with finfo(dtype).min: the kernel's mask_value, None when nothing is masked
    assert m.mask_value == (None if mask == "none" else float(jnp.finfo(dtype).min))
    if "padding" in mask:  # the key padding [B, Tk] itself: never broadcast over heads or queries
        assert m.masks[0].var.aval.shape == (2, 16)


def test_linen_query_and_key_padding_rows_with_no_key_give_the_programs_mean_of_the_values():
    # Flax fills masked logits with finfo.min: a padding query row, whose keys are all masked, is a uniform
    # softmax, the mean of the values; the kernel takes that fill (mask_value) and gives the same
    model, params, x = linen_mha(jnp.float32)
    pad = padding(2, 16, [16, 9])
    (m,) = check(lambda p, x: model.apply(p, x, mask=nn.make_attention_mask(pad, pad)), params, x)
    assert m.mask_value == float(jnp.finfo(jnp.float32).min)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_dot_product_attention_with_bias(dtype):
    q, k, v = qkv((2, 12, 4, 8), dtype)
    bias = jax.random.normal(jax.random.key(5), (2, 4, 12, 12), dtype)
    causal = nn.make_causal_mask(jnp.ones((2, 12)))
    (m,) = check(lambda q, k, v, b: nn.dot_product_attention(q, k, v, bias=b, mask=causal), q, k, v, bias)
    assert m.is_causal and len(m.biases) == 1 and not m.masks


def test_linen_dropout_is_flagged():
    model, params, x = linen_mha(jnp.float32, dropout_rate=0.1, deterministic=False)
    closed = jax.make_jaxpr(lambda p, x: model.apply(p, x, rngs={"dropout": jax.random.key(3)}))(params, x)
    (m,) = find_attention(closed)
    assert m.dropout and m.fallback.startswith("dropout")


def test_linen_sown_weights_are_flagged():
    model, params, x = linen_mha(jnp.float32)
    fun = lambda p, x: model.apply(p, x, sow_weights=True, mutable=["intermediates"])  # noqa: E731
    (m,) = find_attention(jax.make_jaxpr(fun)(params, x))
    assert not m.dropout and "used outside" in m.fallback
    check(lambda p, x: model.apply(p, x, sow_weights=True), params, x)  # sown but not kept: served


# ------------------------------------------------------------------------------------------------------
# 2. Flax NNX MultiHeadAttention (jax.nn.dot_product_attention's XLA path on CPU)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", NO_F16)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_and_padding"])
def test_nnx_mha(dtype, mask):
    model = nnx.MultiHeadAttention(
        num_heads=4, in_features=24, qkv_features=32, decode=False, dtype=dtype, rngs=nnx.Rngs(0)
    )
    graph, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (2, 16, 24), dtype)
    pad = padding(2, 16, [16, 10])

    def fun(state, x):
        m = nnx.make_causal_mask(x[..., 0]) if mask != "none" else None
        if mask == "causal_and_padding":
            m = nnx.combine_masks(m, nnx.make_attention_mask(jnp.ones((2, 16), bool), pad))
        return nnx.merge(graph, state)(x, mask=m)

    (m,) = check(fun, state, x, causal=mask != "none")
    assert len(m.masks) == (mask == "causal_and_padding")


# ------------------------------------------------------------------------------------------------------
# 3. jax.nn.dot_product_attention(implementation="xla")
# ------------------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", NO_F16)
@pytest.mark.parametrize(
    "extra, kv_heads",
    [
        ("causal", 4),
        ("causal", 2),
        ("causal", 1),
        ("mask", 4),
        ("mask", 2),
        ("bias", 4),
        ("bias", 2),
        ("none", 1),
    ],
)
def test_jax_nn_xla(dtype, extra, kv_heads):
    q, k, v = qkv((2, 16, 4, 8), dtype, kv_heads=kv_heads)
    mask = jax.random.bernoulli(jax.random.key(7), 0.7, (2, 1, 16, 16)).at[..., 0].set(True)
    bias = jax.random.normal(jax.random.key(8), (1, 4, 16, 16), dtype)
    kwargs = {
        "causal": lambda m, b: {"is_causal": True},
        "mask": lambda m, b: {"mask": m},
        "bias": lambda m, b: {"bias": b},
        "none": lambda m, b: {},
    }[extra]

    def fun(q, k, v, m, b):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla", scale=0.3, **kwargs(m, b))

    (m,) = check(fun, q, k, v, mask, bias, causal=extra == "causal")
    assert m.scale == pytest.approx(0.3)
    assert len(m.masks) == (extra == "mask") and len(m.biases) == (extra == "bias")
    if extra == "mask":  # the mask is read before jax broadcasts it over heads
        assert m.masks[0].var.aval.shape == (2, 1, 16, 16)


def test_jax_nn_xla_causal_with_padding_lengths():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    lengths = jnp.array([16, 7])

    def fun(q, k, v, n):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=n, implementation="xla"
        )

    (m,) = check(fun, q, k, v, lengths, causal=True)
    assert len(m.masks) == 1


# ------------------------------------------------------------------------------------------------------
# 4. The hand-written GPT-2 attention of the benchmarks
# ------------------------------------------------------------------------------------------------------


def load_benchmark(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Flax's dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_trace_block(dtype):
    block = load_benchmark("autocast_trace")._block
    d, heads = 32, 4
    shapes = {
        "ln1": (2, d),
        "qkv": (d, 3 * d),
        "proj": (d, d),
        "ln2": (2, d),
        "fc": (d, 4 * d),
        "out": (4 * d, d),
    }
    keys = jax.random.split(jax.random.key(0), len(shapes))
    p = {n: 0.2 * jax.random.normal(k, s, dtype) for k, (n, s) in zip(keys, shapes.items())}
    x = jax.random.normal(jax.random.key(1), (2, 16, d), dtype)
    (m,) = check(lambda x, p: block(x, p, heads), x, p, causal=True)
    assert m.scale == pytest.approx(1 / np.sqrt(8)) and not m.masks


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_gpt_every_layer(dtype):
    lm = load_benchmark("lm")
    model = lm.GPT(layers=2, width=32, heads=4, context=16)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    params = model.init(jax.random.key(1), tokens)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    # one causal mask, built once outside the blocks, serves both layers
    check(lambda p, t: model.apply(p, t), params, tokens, count=2, causal=True, tol=dtype)


# ------------------------------------------------------------------------------------------------------
# 5. Equinox MultiheadAttention (vmapped over the batch)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_equinox_mha(dtype, mask):
    model = eqx.nn.MultiheadAttention(4, 24, qk_size=8, vo_size=8, dtype=dtype, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (2, 16, 24), dtype)
    valid = jnp.array([16, 5])

    def fun(params, x, valid):
        model = eqx.combine(params, static)

        def one(x, n):
            m = {"none": None, "causal": jnp.tril(jnp.ones((16, 16), bool))}.get(mask)
            if mask == "padding":
                m = jnp.broadcast_to(jnp.arange(16) < n, (16, 16))
            return model(x, x, x, mask=m)

        return jax.vmap(one)(x, valid)

    (m,) = check(fun, params, x, valid, causal=mask == "causal", tol=dtype)
    assert len(m.masks) == (mask == "padding")


def test_equinox_dropout_is_flagged():
    model = eqx.nn.MultiheadAttention(4, 24, dropout_p=0.2, key=jax.random.key(0))
    x = jnp.ones((16, 24))
    closed = jax.make_jaxpr(lambda x, key: model(x, x, x, key=key))(x, jax.random.key(1))
    (m,) = find_attention(closed)
    assert m.dropout and m.fallback.startswith("dropout")


# ------------------------------------------------------------------------------------------------------
# Softmax written other ways, masks built other ways
# ------------------------------------------------------------------------------------------------------


def plain(q, k, v, mask=None, where=jnp.where, fill=-jnp.inf, softmax=jax.nn.softmax):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    if mask is not None:
        logits = where(mask, logits, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", softmax(logits, axis=-1), v)


@pytest.mark.parametrize("custom_jvp", [False, True])
def test_softmax_as_custom_jvp_call_or_plain_ops(custom_jvp):
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    before = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", custom_jvp)
    try:
        closed = jax.make_jaxpr(lambda q, k, v: plain(q, k, v, jnp.tril(jnp.ones((16, 16), bool))))(q, k, v)
        assert any(e.primitive.name == "custom_jvp_call" for e in closed.jaxpr.eqns) == custom_jvp
        check(lambda q, k, v: plain(q, k, v, jnp.tril(jnp.ones((16, 16), bool))), q, k, v, causal=True)
    finally:
        jax.config.update("jax_softmax_custom_jvp", before)


def test_hand_written_softmax_and_inverted_mask():
    def softmax(x, axis):
        e = jnp.exp(x - x.max(axis, keepdims=True))
        return e / e.sum(axis, keepdims=True)

    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    future = jnp.triu(jnp.ones((16, 16), bool), 1)  # True = drop, as torch's masked_fill
    (m,) = check(lambda q, k, v: plain(q, k, v, ~future, softmax=softmax), q, k, v, causal=True)
    (m,) = check(lambda q, k, v: plain(q, k, v, future, lambda c, x, y: jnp.where(c, y, x), -1e9), q, k, v)
    assert m.is_causal


def test_a_constant_mask_that_is_not_causal_is_handed_over():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    i = jnp.arange(16)
    window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)  # sliding window
    (m,) = check(lambda q, k, v: plain(q, k, v, window), q, k, v, causal=False)
    assert len(m.masks) == 1


def test_unbatched_single_head_and_scale_after_bias():
    q, k, v = qkv((16, 8), jnp.float32)[0], *qkv((12, 8), jnp.float32, seed=1)[1:]
    bias = jax.random.normal(jax.random.key(4), (1, 12))

    def fun(q, k, v, b):
        return jax.nn.softmax((q @ k.T + b) / 3.0) @ v

    (m,) = check(fun, q, k, v, bias)
    assert m.scale == pytest.approx(1 / 3) and m.biases[0].factor == pytest.approx(1 / 3)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_first_layout_with_key_first_logits(dtype):
    # PyTorch's [B, H, T, D], logits written [B, H, Tk, Tq], softmax over axis -2: every input is transposed
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in qkv((2, 16, 4, 8), dtype))
    bias = jax.random.normal(jax.random.key(3), (4, 16, 16), dtype)  # [H, Tk, Tq]
    keep = jax.random.bernoulli(jax.random.key(4), 0.8, (2, 16, 1)).at[:, 0].set(True)  # [B, Tk, 1]

    def fun(q, k, v, bias, keep):
        s = jnp.einsum("bhkd,bhqd->bhkq", k, q) / 8.0 + bias
        w = jax.nn.softmax(jnp.where(keep[:, None], s, -jnp.inf), axis=-2)
        return jnp.einsum("bhkq,bhkd->bhqd", w, v)

    (m,) = check(fun, q, k, v, bias, keep)
    assert any(op == "transpose" for op, _ in m.query.layout.steps)
    assert m.biases[0].var.aval.shape == (4, 16, 16) and m.masks[0].var.aval.shape == (2, 16, 1)


def test_grouped_query_heads_with_a_bias_per_kv_head():
    # the bias varies over k/v heads but not over the query heads of a group: broadcast within the group
    q, k, v = qkv((2, 16, 4, 8), jnp.float32, kv_heads=2)
    bias = jax.random.normal(jax.random.key(3), (2, 1, 16, 16))  # [K, G=1, Tq, Tk]

    def fun(q, k, v, bias):
        q = q.reshape(2, 16, 2, 2, 8)
        w = jax.nn.softmax(jnp.einsum("btkgd,bskd->bkgts", q, k) * 0.3 + bias)
        return jnp.einsum("bkgts,bskd->btkgd", w, v).reshape(2, 16, 4, 8)

    (m,) = check(fun, q, k, v, bias)
    assert any(op == "broadcast" for op, _ in m.biases[0].layout.steps)


def test_analysis_runs_while_a_program_is_traced():
    # the engine analyses a level while it evaluates it under jax.jit: constant masks still evaluate
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    causal = lambda q, k, v: plain(q, k, v, jnp.tril(jnp.ones((16, 16), bool)))  # noqa: E731
    closed = jax.make_jaxpr(causal)(q, k, v)

    @jax.jit
    def run(q, k, v):
        (m,) = find_attention(closed)
        assert m.is_causal and not m.masks
        return run_with_kernel(closed, [m], q, k, v)

    np.testing.assert_allclose(run(q, k, v)[0], causal(q, k, v), rtol=1e-5, atol=1e-5)


def test_gradients_through_the_re_emitted_program():
    model, params, x = linen_mha(jnp.float32)
    fun = lambda p, x: model.apply(p, x, mask=nn.make_causal_mask(x[..., 0])).sum()  # noqa: E731
    closed = jax.make_jaxpr(fun)(params, x)
    (m,) = find_attention(closed)
    want = jax.jit(jax.grad(fun, argnums=(0, 1)))(params, x)
    leaves = jax.tree.leaves((params, x))
    got = jax.jit(
        jax.grad(lambda *a: run_with_kernel(closed, [m], *a)[0], argnums=tuple(range(len(leaves))))
    )(*leaves)
    for w, g in zip(jax.tree.leaves(want), got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------
# What must not match
# ------------------------------------------------------------------------------------------------------


def test_classifier_softmax_does_not_match():
    model = nn.Dense(10)
    x = jnp.ones((4, 32))
    params = model.init(jax.random.key(0), x)
    assert find_attention(jax.make_jaxpr(lambda p, x: jax.nn.softmax(model.apply(p, x)))(params, x)) == []
    labels = jnp.zeros((4,), jnp.int32)

    def loss(p, x):
        return -jnp.take_along_axis(jax.nn.log_softmax(model.apply(p, x)), labels[:, None], 1).mean()

    assert find_attention(jax.make_jaxpr(jax.grad(loss))(params, x)) == []


def test_matmuls_without_softmax_do_not_match():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)
    linear = lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jnp.einsum("bqhd,bkhd->bhqk", q, k), v)  # noqa: E731
    assert find_attention(jax.make_jaxpr(linear)(q, k, v)) == []
    capped = lambda q, k, v: plain(q, k, v, softmax=lambda x, axis: jax.nn.softmax(jnp.tanh(x), axis))  # noqa: E731
    assert find_attention(jax.make_jaxpr(capped)(q, k, v)) == []
    soft_mask = lambda q, k, v: plain(q, k, v, jnp.ones((16, 16), bool), fill=-5.0)  # noqa: E731
    assert find_attention(jax.make_jaxpr(soft_mask)(q, k, v)) == []
    rescaled = lambda q, k, v: plain(q, k, v, softmax=lambda x, axis: 2 * jax.nn.softmax(x, axis))  # noqa: E731
    assert find_attention(jax.make_jaxpr(rescaled)(q, k, v)) == []


def test_returned_weights_are_flagged():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)

    def fun(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", w, v), w

    (m,) = find_attention(jax.make_jaxpr(fun)(q, k, v))
    assert "used outside" in m.fallback and not m.dropout

    def logits_too(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v), s.mean()

    (m,) = find_attention(jax.make_jaxpr(logits_too)(q, k, v))
    assert "used outside" in m.fallback

    @jax.jit
    def masked_and_counted(s, keep):  # a helper call computing a masked logit and something else
        return jnp.where(keep, s, -jnp.inf), keep.sum()

    def helper_too(q, k, v):
        s, n = masked_and_counted(jnp.einsum("bqhd,bkhd->bhqk", q, k), jnp.tril(jnp.ones((16, 16), bool)))
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v), n

    (m,) = find_attention(jax.make_jaxpr(helper_too)(q, k, v))
    assert m.is_causal and "also computes" in m.fallback


def test_input_computed_from_the_weights_is_rejected():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)

    def fun(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", w, v + w.sum())

    assert [m.fallback is None for m in find_attention(jax.make_jaxpr(fun)(q, k, v))] in ([], [False])


def test_inside_scan_each_level_on_its_own():
    q, k, v = qkv((2, 16, 4, 8), jnp.float32)

    def fun(q, k, v):
        return jax.lax.scan(lambda c, _: (plain(c, k, v), None), q, length=2)[0]

    closed = jax.make_jaxpr(fun)(q, k, v)
    assert find_attention(closed) == []
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    (m,) = find_attention(scan.params["jaxpr"])
    assert m.fallback is None
