"""Block-scaled fp8: quantize in tiles along the contraction, contract tile by tile in float32.

Per-tensor scaling gives a whole tensor one scale, so one large value sets the scale of all the others.
Block scaling gives each tile its own (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", section 3.3:
1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights, the partial sums promoted to
float32 every 128 elements of the contraction). The OCP Microscaling format (MX v1.0, 2023) does the
same with 1 x 32 tiles and power-of-two (E8M0) scales: MXFP8.

Everything here works on the canonical layout of ``jax.nn.scaled_matmul``: an operand is
``(batch, rows, C)``, contracted over its last axis ``C``; a tile is ``rows_per_tile`` rows by ``B``
consecutive elements of ``C``, and each row carries one dequantization multiplier per block of ``C``
(``inverse``: ``x ~= q * inverse``, the reciprocal of the scale ``q = saturate(x * scale)`` used).
With ``a (b, Ra, C)``, ``b (b, Rb, C)`` and ``C = n * B``:

    out[b, i, j] = sum over k < n of  inverse_a[b, i, k] * inverse_b[b, j, k]
                   * sum over c in block k of  q_a[b, i, c] * q_b[b, j, c]

Each inner sum multiplies fp8 values and accumulates in float32 (one fp8 GEMM per block), each is
multiplied by its two blocks' inverse scales, and the outer sum runs over the blocks in float32, in
order (``emulated_scaled_matmul``). ``scaled_matmul`` uses ``jax.nn.scaled_matmul`` instead where the
backend has a native block-scaled fp8 GEMM for the recipe (MXFP8 on NVIDIA Blackwell through cuDNN)
and this emulation everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jmp_lite._src.fp8.fp8 import scale_from_amax
from jmp_lite._src.kernels.accumulate import contraction_sharding

__all__ = [
    "batch_merged",
    "canonical",
    "descale",
    "element_scales",
    "emulated_scaled_matmul",
    "native_mxfp8",
    "per_row",
    "quantize",
    "quantize_tiles",
    "scaled_matmul",
    "tile_length",
    "tile_scales",
    "to_varying",
    "varying",
]

_F32 = np.dtype(np.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``saturate(x * scale)`` cast to the fp8 ``dtype``; the product is formed in float32.

    Finite values beyond the format's maximum are clipped to it (a scale that lags behind a growing
    tensor costs accuracy, not a NaN). Non-finite values stay non-finite (inf becomes NaN in E4M3,
    which has no infinity), so an overflowing float16 backward still reaches ``loss_scaling``'s
    finiteness check instead of being saturated into a plausible gradient.
    """
    top = float(ml_dtypes.finfo(dtype).max)
    y = x.astype(jnp.float32) * scale
    return jnp.where(jnp.isfinite(x), jnp.clip(y, -top, top), y).astype(dtype)


def descale(out: jax.Array, inv_a: jax.Array, inv_b: jax.Array) -> jax.Array:
    """``out * inv_a * inv_b``: the product of the two inverse scales first (one rounding, as Flax and
    TransformerEngine do), unless that product is no normal float32 (two extreme scales), when XLA
    would flush it to zero: then one factor at a time."""
    both = inv_a * inv_b
    normal = (both >= np.finfo(np.float32).tiny) & (both <= np.finfo(np.float32).max)
    return jnp.where(normal, out * both, (out * inv_a) * inv_b)


def tile_scales(amax: jax.Array, fp8_max: float, margin: int, power_of_two: bool) -> jax.Array:
    """The scale of each tile: ``fp8_max / (amax * 2**margin)`` (``scale_from_amax``: 1 for an
    all-zero or non-finite tile), rounded down to a power of two when ``power_of_two`` (MXFP8's E8M0
    scales: the tile's amax then lands in ``(fp8_max / 2, fp8_max]``, never beyond, as
    ``jax.nn.scaled_dot_general`` rounds its MXFP8 scales)."""
    scale = scale_from_amax(amax, fp8_max, margin, 1.0)
    if not power_of_two:
        return scale
    _, exponent = jnp.frexp(scale)  # scale = m * 2**exponent, m in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(scale), exponent - 1)


def tile_length(size: int | Any, block: int) -> int:
    """The length of the tiles along an axis of ``size`` elements: ``block``, or ``size`` itself where
    that is a known size shorter than ``block``: one tile of its own length, not one padded with
    zeros to ``block`` (a batch of 16 x 16 weights padded to 128 x 128 blocks takes 64 times their
    bytes in temporaries). The tile's amax, and so every quantized value, is the padded tile's. A
    symbolic size (``jax.export``) may be longer than ``block``: it gets ``block``-long tiles."""
    if isinstance(size, (int, np.integer)) and size < block:
        return max(int(size), 1)
    return block


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    size = x.shape[axis]
    # written as a ceiling, not size + (-size % multiple): for a symbolic size (jax.export) JAX can then
    # prove that there is at least one tile, which the scan over the tiles needs
    extra = (size + multiple - 1) // multiple * multiple - size
    if isinstance(extra, (int, np.integer)) and not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)  # zeros: they add nothing to a product and leave every amax unchanged


