"""Attention that keeps no T x T matrix: a blockwise kernel with its own backward pass, and the dispatch.

``dot_product_attention`` takes the arguments of ``jax.nn.dot_product_attention`` and runs one of:

* ``"blockwise"``: online-softmax attention over blocks of queries and keys (Rabe and Staats, 2021,
  "Self-attention does not need O(n^2) memory"; Dao et al., 2022, "FlashAttention"), written in
  ``lax`` loops, with a ``jax.custom_vjp`` whose backward pass recomputes each block of logits from
  q, k, v and two float32 statistics of each query row (FlashAttention-2's backward, Dao, 2023).
  It keeps q, k, v, the output and those statistics for the backward pass; the largest array of the
  forward or the backward program is one block of logits (by default at most 256 x 256 per head), so
  nothing grows as T x T. Every matmul takes operands in the input dtype and accumulates in float32:
  the softmax weights P are rounded to the input dtype before P.V, as FlashAttention rounds them;
  ``float32_probabilities=True`` asks for P.V in float32 instead (``_Config``). The softmax statistics
  are float32; the output is in the input dtype. ``mask_value`` makes masked logits take a value
  instead of dropping out, as ``jnp.where(mask, logits, mask_value)`` does, exactly, also in the blocks
  the causal loops skip.
* ``"cudnn"`` / ``"xla"``: ``jax.nn.dot_product_attention`` with that implementation.
* ``"tpu_flash"``: the Pallas FlashAttention kernel that JAX ships for TPUs
  (``jax.experimental.pallas.ops.tpu.flash_attention``). Untested on hardware.

``implementation=None`` picks by backend (``choose_implementation``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmp_lite._src.base import validate
from jmp_lite._src.kernels.accumulate import _canonical_dot, _pinned

__all__ = ["choose_implementation", "dot_product_attention"]

IMPLEMENTATIONS = ("blockwise", "xla", "cudnn", "tpu_flash")
# A fill this low gives a masked key the weight exp(fill - max) = 0 in float32, as dropping it does.
_DROPS_OUT = -1e30
_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32 = np.dtype(np.float32)
# Rough measurements (best of 3 steps, a shared 2-core AMD EPYC under load, XLA:CPU, causal, depth 64):
# a forward+backward step at T=1024 (bf16) took 171, 117, 210 and 272 ms with square blocks of 64, 128,
# 256 and 512 (today's T x T path: 430-770 ms); at T=256, 128 and 256 tied. Small blocks pay loop
# overhead per iteration; large ones skip less of the causal triangle and leave the cache.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
# A length up to this is one block by default: straight-line code with no loop. XLA compiles each
# layer's copy of the kernel, and a loop nest costs it more than twice what one block does (Intel Xeon,
# XLA:CPU, `benchmarks/attention.py --shapes tiny`, B=8, T=256, bf16: compile 1.1 s as one block, 2.5 s
# as 128-blocks in loops; step 1.42x and 1.60x of the plain attention's on that CPU without bf16 kernels).
ONE_BLOCK = 256
# The name the kernel's forward gives its output and log-sum-exp under differentiation.
RESIDUALS = "jmp_lite_attention_residuals"


class _Config(NamedTuple):
    """Static settings of one blockwise call (hashable: a ``nondiff_argnums`` argument)."""

    scale: float
    causal: bool
    block_q: int
    block_k: int
    tq: int  # true lengths, before padding to whole blocks
    tk: int
    unrolled: bool = False  # one block each way: straight-line code, no lax loops
    fill: float | None = None  # the logit of a masked key (-inf or finite); None: masked keys drop out
    # P.V with float32 weights and values at HIGHEST precision, the output kept in float32 for the
    # backward's delta (``_delta_from_output``); False: P rounded to the input dtype (FlashAttention's)
    float32_probabilities: bool = False


# ---------------------------------------------------------------------------------------------------
# The blockwise kernel. Internal layout, after the public function's reshapes (no copies):
#   q [B, Tq, Hk, G, D], k [B, Tk, Hk, D], v [B, Tk, Hk, Dv]  (G query heads share each k/v head)
#   bias / mask [Bb, Hb, Gb, Tqb, Tkb], each axis 1 or full: never broadcast to T x T or over heads
#   q_len / kv_len [B] int32 or None
# ---------------------------------------------------------------------------------------------------


def _blocks(n: int, block: int) -> tuple[int, int]:
    """(number of blocks, block size) covering ``n``: equal blocks, a multiple of 8, little padding."""
    count = -(-n // block)
    size = -(-n // count)
    if count > 1:
        size = -(-size // 8) * 8
    return -(-n // size), size


def _mm(
    lhs: jax.Array, rhs: jax.Array, contract: tuple[Sequence[int], Sequence[int]], exact: bool = False
) -> jax.Array:
    """A dot batched over the two leading axes (batch, k/v head), accumulating in float32. ``exact``:
    float32 operands at float32 precision (``float32_probabilities``; not TF32 on a GPU)."""
    dims = ((tuple(contract[0]), tuple(contract[1])), ((0, 1), (0, 1)))
    if lhs.dtype in _LOW and lhs.dtype == rhs.dtype:
        # XLA:CPU runs 16-bit x 16-bit -> float32 dots only in (batch, free, contracting) x
        # (batch, contracting, free) layout; accumulate.py knows how to lay them out.
        lhs, rhs, dims = _canonical_dot(lhs, rhs, dims)
        lhs, rhs = _pinned(lhs, rhs)
    precision = lax.Precision.HIGHEST if exact else None
    return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32)


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), pad)


def _split(x: jax.Array, axis: int, count: int, size: int) -> jax.Array:
    """Pads ``axis`` to ``count * size`` and moves the block index to the front: [count, ..., size, ...]."""
    x = _pad_axis(x, axis, count * size)
    x = x.reshape(x.shape[:axis] + (count, size) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _q_blocks(x: jax.Array, cfg: _Config, nq: int) -> jax.Array:
    """[B, Tq, Hk, G, X] -> [nq, B, Hk, G, bq, X]."""
    x = _split(x, 1, nq, cfg.block_q)  # [nq, B, bq, Hk, G, X]
    return jnp.transpose(x, (0, 1, 3, 4, 2, 5))


def _k_blocks(x: jax.Array, cfg: _Config, nk: int, transposed: bool = False) -> jax.Array:
    """[B, Tk, Hk, X] -> [nk, B, Hk, bk, X] (or [nk, B, Hk, X, bk])."""
    x = _split(x, 1, nk, cfg.block_k)  # [nk, B, bk, Hk, X]
    return jnp.transpose(x, (0, 1, 3, 4, 2) if transposed else (0, 1, 3, 2, 4))


def _at(x: jax.Array, i: Any) -> jax.Array:
    return x[i] if isinstance(i, int) else lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over (``shard_map``'s type); empty outside one."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _varying_like(tree: Any, *like: Any) -> Any:
    """``tree`` typed as varying over every manual mesh axis that an array of ``like`` varies over.

    Inside ``shard_map`` (FSDP runs the model in one) a loop's carry must keep its type: a zero
    accumulator starts invariant, but adding a per-device q, k or v makes it varying."""
    axes = frozenset().union(*(_varying_axes(x) for x in like if x is not None))
    if not axes:
        return tree

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - _varying_axes(x), key=str))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _loop(cfg: _Config, lo: Any, hi: Any, body: Any, init: Any) -> Any:
    """``lax.fori_loop(lo, hi, body, init)``, or a Python loop when ``cfg.unrolled``."""
    if not cfg.unrolled:
        return lax.fori_loop(lo, hi, body, init)
    for i in range(lo, hi):
        init = body(i, init)
    return init


def _scan(cfg: _Config, body: Any, init: Any, n: int) -> tuple:
    """``lax.scan`` of ``body`` over ``arange(n)``; a Python loop stacking the outputs if unrolled."""
    if not cfg.unrolled:
        return lax.scan(body, init, jnp.arange(n))
    ys = []
    for i in range(n):
        init, y = body(init, i)
        ys.append(y)
    return init, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _extra_padded(x: jax.Array | None, cfg: _Config, nq: int, nk: int) -> jax.Array | None:
    """Bias or mask padded along its full-length axes only (a broadcast axis stays size 1)."""
    if x is None:
        return None
    if x.shape[3] == cfg.tq:
        x = _pad_axis(x, 3, nq * cfg.block_q)
    if x.shape[4] == cfg.tk:
        x = _pad_axis(x, 4, nk * cfg.block_k)
    return x


def _extra_block(x: jax.Array, cfg: _Config, i: jax.Array, j: jax.Array) -> jax.Array:
    if x.shape[3] > 1:
        x = lax.dynamic_slice_in_dim(x, i * cfg.block_q, cfg.block_q, axis=3)
    if x.shape[4] > 1:
        x = lax.dynamic_slice_in_dim(x, j * cfg.block_k, cfg.block_k, axis=4)
    return x


def _logits(
    cfg: _Config,
    i: jax.Array,
    j: jax.Array,
    q_i: jax.Array,
    k_t: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_len: jax.Array | None,
    kv_len: jax.Array | None,
) -> tuple[jax.Array, jax.Array | None]:
    """Float32 logits of query block i against key block j, [B, Hk, G, bq, bk], and where the caller's
    masks keep them (None: nothing masked in this call).

    A masked logit is ``cfg.fill`` (-inf when None), as ``jnp.where(keep, logits, fill)`` makes it; the
    padding keys of the last block are -inf whatever the fill (they are not keys of the call). The causal
    and length masks are built here from iotas, one block at a time.
    """
    s = _mm(q_i, k_t, ((4,), (2,))) * jnp.float32(cfg.scale)
    if bias is not None:
        s = s + _extra_block(bias, cfg, i, j).astype(jnp.float32)
    rows = i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (cfg.block_q, 1), 0)
    cols = j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (1, cfg.block_k), 1)
    keep = None

    def both(a: jax.Array | None, b: jax.Array) -> jax.Array:
        return b if a is None else a & b

    if cfg.causal:  # top-left aligned, as jax.nn.dot_product_attention: key <= query
        keep = (cols <= rows)[None, None, None]
    if kv_len is not None:
        keep = both(keep, (cols[None] < kv_len[:, None, None])[:, None, None])
    if q_len is not None:
        keep = both(keep, (rows[None] < q_len[:, None, None])[:, None, None])
    if mask is not None:
        keep = both(keep, _extra_block(mask, cfg, i, j))
    real = cols < cfg.tk if cfg.tk % cfg.block_k else None  # [1, bk]: False at padding keys
    fill = -math.inf if cfg.fill is None else cfg.fill
    if keep is None:
        return (s if real is None else jnp.where(real, s, -jnp.inf)), None
    if fill == -math.inf:
        return jnp.where(keep if real is None else keep & real, s, -jnp.inf), keep
    masked = jnp.float32(fill) if real is None else jnp.where(real, jnp.float32(fill), -jnp.inf)
    return jnp.where(keep, s, masked), keep


def _key_blocks_seen(cfg: _Config, i: jax.Array, nk: int) -> Any:
    """How many key blocks query block i reads (causal attention skips the blocks above the diagonal)."""
    if not cfg.causal:
        return nk
    seen = ((i + 1) * cfg.block_q - 1) // cfg.block_k + 1
    return min(nk, seen) if isinstance(i, int) else jnp.minimum(nk, seen)


def _first_query_block(cfg: _Config, j: jax.Array) -> Any:
    return (j * cfg.block_k) // cfg.block_q if cfg.causal else 0


def _fills_skipped_keys(cfg: _Config, nk: int, finite: bool = True) -> bool:
    """Whether the loops skip key blocks (causal, several of them) whose keys, all masked, still take
    part in the softmax with the fill as logit: their share is then added in closed form. ``finite=False``
    counts a -inf fill too (the backward pass: a row of -inf fills, NaN in the program, reaches every
    key's gradient there)."""
    if not (cfg.causal and nk > 1 and cfg.fill is not None):
        return False
    return math.isfinite(cfg.fill) or not finite


def _delta_from_output(nk: int) -> bool:
    """Whether the backward pass takes ``delta_i = sum_j p_ij dP_ij`` from the output, as ``dO_i . O_i``.

    Each query row needs delta before its first dS = p (dP - delta). When a row's keys are one block,
    the block gives delta from its own float32 p and dP, so dS sums to 0 over the row, as the softmax's
    derivative does. Across several key blocks delta is ``dO . O`` (FlashAttention-2's backward, and
    cuDNN's): from the 16-bit output by default, whose weights were rounded to 16 bits too, so it is
    off by about 2^-9 |dO||O| in bfloat16, as native 16-bit attention is; with
    ``float32_probabilities`` from the float32 output of float32 weights. A second pass over the blocks
    for an exact delta cost +27% step time at T=1024 on XLA:CPU."""
    return nk > 1


def _suffix_sums(vt: jax.Array) -> jax.Array:
    """[nk, B, Hk, Dv, bk] value blocks -> [nk + 1, B, Hk, Dv]: entry n sums the values of blocks n and
    later (float32; padding keys are 0)."""
    sums = jnp.sum(vt.astype(jnp.float32), axis=-1)
    after = jnp.cumsum(sums[::-1], axis=0)[::-1]
    return jnp.concatenate([after, jnp.zeros_like(sums[:1])])


def _skipped_count(cfg: _Config, seen: Any) -> Any:
    """How many real keys lie in the key blocks after the first ``seen``."""
    count = cfg.tk - seen * cfg.block_k
    return max(count, 0) if isinstance(count, int) else jnp.maximum(count, 0)


def _forward(
    cfg: _Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_len: jax.Array | None,
    kv_len: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(output [B, Tq, Hk, G, Dv], and per query row the float32 logit maximum ``m`` and
    ``log sum_j exp(s_j - m)``, each [B, Hk, G, Tq]).

    The output is in q's dtype, or float32 with ``float32_probabilities``.
    The two row statistics stay apart: with a finite fill (Flax's ``finfo.min``), a row whose keys are
    all masked has m = fill, and ``m + log(T)`` would round back to m.
    """
    dtype = q.dtype
    B, _, Hk, G, _ = q.shape
    Dv = v.shape[-1]
    nq, nk = -(-cfg.tq // cfg.block_q), -(-cfg.tk // cfg.block_k)
    qb = _q_blocks(q, cfg, nq)
    kt = _k_blocks(k, cfg, nk, transposed=True)
    vb = _k_blocks(v, cfg, nk)
    exact = cfg.float32_probabilities
    if exact:
        vb = vb.astype(jnp.float32)
    bias, mask = _extra_padded(bias, cfg, nq, nk), _extra_padded(mask, cfg, nq, nk)
    rows = (B, Hk, G, cfg.block_q)
    skipped = _fills_skipped_keys(cfg, nk)
    suffix = _suffix_sums(jnp.swapaxes(vb, -1, -2)) if skipped else None

    def query_block(_: None, i: Any) -> tuple[None, tuple]:
        q_i = _at(qb, i)

        def key_block(j: jax.Array, carry: tuple) -> tuple:
            m, total, acc = carry
            s, _ = _logits(cfg, i, j, q_i, _at(kt, j), bias, mask, q_len, kv_len)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing yet: no inf - inf
            p = jnp.exp(s - m_use[..., None])
            alpha = jnp.exp(m - m_use)
            total = alpha * total + p.sum(axis=-1)
            acc = alpha[..., None] * acc + _mm(
                p if exact else p.astype(dtype), _at(vb, j), ((4,), (2,)), exact
            )
            return m_new, total, acc

        init = (
            jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, Dv), jnp.float32),
        )
        init = _varying_like(init, q_i, kt, vb, bias, mask, q_len, kv_len)
        seen = _key_blocks_seen(cfg, i, nk)
        m, total, acc = _loop(cfg, 0, seen, key_block, init)
        if skipped:  # the skipped keys' logits are all the fill: count * exp(fill - m), and the values' sum
            count = _skipped_count(cfg, seen)
            fill = jnp.float32(cfg.fill)
            m_new = jnp.where(count > 0, jnp.maximum(m, fill), m)  # m is finite: block 0 is always seen
            alpha, w = jnp.exp(m - m_new), jnp.where(count > 0, jnp.exp(fill - m_new), 0.0)
            total = alpha * total + w * jnp.asarray(count, jnp.float32)
            acc = alpha[..., None] * acc + w[..., None] * _at(suffix, seen)[:, :, None, None, :]
            m = m_new
        if cfg.fill is None:  # every key masked: output 0, and m = +inf so that the backward sees p = 0
            empty = total == 0
            out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, total)[..., None])
            m = jnp.where(empty, jnp.inf, m)
            log_total = jnp.where(empty, 0.0, jnp.log(jnp.where(empty, 1.0, total)))
        else:  # as the program: a row of finite fills is uniform, a row of -inf fills is 0 / 0 (NaN)
            out = acc / total[..., None]
            log_total = jnp.log(total)
        return None, (out if exact else out.astype(dtype), m, log_total)

    _, (out, m, log_total) = _scan(cfg, query_block, None, nq)
    # [nq, B, Hk, G, bq, Dv] -> [B, Tq, Hk, G, Dv]; [nq, B, Hk, G, bq] -> [B, Hk, G, Tq]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, nq * cfg.block_q, Hk, G, Dv)[:, : cfg.tq]

    def per_row(x: jax.Array) -> jax.Array:
        return jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(B, Hk, G, nq * cfg.block_q)[..., : cfg.tq]

    return out, per_row(m), per_row(log_total)


def _skipped_dv(cfg: _Config, g: jax.Array, m: jax.Array, log_total: jax.Array, nq: int) -> jax.Array:
    """What the query rows the causal loops skip add to each skipped key's dv: there p = exp(fill - m -
    log_total), the same for every key of the row. Summed over the rows of each query block and the
    heads of a group, then over the blocks before each: [nq + 1, B, Hk, Dv], entry f for the key blocks
    whose loop starts at query block f (padding rows have m = +inf: p = 0)."""
    w = jnp.exp((jnp.float32(cfg.fill) - m) - log_total)  # [nq, B, Hk, G, bq]
    per_block = jnp.einsum("nbhgr,nbhgrd->nbhd", w, g.astype(jnp.float32))
    return jnp.concatenate([jnp.zeros_like(per_block[:1]), jnp.cumsum(per_block, axis=0)])


def _backward(cfg: _Config, residuals: tuple, g: jax.Array) -> tuple:
    q, k, v, bias, mask, q_len, kv_len, m, log_total, out = residuals
    dtype = q.dtype
    B, _, Hk, G, D = q.shape
    Dv = v.shape[-1]
    nq, nk = -(-cfg.tq // cfg.block_q), -(-cfg.tk // cfg.block_k)
    g = g.astype(dtype)
    qb, gb = _q_blocks(q, cfg, nq), _q_blocks(g, cfg, nq)
    # padding query rows get m = +inf, so p = 0 there
    m_b = _split(_pad_axis(m, 3, nq * cfg.block_q, jnp.inf), 3, nq, cfg.block_q)  # [nq, B, Hk, G, bq]
    log_b = _split(_pad_axis(log_total, 3, nq * cfg.block_q, 0.0), 3, nq, cfg.block_q)
    # the forward pass's layouts of k and v: one blocked copy of each is all a rematerializing caller keeps
    kt, vb = _k_blocks(k, cfg, nk, transposed=True), _k_blocks(v, cfg, nk)
    bias_p, mask_p = _extra_padded(bias, cfg, nq, nk), _extra_padded(mask, cfg, nq, nk)
    # delta_i = sum_j p_ij dP_ij (``_delta_from_output``): summed in the block when a row's keys are one
    # block, else dO . O
    delta_b = None
    if out is not None:
        delta = jnp.sum(g.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Tq, Hk, G]
        delta_b = _split(jnp.transpose(delta, (0, 2, 3, 1)), 3, nq, cfg.block_q)
    dv_skipped = None
    if _fills_skipped_keys(cfg, nk, finite=False):
        dv_skipped = _skipped_dv(cfg, gb, m_b, log_b, nq)
    masked_zero = cfg.fill is not None  # a masked logit has a value: the where's derivative drops its dS
    # A bias constant along the keys shifts each row's logits alike: the softmax does not see it, and its
    # gradient, sum_j dS_ij, is exactly 0 unless masked keys sit at a finite fill (the shift misses them).
    # Summed, it would be float32 noise; it is not summed.
    masks = cfg.causal or mask is not None or q_len is not None or kv_len is not None
    unseen_bias = (
        bias is not None and bias.shape[4] == 1 and not (masks and cfg.fill not in (None, -math.inf))
    )

    def key_block(carry: tuple, j: jax.Array) -> tuple:
        dq, dbias = carry
        k_t, v_j = _at(kt, j), _at(vb, j)

        def query_block(i: jax.Array, inner: tuple) -> tuple:
            dk, dv, dq, dbias = inner
            q_i, g_i = _at(qb, i), _at(gb, i)
            s, keep = _logits(cfg, i, j, q_i, k_t, bias_p, mask_p, q_len, kv_len)
            p = jnp.exp((s - _at(m_b, i)[..., None]) - _at(log_b, i)[..., None])  # [B, Hk, G, bq, bk]
            dv = dv + _mm(p.astype(dtype), g_i, ((2, 3), (2, 3)))
            dp = _mm(g_i, v_j, ((4,), (3,)))
            delta = jnp.sum(p * dp, axis=-1) if delta_b is None else _at(delta_b, i)
            ds = p * (dp - delta[..., None])
            if masked_zero and keep is not None:
                ds = jnp.where(keep, ds, 0.0)
            ds16 = ds.astype(dtype)
            dk = dk + _mm(ds16, q_i, ((2, 3), (2, 3)))
            dq = lax.dynamic_update_index_in_dim(dq, _at(dq, i) + _mm(ds16, k_t, ((4,), (3,))), i, 0)
            if dbias is not None:
                summed = tuple(a for a in range(5) if bias_p.shape[a] == 1 and ds.shape[a] > 1)
                block = ds.sum(axis=summed, keepdims=True)
                start = [0, 0, 0, 0, 0]
                if bias_p.shape[3] > 1:
                    start[3] = i * cfg.block_q
                if bias_p.shape[4] > 1:
                    start[4] = j * cfg.block_k
                current = lax.dynamic_slice(dbias, start, block.shape)
                dbias = lax.dynamic_update_slice(dbias, current + block, start)
            return dk, dv, dq, dbias

        first = _first_query_block(cfg, j)
        dv0 = jnp.zeros((B, Hk, cfg.block_k, Dv), jnp.float32)
        if dv_skipped is not None:  # the query blocks before ``first`` see these keys at the fill
            dv0 = dv0 + _at(dv_skipped, first)[:, :, None, :]
        init = (jnp.zeros((B, Hk, cfg.block_k, D), jnp.float32), dv0, dq, dbias)
        init = _varying_like(init, qb, gb, kt, vb, m_b, bias_p, mask_p, q_len, kv_len, delta_b)
        dk, dv, dq, dbias = _loop(cfg, first, nq, query_block, init)
        return (dq, dbias), (dk, dv)

    dq0 = jnp.zeros((nq, B, Hk, G, cfg.block_q, D), jnp.float32)
    dbias0 = None if bias is None or unseen_bias else jnp.zeros(bias_p.shape, jnp.float32)
    carry = _varying_like((dq0, dbias0), qb, gb, kt, vb, m_b, bias_p, mask_p, q_len, kv_len, delta_b)
    (dq, dbias), (dk, dv) = _scan(cfg, key_block, carry, nk)
    scale = jnp.float32(cfg.scale)
    dq = jnp.transpose(dq * scale, (1, 0, 4, 2, 3, 5)).reshape(B, nq * cfg.block_q, Hk, G, D)[:, : cfg.tq]
    dk = jnp.transpose(dk * scale, (1, 0, 3, 2, 4)).reshape(B, nk * cfg.block_k, Hk, D)[:, : cfg.tk]
    dv = jnp.transpose(dv, (1, 0, 3, 2, 4)).reshape(B, nk * cfg.block_k, Hk, Dv)[:, : cfg.tk]
    if dbias is not None:
        dbias = dbias[:, :, :, : bias.shape[3], : bias.shape[4]].astype(bias.dtype)
    elif bias is not None:
        dbias = jnp.zeros_like(bias)
    return dq.astype(dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None, None, None


def _blockwise_attention(
    cfg: _Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_len: jax.Array | None,
    kv_len: jax.Array | None,
) -> jax.Array:
    return _forward(cfg, q, k, v, bias, mask, q_len, kv_len)[0].astype(q.dtype)


def _blockwise_fwd(
    cfg: _Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_len: jax.Array | None,
    kv_len: jax.Array | None,
) -> tuple[jax.Array, tuple]:
    # q, k, v as the backward pass reads them, in their own buffers: without the barrier XLA may keep
    # what they were converted from (a projection's float32 result, twice the bytes) alive until the
    # backward pass and convert it again there
    q, k, v = lax.optimization_barrier((q, k, v))
    out, m, log_total = _forward(cfg, q, k, v, bias, mask, q_len, kv_len)
    # named so that a rematerializing caller keeps them (``RESIDUALS``) instead of running the loops again
    out, m, log_total = (checkpoint_name(x, RESIDUALS) for x in (out, m, log_total))
    kept = out if _delta_from_output(-(-cfg.tk // cfg.block_k)) else None
    return out.astype(q.dtype), (q, k, v, bias, mask, q_len, kv_len, m, log_total, kept)


_blockwise_vjp = jax.custom_vjp(_blockwise_attention, nondiff_argnums=(0,))
_blockwise_vjp.defvjp(_blockwise_fwd, _backward)
# One trace per shape and config: the layers of a model share it, and so do the derivatives JAX
# takes of it (a model's trace would otherwise re-trace the kernel's loops for every layer).
_blockwise = jax.jit(_blockwise_vjp, static_argnums=(0,))


# ---------------------------------------------------------------------------------------------------
# Argument checks and the reshapes between the public layout and the kernel's.
# ---------------------------------------------------------------------------------------------------


def _check_inputs(query: Any, key: Any, value: Any) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"dot_product_attention: {name} is a {type(x).__name__}; it takes arrays")
        if x.ndim < 3:
            raise ValueError(
                f"dot_product_attention: {name} has shape {x.shape}; it takes [batch..., length, heads, "
                "depth] (at least 3 axes)"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"dot_product_attention: {name} has dtype {x.dtype}; it takes floating arrays")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            "dot_product_attention: query, key and value must share one dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not query.ndim == key.ndim == value.ndim or query.shape[:-3] != key.shape[:-3]:
        raise ValueError(
            "dot_product_attention: query, key and value need the same batch axes, got shapes "
            f"{query.shape}, {key.shape}, {value.shape}"
        )
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"dot_product_attention: key {key.shape} and value {value.shape} must agree on all axes but depth"
        )
    if query.shape[-3] == 0 or key.shape[-3] == 0:
        raise ValueError(
            f"dot_product_attention: empty sequence (query {query.shape}, key {key.shape}); lengths must be"
            " at least 1"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"dot_product_attention: query depth {query.shape[-1]} differs from key depth {key.shape[-1]}"
        )
    if query.shape[-2] % key.shape[-2]:
        raise ValueError(
            f"dot_product_attention: query heads ({query.shape[-2]}) must be a multiple of key/value heads "
            f"({key.shape[-2]})"
        )


def _full_extra_shape(query: jax.Array, key: jax.Array) -> tuple[int, ...]:
    return (*query.shape[:-3], query.shape[-2], query.shape[-3], key.shape[-3])


def _extra_4d(x: Any, name: str, query: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` with leading 1s to [batch..., heads, Tq, Tk] rank, each axis checked to be 1 or full."""
    full = _full_extra_shape(query, key)
    x = jnp.asarray(x)
    if x.ndim > len(full) or any(a not in (1, b) for a, b in zip(x.shape[::-1], full[::-1])):
        raise ValueError(
            f"dot_product_attention: {name} of shape {x.shape} does not broadcast to [batch..., heads, "
            f"query length, key length] = {full} (each axis must be 1 or the full size)"
        )
    return x.reshape((1,) * (len(full) - x.ndim) + x.shape)


def _check_mask_value(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or math.isnan(number) or number == math.inf or np.ndim(value) != 0:
        raise ValueError(
            f"dot_product_attention: mask_value must be a number below +inf (finite or -inf), or None; "
            f"got {value!r}"
        )
    return number


def _check_mask(mask: Any, where: str = "dot_product_attention") -> None:
    if mask is not None and validate.array(mask, f"{where}'s mask").dtype != np.dtype(bool):
        raise TypeError(
            f"{where}: mask has dtype {jnp.asarray(mask).dtype}; it takes a boolean mask "
            "(True = attend). Pass an additive mask as bias."
        )


def _check_bias(bias: Any, query: jax.Array, key: jax.Array, where: str) -> jax.Array | None:
    """``bias`` as a floating array at [batch..., heads, Tq, Tk] rank (see ``_extra_4d``), or None."""
    if bias is None:
        return None
    bias = validate.array(bias, f"{where}'s bias", jnp.floating)
    return _extra_4d(bias, "bias", query, key)


def _extra_kernel_layout(x: jax.Array, query: jax.Array, key: jax.Array) -> jax.Array:
    """[batch..., Hq or 1, Tq or 1, Tk or 1] -> [B or 1, Hk or 1, G or 1, Tq or 1, Tk or 1]."""
    batch = query.shape[:-3]
    nb = len(batch)
    if any(a != 1 for a in x.shape[:nb]) and x.shape[:nb] != batch:
        x = jnp.broadcast_to(x, batch + x.shape[nb:])  # copies over batch axes only, at x's own rank
    bb = math.prod(x.shape[:nb])
    hq, hk = query.shape[-2], key.shape[-2]
    heads = (hk, hq // hk) if x.shape[nb] == hq else (1, 1)
    return x.reshape(bb, *heads, *x.shape[nb + 1 :])


def _lengths(x: Any, name: str, batch: tuple[int, ...]) -> jax.Array | None:
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != batch or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"dot_product_attention: {name} must be an integer array of the batch shape {batch}, got "
            f"{x.dtype}{list(x.shape)}"
        )
    return x.reshape(-1).astype(jnp.int32)


def _default_block(length: int, block: int) -> int:
    """The whole length when it is at most ``ONE_BLOCK``, else ``block``."""
    return length if length <= ONE_BLOCK else block


def _block_size(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"dot_product_attention: {name} must be a positive int, got {value!r}")
    return int(value)


def _run_blockwise(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    scale: float,
    is_causal: bool,
    q_len: Any,
    kv_len: Any,
    block_q: int,
    block_k: int,
    mask_value: float | None = None,
    float32_probabilities: bool = False,
) -> jax.Array:
    batch = query.shape[:-3]
    tq, hq, d = query.shape[-3:]
    tk, hk, dv = value.shape[-3:]
    b = math.prod(batch)
    q = query.reshape(b, tq, hk, hq // hk, d)
    k = key.reshape(b, tk, hk, d)
    v = value.reshape(b, tk, hk, dv)
    if bias is not None:
        bias = _extra_kernel_layout(bias, query, key)
    if mask is not None:
        mask = _extra_kernel_layout(mask, query, key)
    nq, bq = _blocks(tq, block_q)
    nk, bk = _blocks(tk, block_k)
    cfg = _Config(
        float(scale), bool(is_causal), bq, bk, tq, tk, nq == nk == 1, mask_value, float32_probabilities
    )
    q_len = _lengths(q_len, "query_seq_lengths", batch)
    kv_len = _lengths(kv_len, "key_value_seq_lengths", batch)
    out = _blockwise(cfg, q, k, v, bias, mask, q_len, kv_len)
    return out.reshape(*batch, tq, hq, dv)


# ---------------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------------


def _backend_name() -> str:
    """ "cpu", "tpu", "cuda", "rocm" or another platform name, for the devices JAX computes on."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = getattr(jax.devices()[0].client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def _cudnn_declines(query: Any, key: Any, value: Any, bias: Any, mask: Any, is_causal: bool) -> str | None:
    """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` cannot take this call, or None."""
    if query.ndim != 4:
        return "cuDNN takes 4-d [batch, length, heads, depth] inputs only"
    if np.dtype(query.dtype) not in _LOW:
        return f"cuDNN attention takes bfloat16 or float16, not {query.dtype}"
    d, dv = query.shape[-1], value.shape[-1]
    if d != dv or d > 128 or d % 8:
        return f"cuDNN needs equal query/value depth, at most 128 and a multiple of 8 (got {d}, {dv})"
    tq, tk = query.shape[1], key.shape[1]
    if is_causal and tq != tk:
        return "causal attention with query length != key length (alignment differs between kernels)"
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None and tuple(jnp.shape(x)[-2:]) != (tq, tk):
            # cuDNN takes a bias of [.., Tq, Tk] only; a lower-rank padding mask would have to be
            # materialized at T x T. Pass padding as key_value_seq_lengths to keep cuDNN.
            return f"cuDNN needs the {name} at full [.., {tq}, {tk}] (it is {tuple(jnp.shape(x))})"
    if (bias is not None or mask is not None) and (tq % 2 or tk % 2):
        return "cuDNN's backward pass with a bias needs even lengths"
    return None


def _tpu_flash_declines(
    query: Any, key: Any, value: Any, bias: Any, mask: Any, is_causal: bool, q_len: Any
) -> str | None:
    """Why the Pallas TPU FlashAttention kernel cannot take this call, or None."""
    if query.ndim != 4:
        return "the TPU kernel takes 4-d [batch, length, heads, depth] inputs only"
    if np.dtype(query.dtype) not in (np.dtype(jnp.bfloat16), _F32):
        return f"the TPU kernel runs bfloat16 or float32, not {query.dtype}"
    b, tq, hq, d = query.shape
    tk = key.shape[1]
    if tq % 128 or tk % 128:
        return f"the TPU kernel's blocks are 128 long; lengths {tq}, {tk} are not multiples of 128"
    if value.shape[-1] != d:
        return "the TPU kernel needs equal query and value depth"
    if is_causal and tq != tk:
        return "causal attention with query length != key length"
    if bias is not None and tuple(jnp.shape(bias)) != (b, hq, tq, tk):
        return "the TPU kernel takes a bias of shape [batch, heads, Tq, Tk] only"
    if mask is not None:
        shape = tuple(jnp.shape(mask))
        if len(shape) != 4 or shape[1:3] != (1, 1):
            return "the TPU kernel takes key-padding masks [batch or 1, 1, 1, Tk] only (as segment ids)"
    if q_len is not None:
        return "the TPU kernel takes no query lengths"
    return None


# What each implementation needs beyond "blockwise" and "xla", which run on every backend.
_NEEDS = {"cudnn": ("a CUDA GPU backend (cuDNN)", ("gpu", "cuda")), "tpu_flash": ("a TPU backend", ("tpu",))}


def _implementations(backend: str) -> tuple[str, ...]:
    """The implementations that run on ``backend``."""
    return tuple(i for i in IMPLEMENTATIONS if i not in _NEEDS or backend in _NEEDS[i][1])


def _check_backend(backend: Any) -> str:
    """A platform name (``None``: the backend JAX computes on)."""
    if backend is None:
        return _backend_name()
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            "dot_product_attention's backend must be a platform name such as 'cuda', 'tpu' or 'cpu', "
            f"got {backend!r}"
        )
    return "cuda" if backend == "gpu" else backend


def _check_implementation(implementation: Any, declines: Any, backend: str) -> None:
    """An implementation asked for by name runs on ``backend`` and takes this call (``declines()``:
    why the TPU kernel cannot, or None)."""
    validate.choice(implementation, "dot_product_attention's implementation", (None, *IMPLEMENTATIONS))
    if implementation not in _NEEDS:
        return
    need = f"{implementation!r} needs {_NEEDS[implementation][0]}"
    what = f"dot_product_attention's implementation on the {backend!r} backend ({need})"
    validate.choice(implementation, what, (None, *_implementations(backend)))
    reason = declines() if implementation == "tpu_flash" else None
    if reason is not None:
        raise ValueError(
            f"dot_product_attention: implementation='tpu_flash' cannot take this call: {reason}; use "
            "implementation='blockwise' (or None, to choose)"
        )


def choose_implementation(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    mask_value: float | None = None,
    backend: str | None = None,
) -> str:
    """The kernel ``dot_product_attention(..., implementation=None)`` takes for these arguments.

    ``backend`` is a platform name (``"cpu"``, ``"gpu"``/``"cuda"``, ``"rocm"``, ``"tpu"``): the
    platform the program will run on; ``None`` means the backend JAX computes on. The rule:

    * CUDA GPUs: ``"cudnn"`` (cuDNN's fused attention, forward and backward) when cuDNN's
      constraints hold (bfloat16/float16, 4-d inputs, depth a multiple of 8 and at most 128, bias
      and mask given at full [.., Tq, Tk] or not at all), else ``"blockwise"``. Padding given as
      ``key_value_seq_lengths`` keeps cuDNN; a padding mask [B, 1, 1, Tk] does not, because cuDNN
      would need it materialized at T x T.
    * everything else (TPU, CPU, ROCm): ``"blockwise"``. On a TPU it needs less memory than JAX's
      Pallas FlashAttention kernel (``"tpu_flash"``, on request): compiled for a v5e chip, the
      forward and backward pass of a [4, 1024, 12, 64] bfloat16 causal call hold 0.84 MB of
      temporaries against 38 MB.
    * a ``mask_value`` (masked logits that stay in the softmax, as ``jnp.where`` leaves them):
      ``"blockwise"``, the one kernel that computes it, unless the masked weights are exactly 0
      anyway: a value at or below -1e30 (Flax's and Hugging Face's ``finfo.min``, or ``-inf``) with
      no mask array and no lengths (at most ``is_causal``), where no row has every key masked.

    Only static properties (shapes, dtypes, backend) decide. If cuDNN still declines when the call
    is traced (an old cuDNN, a GPU generation it does not support), ``dot_product_attention`` runs
    the blockwise kernel instead.

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite.attention import choose_implementation
        >>> q = jnp.ones((2, 256, 4, 64), jnp.bfloat16)
        >>> choose_implementation(q, q, q, is_causal=True, backend="cpu")
        'blockwise'
        >>> choose_implementation(q, q, q, is_causal=True, backend="gpu")
        'cudnn'
        >>> choose_implementation(q, q, q, is_causal=True, backend="tpu")
        'blockwise'
        >>> choose_implementation(q, q, q, mask=jnp.ones((2, 1, 1, 256), bool), backend="gpu")
        'blockwise'
    """
    _check_inputs(query, key, value)
    _check_mask(mask, "choose_implementation")
    _check_bias(bias, query, key, "choose_implementation")
    mask_value = _check_mask_value(mask_value)
    validate.flag(is_causal, "choose_implementation's is_causal")
    backend = _check_backend(backend)
    lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
    if mask_value is not None and not (mask_value <= _DROPS_OUT and mask is None and not lengths):
        return "blockwise"
    if backend == "cuda" and _cudnn_declines(query, key, value, bias, mask, is_causal) is None:
        return "cudnn"
    return "blockwise"


def _run_tpu_flash(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    scale: float,
    is_causal: bool,
    kv_len: Any,
) -> jax.Array:
    """JAX's Pallas TPU FlashAttention: [B, H, T, D] layout, padding as segment ids. Untested on TPUs."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    b, tq, hq, _ = query.shape
    tk, hk = key.shape[1], key.shape[2]
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    if hk != hq:  # the kernel has no grouped heads: share each k/v head explicitly (O(T) memory)
        k, v = jnp.repeat(k, hq // hk, axis=1), jnp.repeat(v, hq // hk, axis=1)
    segment_ids = None
    if mask is not None or kv_len is not None:
        keep = jnp.ones((b, tk), bool)
        if mask is not None:
            keep = keep & jnp.broadcast_to(mask[:, 0, 0, :], (b, tk))
        if kv_len is not None:
            keep = keep & (jnp.arange(tk)[None] < jnp.asarray(kv_len).reshape(b, 1))
        # a query (segment 1) attends to keys of the same segment: kept keys 1, masked keys 0
        segment_ids = tpu_flash.SegmentIds(q=jnp.ones((b, tq), jnp.int32), kv=keep.astype(jnp.int32))
    out = tpu_flash.flash_attention(
        q, k, v, ab=bias, segment_ids=segment_ids, causal=is_causal, sm_scale=float(scale)
    )
    return jnp.swapaxes(out, 1, 2)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    mask_value: float | None = None,
    float32_probabilities: bool = False,
    backend: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention that keeps no T x T matrix, forward or backward.

    ``softmax(scale * q k^T + bias, masked) v`` per head, with the arguments of
    ``jax.nn.dot_product_attention``:

    * ``query`` [batch..., Tq, heads, depth], ``key``/``value`` [batch..., Tk, kv_heads, depth]
      (``heads`` a multiple of ``kv_heads``: grouped-query attention; query head ``n`` reads k/v
      head ``n // (heads // kv_heads)``). One floating dtype for all three; the output has it too.
    * ``bias`` (additive) and ``mask`` (boolean, True = attend): broadcastable to
      [batch..., heads, Tq, Tk]. They stay at the rank they are given: a key-padding mask
      [B, 1, 1, Tk] is never broadcast over heads or queries.
    * ``is_causal``: query ``i`` sees keys ``j <= i`` (top-left aligned, as in JAX). The blockwise
      kernel builds this mask inside each block and skips the blocks above the diagonal.
    * ``query_seq_lengths`` / ``key_value_seq_lengths``: integer arrays of the batch shape; rows and
      keys at or beyond the length are masked.
    * ``scale``: a number finite in float32 (not traced: the kernel is built for it); default
      ``1 / sqrt(depth)``.
    * ``implementation``: ``None`` (``choose_implementation`` picks), ``"blockwise"``, ``"xla"``,
      ``"cudnn"`` (``jax.nn.dot_product_attention`` with that implementation), or ``"tpu_flash"``.
      ``"cudnn"`` needs a CUDA GPU and ``"tpu_flash"`` a TPU (and a call it takes, see
      ``choose_implementation``): asked for elsewhere, they are refused with the list of what runs.
    * ``backend``: the platform the program will run on (``"cuda"``, ``"tpu"``, ``"cpu"``, ...), for
      ``implementation=None``'s choice and the check of a named one; ``None``: the backend JAX
      computes on. Give it when compiling for another platform than this machine's (a step compiled
      for an H100 on a CPU-only machine: ``jmp_lite.memory.compiled`` gives it for its target).
    * ``block_q``, ``block_k``: block sizes of the blockwise kernel. By default a length of at most
      256 is one block (straight-line code, no loop: cheaper for XLA to compile per layer) and a
      longer one is cut into blocks of 128 (chosen on XLA:CPU). A length that is not a multiple is
      split into equal blocks with a few padded rows.
    * ``mask_value``: ``None`` (default): masked keys drop out of the softmax, and a query row whose
      keys are all masked gives 0 (JAX's ``"xla"`` implementation gives the mean of the values).
      A number (finite or ``-inf``): a masked logit takes this value and stays in the softmax, as
      in ``softmax(jnp.where(mask, logits, mask_value))``: a row whose keys are all masked gives the
      mean of the values for a finite value and NaN for ``-inf``, exactly as that program. Masks,
      lengths and ``is_causal`` all mask this way. Blockwise kernel only.
    * ``float32_probabilities``: ``False`` (default): the softmax weights P are rounded to the input
      dtype before P.V, which accumulates in float32, as FlashAttention and cuDNN do, and the backward
      pass takes each row's ``sum_j p_ij dP_ij`` from the 16-bit output. ``True``: P.V takes float32
      weights and values at ``HIGHEST`` precision (a float32 GEMM on GPUs, several passes on TPUs) and
      the output is kept in float32 for the backward pass: the output as exact as float32
      accumulation of the 16-bit inputs gives it, at that cost. Blockwise kernel only.

    The blockwise kernel (Rabe and Staats, 2021; Dao et al., 2022) runs an online softmax over key
    blocks in ``lax`` loops, so the program does not grow with T. Its ``jax.custom_vjp`` keeps only
    q, k, v and two float32 numbers per query row (the logits' maximum and the log of the softmax's
    sum) for the backward pass (and the bias and mask as given), and recomputes each block of logits
    there (with the output, when the keys are more than one block). The matmuls take operands in the
    input dtype and accumulate in float32; the softmax and its statistics are float32.

    Not served here, by design: dropout on the attention weights, and returning or sowing the
    weights (they are never formed). Callers that need them run the plain attention.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.attention import dot_product_attention
        >>> q = jax.random.normal(jax.random.key(0), (2, 300, 4, 32), jnp.bfloat16)
        >>> out = dot_product_attention(q, q, q, is_causal=True, implementation="blockwise")
        >>> out.shape, out.dtype
        ((2, 300, 4, 32), dtype(bfloat16))
    """
    _check_inputs(query, key, value)
    _check_mask(mask)
    mask_value = _check_mask_value(mask_value)
    bias = _check_bias(bias, query, key, "dot_product_attention")
    if mask is not None:
        mask = _extra_4d(mask, "mask", query, key)
    is_causal = validate.flag(is_causal, "dot_product_attention's is_causal")
    q_len, kv_len = query_seq_lengths, key_value_seq_lengths
    backend = _check_backend(backend)
    _check_implementation(
        implementation, lambda: _tpu_flash_declines(query, key, value, bias, mask, is_causal, q_len), backend
    )
    float32_probabilities = validate.flag(
        float32_probabilities, "dot_product_attention's float32_probabilities"
    )
    for option, given in (
        ("mask_value", mask_value is not None),
        ("float32_probabilities", float32_probabilities),
    ):
        if given and implementation not in (None, "blockwise"):
            raise ValueError(
                f"dot_product_attention: {option} is computed by the blockwise kernel only, not by "
                f"implementation={implementation!r}"
            )
    block_q = _block_size(block_q, "block_q", _default_block(query.shape[-3], DEFAULT_BLOCK_Q))
    block_k = _block_size(block_k, "block_k", _default_block(key.shape[-3], DEFAULT_BLOCK_K))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    else:
        scale = validate.finite_number(scale, "dot_product_attention's scale")
    blockwise = (query, key, value, bias, mask, scale, is_causal, q_len, kv_len, block_q, block_k)
    blockwise += (mask_value, float32_probabilities)
    auto = implementation is None
    if auto and float32_probabilities:
        implementation = "blockwise"  # the one kernel that computes it
    elif auto:
        implementation = choose_implementation(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=is_causal,
            query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len,
            mask_value=mask_value,
            backend=backend,
        )
    if implementation == "blockwise":
        return _run_blockwise(*blockwise)
    if implementation == "tpu_flash":
        return _run_tpu_flash(query, key, value, bias, mask, scale, is_causal, kv_len)
    try:
        return _run_jax(query, key, value, bias, mask, scale, is_causal, q_len, kv_len, implementation)
    except (NotImplementedError, RuntimeError):
        if not auto:
            raise
    # cuDNN declined when traced (its version, the GPU generation): the blockwise kernel runs instead
    return _run_blockwise(*blockwise)


def _run_jax(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    scale: float,
    is_causal: bool,
    q_len: Any,
    kv_len: Any,
    implementation: str,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with ``implementation`` ("xla" or "cudnn")."""
    if implementation == "cudnn" and bias is not None:
        bias = bias.astype(query.dtype)  # cuDNN adds the bias in the operand dtype
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        implementation=implementation,
        query_seq_lengths=None if q_len is None else jnp.asarray(q_len, jnp.int32),
        key_value_seq_lengths=None if kv_len is None else jnp.asarray(kv_len, jnp.int32),
    )
