"""Block-wise 8-bit storage of optimizer state: ``QuantizedArray``, its two codebooks, and the
quantization ``low_precision_state`` runs for ``dtype="int8"`` and ``dtype="float8_e4m3fn"``.

Dettmers et al. (2022), "8-bit Optimizers via Block-wise Quantization": an array is cut into
blocks, each block is divided by its largest magnitude (its *absmax*), and every value is stored as
the index (or the value) of the nearest entry of a fixed 256-entry codebook on ``[-1, 1]``. An
outlier then costs precision only in its own block, and a non-linear codebook keeps precision over
several decades below the block's maximum.

Here the blocks run along the **last** axis: each row is cut into ``ceil(last / block_size)``
blocks (the last one short when ``block_size`` does not divide the row), so the values keep the
array's shape and the scales have shape ``(*shape[:-1], ceil(last / block_size))``. Sharding the
array along any leading axis, or along the last one where each shard's length is a multiple of
``block_size``, never splits a block, and the scales take the same ``PartitionSpec`` as the values.

Per block, with ``a`` its absmax, ``z = x / a`` in ``[-1, 1]`` and ``top`` the codebook's largest
entry, the stored code ``c`` is the entry nearest to ``z * top`` and reads back as ``a * c / top``:

- a block that holds a negative value uses the **signed** codebook;
- a block with no negative value (always so for Adam's second moment ``nu``, a running mean of
  squares) uses the **unsigned** one, all of whose codes lie in ``[0, 1]`` (twice the codes per
  binade of the signed one, and a range down to ``2**-30``), and no positive value is stored as 0:
  one below the smallest positive code is raised to it. Adam divides by ``sqrt(nu) + eps``: a
  linear 8-bit map stores every ``nu`` below ``a / 255`` as 0 and turns ``mu / eps`` into an update
  thousands of times too large, while a raised ``nu`` only makes that update smaller.

The choice is made per block at every quantization, from the values themselves, and recorded in the
sign of the block's float32 scale (``-a`` for a signed block, ``+a`` otherwise): no array has to be
known as non-negative in advance (at init every state is zeros), and a restored state dequantizes
the way it was stored.

The two codebooks (both built here; no table is copied from another project):

- ``int8``: a *tapered* binary map. Binade ``(2**-(k+1), 2**-k]`` holds ``n_k`` evenly spaced codes,
  the most near the block's maximum, where most of a normalised block's mass is, halving every four
  binades: signed, ``n = 16, 8, 4, 2`` for four binades each and then 1 for seven (127 magnitudes
  down to ``2**-22``), mirrored, plus zero; unsigned, ``n = 32, 16, 8, 4`` for four binades each and
  then 1 for fifteen (255 magnitudes down to ``2**-30``), plus zero. Above ``a / 16`` the relative
  error is at most ``1/32`` (signed) and ``1/64`` (unsigned). Stored as ``int8``: the codebook
  index minus 127 (signed: -127 to 127) or 128 (unsigned: -128 to 127).
- ``float8_e4m3fn``: every finite e4m3fn value (``top = 448``, so the scale is ``448 / a``); the
  stored byte *is* the e4m3fn value of ``z * 448``, and round to nearest equals the cast
  ``(z * 448).astype(float8_e4m3fn)`` (ties to even) but for the sign of zero and the
  no-positive-to-zero rule (the unsigned codebook is the non-negative e4m3fn values).

``quantize`` rounds to nearest unless given uniform numbers (``low_precision_state`` gives them by
default, with ``rounding="stochastic"``); stochastic rounding picks the upper neighbour ``hi`` of ``z * top``
with probability ``(z * top - lo) / (hi - lo)``, so the stored value equals ``z`` on average, except
that a positive value of a block without negative values is still never stored as 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

INT8 = np.dtype(jnp.int8)
FLOAT8 = np.dtype(jnp.float8_e4m3fn)
DTYPES = (INT8, FLOAT8)


class QuantizedArray(NamedTuple):
    """One optimizer state array stored in 8 bits by ``low_precision_state(inner, "int8")`` (or
    ``"float8_e4m3fn"``), in the place of the float32 array it stands for.

    Attributes:
        quantized_values: the array's shape, ``int8`` codebook indices or ``float8_e4m3fn`` values.
        block_scales: float32, shape ``(*shape[:-1], ceil(shape[-1] / block_size))``: each block's
            absmax, negative for a block stored with the signed codebook (one that held a negative
            value), positive for one stored with the unsigned codebook. Shards with the same
            ``PartitionSpec`` as ``quantized_values``.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.low_precision_state(optax.adam(1e-3), "int8")
        >>> mu = tx.init({"w": jnp.ones((8, 1024))}).low_precision_inner_state[0].mu["w"]
        >>> mu.quantized_values.dtype, mu.quantized_values.shape, mu.block_scales.shape
        (dtype('int8'), (8, 1024), (8, 4))
    """

    quantized_values: jax.Array
    block_scales: jax.Array


def _tapered(counts: list[int]) -> np.ndarray:
    """Magnitudes in ``(0, 1]``: ``counts[k]`` evenly spaced ones in binade ``(2**-(k+1), 2**-k]``."""
    mags = [2.0 ** -(k + 1) * (1 + np.arange(1, n + 1) / n) for k, n in enumerate(counts)]
    return np.sort(np.concatenate(mags))


class Codebook(NamedTuple):
    """The sorted code values of one format (signed entries first, then unsigned), as float32."""

    values: np.ndarray  # signed entries, then unsigned entries, each sorted
    signed: int  # how many signed entries
    top: float  # the largest entry: z = 1 is stored as top
    even: np.ndarray  # where a tie between two neighbours goes


def _int8_codebook() -> Codebook:
    # Codes per binade halve every four binades: precision near the block's maximum, range below it.
    signed = _tapered([16] * 4 + [8] * 4 + [4] * 4 + [2] * 4 + [1] * 7)
    unsigned = _tapered([32] * 4 + [16] * 4 + [8] * 4 + [4] * 4 + [1] * 15)
    assert signed.size == 127 and unsigned.size == 255  # 255 signed codes (-127..127), 256 unsigned
    values = np.concatenate([-signed[::-1], [0.0], signed, [0.0], unsigned]).astype(np.float32)
    index = np.concatenate([np.arange(255), np.arange(256)])
    return Codebook(values, 255, 1.0, index % 2 == 0)


def _float8_codebook() -> Codebook:
    bits = np.arange(256, dtype=np.uint8)
    values = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(values) & ~((values == 0) & np.signbit(values))  # no NaN, no -0
    order = np.argsort(values[finite], kind="stable")
    signed, even = values[finite][order], (bits[finite][order] % 2) == 0  # even mantissa
    positive = signed >= 0
    return Codebook(
        np.concatenate([signed, signed[positive]]),
        signed.size,
        float(signed.max()),
        np.concatenate([even, even[positive]]),
    )


CODEBOOKS = {INT8: _int8_codebook(), FLOAT8: _float8_codebook()}


def scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of the block scales of an array of ``shape``: one per block of its last axis."""
    return (*shape[:-1], math.ceil(shape[-1] / block_size))


