"""Block-scaled fp8 contractions: Fp8Recipe(scaling="block" | "mxfp8") and jmp_lite._src.fp8.fp8_blocks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jmp_lite
import jmp_lite.flax
import jmp_lite.flax.nnx as jnnx
from jmp_lite import Fp8Recipe, fp8, get_fp8_recipe
from jmp_lite._src.fp8 import fp8_blocks

pytestmark = pytest.mark.unit

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))
BLOCK_RECIPES = ["hybrid,block", "e4m3,block,block=16", "hybrid,mxfp8"]


def rand(seed, shape, scale=1.0, dtype=np.float32):
    # drawn on the host: jax.random compiles a program per shape, seconds each on CPU
    return jnp.asarray((np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype))


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---------------------------------------------------------------------------------------------------------
# The recipe


@pytest.mark.parametrize(
    "recipe",
    [
        Fp8Recipe("hybrid", "block"),
        Fp8Recipe("e4m3", "block", block_size=64, margin=1),
        Fp8Recipe("hybrid", "mxfp8"),
        Fp8Recipe("hybrid", "current", block_size=16),  # kept, and ignored, like amax_history
    ],
    ids=str,
)
def test_block_recipes_round_trip_through_str_and_repr(recipe):
    assert get_fp8_recipe(str(recipe)) == recipe
    assert eval(repr(recipe), {"Fp8Recipe": Fp8Recipe}) == recipe
    assert str(recipe).endswith(f",block={recipe.block_size}")


def test_block_recipe_fields_defaults_and_strings():
    block = Fp8Recipe("hybrid", "block")
    assert (block.block_size, block.block_scaled, block.history_length) == (128, True, 1)
    assert str(block) == "hybrid,block,history=1024,margin=0,reduce=max,block=128"
    assert get_fp8_recipe("hybrid,block,block=128") == block == get_fp8_recipe("block")
    assert get_fp8_recipe("hybrid,block,block_size=64").block_size == 64
    mx = get_fp8_recipe("hybrid,mxfp8")
    assert (mx.block_size, mx.block_scaled) == (32, True) and get_fp8_recipe("mxfp8,block=32") == mx
    # per-tensor recipes read as they always have: no block size unless one is given
    assert Fp8Recipe("hybrid", "current").block_size is None and not Fp8Recipe().block_scaled
    assert "block" not in str(Fp8Recipe()) and "block" not in repr(Fp8Recipe())
    # a block size left at its scaling's default follows a change of scaling; one that was set stays
    assert block.replace(scaling="current") == Fp8Recipe("hybrid", "current")
    assert block.replace(scaling="mxfp8") == mx and mx.replace(scaling="block") == block
    assert Fp8Recipe("hybrid", "block", block_size=64).replace(scaling="current").block_size == 64
    assert len({block, Fp8Recipe("hybrid", "block", block_size=128), mx}) == 2  # hashable: static args


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"block_size": 0},
            r"block_size must be an int >= 1 \(elements per tile along the contraction\); got 0",
        ),
        ({"block_size": -128}, "block_size must be an int >= 1"),
        ({"block_size": 1.5}, "block_size must be an int >= 1 .* got 1.5"),
        ({"block_size": "128"}, "block_size must be an int >= 1 .* got '128'"),
        ({"block_size": True}, "block_size must be an int >= 1"),
        ({"scaling": "mxfp8", "block_size": 128}, "block_size must be 32 .* for scaling='mxfp8'.*got 128"),
        ({"scaling": "tiles"}, "scaling must be one of 'current', 'delayed', 'block', 'mxfp8'; got 'tiles'"),
    ],
)
def test_bad_block_recipes_name_the_accepted_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fp8Recipe(**{"scaling": "block", **kwargs})


@pytest.mark.parametrize("size", [100, 8, 48, 96, 2048, 1, 127])
def test_block_sizes_the_kernels_do_not_take_are_refused_naming_the_accepted_ones(size):
    # each block is one fp8 GEMM (a multiple of 16 long on tensor cores); powers of two from 16 to 1024
    accepted = r"must be one of 16, 32, 64, 128, 256, 512, 1024 \(a power of two from 16 to 1024"
    with pytest.raises(ValueError, match=accepted + r".*got " + str(size)):
        get_fp8_recipe(f"hybrid,block,block={size}")
    with pytest.raises(ValueError, match=accepted):
        Fp8Recipe("e4m3", "block", block_size=size)
    with pytest.raises(ValueError, match=accepted):  # kept by a per-tensor recipe: checked the same
        Fp8Recipe("hybrid", "current", block_size=size)
    with pytest.raises(ValueError, match=accepted):
        Fp8Recipe("hybrid", "block").replace(block_size=size)
    with pytest.raises(ValueError, match=accepted):  # the front-ends' fp8= argument parses the same
        jmp_lite.autocast(lambda w, x: x @ w, "p=f32,c=bf16,o=f32", fp8=f"hybrid,block,block={size}")


def test_every_accepted_block_size_builds_a_recipe():
    for size in (16, 32, 64, 128, 256, 512, 1024):
        assert get_fp8_recipe(f"e4m3,block,block={size}").block_size == size


def test_bad_block_recipe_strings_name_the_grammar():
    for spec, message in {
        "block,block=0": "block_size must be an int >= 1",
        "block,block=1.5": "block must be a non-negative integer",
        "block,block=": "malformed",
        "mxfp8,block=16": "must be 32",
        "block,block=8,block_size=8": "block_size is given twice",
        "block,block=\u00b2": "block must be a non-negative integer",  # str.isdigit takes a superscript
        "block,block=\u0661\u0662\u0668": "block must be a non-negative integer",  # and Arabic-Indic 128
        "hybrid,block=64": r"gives a tile length \(block=64\) but no scaling.*'hybrid,block,block=64'",
    }.items():
        with pytest.raises(ValueError, match=message) as info:
            get_fp8_recipe(spec)
        if "integer" in message or "malformed" in message:
            assert "block=N (N one of 16, 32, 64, 128, 256, 512, 1024)" in str(info.value)
    # the form str() prints for a per-tensor recipe that keeps a block size names its scaling: it parses
    kept = Fp8Recipe("hybrid", "block", block_size=64).replace(scaling="current")
    assert str(kept).startswith("hybrid,current,") and get_fp8_recipe(str(kept)) == kept


# ---------------------------------------------------------------------------------------------------------
# The contraction against an independent NumPy reference


def np_quantize(x, block, rows, dtype, power_of_two):
    """``x (R, C)`` quantized tile by tile (``rows`` x ``block``): the fp8 values and each value's
    float32 inverse scale, both as float64 ``(R, C)``."""
    top = np.float32(ml_dtypes.finfo(dtype).max)
    r, c = x.shape
    pr, pc = -r % rows, -c % block
    t = np.pad(x.astype(np.float32), ((0, pr), (0, pc))).reshape(
        (r + pr) // rows, rows, (c + pc) // block, block
    )
    amax = np.abs(t).max(axis=(1, 3))
    scale = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    if power_of_two:
        scale = np.exp2(np.floor(np.log2(scale))).astype(np.float32)
    q = np.clip(t * scale[:, None, :, None], -top, top).astype(dtype).astype(np.float64)
    inverse = np.broadcast_to((np.float32(1) / scale).astype(np.float64)[:, None, :, None], t.shape)
    return (a.reshape(r + pr, c + pc)[:r, :c] for a in (q, inverse))


def np_tiles(x, block, rows, dtype, power_of_two):
    """``x (R, C)`` float32 dequantized tile by tile (``rows`` x ``block``), as float64: every value is
    an fp8 value times its tile's float32 inverse scale, exactly."""
    q, inverse = np_quantize(x, block, rows, dtype, power_of_two)
    return q * inverse


