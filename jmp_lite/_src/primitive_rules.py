"""The per-primitive dtype rules of ``jmp_lite.autocast``.

Four modes, named by the strings users may pass in ``autocast(..., rules=...)``:

* ``"compute"``: floating operands are cast to the policy's compute dtype; a
  16-bit ``dot_general``/``conv_general_dilated`` accumulates in float32
  (``jmp_lite.accumulate``) and hands on the compute dtype.
* ``"compute_no_accumulate"``: the same casts, but a contraction runs as
  ``jax.lax`` does by itself (the result and JAX's own transpose in the compute
  dtype, no ``custom_vjp``: forward-mode differentiation works).
* ``"float32"``: bfloat16/float16 operands are cast to float32 first.
* ``"follow"``: the op runs in the dtype its operands arrive in; where they
  disagree the widest wins (weakly typed Python scalars never widen).
* ``"as_written"``: floating operands are cast back to the dtypes the program
  was traced with and the op runs exactly as written (the default for any
  primitive not listed here, so an unknown primitive never sees a dtype it
  was not traced for).
"""

from __future__ import annotations

import sys

from jax.extend import core as _jcore

MODES = ("compute", "compute_no_accumulate", "float32", "follow", "as_written")

# Contractions: matmul, einsum, Dense, attention scores, convolutions lower to these.
COMPUTE = frozenset({"dot_general", "conv_general_dilated"})

# Range- or accumulation-sensitive ops. torch.autocast's float32 list is the
# reference (exp, log, log1p, expm1, pow, rsqrt, erfinv, acos/asin/cosh/sinh/tan,
# sum, prod, cumsum, cumprod, softmax/log_softmax/logsumexp, norms, losses);
# JAX's softmax, logsumexp, LayerNorm and losses decompose into these primitives.
FLOAT32 = frozenset(
    {
        # exp/log family: overflow at 16-bit range (f16 exp overflows past 11.1),
        # log of small values needs the mantissa (softmax, log_softmax, logsumexp, losses).
        "exp", "exp2", "log", "log1p", "expm1", "logistic",
        # normalisers: rsqrt/sqrt of a variance (LayerNorm, RMSNorm), pow, erf in GELU
        "rsqrt", "sqrt", "cbrt", "pow", "erf", "erfc", "erf_inv", "lgamma", "digamma",
        # torch lists these trigonometric/hyperbolic functions as float32
        "tan", "acos", "asin", "sinh", "cosh",
        # reductions and scans that accumulate many terms (means, variances, losses)
        "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    }
)  # fmt: skip

# Ops whose result is as exact in the operands' dtype as in any wider one, or
# whose dtype is fixed by their operands (elementwise arithmetic, data movement).
FOLLOW = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "abs", "sign", "max", "min", "rem",
        "integer_pow", "square", "tanh", "sin", "cos", "atan2", "atan", "floor",
        "ceil", "round", "clamp", "select_n", "nextafter", "copy",
        "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "not", "and", "or",
        "reshape", "transpose", "broadcast_in_dim", "squeeze",
        "concatenate", "pad", "slice", "dynamic_slice", "dynamic_update_slice",
        "gather", "scatter", "scatter-add", "rev", "sort",
        "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin",
        "reduce_and", "reduce_or", "stop_gradient", "pvary", "real", "imag",
        "select_and_gather_add", "reduce_window_max", "reduce_window_min",
        "psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all",
        "split", "iota", "optimization_barrier",
    }
)  # fmt: skip


def default_mode(primitive_name: str) -> str:
    """The mode a primitive gets when no rule overrides it."""
    if primitive_name in COMPUTE:
        return "compute"
    if primitive_name in FLOAT32:
        return "float32"
    if primitive_name in FOLLOW:
        return "follow"
    return "as_written"


def primitive_names(refresh: bool = False) -> frozenset[str]:
    """Names of every primitive defined so far (the tables above name only such primitives).

    Found by scanning loaded modules for ``jax.extend.core.Primitive`` objects (JAX's own
    and any a user defined); ``refresh`` rescans, for primitives defined after the last scan.
    """
    global _KNOWN
    if _KNOWN is None or refresh:
        names = set()
        for module in list(sys.modules.values()):
            try:  # any module may be half-initialised or lazy: skip what cannot be read
                names.update(v.name for v in list(vars(module).values()) if isinstance(v, _jcore.Primitive))
            except Exception:  # noqa: BLE001
                continue
        _KNOWN = frozenset(names)
    return _KNOWN


_KNOWN: frozenset[str] | None = None