def _block_length(last: int, block_size: int) -> int:
    """The padded block length: ``block_size``, or the row itself where it is shorter (one block)."""
    return max(1, min(block_size, last))


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """``x`` with its last axis zero-padded to whole blocks, as ``(*shape[:-1], blocks, block)``.

    A row shorter than ``block_size`` is one block of its own length: padding it to ``block_size``
    would change nothing stored and multiply the temporaries (a 64-wide row, 4x at 256)."""
    last = x.shape[-1]
    b = _block_length(last, block_size)
    n = math.ceil(last / b)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * b - last)])
    return padded.reshape(*x.shape[:-1], n, b)


def _unblocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # explicit sizes: ``-1`` cannot be inferred when a leading axis is 0
    return x.reshape(*shape[:-1], x.shape[-2] * x.shape[-1])[..., : shape[-1]]


# --- sharding ------------------------------------------------------------------------------------
# The values keep the layout of the array they store, and the scales take it too wherever each shard of
# the last axis holds whole blocks (otherwise that axis of the scales is not split). On a mesh with
# Explicit axes (jax.make_mesh's default) an array's type carries its layout, and JAX refuses an
# operation whose output layout it cannot infer: a gather of the replicated codebook at sharded
# indices, or a reshape that cuts a split axis into blocks straddling its shards; the blocks are then
# computed in a layout that holds them whole, and the results resharded. An eager array on Auto axes
# is placed back with device_put (op by op, a straddling reshape would leave it replicated); under jit
# on Auto axes XLA chooses (jit's out_shardings fix it).


class _Placement(NamedTuple):
    sharding: NamedSharding  # where the array lies: in its type (Explicit axes) or, eager, its own
    explicit: bool


def _placement(x: Any) -> _Placement | None:
    """Where ``x`` lies on a mesh, when Python can know it; ``None`` off a mesh, or traced on Auto axes."""
    typed = getattr(jax.typeof(x), "sharding", None)
    if isinstance(typed, NamedSharding) and any(t == AxisType.Explicit for t in typed.mesh.axis_types):
        return _Placement(typed, True)
    own = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(own, NamedSharding) and own.mesh.size > 1:
        return _Placement(own, False)
    return None