def np_block_contraction(x, w, g, recipe):
    """Forward ``x (M, K) @ w (K, N)`` and the two gradients for the output gradient ``g (M, N)``, the
    way the recipe's tiles fall (DeepSeek-V3, section 3.3), the sums in float64."""
    b, mx = recipe.block_size, recipe.scaling == "mxfp8"
    fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
    w_rows = 1 if mx else b
    x_t = np_tiles(x, b, 1, fwd, mx)  # 1 x B tiles along K
    w_nk = np_tiles(w.T, b, w_rows, fwd, mx)  # (N, K): B x B blocks, or MXFP8's 1 x 32 along K
    y = x_t @ w_nk.T
    # d x = g @ w^T contracts over N: g in tiles along N; w's B x B blocks again (MXFP8: tiles along N)
    w_kn = w_nk.T if not mx else np_tiles(w, b, 1, fwd, mx)
    dx = np_tiles(g, b, 1, bwd, mx) @ w_kn.T
    # d w = x^T @ g contracts over M: both in tiles along M
    dw = np_tiles(x.T, b, 1, fwd, mx) @ np_tiles(g.T, b, 1, bwd, mx).T
    return y, dx, dw


def float32_accumulation_bound(a, b):
    """A float32 accumulation error bound for ``a @ b`` (K terms): K * 2**-23 * (|a| @ |b|)."""
    return a.shape[1] * 2.0**-23 * (np.abs(a) @ np.abs(b))


def contraction_and_vjp(recipe, x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, recipe=recipe), x, w)
    return y, vjp(g)


@pytest.mark.numerics
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
@pytest.mark.parametrize("shape", [(50, 300, 70), (8, 256, 128), (130, 33, 5)], ids=str)
def test_forward_and_gradients_match_the_tiles_of_a_numpy_reference(recipe, shape):
    """K and N not multiples of B (padded with zeros), and exact multiples; tiles along K forward,
    along N for the lhs gradient, along M for the rhs gradient."""
    recipe = get_fp8_recipe(recipe)
    m, k, n = shape
    x, w, g = rand(0, (m, k)), rand(1, (k, n), 0.05), rand(2, (m, n), 1e-3)
    y, (dx, dw) = jax.jit(lambda x, w, g: contraction_and_vjp(recipe, x, w, g))(x, w, g)
    ref_y, ref_dx, ref_dw = np_block_contraction(np.asarray(x), np.asarray(w), np.asarray(g), recipe)
    # the same fp8 values and scales: only float32 rounding of the sums differs (a wrong tile would
    # be off by ~2**-4 of a term, thousands of times this bound)
    for got, want, a, b in (
        (y, ref_y, np.abs(x), np.abs(w)),
        (dx, ref_dx, np.abs(g), np.abs(w).T),
        (dw, ref_dw, np.abs(x).T, np.abs(g)),
    ):
        bound = 2 * float32_accumulation_bound(np.asarray(a, np.float64), np.asarray(b, np.float64))
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30), recipe


@pytest.mark.numerics
@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
def test_batch_dims_and_several_contracting_dims_flatten_k_in_pair_order(recipe):
    recipe = get_fp8_recipe(recipe)
    # lhs (batch 2, m1 5, k1 3, m2 4, k2 100), rhs (k2 100, batch 2, n 7, k1 3): K = k2 * k1 = 300
    x, w = rand(3, (2, 5, 3, 4, 100)), rand(4, (100, 2, 7, 3), 0.05)
    dims = (((4, 2), (0, 3)), ((0,), (1,)))
    y = jax.jit(lambda x, w: fp8.dot_general(x, w, dims, recipe=recipe))(x, w)
    assert y.shape == jax.lax.dot_general(x, w, dims).shape == (2, 5, 4, 7)
    x3 = np.asarray(x).transpose(0, 1, 3, 4, 2).reshape(2, 20, 300)
    w3 = np.asarray(w).transpose(1, 2, 0, 3).reshape(2, 7, 300)
    for i in range(2):
        ref = np_block_contraction(x3[i], w3[i].T, np.zeros((20, 7), np.float32), recipe)[0]
        bound = 2 * float32_accumulation_bound(
            np.abs(x3[i]).astype(np.float64), np.abs(w3[i].T).astype(np.float64)
        )
        assert np.all(np.abs(np.asarray(y[i]).reshape(20, 7) - ref) <= bound)
    # gradients through the layout: within fp8 accuracy of float32's (a wrong axis would be O(1) off)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * jnp.cos(jnp.arange(7.0)))  # noqa: E731
    got = jax.jit(jax.grad(loss(lambda x, w: fp8.dot_general(x, w, dims, recipe=recipe)), (0, 1)))(x, w)
    want = jax.grad(loss(lambda x, w: jax.lax.dot_general(x, w, dims)), (0, 1))(x, w)
    assert max(rel(a, b) for a, b in zip(got, want)) < 0.08


def test_einsum_with_a_block_recipe_is_the_block_dot_general():
    x, w = rand(5, (2, 6, 4, 40)), rand(6, (4, 40, 24), 0.05)
    got = fp8.einsum("bthd,hdf->btf", x, w, recipe="hybrid,block")
    dims = (((2, 3), (0, 1)), ((), ()))
    assert bits(got) == bits(fp8.dot_general(x, w, dims, recipe="hybrid,block"))
    assert rel(got, jnp.einsum("bthd,hdf->btf", x, w)) < 0.05


# ---------------------------------------------------------------------------------------------------------
# Axes shorter than the block, and symbolic axes (jax.export)