def _tile_grid(
    x: jax.Array, block: int, rows: int, fp8_max: float, margin: int, power_of_two: bool
) -> tuple[jax.Array, jax.Array]:
    """``x (batch, R, C)`` zero-padded and split into tiles ``(batch, R' / rows, rows, C' / block,
    block)``, and each tile's scale ``(batch, R' / rows, C' / block)``."""
    x = _pad(_pad(x, 2, block), 1, rows)
    b, r, c = x.shape
    tiles = x.reshape(b, r // rows, rows, c // block, block)
    amax = jnp.max(jnp.abs(tiles.astype(jnp.float32)), axis=(2, 4), initial=0.0)
    return tiles, tile_scales(amax, fp8_max, margin, power_of_two)


def quantize_tiles(
    x: jax.Array,
    block: int,
    rows: int,
    dtype: np.dtype,
    fp8_max: float,
    margin: int,
    power_of_two: bool,
) -> tuple[jax.Array, jax.Array]:
    """``x (batch, R, C)`` quantized with one scale per tile of ``rows`` x ``block`` elements.

    ``C`` is padded with zeros to a multiple of ``block``, and ``R`` to a multiple of ``rows``.
    Returns ``(q, inverse)``: ``q (batch, R', C')`` in ``dtype`` and ``inverse (batch, R' / rows,
    C' / block)`` float32, the reciprocal of each tile's scale (``x ~= q * inverse`` tile by tile).
    """
    tiles, scale = _tile_grid(x, block, rows, fp8_max, margin, power_of_two)
    b, nr, _, nc, _ = tiles.shape
    q = quantize(tiles, scale[:, :, None, :, None], dtype).reshape(b, nr * rows, nc * block)
    return q, 1.0 / scale


def element_scales(
    x: jax.Array, block: int, rows: int, fp8_max: float, margin: int, power_of_two: bool
) -> jax.Array:
    """The scale ``quantize_tiles`` multiplies each element of ``x (batch, R, C)`` by: its tile's,
    shaped like ``x`` (no padding), for tools that count what the cast does to each value."""
    tiles, scale = _tile_grid(x, block, rows, fp8_max, margin, power_of_two)
    b, nr, _, nc, _ = tiles.shape
    full = jnp.broadcast_to(scale[:, :, None, :, None], tiles.shape).reshape(b, nr * rows, nc * block)
    return full[:, : x.shape[1], : x.shape[2]]


def per_row(inverse: jax.Array, rows: int) -> jax.Array:
    """Tile scales ``(batch, R / rows, n)`` repeated to one per row, ``(batch, R, n)``."""
    return inverse if rows == 1 else jnp.repeat(inverse, rows, axis=1)


def emulated_scaled_matmul(
    a: jax.Array, inverse_a: jax.Array, b: jax.Array, inverse_b: jax.Array
) -> jax.Array:
    """``jax.nn.scaled_matmul``'s contraction with per-block float32 promotion, on any backend.

    ``a (batch, Ra, C)``, ``b (batch, Rb, C)`` fp8; ``inverse_a (batch, Ra, n)``, ``inverse_b (batch,
    Rb, n)`` float32 with ``C = n * B``. Block ``k``'s partial product is one fp8 ``dot_general`` with
    ``preferred_element_type=float32`` (exact products, float32 accumulation on XLA:CPU), multiplied
    by ``inverse_a[..., k] * inverse_b[..., k]`` and added to a float32 accumulator, block after block
    (a ``lax.scan`` over the blocks after the first, so the accumulator is the only ``(batch, Ra, Rb)``
    float32 array alive).
    Returns ``(batch, Ra, Rb)`` float32.
    """
    batch, ra, c = a.shape
    rb, n = b.shape[1], inverse_a.shape[-1]
    symbolic = not isinstance(n, (int, np.integer))  # jax.export: K (or M, in the backward) symbolic
    if not symbolic and n == 0:  # nothing contracted
        return jnp.zeros((batch, ra, rb), jnp.float32)
    block = c // n
    blocks_a = jnp.moveaxis(a.reshape(batch, ra, n, block), 2, 0)
    blocks_b = jnp.moveaxis(b.reshape(batch, rb, n, block), 2, 0)
    xs = (blocks_a, blocks_b, jnp.moveaxis(inverse_a, 2, 0), jnp.moveaxis(inverse_b, 2, 0))
    dims = (((2,), (2,)), ((0,), (0,)))

    def product(x: tuple) -> jax.Array:
        qa, qb, ia, ib = x
        out_sharding = contraction_sharding(jax.typeof(qa), jax.typeof(qb), dims)
        part = lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32, out_sharding=out_sharding)
        return descale(part, ia[:, :, None], ib[:, None, :])

    if symbolic:  # n >= 1 cannot be proven, so no first block to start from: zeros, typed like it
        zeros = jnp.zeros((batch, ra, rb), jnp.float32)
        start = to_varying(zeros, frozenset().union(*map(varying, (a, inverse_a, b, inverse_b))))
        return lax.scan(lambda acc, x: (acc + product(x), None), start, xs)[0]  # 0 + p is p
    # The first block starts the accumulator, so that it is typed like the operands (inside shard_map,
    # varying over their mesh axes: a carry of zeros would not be).
    out = product(tuple(x[0] for x in xs))
    if n > 1:
        out, _ = lax.scan(lambda acc, x: (acc + product(x), None), out, tuple(x[1:] for x in xs))
    return out