def _entries(spec: Any, ndim: int) -> tuple:
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def _layouts(where: _Placement, shape: tuple[int, ...], block_size: int) -> tuple[P, P]:
    """The layout the blocks are computed in (which is that of the scales) and that of the values."""
    spec = _entries(where.sharding.spec, len(shape))
    last = spec[-1]
    names = () if last is None else (last,) if isinstance(last, str) else tuple(last)
    shards = math.prod(where.sharding.mesh.shape[name] for name in names)
    whole = shards == 1 or (shape[-1] // shards) % _block_length(shape[-1], block_size) == 0
    return (P(*spec) if whole else P(*spec[:-1], None)), P(*spec)


def _placed(x: jax.Array, where: _Placement, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on ``where``'s mesh (itself where it already is)."""
    if where.explicit:
        if _entries(jax.typeof(x).sharding.spec, x.ndim) == _entries(spec, x.ndim):
            return x
        return jax.sharding.reshard(x, where.sharding.update(spec=spec))
    return jax.device_put(x, where.sharding.update(spec=spec))


def _lookup(table: jax.Array, index: jax.Array, mode: str = "fill") -> jax.Array:
    """``jnp.take(table, index, mode=mode)`` of the replicated codebook, laid out as ``index`` on a mesh
    with Explicit axes (elsewhere the very ``jnp.take``, so those programs are unchanged)."""
    where = _placement(index)
    if where is None or not where.explicit:
        return jnp.take(table, index, mode=mode)
    return table.at[index].get(mode=mode, out_sharding=where.sharding)


def _first_at_least(table: jax.Array, q: jax.Array, start: jax.Array, stop: jax.Array, n: int) -> jax.Array:
    """Per element, the first index ``i`` in ``[start, stop)`` with ``table[i] >= q`` (``stop - 1``
    if none): a binary search with per-element bounds (``jnp.searchsorted`` has one table only)."""
    lo, hi = start, stop - 1
    for _ in range(max(n - 1, 1).bit_length()):
        mid = (lo + hi) // 2
        right = _lookup(table, mid, "clip") < q
        lo, hi = jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)
    return jnp.minimum(lo, stop - 1)


def quantize(
    x: jax.Array, dtype: np.dtype, block_size: int, uniform: jax.Array | None = None
) -> QuantizedArray:
    """``x`` (any floating dtype, at least one dimension) stored in ``dtype`` with a float32 scale per
    block of ``block_size`` along its last axis; round to nearest, or stochastic with ``uniform``
    (numbers in ``[0, 1)`` of ``x``'s shape). The module docstring gives the math."""
    book = CODEBOOKS[np.dtype(dtype)]
    table = jnp.asarray(book.values)
    shape = x.shape
    where = _placement(x)
    if where is not None:
        blocks_spec, values_spec = _layouts(where, shape, block_size)
        x = _placed(x, where, blocks_spec) if where.explicit else x
    xb = _blocks(x.astype(jnp.float32), block_size)
    signed = jnp.any(xb < 0, axis=-1, keepdims=True)
    absmax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    z = xb / jnp.where(absmax > 0, absmax, 1.0)  # in [-1, 1]; an all-zero block stays 0
    q = z * book.top
    n_signed, n = book.signed, book.values.size
    start = jnp.where(signed, 0, n_signed)
    i = _first_at_least(table, q, start, jnp.where(signed, n_signed, n), max(n_signed, n - n_signed))
    below = jnp.maximum(i - 1, start)
    lo, hi = _lookup(table, below), _lookup(table, i)
    if uniform is None:  # the nearer neighbour; a tie goes to the even one, as a cast does
        d_lo, d_hi = q - lo, hi - q
        take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & _lookup(jnp.asarray(book.even), i))
    else:  # the upper neighbour with probability (z - lo) / (hi - lo), in z's own units
        u = _blocks(uniform.astype(jnp.float32), block_size)
        take_hi = (i == below) | (u * (hi - lo) < q - lo)
    index = jnp.where(take_hi, i, below)
    # No positive value is stored as 0 in an unsigned block: it may be a second moment, divided by.
    index = jnp.where(~signed & (z > 0) & (index == n_signed), n_signed + 1, index)
    if np.dtype(dtype) == INT8:
        codes = jnp.where(signed, index - 127, index - n_signed - 128).astype(jnp.int8)
    else:  # the table holds e4m3fn values exactly: this cast rounds nothing
        codes = _lookup(table, index).astype(dtype)
    values, scales = _unblocks(codes, shape), jnp.where(signed, -absmax, absmax)[..., 0]
    if where is not None:
        values, scales = _placed(values, where, values_spec), _placed(scales, where, blocks_spec)
    return QuantizedArray(values, scales)


