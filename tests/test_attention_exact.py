"""The attention kernel computes the program's math (issue 27, item 4).

Under a 16-bit policy the engine runs each recognised attention chain as the blockwise kernel. These tests
hold it to the program it replaces: one regression test per way it used to change the math (an explicit
``precision=``, a fill value taken for -inf, rows with every key masked, gradients less accurate than the
same policy without the kernel, the gradient of a bias constant along the keys), the reasons a chain is
declined, and a seeded random sweep of attention programs comparing the kernel, the float32 program and
the same policy with ``attention=False``.

Errors are ``max |got - want| / max(max |want|, 1e-3)`` per array, with non-finite entries compared as a
pattern (the program's NaN rows must be the kernel's). Gradients are compared against the float32 program
run on q, k and v rounded to the policy's dtype (``rounded``): both 16-bit paths round those inputs the
same way, and in a sharp softmax that shared rounding is most of the error against the float32 program,
with a sign that is luck (it made ``attention=False`` look 5x better on attn_fuzz seed 46).
The kernel's errors may exceed ``attention=False``'s by 10% or by one rounding of the policy's dtype
(``SLACK``), no more. ``JMP_ATTENTION_SWEEP=N`` runs N random programs instead of the default three.
"""

import os
from functools import partial
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import jmp_lite
from jmp_lite._src.engine.attention_pattern import declined_attention, find_attention
from jmp_lite._src.kernels.attention_kernels import dot_product_attention

pytestmark = pytest.mark.numerics

BF16 = "p=f32,c=bf16,o=f32"
F16 = "p=f32,c=f16,o=f32"
F32_MIN = float(jnp.finfo(jnp.float32).min)


def rel_err(got: Any, want: Any, floor: float = 1e-3) -> float:
    """max |got - want| / max(max |want|, floor); inf when the non-finite entries differ."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.array_equal(np.isfinite(got), np.isfinite(want)):
        return float("inf")
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got - want)[finite]) / max(np.max(np.abs(want[finite])), floor))


def cotangent(shape: tuple) -> jax.Array:
    return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37)


def loss_of(fun: Any) -> Any:
    def loss(*args: Any) -> jax.Array:
        out = fun(*args)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * cotangent(out.shape))

    return loss


def kernel_calls(fun: Any, *args: Any) -> int:
    """How many times the traced program calls the blockwise kernel (nested calls included)."""

    def count(jaxpr: Any) -> int:
        kernel = "_blockwise_attention"
        return sum(
            1 if e.params.get("name") == kernel else sum(map(count, jaxprs_in_params(e.params)))
            for e in jaxpr.eqns
        )

    return count(jax.make_jaxpr(fun)(*args).jaxpr)


def qkv(b: int, tq: int, tk: int, h: int, d: int, hk: int | None = None, seed: int = 0) -> list:
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((b, tq, h, d), (b, tk, hk or h, d), (b, tk, hk or h, d))
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def value_and_grads(fun: Any, *args: Any) -> tuple:
    """Under one jit: the output, and the gradients of ``loss_of(fun)`` w.r.t. every argument."""

    def run(*args: Any) -> tuple:
        out, vjp = jax.vjp(fun, *args)
        return out, vjp(jnp.where(jnp.isfinite(out), cotangent(out.shape), 0.0).astype(out.dtype))

    return jax.jit(run)(*args)


def errors(fun: Any, args: list, policy: str) -> dict:
    """Relative errors of the output and of each gradient, of the kernel and of attention=False, against
    the float32 program on the inputs rounded to the policy's dtype: {"calls": kernel calls, "value":
    (kernel, plain), "grads": [(kernel, plain), ...]}."""
    dtype = jnp.bfloat16 if "bf16" in policy else jnp.float16
    rounded = [a.astype(dtype).astype(a.dtype) if i < 3 else a for i, a in enumerate(args)]
    kernel, plain = (jmp_lite.autocast(fun, policy, attention=flag) for flag in (True, False))
    (want, want_grads), *found = (
        value_and_grads(f, *a) for f, a in ((fun, rounded), (kernel, args), (plain, args))
    )
    return {
        "calls": kernel_calls(kernel, *args),
        "value": tuple(rel_err(out, want) for out, _ in found),
        "grads": [(rel_err(k, w), rel_err(p, w)) for k, p, w in zip(found[0][1], found[1][1], want_grads)],
    }


# One rounding of the policy's dtype, relative (its unit roundoff), and at least 1e-3: two ways of rounding
# the same math differ by about that either way (a 16-bit gradient is itself rounded once).
SLACK = {BF16: 2.0**-8, F16: 1e-3}


def no_worse(kernel: float, plain: float, policy: str = BF16) -> bool:
    """The kernel's error is at most attention=False's: 10% more, or one rounding of the policy's dtype."""
    return kernel <= max(1.1 * plain, plain + SLACK[policy])