def exact_values(seed, shape, dtype=np.float32):
    """Integers from -8 to 8: every E4M3 value they quantize to is a multiple of 4 (each tile's amax
    lands on 448) and every E5M2 one a multiple of 1024, so every product and block sum of the tests
    below is exact in float32, whatever order XLA sums in: any difference is a different tile."""
    return jnp.asarray(np.random.default_rng(seed).integers(-8, 9, shape).astype(dtype))


def contraction_and_gradients(f):
    """``f(x, w)`` and its gradients for the cotangent ``g`` (one program)."""

    def run(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        return y, *vjp(g)

    return jax.jit(run)


def zero_padded_to_whole_blocks(recipe):
    """The block contraction of ``x (M, K) @ w (K, N)`` with every axis zero-padded to a multiple of
    128 by hand: whole blocks everywhere, as every axis was tiled before short axes had tiles of their
    own length."""

    def f(x, w):
        (m, k), n = x.shape, w.shape[1]
        up = lambda size: -(-size // 128) * 128 - size  # noqa: E731
        xp, wp = jnp.pad(x, ((0, up(m)), (0, up(k)))), jnp.pad(w, ((0, up(k)), (0, up(n))))
        return fp8.dot_general(xp, wp, MATMUL, recipe=recipe)[:m, :n]

    return f


@pytest.mark.compiled
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_small_batched_weights_take_no_padded_blocks(dtype):
    """An ensemble of 1024 16 x 16 layers: each weight padded to a 128 x 128 block took 102 MiB of
    temporaries forward, 120 MiB with the gradients, against 2.0 and 2.5 MiB under per-tensor scaling;
    an axis shorter than the block is now one tile of its own length (2.0 and 3.1 MiB)."""
    x, w = exact_values(0, (1024, 8, 16), dtype), exact_values(1, (1024, 16, 16), dtype)

    def programs(recipe):
        forward = lambda x, w: fp8.einsum("ebi,eio->ebo", x, w, recipe=recipe)  # noqa: E731
        loss = lambda x, w: forward(x, w).astype(jnp.float32).sum()  # noqa: E731
        return {"forward": forward, "gradients": jax.grad(loss, argnums=(0, 1))}

    def temp_bytes(fn):
        return jax.jit(fn).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    tensor, block = programs("hybrid,current"), programs("hybrid,block")
    for name in ("forward", "gradients"):
        per_tensor, blocks = temp_bytes(tensor[name]), temp_bytes(block[name])
        assert blocks < 2 * per_tensor, f"{name}: {blocks / 2**20:.1f} MiB vs {per_tensor / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    "shape, dtype",
    [((8, 16, 16), jnp.bfloat16), ((8, 16, 300), jnp.float16), ((200, 24, 40), jnp.bfloat16)],
    ids=str,
)
def test_a_short_axis_gives_the_values_of_its_zero_padded_block_bit_for_bit(shape, dtype):
    """Tiles of an axis's own length hold the values a zero-padded 128-long tile held (the same amax,
    so the same scale and fp8 values), forward and both gradients; axes of 128 and more keep 128."""
    m, k, n = shape
    x, w, g = exact_values(2, (m, k), dtype), exact_values(3, (k, n), dtype), exact_values(4, (m, n), dtype)
    recipe = get_fp8_recipe("hybrid,block")
    own = contraction_and_gradients(lambda x, w: fp8.dot_general(x, w, MATMUL, recipe=recipe))(x, w, g)
    padded = contraction_and_gradients(zero_padded_to_whole_blocks(recipe))(x, w, g)
    assert bits(own) == bits(padded)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert rel(own[0], exact) < 0.1  # and they are the contraction


@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
@pytest.mark.parametrize("spec", ["b, 128", "8, k", "b, k"])
@pytest.mark.composition  # with a JAX transformation or another front-end
def test_jax_export_with_symbolic_dimensions(recipe, spec):
    """A symbolic token count (the weight gradient's contraction) or contraction length: the tiles
    along a symbolic axis are B long, and the exported program gives the jitted one's values."""
    shape = jax.export.symbolic_shape(spec)
    f = lambda x, w: fp8.dot_general(x, w, MATMUL, recipe=recipe)  # noqa: E731
    run = contraction_and_gradients(f)
    args = (
        jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((shape[1], 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((shape[0], 32), jnp.bfloat16),
    )
    exported = jax.export.export(run)(*args)
    for m, k in {"b, 128": [(8, 128)], "8, k": [(8, 16)], "b, k": [(200, 300)]}[spec]:
        x, w, g = (exact_values(i, s, jnp.bfloat16) for i, s in enumerate(((m, k), (k, 32), (m, 32))))
        assert bits(exported.call(x, w, g)) == bits(run(x, w, g)), (m, k)


@pytest.mark.composition
def test_autocast_block_fp8_exports_with_a_symbolic_batch():
    # remat_float32=False: the engine's float32 remat policy compares array sizes, which a symbolic
    # batch leaves undecided (JAX's InconclusiveDimensionOperation), with or without fp8
    f = jmp_lite.autocast(lambda p, x: x @ p["w"], POLICY, fp8="hybrid,block", remat_float32=False)
    loss = jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) * jnp.arange(24.0)), argnums=(0, 1)))
    p, x = {"w": exact_values(0, (64, 24))}, exact_values(1, (8, 64))
    batch = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 64"), jnp.float32)
    exported = jax.export.export(loss)({"w": jax.ShapeDtypeStruct((64, 24), jnp.float32)}, batch)
    assert bits(exported.call(p, x)) == bits(loss(p, x))
    assert "f8E4M3FN" in exported.mlir_module()


# ---------------------------------------------------------------------------------------------------------
# Accuracy against per-tensor scaling (the acceptance measurement)

M, K, N = 256, 1024, 256


def outlier_matrices(layout, ratio, seed=0):
    """``x (256, 1024)``, standard normal, with 1% of its rows (tokens) or columns (channels, K)
    ``ratio`` times larger; ``w (1024, 256)`` normal / 32; and the rows that are not outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / 32).astype(np.float32)
    keep = np.ones(M, bool)
    if layout == "tokens":
        rows = rng.choice(M, round(0.01 * M), replace=False)
        x[rows] *= ratio
        keep[rows] = False
    else:
        x[:, rng.choice(K, round(0.01 * K), replace=False)] *= ratio
    return x, w, keep


def errors(x, w, keep, recipe):
    """Relative Frobenius errors against float64 over the rows ``keep``: of the quantized operand (the
    contraction with the identity, whose fp8 blocks are exact) and of the contraction's output."""
    contract = jax.jit(lambda a, b: fp8.dot_general(a, b, MATMUL, recipe=recipe))
    operand = np.asarray(contract(x, np.eye(K, dtype=np.float32)))
    output = np.asarray(contract(x, w))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    return rel(operand[keep], x[keep]), rel(output[keep], exact[keep])