def varying(x: Any) -> frozenset:
    """The ``shard_map`` mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    # jax 0.10 keeps them in manual_axis_type.varying; older releases in vma.
    axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(axes if axes is not None else getattr(aval, "vma", ()) or ())


def to_varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` made to vary over ``axes`` as well (``lax.pcast``), as values computed from operands that
    vary over them are typed."""
    missing = tuple(sorted(axes - varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def native_mxfp8() -> bool:
    """Whether this process sees NVIDIA GPUs of compute capability 10 or newer (Blackwell), whose
    cuDNN has the MXFP8 block-scaled GEMM ``jax.nn.scaled_matmul`` lowers to."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend in this process
        return False
    try:
        return all(float(d.compute_capability) >= 10.0 for d in devices)
    except (AttributeError, TypeError, ValueError):
        return False


def batch_merged(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn(a, inverse_a, b, inverse_b) -> (batch, Ra, Rb)``, vmapped by merging the vmapped axis into
    ``batch`` (an unbatched argument broadcast first). ``jax.nn.scaled_matmul``'s own batching rule
    requires all four arguments batched along the same axis, which a vmap over the examples of one
    weight does not give."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size: int, in_batched: list, *args: jax.Array) -> tuple[jax.Array, bool]:
        full = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        out = wrapped(*(x.reshape(-1, *x.shape[2:]) for x in full))
        return out.reshape(axis_size, -1, *out.shape[1:]), True

    return wrapped


@batch_merged
def _native_scaled_matmul(
    a: jax.Array, inverse_a: jax.Array, b: jax.Array, inverse_b: jax.Array
) -> jax.Array:
    e8m0 = jnp.float8_e8m0fnu  # the inverse scales are powers of two within its range: exact
    return jax.nn.scaled_matmul(
        a, b, inverse_a.astype(e8m0), inverse_b.astype(e8m0), preferred_element_type=jnp.float32
    )


def scaled_matmul(
    a: jax.Array, inverse_a: jax.Array, b: jax.Array, inverse_b: jax.Array, power_of_two: bool
) -> jax.Array:
    """``emulated_scaled_matmul``, or ``jax.nn.scaled_matmul`` where it is native.

    Native means MXFP8 (``power_of_two`` scales, blocks of 32) on NVIDIA GPUs of compute capability
    10 or newer (cuDNN's block-scaled GEMM), chosen when the program is lowered for CUDA
    (``lax.platform_dependent``); every other backend and recipe (``"block"``'s float32 scales of
    128-element tiles have no native GEMM in jax 0.10.2) runs the emulation. The native path has not
    been run by jmp_lite's tests: no Blackwell GPU was available to them.
    """
    if power_of_two and native_mxfp8():
        return lax.platform_dependent(
            a, inverse_a, b, inverse_b, cuda=_native_scaled_matmul, default=emulated_scaled_matmul
        )
    return emulated_scaled_matmul(a, inverse_a, b, inverse_b)


def canonical(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> tuple[jax.Array, tuple]:
    """``x`` as ``(prod(batch), prod(free), prod(contract))``, its axes in the order batch, free (in
    increasing order), contract (in the given order: the pairs of ``dimension_numbers``), and the
    free axes' sizes."""
    free = [d for d in range(x.ndim) if d not in batch and d not in contract]
    order = (*batch, *free, *contract)
    if order != tuple(range(x.ndim)):
        x = lax.transpose(x, order)
    nb, nf = len(batch), len(free)
    shape = x.shape
    rows = (math.prod(shape[:nb]), math.prod(shape[nb : nb + nf]), math.prod(shape[nb + nf :]))
    return x.reshape(rows), tuple(shape[nb : nb + nf])