def einsum_attention(q, k, v, bias=None, keep=None, fill=-jnp.inf, precision=(None, None)):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision[0]) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision=precision[1])


# ------------------------------------------------------------------------------------------------------
# One regression test per way the kernel changed the math (each fails on the kernel and matcher of commit
# 2cfa7c7, before this file).
# ------------------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "precision",
    [
        ("highest", "highest"),
        ("highest", None),
        (None, (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)),
        (jax.lax.DotAlgorithmPreset.F32_F32_F32, None),
    ],
    ids=["both", "logits", "value-operand", "algorithm"],
)
def test_an_explicit_precision_on_either_matmul_runs_the_program_as_written(precision):
    q, k, v = qkv(2, 12, 12, 2, 8)

    def attention(q, k, v):
        return einsum_attention(q, k, v, precision=precision)

    (match,) = find_attention(jax.make_jaxpr(attention)(q, k, v))
    assert match.fallback is not None and "requested on the" in match.fallback
    fun = jmp_lite.autocast(attention, BF16)
    assert kernel_calls(fun, q, k, v) == 0
    as_written = jmp_lite.autocast(attention, BF16, attention=False)
    np.testing.assert_array_equal(jax.jit(fun)(q, k, v), jax.jit(as_written)(q, k, v))
    if precision == ("highest", "highest"):  # float32 math asked for on both: the float32 program's value
        assert rel_err(jax.jit(fun)(q, k, v), jax.jit(attention)(q, k, v)) < 1e-6


def test_a_fill_is_the_programs_value_not_minus_infinity():
    # kept logits 2e4 below the fill -1e4: the program gives the masked keys all the weight
    q, k, v = qkv(2, 12, 12, 2, 8, seed=1)
    keep = jnp.ones((2, 1, 1, 12), bool).at[..., :4].set(False)

    def attention(q, k, v, keep):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8) - 2e4
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -1e4), axis=-1), v)

    fun = jmp_lite.autocast(attention, BF16)
    assert kernel_calls(fun, q, k, v, keep) == 1
    want = jax.jit(attention)(q, k, v, keep)
    assert rel_err(jax.jit(fun)(q, k, v, keep), want) < 1e-2  # was 1.92


@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("fill", [-1e9, F32_MIN, "flax"])
def test_rows_with_every_key_masked_give_the_programs_mean_of_the_values(fill):
    b, t, h, d = 2, 24, 2, 8
    q, k, v = qkv(b, t, t, h, d, seed=2)
    lengths = jnp.array([t, 0])  # the second sequence has no key: a uniform softmax, the mean of v
    keep = (jnp.arange(t) < lengths[:, None])[:, None, None, :] & jnp.tril(jnp.ones((t, t), bool))
    if fill == "flax":  # finfo(float32).min

        def attention(q, k, v):
            return nn.dot_product_attention(q, k, v, mask=keep)

    else:

        def attention(q, k, v):
            return einsum_attention(q, k, v, keep=keep, fill=fill)

    want, want_grads = value_and_grads(attention, q, k, v)
    np.testing.assert_allclose(want[1], jnp.broadcast_to(v[1].mean(0), (t, h, d)), atol=1e-5)
    fun = jmp_lite.autocast(attention, BF16)
    assert kernel_calls(fun, q, k, v) == 1
    out, grads = value_and_grads(fun, q, k, v)
    assert rel_err(out, want) < 1e-2  # was 0.2 - 0.4 (0 in the empty rows)
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) < 2e-2  # dv was 0.46