@pytest.mark.numerics
def test_block_scaling_is_at_least_4x_more_accurate_where_a_few_tokens_dwarf_the_rest():
    """1% of the tokens 2**16 times larger (seed 0, x 256x1024, w 1024x256): per-tensor scaling maps the
    others into E4M3's subnormals, where its relative precision is gone; each 1 x 128 tile (and
    each 1 x 32 MXFP8 tile) keeps its own scale. E4M3 is a floating-point format, so per-tensor
    scaling only loses where the ratio approaches its range (the next test)."""
    x, w, keep = outlier_matrices("tokens", 2.0**16)
    tensor = errors(x, w, keep, "hybrid,current")
    for recipe in ("hybrid,block", "hybrid,mxfp8"):
        block = errors(x, w, keep, recipe)
        message = (
            f"{recipe}: relative errors over the 99% ordinary tokens, per-tensor vs block: quantized "
            f"operand {tensor[0]:.4f} vs {block[0]:.4f}, contraction output {tensor[1]:.4f} vs {block[1]:.4f}"
        )
        assert tensor[0] >= 4 * block[0] and tensor[1] >= 4 * block[1], message


@pytest.mark.numerics
def test_outlier_channels_100x_gain_less_than_4x():
    """The same matrix with 1% of its K channels 100x larger, errors over all rows: every 1 x 128 tile
    that holds an outlier channel is scaled by it, as the whole tensor is, and 100x stays far inside
    E4M3's range. What block scaling gains there: the outlier lands exactly on 448 in its own tile
    (the operand error drops), little on the output; MXFP8's power-of-two scales gain nothing."""
    x, w, keep = outlier_matrices("channels", 100.0)
    tensor = errors(x, w, keep, "hybrid,current")
    block = errors(x, w, keep, "hybrid,block")
    mx = errors(x, w, keep, "hybrid,mxfp8")
    message = f"operand, output: per-tensor {tensor}, block {block}, mxfp8 {mx}"
    assert block[0] < tensor[0] / 2 and block[1] < tensor[1] < 4 * block[1], message
    assert abs(mx[0] - tensor[0]) < 0.1 * tensor[0], message
    # No scaling of x can gain 4x on x @ w: with x exact and only w in E4M3 (128 x 128 blocks, each
    # scaled to its own maximum) the output error is already 0.026, per-tensor's is 0.038.
    blocks = w.reshape(K // 128, 128, N // 128, 128)
    scale = np.abs(blocks).max(axis=(1, 3), keepdims=True) / 448
    w8 = ((blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(K, N)
    floor = rel(x.astype(np.float64) @ w8.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64))
    assert floor < block[1] < tensor[1] < 1.5 * floor, (floor, message)


# ---------------------------------------------------------------------------------------------------------
# Against jax.nn.scaled_matmul and jax.lax.scaled_dot


def test_jax_nn_scaled_matmul_has_no_cpu_lowering_so_the_emulation_runs():
    a = jnp.ones((1, 4, 32), E4M3)
    ones = jnp.ones((1, 4, 1), jnp.float8_e8m0fnu)
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError, match="scaled_matmul"):
            jax.nn.scaled_matmul(a, a, ones, ones)
    assert not fp8_blocks.native_mxfp8() or jax.default_backend() == "gpu"


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_the_native_calls_vmap_by_merging_the_vmapped_axis_into_the_batch():
    """jax.nn.scaled_matmul's batching rule wants all four arguments batched alike; the native call is
    wrapped so that a vmap over the examples of one weight (nested, too) folds into its batch axis.
    Checked here on the emulation, the same wrapper around a function that runs on CPU."""
    x, w = rand(25, (3, 2, 16, 64)), rand(26, (2, 8, 64))
    qa, ia = jax.vmap(lambda x: fp8_blocks.quantize_tiles(x, 32, 1, E4M3, 448.0, 0, True))(x)
    qb, ib = fp8_blocks.quantize_tiles(w, 32, 1, E4M3, 448.0, 0, True)
    merged = fp8_blocks.batch_merged(fp8_blocks.emulated_scaled_matmul)
    want = jax.jit(jax.vmap(fp8_blocks.emulated_scaled_matmul, (0, 0, None, None)))(qa, ia, qb, ib)
    assert bits(jax.jit(jax.vmap(merged, (0, 0, None, None)))(qa, ia, qb, ib)) == bits(want)
    nested = jax.vmap(jax.vmap(merged, (0, 0, None, None)), (1, 1, None, None), 1)
    assert bits(jax.jit(nested)(qa[:, None], ia[:, None], qb, ib)[:, 0]) == bits(want)


def scaled_dot(a, inverse_a, b, inverse_b):
    """``jax.lax.scaled_dot`` (what jax.nn.scaled_matmul lowers to on ROCm) in scaled_matmul's layout."""
    return jax.lax.scaled_dot(
        a,
        jnp.swapaxes(b, 1, 2),
        lhs_scale=inverse_a,
        rhs_scale=jnp.swapaxes(inverse_b, 1, 2),
        dimension_numbers=(((2,), (1,)), ((0,), (0,))),
        preferred_element_type=jnp.float32,
    )


def test_emulation_equals_lax_scaled_dot_bitwise_where_every_sum_is_exact():
    """Integer fp8 values and power-of-two scales: every product and partial sum is exact in float32,
    so the per-block promotion and scaled_dot's one dot over dequantized operands agree bit for bit."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.integers(-8, 9, (2, 16, 256)).astype(E4M3))
    b = jnp.asarray(rng.integers(-8, 9, (2, 24, 256)).astype(E4M3))
    ia = jnp.asarray(np.exp2(rng.integers(-2, 3, (2, 16, 8))).astype(np.float32))
    ib = jnp.asarray(np.exp2(rng.integers(-2, 3, (2, 24, 8))).astype(np.float32))
    got = jax.jit(fp8_blocks.emulated_scaled_matmul)(a, ia, b, ib)
    assert bits(got) == bits(jax.jit(scaled_dot)(a, ia, b, ib))


@pytest.mark.numerics
def test_emulation_and_lax_scaled_dot_differ_by_summation_order_or_bf16_scales():
    """On XLA:CPU scaled_dot dequantizes each operand in bfloat16 (its scale rounded to bfloat16) and
    runs one float32-accumulating dot over all of K. With MXFP8's power-of-two scales that is exact,
    so the two differ only in the order of the float32 sums: within K * 2**-24 of sum(|products|).
    With block scaling's float32 scales, the bfloat16 rounding of the scales (2**-9) shows."""
    x, w = rand(7, (2, 64, 1024)), rand(8, (2, 48, 1024))
    for power_of_two, block, limit in ((True, 32, 1024 * 2.0**-24), (False, 128, 2.0**-8)):
        qa, ia = fp8_blocks.quantize_tiles(x, block, 1, E4M3, 448.0, 0, power_of_two)
        qb, ib = fp8_blocks.quantize_tiles(w, block, 1, E4M3, 448.0, 0, power_of_two)
        got = np.asarray(jax.jit(fp8_blocks.emulated_scaled_matmul)(qa, ia, qb, ib))
        theirs = np.asarray(jax.jit(scaled_dot)(qa, ia, qb, ib))
        deq_a = np.abs(np.asarray(qa, np.float64) * np.repeat(np.asarray(ia), block, -1))
        deq_b = np.abs(np.asarray(qb, np.float64) * np.repeat(np.asarray(ib), block, -1))
        scale = np.einsum("bmk,bnk->bmn", deq_a, deq_b)
        worst = float(np.max(np.abs(got - theirs) / scale))
        assert worst <= limit, (power_of_two, worst)
        if not power_of_two:
            assert worst > 2.0**-16  # not mere summation order: the scales were rounded


def test_mxfp8_quantization_is_jax_scaled_dot_generals_bit_for_bit():
    quantize = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo").quantize
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    rng = np.random.default_rng(1)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = (rng.standard_normal((2, 64, 256)) * np.exp(3 * rng.standard_normal((2, 64, 256)))).astype(dtype)
        theirs, their_scales = quantize(jnp.asarray(x), config)
        ours, inverse = fp8_blocks.quantize_tiles(jnp.asarray(x), 32, 1, E4M3, 448.0, 0, True)
        assert bits(ours) == bits(theirs)
        assert bits(inverse) == bits(their_scales.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------------------
# Transformations, dtypes, state


@pytest.mark.numerics
@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_compute_dtypes_under_jit_and_grad(recipe, dtype):
    x, w = rand(9, (4, 20, 200), dtype=dtype), rand(10, (200, 40), 0.05, dtype=dtype)
    dims = (((2,), (0,)), ((), ()))

    def loss(x, w):
        return jnp.sum(fp8.dot_general(x, w, dims, recipe=recipe).astype(jnp.float32) ** 2)

    eager = fp8.dot_general(x, w, dims, recipe=recipe)
    jitted = jax.jit(lambda x, w: fp8.dot_general(x, w, dims, recipe=recipe))(x, w)
    assert eager.dtype == dtype and bits(eager) == bits(jitted)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    want = jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert [g.dtype for g in grads] == [dtype, dtype]
    assert max(rel(a, b) for a, b in zip(grads, want)) < 0.1
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert "f8E4M3FN" in text and "f8E5M2" in text  # E4M3 forward, E5M2 gradients


@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
@pytest.mark.composition  # with a JAX transformation or another front-end
def test_vmap_is_the_loop_over_examples(recipe):
    """Tiles never cross the vmapped axis: forward and lhs gradient are the loop's bit for bit; the rhs
    gradient sums the examples' (each with tiles along its own M) in another order."""
    xs, w = rand(11, (3, 50, 300)), rand(12, (300, 70), 0.05)

    def f(x, w):
        return fp8.dot_general(x, w, MATMUL, recipe=recipe)

    def loss(x, w):
        return jnp.sum(jnp.sin(f(x, w)))

    assert bits(jax.jit(jax.vmap(f, (0, None)))(xs, w)) == bits(jnp.stack([jax.jit(f)(x, w) for x in xs]))
    vloss = lambda xs, w: jnp.sum(jax.vmap(loss, (0, None))(xs, w))  # noqa: E731
    dxs, dw = jax.jit(jax.grad(vloss, (0, 1)))(xs, w)
    loop = [jax.jit(jax.grad(loss, (0, 1)))(x, w) for x in xs]
    assert bits(dxs) == bits(jnp.stack([d for d, _ in loop]))
    np.testing.assert_allclose(dw, sum(d for _, d in loop), rtol=1e-5, atol=1e-6)


def test_an_optional_state_observes_the_per_tensor_amaxes():
    recipe = Fp8Recipe("hybrid", "block")
    state = fp8.init_fp8_state(recipe)
    assert state.fp8_amax_history.shape == (3, 1)
    x, w, g = rand(13, (10, 300)), rand(14, (300, 20), 0.05), rand(15, (10, 20))

    def loss(x, w, s):
        return jnp.sum(fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s) * g)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, state)
    without = jax.jit(jax.grad(lambda x, w: loss(x, w, None), argnums=(0, 1)))(x, w)
    assert bits(grads[:2]) == bits(without)  # the state changes nothing but what is observed
    want = [float(jnp.abs(a).max()) for a in (x, w, g)]
    assert np.asarray(grads[2].fp8_amax).tolist() == want
    new = fp8.update_fp8_state(state, grads[2], recipe)
    assert float(new.fp8_amax_history[0, 0]) == want[0]