def dequantize(q: QuantizedArray, block_size: int) -> jax.Array:
    """The float32 array that ``q`` stands for."""
    values, scales = q.quantized_values, q.block_scales
    book = CODEBOOKS[np.dtype(values.dtype)]
    shape = values.shape
    where = _placement(values)
    if where is not None and where.explicit:  # computed in the layout quantize computed it in
        blocks_spec, _ = _layouts(where, shape, block_size)
        values, scales = _placed(values, where, blocks_spec), _placed(scales, where, blocks_spec)
    signed = jnp.signbit(scales)[..., None]
    if np.dtype(values.dtype) == INT8:
        codes = _blocks(values.astype(jnp.int32), block_size)
        index = jnp.where(signed, jnp.clip(codes + 127, 0, 254), codes + book.signed + 128)
        code = _lookup(jnp.asarray(book.values), index)
    else:
        code = _blocks(values.astype(jnp.float32), block_size)
    out = _unblocks(jnp.abs(scales)[..., None] * (code / book.top), shape)
    return out if where is None else _placed(out, where, _layouts(where, shape, block_size)[1])


def block_size_of(q: QuantizedArray) -> int:
    """The block size ``q`` was stored with, read off its shapes: ``low_precision_state`` takes powers
    of two only, and two different powers of two cut a row longer than the smaller one into different
    numbers of blocks (a row no longer than either is one block under both, stored alike)."""
    last, n = q.quantized_values.shape[-1], q.block_scales.shape[-1]
    if n <= 1:
        return max(last, 1)
    size = 1 << max(0, math.ceil(math.log2(last / n)))
    if math.ceil(last / size) != n:
        raise ValueError(
            f"a QuantizedArray with a last axis of {last} values and {n} block scales was not made with a "
            "power-of-two block_size, the only ones low_precision_state stores"
        )
    return size


def dequantized(tree: Any) -> Any:
    """``tree`` with every ``QuantizedArray`` replaced by the float32 array it stands for.

    For what reads an optimizer's state outside its ``update``: an 8-bit schedule-free ``z`` that
    ``optax.contrib.schedule_free_eval_params`` needs, or a moment to inspect. The block size is read
    off each array's shapes (``block_size_of``). The mapping of its two fields that ``nnx.Optimizer``
    keeps is read the same way.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.low_precision_state(optax.adam(1e-3), "int8", rounding="nearest")
        >>> params = {"w": jnp.ones((8, 1024))}
        >>> _, state = tx.update({"w": jnp.full((8, 1024), 0.5)}, tx.init(params), params)
        >>> mu = jmp_lite.low_precision.dequantized(state.low_precision_inner_state)[0].mu["w"]
        >>> mu.dtype, float(mu[0, 0])  # (1 - 0.9) * 0.5, stored exactly: a block's maximum
        (dtype('float32'), 0.05000000074505806)
    """

    def one(x: Any) -> Any:
        if _as_fields(x):
            x = QuantizedArray(**x)
        return dequantize(x, block_size_of(x)) if is_quantized(x) else x

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: is_quantized(x) or _as_fields(x))


def spec(shape: tuple[int, ...], dtype: np.dtype, block_size: int) -> QuantizedArray:
    """What ``quantize`` makes of an array of ``shape``, as ``jax.ShapeDtypeStruct`` fields."""
    return QuantizedArray(
        jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(scales_shape(shape, block_size), jnp.float32)
    )


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _as_fields(x: Any) -> bool:
    """``x`` is a mapping of exactly ``QuantizedArray``'s fields, typed as ``quantize`` makes them."""
    if not (isinstance(x, Mapping) and len(x) == 2 and set(x) == set(QuantizedArray._fields)):
        return False
    values, scales = x["quantized_values"], x["block_scales"]
    shape, scales_shape = tuple(getattr(values, "shape", ())), tuple(getattr(scales, "shape", ()))
    return (
        getattr(values, "dtype", None) in DTYPES
        and getattr(scales, "dtype", None) == np.dtype(np.float32)
        and len(shape) >= 1
        and scales_shape[:-1] == shape[:-1]
        and len(scales_shape) == len(shape)
    )


def rebuilt(tree: Any) -> Any:
    """``tree`` with each mapping of exactly ``QuantizedArray``'s two fields (int8 or e4m3fn values,
    float32 scales of matching rank) turned back into one.

    ``nnx.state`` (hence ``nnx.Optimizer.update``, which writes the new state through it) stores a
    ``QuantizedArray`` that sits inside a parameter mapping as a mapping of its fields."""
    return jax.tree_util.tree_map(
        lambda x: QuantizedArray(**x) if _as_fields(x) else x,
        tree,
        is_leaf=lambda x: is_quantized(x) or _as_fields(x),
    )


def in_form_of(template: Any, q: QuantizedArray) -> Any:
    """``q`` in ``template``'s form: itself for a ``QuantizedArray``, else the mapping of its fields
    that ``template`` is (so that a state read in that form is returned with the same structure)."""
    if not _as_fields(template):
        return q
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) for path, _ in paths]
    return jax.tree_util.tree_unflatten(treedef, [getattr(q, name) for name in names])