def test_the_kernel_counts_the_masked_keys_its_causal_loops_skip():
    # Blocks of 8: the causal loops skip the blocks above the diagonal, whose keys still take part at a
    # finite fill. Kept logits 2e4 below the fill make those keys carry the weight of every row.
    b, t, h, d = 2, 24, 2, 8
    q, k, v = qkv(b, t, t, h, d, seed=4)
    padding = (jnp.arange(t) < jnp.array([t, 0])[:, None])[:, None, None, :]
    shift = jnp.full((1, 1, 1, 1), -2e4)

    def program(q, k, v):
        return einsum_attention(
            q, k, v, bias=shift, keep=padding & jnp.tril(jnp.ones((t, t), bool)), fill=-1e4
        )

    def kernel(q, k, v):
        return dot_product_attention(
            q, k, v, shift, padding, is_causal=True, implementation="blockwise", block_q=8, block_k=8,
            mask_value=-1e4,
        )  # fmt: skip

    (want, want_grads), (out, grads) = value_and_grads(program, q, k, v), value_and_grads(kernel, q, k, v)
    assert rel_err(out, want) < 1e-5  # float32 inputs: the same math
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) < 1e-5


def test_rows_with_every_key_masked_by_minus_infinity_are_nan_as_in_the_program():
    q, k, v = qkv(2, 12, 12, 2, 8, seed=3)
    keep = (jnp.arange(12) < jnp.array([12, 0])[:, None])[:, None, None, :]

    def attention(q, k, v):
        return einsum_attention(q, k, v, keep=keep, fill=-jnp.inf)

    (want, want_grads), (got, grads) = (
        value_and_grads(fun, q, k, v) for fun in (attention, jmp_lite.autocast(attention, BF16))
    )
    assert bool(jnp.isnan(want[1]).all()) and bool(jnp.isfinite(want[0]).all())
    assert rel_err(got, want) < 1e-2  # the same NaN rows, the same finite rows
    assert not bool(jnp.isfinite(want_grads[2][1]).any())  # dv: NaN where the NaN weights reach it
    for got_grad, ref in zip(grads, want_grads):
        assert rel_err(got_grad, ref) < 2e-2