@pytest.mark.composition
@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
def test_shard_map_over_the_batch_observes_global_amaxes(recipe):
    """A replicated weight and state, the batch sharded: the carry of the block loop is typed as varying
    over the mesh axis like the operands, the state's observed amaxes are max-reduced over the shards
    (out_specs=P() checks they agree), and the weight gradient is summed. Each shard is its own
    contraction: the weight gradient's tiles along M do not cross shards."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = rand(23, (8 * len(jax.devices()), 300)) * jnp.linspace(0.5, 4.0, 8 * len(jax.devices()))[:, None]
    w, state = rand(24, (300, 40), 0.05), fp8.init_fp8_state(recipe)

    def loss(w, s, x):
        return jnp.sum(fp8.dot_general(x, w, MATMUL, recipe=recipe, state=s) ** 2)

    grad = jax.grad(loss, (0, 1))
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P()))
    dw, observed = sharded(w, state, jax.device_put(x, NamedSharding(mesh, P("d"))))
    _, want = jax.jit(grad)(w, state, x)
    assert bits(observed.fp8_amax[:2]) == bits(want.fp8_amax[:2])
    assert float(observed.fp8_amax[0]) == float(jnp.abs(x).max())
    shards = [jax.jit(grad)(w, state, part)[0] for part in jnp.split(x, len(jax.devices()))]
    np.testing.assert_allclose(dw, sum(shards), rtol=1e-5, atol=1e-5)


def test_checkpointed_residuals_keep_e4m3s_top_binade_and_non_finite_values_stay_non_finite():
    x, w = rand(16, (8, 256), 100.0), rand(17, (256, 16))  # every tile's amax lands on 448 exactly

    def loss(x, w):
        return jnp.sum(fp8.dot_general(x, w, MATMUL, recipe="hybrid,block") ** 2)

    plain = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    assert bits(jax.jit(jax.grad(jax.checkpoint(loss), (0, 1)))(x, w)) == bits(plain)
    assert all(bool(jnp.isfinite(g).all()) for g in plain)
    y = fp8.dot_general(x.at[0, 0].set(jnp.inf), w, MATMUL, recipe="hybrid,block")
    assert not bool(jnp.isfinite(y[0]).any()) and bool(jnp.isfinite(y[1:]).all())  # one row's tile only


def test_bad_operands_are_refused_with_lax_dot_generals_message():
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        fp8.dot_general(jnp.ones((2, 3)), jnp.ones((4, 2)), MATMUL, recipe="hybrid,block")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got float64"):
        fp8.dot_general(np.ones((2, 3)), np.ones((3, 2)), MATMUL, recipe="hybrid,block")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        fp8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), MATMUL, recipe="hybrid,block,block=0")


# ---------------------------------------------------------------------------------------------------------
# The front-ends: fp8="hybrid,block" through the same argument


POLICY = "p=f32,c=bf16,o=f32"


def lowered_gradient(loss, *args):
    return jax.jit(jax.grad(loss)).lower(*args).as_text()


@pytest.mark.composition
def test_linen_apply_policy_runs_block_scaled_dense_layers():
    mlp = nn.Sequential([nn.Dense(160), nn.gelu, nn.Dense(8)])
    model = jmp_lite.flax.linen.apply_policy(mlp, POLICY, fp8="hybrid,block")
    x = rand(18, (4, 200))
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # block scaling keeps no state
    text = lowered_gradient(lambda v: jnp.sum(model.apply(v, x) ** 2), variables)
    assert "f8E4M3FN" in text and "f8E5M2" in text
    exact = mlp.apply(variables, x)
    assert rel(model.apply(variables, x), exact) < 0.1


@pytest.mark.composition
def test_nnx_apply_policy_runs_block_scaled_linear_layers():
    net = nnx.Sequential(
        nnx.Linear(200, 160, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(160, 8, rngs=nnx.Rngs(1))
    )
    view = jnnx.apply_policy(net, POLICY, fp8="hybrid,block")
    assert not nnx.state(view, jnnx.Fp8Variable)  # no state for block scaling
    graphdef, state = nnx.split(view)
    x = rand(19, (4, 200))
    text = lowered_gradient(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2), state)
    assert "f8E4M3FN" in text and "f8E5M2" in text


@pytest.mark.composition
def test_autocast_runs_block_scaled_contractions():
    params = {"w1": rand(20, (200, 160), 0.1), "w2": rand(21, (160, 8), 0.1)}
    f = jmp_lite.autocast(lambda p, x: jax.nn.gelu(x @ p["w1"]) @ p["w2"], POLICY, fp8="hybrid,block")
    x = rand(22, (4, 200))
    assert f.init_fp8_state(params, x) == {}
    text = lowered_gradient(lambda p: jnp.sum(f(p, x) ** 2), params)
    assert "f8E4M3FN" in text and "f8E5M2" in text


@pytest.mark.composition
@pytest.mark.parametrize("recipe", ["hybrid,block", "hybrid,mxfp8"])
def test_a_weight_written_first_still_gets_the_weight_tiles(recipe):
    """``w @ x`` (Equinox's ``Linear``): the engine contracts the operands swapped and transposes back, so
    the activation keeps its 1 x B tiles along K. The same values and gradient as ``x @ w.T``, bit for
    bit; before, the tokens got the B x B blocks and one outlier token spoiled its 127 neighbours
    ("block" fails without the swap; MXFP8 tiles both operands 1 x 32 along K, so it checks that the
    swap changes no bit there)."""
    rng = np.random.default_rng(4)
    tokens = rng.standard_normal((64, 256)).astype(np.float32)
    tokens[0] *= 2.0**16
    w = (rng.standard_normal((32, 256)) / 16).astype(np.float32)
    policy = "p=f32,c=bf16,o=f32"
    first = jax.jit(
        jax.value_and_grad(
            lambda w: jnp.sum(jmp_lite.autocast(lambda w: (w @ tokens.T).T, policy, fp8=recipe)(w) ** 2)
        )
    )
    second = jax.jit(
        jax.value_and_grad(
            lambda w: jnp.sum(jmp_lite.autocast(lambda w: tokens @ w.T, policy, fp8=recipe)(w) ** 2)
        )
    )
    (a, ga), (b, gb) = first(w), second(w)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ga, gb)
    y = jax.jit(jmp_lite.autocast(lambda w: (w @ tokens.T).T, policy, fp8=recipe))(w)
    exact = tokens[1:].astype(np.float64) @ w.T.astype(np.float64)
    assert rel(np.asarray(y)[1:], exact) < 0.05  # measured 0.037 (block and mxfp8); 0.23 before, for block


# ---------------------------------------------------------------------------------------------------------
# fp8_report with the tiles of each use


def np_fractions(x, block, rows, dtype, power_of_two):
    """Underflow and subnormal fractions of ``x (R, C)`` quantized by ``np_quantize``."""
    q, _ = np_quantize(x, block, rows, dtype, power_of_two)
    subnormal = (q != 0) & (np.abs(q) < ml_dtypes.finfo(dtype).smallest_normal)
    return np.array([((x != 0) & (q == 0)).mean(), subnormal.mean()])


@pytest.mark.numerics
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_fp8_report_counts_each_tensor_in_the_tiles_of_each_of_its_products(recipe):
    """One token 2**16 times larger: the forward's 1 x B tiles along K keep it to its own row, the
    kernel gradient's tiles along M put it in every channel of its group of B tokens, whose other
    values underflow there. The report gives each tensor its worst layout (a NumPy count per layout)
    and the tile holding the amax's scale; per-tensor current scaling loses more."""
    recipe = get_fp8_recipe(recipe)
    b, mx = recipe.block_size, recipe.scaling == "mxfp8"
    fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
    x = np.array(rand(30, (256, 320)))
    x[5] *= 2.0**16
    w, g = np.array(rand(31, (320, 96))), np.array(rand(32, (256, 96), 1e-6))
    w[3, 7] *= 2.0**16  # one weight: its B x B block (or its two 1 x 32 tiles) underflow around it
    g[:, 7] *= 2.0**20  # one output channel: E5M2's range still holds the rest in tiles along N
    report = jax.jit(lambda x, w, g: fp8.fp8_report(x, w, recipe, grad=g))(x, w, g)
    layouts = {
        "lhs": [(x, 1, fwd), (x.T, 1, fwd)],
        "rhs": [(w.T, 1, fwd), (w, 1, fwd)] if mx else [(w.T, b, fwd)],
        "grad": [(g, 1, bwd), (g.T, 1, bwd)],
    }
    for name, uses in layouts.items():
        got = getattr(report, name)
        each = [np_fractions(t, b, rows, dtype, mx) for t, rows, dtype in uses]
        want = np.max(each, axis=0)
        np.testing.assert_allclose(
            [float(got.underflow), float(got.subnormal)], want, rtol=1e-6, err_msg=name
        )
        top = float(ml_dtypes.finfo(uses[0][2]).max)
        amax = np.abs(uses[0][0]).max()
        assert float(got.amax) == amax
        assert 0 <= float(got.headroom_bits) < (1 if mx else 1e-6), name
        if not mx:
            assert float(got.scale) == np.float32(top) / amax, name
    # the worst layout is the kernel gradient's for x (along M), the lhs gradient's for g (along N)
    lost_x = [np_fractions(x, b, 1, fwd, mx)[0], np_fractions(x.T, b, 1, fwd, mx)[0]]
    assert lost_x[0] == 0 < lost_x[1] == pytest.approx(float(report.lhs.underflow), rel=1e-6)
    current = recipe.replace(scaling="current")
    tensor = jax.jit(lambda x, w, g: fp8.fp8_report(x, w, current, grad=g))(x, w, g)
    assert float(tensor.lhs.underflow) > 1.5 * float(report.lhs.underflow)


def test_fp8_report_follows_dimension_numbers_for_block_recipes():
    x, w = rand(33, (64, 256)), rand(34, (256, 48))
    x = x.at[3, :128].multiply(2.0**16)
    x3 = x.reshape(4, 16, 256)  # 4 examples of 16 tokens; the outlier token is example 0's
    batch = (((2,), (1,)), ((0,), (0,)))

    @jax.jit
    def reports(x, w, x3):
        return (
            fp8.fp8_report(x, w, "hybrid,block"),
            # the same contraction written as x^T contracted over its first axis
            fp8.fp8_report(x.T, w, "hybrid,block", dimension_numbers=(((0,), (0,)), ((), ()))),
            fp8.fp8_report(x3, jnp.stack([w] * 4), "hybrid,block", dimension_numbers=batch),
            fp8.fp8_report(x3, w, "hybrid,block"),
        )

    plain, turned, batched, flat = reports(x, w, x3)
    assert bits(turned) == bits(plain)
    # the layout matters: with a batch axis, x's tiles along M hold one example's 16 tokens instead
    # of all 64, so fewer values share the outlier token's tiles
    assert 0 < float(batched.lhs.underflow) < float(flat.lhs.underflow) == float(plain.lhs.underflow)


@pytest.mark.numerics
def test_fp8_report_counts_a_value_its_tile_scales_below_float32s_range_as_underflow():
    """1e-10 next to 1e30 in one tile: scaled by 448 / 1e30 it is no float32 at all, and the cast loses
    it. The block report counts it as the per-tensor report does (not as a zero)."""
    x = jnp.zeros((1, 256)).at[0, 0].set(1e30).at[0, 1].set(1e-10).at[0, 128:].set(1.0)
    report = jax.jit(lambda x: fp8.fp8_report(x, jnp.ones((256, 2)), "hybrid,block"))(x)
    assert float(report.lhs.underflow) == 1 / 256  # the ones keep their own tile


def test_fp8_report_block_scale_ignores_a_nan_elsewhere_and_an_empty_tensor_has_no_fractions():
    x = jnp.zeros((2, 256)).at[0, 0].set(4.0).at[0, 5:128].set(1.0)
    w = jnp.ones((256, 2))
    report = jax.jit(lambda x: fp8.fp8_report(x, w, "hybrid,block"))
    clean, poisoned = report(x).lhs, report(x.at[1, 200].set(jnp.nan)).lhs
    assert (float(clean.amax), float(clean.scale)) == (4.0, 112.0) and abs(float(clean.headroom_bits)) < 1e-5
    assert (float(poisoned.amax), float(poisoned.scale)) == (4.0, 112.0), poisoned  # was scale 1
    assert float(poisoned.headroom_bits) == float(clean.headroom_bits)  # was 6.81
    reported = jax.jit(fp8.fp8_report, static_argnums=2)
    for recipe in ("hybrid,current", "hybrid,block", "hybrid,mxfp8"):
        empty = reported(jnp.zeros((0, 200)), jnp.ones((200, 3)), recipe).lhs
        assert [float(empty.saturated), float(empty.underflow), float(empty.subnormal)] == [0, 0, 0], recipe


@pytest.mark.parametrize("recipe", ["hybrid,current", *BLOCK_RECIPES])
def test_second_derivatives_are_refused_with_a_clear_error(recipe):
    """The backward quantizes the output gradient to fp8 and keeps the operands as fp8 bits: neither has a
    derivative. grad of grad and jax.hessian raised JAX-internal errors (a failed linearization, a
    RecursionError); letting them through would give wrong mixed second derivatives."""
    x, w = jnp.ones((4, 160)), jnp.full((160, 3), 0.05)
    f = lambda a, b: fp8.dot_general(a, b, MATMUL, recipe=recipe)  # noqa: E731
    penalty = lambda a: jnp.sum(jax.grad(lambda a: jnp.sum(f(a, w) ** 2))(a) ** 2)  # noqa: E731
    message = "fp8 contractions have first derivatives only: a second derivative"
    with pytest.raises(NotImplementedError, match=message):
        jax.eval_shape(jax.grad(penalty), x)
    with pytest.raises(NotImplementedError, match=message):
        jax.eval_shape(jax.hessian(lambda b: jnp.sum(f(x[:2, :3], b) ** 2)), w[:3, :2])
    assert jax.eval_shape(jax.grad(lambda a: jnp.sum(f(a, w) ** 2)), x).shape == x.shape  # first order


# ---------------------------------------------------------------------------------------------------------
# Random contractions


@st.composite
def contractions(draw):
    """A block recipe and a random ``dot_general``: up to 2 batch axes, 1 or 2 contracted axes paired in
    a random order, up to 2 free axes a side, the axes of each operand in a random order, K crossing
    block boundaries or not; operand scales far apart, sometimes one large value."""
    recipe = draw(st.sampled_from(BLOCK_RECIPES))
    n_batch, n_contract = draw(st.integers(0, 2)), draw(st.integers(1, 2))
    batch = [draw(st.integers(1, 3)) for _ in range(n_batch)]
    contract = [draw(st.integers(1, 70)) for _ in range(n_contract)]
    lhs_free = [draw(st.integers(1, 9)) for _ in range(draw(st.integers(0, 2)))]
    rhs_free = [draw(st.integers(1, 9)) for _ in range(draw(st.integers(0, 2)))]
    # each operand's axes as (kind, index) in a random order; the contracted pairs in a random order
    lhs_axes = draw(
        st.permutations(
            [("b", i) for i in range(n_batch)]
            + [("c", i) for i in range(n_contract)]
            + [("f", i) for i in range(len(lhs_free))]
        )
    )
    rhs_axes = draw(
        st.permutations(
            [("b", i) for i in range(n_batch)]
            + [("c", i) for i in range(n_contract)]
            + [("f", i) for i in range(len(rhs_free))]
        )
    )
    pairs = draw(st.permutations(range(n_contract)))
    sizes = {"b": batch, "c": contract}
    lhs_shape = tuple((sizes | {"f": lhs_free})[k][i] for k, i in lhs_axes)
    rhs_shape = tuple((sizes | {"f": rhs_free})[k][i] for k, i in rhs_axes)
    dims = (
        (tuple(lhs_axes.index(("c", i)) for i in pairs), tuple(rhs_axes.index(("c", i)) for i in pairs)),
        (
            tuple(lhs_axes.index(("b", i)) for i in range(n_batch)),
            tuple(rhs_axes.index(("b", i)) for i in range(n_batch)),
        ),
    )
    seed = draw(st.integers(0, 2**16))
    scales = [2.0 ** draw(st.integers(-12, 12)) for _ in range(3)]
    return recipe, lhs_shape, rhs_shape, dims, seed, scales, draw(st.booleans())


def np_canonical(x, batch, contract):
    """``x`` as ``(B, free, K)`` in NumPy: batch axes, free axes in order, contracted ones in pair order."""
    free = [d for d in range(x.ndim) if d not in batch and d not in contract]
    order = [*batch, *free, *contract]
    y = np.transpose(x, order)
    nb, nf = len(batch), len(free)
    return y.reshape(int(np.prod(y.shape[:nb])), int(np.prod(y.shape[nb : nb + nf])), -1), order, y.shape


def np_uncanonical(x3, order, shape):
    return np.transpose(x3.reshape(shape), np.argsort(order))


# the first case is the fast tier's, the other CI's system tier's (a unit or property test's later cases)
@pytest.mark.property
@pytest.mark.parametrize("examples", [3, 10])
def test_random_contractions_match_the_numpy_reference_forward_and_backward(examples):
    derandomized = settings(
        max_examples=examples, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
    )
    derandomized(given(contractions())(random_contraction_matches_the_numpy_reference))()


def random_contraction_matches_the_numpy_reference(case):
    check_random_contraction(case)


@pytest.mark.property
@pytest.mark.scale
@pytest.mark.nightly  # 30 other contractions (derandomized by the test's name)
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(contractions())
def test_more_random_contractions_match_the_numpy_reference(case):
    check_random_contraction(case)


def check_random_contraction(case):
    """Any ``dimension_numbers``: the operands are laid out as (batch, free, K) with K in pair order, and
    the output and both gradients equal the 2-D NumPy reference's per batch, within float32 summation."""
    recipe, lhs_shape, rhs_shape, dims, seed, (sx, sw, sg), spike = case
    recipe = get_fp8_recipe(recipe)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(lhs_shape) * sx).astype(np.float32)
    w = (rng.standard_normal(rhs_shape) * sw).astype(np.float32)
    if spike and x.size:
        x.flat[rng.integers(x.size)] *= 2.0**14  # one value far above the rest of its tiles
    out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), x, w).shape
    g = (rng.standard_normal(out_shape) * sg).astype(np.float32)

    def f(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, dims, recipe=recipe), x, w)
        return y, vjp(g)

    y, (dx, dw) = jax.jit(f)(x, w, g)
    (lc, rc), (lb, rb) = dims
    x3, x_order, x_shape = np_canonical(x, lb, lc)
    w3, w_order, w_shape = np_canonical(w, rb, rc)
    g3 = g.reshape(x3.shape[0], x3.shape[1], w3.shape[1])
    ref = [np_block_contraction(x3[i], w3[i].T, g3[i], recipe) for i in range(x3.shape[0])]
    ref_y = np.stack([r[0] for r in ref]).reshape(out_shape)
    ref_dx = np_uncanonical(np.stack([r[1] for r in ref]), x_order, x_shape)
    ref_dw = np_uncanonical(np.stack([r[2].T for r in ref]), w_order, w_shape)
    ax, aw, ag = (np.abs(a).astype(np.float64) for a in (x3, w3, g3))
    bound_y = np.stack([float32_accumulation_bound(ax[i], aw[i].T) for i in range(len(ax))]).reshape(
        out_shape
    )
    bound_dx = np_uncanonical(
        np.stack([float32_accumulation_bound(ag[i], aw[i]) for i in range(len(ax))]), x_order, x_shape
    )
    bound_dw = np_uncanonical(
        np.stack([float32_accumulation_bound(ag[i].T, ax[i]) for i in range(len(ax))]), w_order, w_shape
    )
    for name, got, want, bound in (
        ("y", y, ref_y, bound_y),
        ("dx", dx, ref_dx, bound_dx),
        ("dw", dw, ref_dw, bound_dw),
    ):
        assert got.shape == want.shape, name
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= 2 * bound + 1e-30), (name, float(np.max(err - 2 * bound)))
    # fp8_report follows the same layouts: each tensor's worst, per batch, as NumPy counts them
    report = jax.jit(lambda x, w, g: fp8.fp8_report(x, w, recipe, grad=g, dimension_numbers=dims))(x, w, g)
    b, mx, (fwd, bwd) = (
        recipe.block_size,
        recipe.scaling == "mxfp8",
        (recipe.forward_dtype, recipe.backward_dtype),
    )
    layouts = {
        "lhs": [(x3, 1, fwd), (x3.transpose(0, 2, 1), 1, fwd)],
        "rhs": [(w3, 1, fwd), (w3.transpose(0, 2, 1), 1, fwd)] if mx else [(w3, b, fwd)],
        "grad": [(g3, 1, bwd), (g3.transpose(0, 2, 1), 1, bwd)],
    }
    for name, uses in layouts.items():
        each = [
            np.mean([np_fractions(t[i], b, rows, d, mx) for i in range(len(t))], axis=0)
            for t, rows, d in uses
        ]
        got = getattr(report, name)
        np.testing.assert_allclose(
            [float(got.underflow), float(got.subnormal)],
            np.max(each, axis=0),
            rtol=1e-5,
            atol=1e-7,
            err_msg=name,
        )