@pytest.mark.parametrize("case", ["gqa_bias_padding", "causal_broadcast_bias", "negated_random_mask"])
def test_gradients_no_worse_than_the_same_policy_without_the_kernel(case):
    # attn_fuzz seeds 46, 103, 73: jax.nn's XLA attention with grouped heads, a broadcast bias, masks and
    # sharp softmax; the kernel's gradients were 5-8x worse (delta = rowsum(dO * O) of the 16-bit O)
    b, tq, tk, h, hk, d, sharp, bias_shape, mask = {
        "gqa_bias_padding": (1, 1, 12, 2, 1, 8, 15.0, (1, 1, 1, 12), "padding"),
        "causal_broadcast_bias": (2, 12, 2, 2, 1, 4, 4.0, (2, 1, 1, 2), "padding_causal"),
        "negated_random_mask": (1, 5, 5, 4, 2, 16, 15.0, (1, 1, 1, 5), "random"),
    }[case]
    q, k, v = qkv(b, tq, tk, h, d, hk, seed=46)
    q = q * sharp
    bias = jax.random.normal(jax.random.key(5), bias_shape)
    keep = jnp.arange(tk)[None, :] < jnp.array([tk, max(1, tk // 2)][:b])[:, None]
    keep = jnp.broadcast_to(keep[:, None, None, :], (b, 1, tq, tk))
    if mask == "random":
        keep = jax.random.bernoulli(jax.random.key(6), 0.7, (b, 1, tq, tk)).at[..., 0].set(True)

    def attention(q, k, v, bias):
        return jax.nn.dot_product_attention(
            q, k, v, bias=jnp.broadcast_to(bias, (b, h, tq, tk)), mask=keep,
            is_causal=mask.endswith("causal"), implementation="xla",
        )  # fmt: skip

    found = errors(attention, [q, k, v, bias], BF16)
    assert found["calls"] == 1 and all(no_worse(*pair) for pair in found["grads"]), found


def native_16_bit_attention(q, k, v, bias, mask, causal):
    """JAX's own 16-bit attention (``jax.nn.dot_product_attention``'s "xla" implementation, written out so
    that it runs in float16 on XLA:CPU too): float32 logits and softmax, the weights rounded to the input
    dtype, a 16-bit P.V."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    keep = jnp.tril(jnp.ones(s.shape[-2:], bool)) if causal else jnp.ones(s.shape[-2:], bool)
    if mask is not None:
        keep = keep & mask
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("policy", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", ["sharp_causal", "gqa_bias_padding", "full_bias"])
def test_key_blocks_no_worse_than_native_16_bit_attention(case, policy):
    # Several key blocks: P is rounded to 16 bits before P.V and delta = dO . O comes from the 16-bit
    # output, as in FlashAttention and cuDNN. Errors against the float32 math on the same 16-bit inputs,
    # measured (bf16, sharp_causal): dq 5.4e-3 and dk 7.5e-3, native 16-bit attention's 2.5e-3 and 4.6e-3,
    # within one bfloat16 rounding of it; with float32_probabilities 2.7e-3 and 4.5e-3
    dtype = jnp.bfloat16 if policy == BF16 else jnp.float16
    b, t, h, hk, d, sharp, bias_shape, causal, pad = {
        "sharp_causal": (2, 40, 4, 2, 16, 8.0, None, True, False),
        "gqa_bias_padding": (2, 37, 4, 1, 8, 15.0, (2, 1, 1, 37), False, True),
        "full_bias": (1, 48, 2, 2, 16, 4.0, (1, 2, 48, 48), True, False),
    }[case]
    q, k, v = qkv(b, t, t, h, d, hk, seed=11)
    args = [x.astype(dtype) for x in (q * sharp, k, v)]
    if bias_shape is not None:
        args.append(jax.random.normal(jax.random.key(3), bias_shape).astype(dtype))
    mask = (jnp.arange(t)[None] < jnp.array([t, t // 2])[:, None])[:, None, None, :] if pad else None

    def native(q, k, v, bias=None):
        return native_16_bit_attention(q, k, v, bias, mask, causal)

    def kernel(q, k, v, bias=None, float32_probabilities=False):
        return dot_product_attention(
            q, k, v, bias, mask, is_causal=causal, implementation="blockwise", block_q=8, block_k=8,
            float32_probabilities=float32_probabilities,
        )  # fmt: skip

    want, want_grads = value_and_grads(native, *(x.astype(jnp.float32) for x in args))
    found = {}
    for name, fun in (
        ("native", native),
        ("kernel", kernel),
        ("p32", partial(kernel, float32_probabilities=True)),
    ):
        out, grads = value_and_grads(fun, *args)
        found[name] = [rel_err(out, want)] + [rel_err(g, w) for g, w in zip(grads, want_grads)]
    assert all(no_worse(k, n, policy) for k, n in zip(found["kernel"], found["native"])), found
    # float32 weights are no cure-all: dq of the grouped, padded, sharp case is 6.0e-3 either way
    assert all(no_worse(p, n, policy) for p, n in zip(found["p32"], found["native"])), found


@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("shape", [(12, 1), (2, 1, 1)], ids=["rows", "heads"])
def test_a_bias_constant_along_the_keys_gets_a_zero_gradient(shape):
    # softmax does not see a bias constant along its axis: the float32 program's gradient is rounding
    # noise (5e-7), the kernel's was 5.7e-3
    q, k, v = qkv(2, 12, 12, 2, 8, seed=7)
    bias = jax.random.normal(jax.random.key(8), shape)

    def attention(q, k, v, bias):
        return einsum_attention(q, k, v, bias=bias)

    fun = jmp_lite.autocast(attention, BF16)
    assert kernel_calls(fun, q, k, v, bias) == 1
    grads = jax.grad(loss_of(fun), argnums=3)
    plain = jax.grad(loss_of(jmp_lite.autocast(attention, BF16, attention=False)), argnums=3)
    grad, plain = jax.jit(lambda *a: (grads(*a), plain(*a)))(q, k, v, bias)
    assert float(jnp.abs(grad).max()) < max(2e-6, 2 * float(jnp.abs(plain).max()))


def test_the_kernels_gradient_of_a_bias_constant_along_the_keys():
    q, k, v = qkv(2, 12, 12, 2, 8, seed=7)
    keep = jnp.ones((2, 1, 1, 12), bool).at[1, ..., 8:].set(False)
    bias = (
        jax.random.normal(jax.random.key(8), (2, 2, 12, 1)) - 30.0
    )  # per batch, head and row; about the fill

    def program(q, k, v, bias):
        return einsum_attention(q, k, v, bias=bias, keep=keep, fill=-30.0)

    # one block (delta from the block's p and dP) and loops (delta from the float32 output)
    for block in (None, 4):

        def kernel(q, k, v, bias, mask_value=None, block=block):
            return dot_product_attention(
                q, k, v, bias, None if mask_value is None else keep, implementation="blockwise",
                block_q=block, block_k=block, mask_value=mask_value,
            )  # fmt: skip

        @jax.jit
        def grads(q, k, v, bias, kernel=kernel):
            found = [
                jax.grad(loss_of(lambda *a, f=f: kernel(*a, f)), argnums=3)(q, k, v, bias)
                for f in (None, -jnp.inf, -30.0)
            ]
            return found, jax.grad(loss_of(program), argnums=3)(q, k, v, bias)

        (unmasked, at_inf, at_fill), want = grads(q, k, v, bias)
        # no mask, or masked keys at -inf: the shift reaches every key that counts, the gradient is 0
        assert float(jnp.abs(unmasked).max()) == 0.0 and float(jnp.abs(at_inf).max()) == 0.0, block
        # masked keys at a finite fill do not move with it: a real gradient, as the program's
        assert float(jnp.abs(want).max()) > 0.1 and rel_err(at_fill, want) < 1e-5, block


# ------------------------------------------------------------------------------------------------------
# Declines say why
# ------------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_declined_chains_and_their_reasons():
    q, k, v = qkv(2, 12, 12, 2, 8)
    causal = jnp.tril(jnp.ones((12, 12), bool))
    pad = jnp.ones((2, 1, 1, 12), bool).at[1, ..., 9:].set(False)
    bias = jax.random.normal(jax.random.key(9), (2, 2, 12, 12))

    def reasons(fun, *args):
        return [reason for _, reason in declined_attention(jax.make_jaxpr(fun)(*args))]

    def two_fills(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(pad, jnp.where(causal, s, -jnp.inf), -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    def bias_after_fill(q, k, v, bias):
        s = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    def soft_capped(q, k, v):
        s = 30 * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    assert reasons(lambda q, k, v: einsum_attention(q, k, v, precision=("highest", None)), q, k, v) == [
        "precision=HIGHEST requested on the logits matmul: the program runs as written"
    ]
    assert reasons(two_fills, q, k, v) == [
        "masks with different fill values (-inf, -1e+09); the kernel takes one"
    ]
    assert reasons(bias_after_fill, q, k, v, bias) == [
        "a bias is added after a mask with a finite fill (masked logits differ per key)"
    ]
    assert reasons(soft_capped, q, k, v) == ["the logits pass through tanh"]
    # the engine runs all four as written
    for fun, args in ((two_fills, (q, k, v)), (bias_after_fill, (q, k, v, bias)), (soft_capped, (q, k, v))):
        assert kernel_calls(jmp_lite.autocast(fun, BF16), *args) == 0
    # a -inf fill with a bias after it, a served chain and a classifier's softmax: nothing to explain
    served = lambda q, k, v: einsum_attention(q, k, v, bias=bias, keep=causal, fill=F32_MIN)  # noqa: E731
    assert reasons(served, q, k, v) == []
    assert reasons(lambda x, w: jax.nn.softmax(x @ w.T), q[0, :, 0], k[0, :, 0]) == []
    inf_then_bias = lambda q, k, v: einsum_attention(q, k, v, keep=causal) + 0 * bias.sum()  # noqa: E731
    assert reasons(inf_then_bias, q, k, v) == []


# ------------------------------------------------------------------------------------------------------
# A seeded random sweep: values and gradients, kernel vs program vs attention=False
# ------------------------------------------------------------------------------------------------------


class Program(NamedTuple):
    seed: int
    policy: str
    layout: str  # "einsum" (grouped heads repeated), "grouped" ([B, T, K, G, D]), "heads_first", "jax_nn"
    shape: tuple  # B, Tq, Tk, H, Hk, D
    bias: str  # "none", "full", "keys", "rows", "heads", "padding"
    mask: str  # "none", "causal", "padding", "random", "causal_padding", "query_padding", "empty_batch"
    fill: float
    sharp: float  # q is multiplied by this
    softmax: str  # "jax", "by_hand"


def random_program(seed: int) -> Program:
    rng = np.random.default_rng(seed)
    pick = lambda *xs: xs[rng.integers(len(xs))]  # noqa: E731
    tq = int(pick(1, 3, 8, 13, 16, 33))
    tk = tq if rng.random() < 0.6 else int(pick(1, 2, 5, 16, 40))
    hk, groups = int(pick(1, 2)), int(pick(1, 2))
    layout = str(pick("einsum", "grouped", "heads_first", "jax_nn"))
    mask = str(pick("none", "causal", "padding", "random", "causal_padding", "query_padding", "empty_batch"))
    fill = float(pick(-np.inf, F32_MIN, -1e9, -1e4)) if mask != "empty_batch" else float(pick(F32_MIN, -1e9))
    return Program(
        seed=seed,
        policy=str(pick(BF16, F16)),
        layout=layout,
        shape=(int(pick(1, 2)), tq, tk, hk * groups, hk, int(pick(4, 8, 16))),
        bias=str(pick("none", "full", "keys", "rows", "heads", "padding")),
        mask=mask,
        fill=fill,
        sharp=float(pick(1.0, 4.0, 15.0)),
        softmax=str(pick("jax", "by_hand")),
    )


def build(p: Program) -> tuple[Any, list]:
    """The attention program and its float32 arguments (q, k, v, then the bias if any)."""
    b, tq, tk, h, hk, d = p.shape
    q, k, v = qkv(b, tq, tk, h, d, hk, seed=p.seed)
    q = q * p.sharp
    key = jax.random.key(p.seed + 1)
    bias_shapes = {
        "full": (b, h, tq, tk),
        "keys": (tk,),
        "rows": (tq, 1),
        "heads": (h, 1, 1),
        "padding": (b, 1, 1, tk),
    }
    args = [q, k, v]
    if p.bias != "none":
        args.append(jax.random.normal(key, bias_shapes[p.bias]))
    keep = jnp.ones((b, 1, tq, tk), bool)
    lengths = jnp.array([tk, max(1, tk // 2)][:b])
    if p.mask in ("padding", "causal_padding"):
        keep = keep & (jnp.arange(tk) < lengths[:, None])[:, None, None, :]
    if p.mask == "empty_batch":  # a batch element with no key at all
        keep = keep & (jnp.arange(tk) < jnp.array([tk, 0][:b])[:, None])[:, None, None, :]
    if p.mask == "query_padding":  # query rows with no key at all
        keep = keep & (jnp.arange(tq) < jnp.array([tq, max(1, tq // 2)][:b])[:, None])[:, None, :, None]
    if p.mask == "random":
        keep = jax.random.bernoulli(jax.random.key(p.seed + 2), 0.7, keep.shape).at[..., 0].set(True)
    causal = p.mask.startswith("causal")

    def softmax(s: jax.Array, axis: int) -> jax.Array:
        if p.softmax == "jax":
            return jax.nn.softmax(s, axis=axis)
        e = jnp.exp(s - jax.lax.stop_gradient(s.max(axis, keepdims=True)))
        return e / e.sum(axis, keepdims=True)

    def fun(q: jax.Array, k: jax.Array, v: jax.Array, *bias: jax.Array) -> jax.Array:
        full_bias = jnp.broadcast_to(bias[0], (b, h, tq, tk)) if bias else None
        if p.layout == "jax_nn":
            return jax.nn.dot_product_attention(
                q, k, v, bias=full_bias, mask=None if p.mask == "none" else keep, is_causal=causal,
                implementation="xla",
            )  # fmt: skip
        allowed = jnp.broadcast_to(
            keep & jnp.tril(jnp.ones((tq, tk), bool)) if causal else keep, (b, h, tq, tk)
        )
        if p.layout == "grouped":  # logits [B, K, G, Tq, Tk]
            s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, tq, hk, h // hk, d), k) / np.sqrt(d)
            regroup = lambda x: x.reshape(x.shape[0], hk, h // hk, *x.shape[2:])  # noqa: E731
            if bias:
                s = s + regroup(full_bias)
            if p.mask != "none":
                s = jnp.where(regroup(allowed), s, p.fill)
            out = jnp.einsum("bkgts,bskd->btkgd", softmax(s, -1), v)
            return out.reshape(b, tq, h, d)
        k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
        if p.layout == "heads_first":
            q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
            s = q @ jnp.swapaxes(k, -1, -2) * (1 / np.sqrt(d))
        else:
            s = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(d), k)
        if bias:
            s = s + full_bias
        if p.mask != "none":
            s = jnp.where(allowed, s, p.fill)
        w = softmax(s, -1)
        if p.layout == "heads_first":
            return jnp.swapaxes(w @ v, 1, 2)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    return fun, args


def sweep_errors(p: Program) -> dict:
    fun, args = build(p)
    return errors(fun, args, p.policy)


# By default three programs that the kernel before this file got wrong (as it did 127 of the first 300),
# cheap to compile and unlike each other (bf16 and f16; jax.nn's and the grouped layout; fills -inf and
# finfo.min; query padding, a batch element with no key, key padding; cross attention; biases per row and
# full); JMP_ATTENTION_SWEEP=N runs seeds 0..N-1.
SWEEP = os.environ.get("JMP_ATTENTION_SWEEP")
SEEDS = range(int(SWEEP)) if SWEEP else (36, 95, 115)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_attention_programs(seed):
    p = random_program(seed)
    found = sweep_errors(p)
    assert found["calls"] == 1, p  # every program of the sweep is one the kernel serves
    assert no_worse(*found["value"], p.policy), (p, found)
    for name, (kernel, plain) in zip("q k v bias".split(), found["grads"]):
        assert no_worse(kernel, plain, p.policy), (name, p, found)
