"""What jmp_lite knows about JAX primitives: one table, asked by every other module.

Every primitive the engine may meet belongs to one **class**, and the class decides the
default **mode** (the strings users may pass in ``autocast(..., rules=...)``):

========================  ====================================================================  ============
class                     members                                                               mode
========================  ====================================================================  ============
``contraction``           ``dot_general``, ``conv_general_dilated``, ``ragged_dot_general``     ``compute``
``float32``               range- or accumulation-sensitive math: exp/log family, rsqrt, pow,    ``float32``
                          erf, sums, products, cumulative sums, scatter-add, linear algebra
``arithmetic``            elementwise math as exact in the operands' dtype as in a wider one,   ``follow``
                          comparisons, max/min reductions, sort, top_k
``movement``              reshape, transpose, slices, gathers, scatters that select, copies     ``follow``
``communication``         collectives and sharding: psum, all_gather, reduce_scatter,           ``follow``
                          ``sharding_constraint``, ``device_put``, ...
``annotation``            names and barriers: ``name`` (``checkpoint_name``),                   ``follow``
                          ``optimization_barrier``, debug callbacks
``integer``               integer, boolean, bit and PRNG-key ops (no floating operands)         ``follow``
``control``               calls, loops, branches, custom derivatives: the engine rewrites the   (recursed)
                          body (``jit``, ``scan``, ``while``, ``cond``, ``remat2``,
                          ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``) or, for the
                          rest, runs them as written
``as_written``            bit reinterpretation, host callbacks, foreign calls, fused kernels    ``as_written``
                          with fixed dtypes: written for their dtypes, run exactly as written
========================  ====================================================================  ============

Modes:

* ``"compute"``: floating operands are cast to the policy's compute dtype; a 16-bit
  contraction accumulates in float32 (``jmp_lite.accumulate``) and hands on the compute dtype.
* ``"compute_no_accumulate"``: the same casts, but a contraction runs as ``jax.lax`` does by
  itself (the result and JAX's own transpose in the compute dtype, no ``custom_vjp``:
  forward-mode differentiation works).
* ``"float32"``: bfloat16/float16 operands are cast to float32 first.
* ``"follow"``: the op runs in the dtype its operands arrive in; where they disagree the
  widest wins (weakly typed Python scalars never widen). Ops of the ``movement``,
  ``communication`` and ``annotation`` classes with several operands treat each operand on
  its own: no cast at all around them.
* ``"as_written"``: floating operands are cast back to the dtypes the program was traced with.

A primitive the table does not know runs as written; under a 16-bit policy the engine warns
once per primitive that it did so (``UnknownPrimitiveWarning``), so a float32 round trip is
never silent. ``tests/test_primitive_rules.py`` checks every name here against the primitives
of the supported jax.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from jax.extend import core as _jcore

MODES = ("compute", "compute_no_accumulate", "float32", "follow", "as_written")
CLASSES = (
    "contraction", "float32", "arithmetic", "movement", "communication", "annotation", "integer", "control",
    "as_written",
)  # fmt: skip


class UnknownPrimitiveWarning(UserWarning):
    """A primitive jmp_lite's table does not know ran as written (its operands cast back to the
    dtypes it was traced with) under a 16-bit policy. Give it a rule (``rules={name: mode}``)
    to silence it, and tell jmp_lite which class it belongs to."""


class Primitive(NamedTuple):
    """What the table says of one primitive."""

    name: str
    kind: str  # one of CLASSES
    # properties the engine, the attention matcher, the report and the memory account read
    moves: bool = False  # output holds the operand's values, rearranged (no arithmetic)
    layout: bool = False  # a relayout or cast (reshape, transpose, ...): a parameter stays that parameter
    summing_grad: bool = False  # its derivative sums (broadcast, gather, max); those sums run in float32
    broadcasting: bool = False  # elementwise, size-1 axes broadcast implicitly (their transpose sums)
    upcastable: bool = False  # exact: may run in float32 when only float32 ops read its result
    same_type: bool = False  # the output has the first operand's dtype and the largest operand's size
    free: bool = False  # rebuilt for nothing in a backward pass: never worth keeping
    identity: bool = False  # its output is its operand unchanged (a name, a sharding or layout constraint)
    uncached: bool = False  # bound directly (effects, keys, custom rules), never through a cached jit
    subprogram: str | None = None  # the parameter holding its body, for ops that carry one
    call: bool = False  # a call: its outputs are its one body's outputs (jit, remat, custom derivatives)
    inlined: bool = False  # a plain call, its body evaluated in place by a rewrite (an observer sees each op)
    checkpoint: bool = False  # a jax.checkpoint region: its body is recomputed in the backward pass
    body: str | None = None  # how interpret.rewrite_body re-emits its rewritten body (its kind of body)
    reduction_body: bool = False  # carries a scalar combiner jaxpr typed for its operand dtype
    pointwise: bool = False  # each output element from the operands' elements at its position only


def _group(kind: str, names: str, **props: object) -> list[Primitive]:
    return [Primitive(n, kind, **props) for n in names.split()]  # type: ignore[arg-type]


_GROUPS: tuple[list[Primitive], ...] = (
    _group("contraction", "dot_general conv_general_dilated ragged_dot_general"),
    # overflow at 16-bit range (f16 exp overflows past 11.1); logs of small values need the mantissa;
    # normalisers (LayerNorm/RMSNorm rsqrt) and GELU's erf
    _group("float32", "exp log rsqrt sqrt logistic erf log1p expm1 pow", same_type=True),
    _group(
        "float32",
        # special functions; torch.autocast's float32 list has these trigonometric/hyperbolic ones
        "exp2 cbrt erfc erf_inv lgamma digamma igamma igammac igamma_grad_a polygamma zeta bessel_i0e "
        "bessel_i1e regularized_incomplete_beta tan acos asin sinh cosh acosh asinh atanh",
        pointwise=True,
    ),
    _group(
        "float32",
        # linear algebra and FFTs: XLA has no 16-bit kernels for most, and they amplify rounding
        "cholesky cholesky_update eig eigh qr svd lu triangular_solve tridiagonal tridiagonal_solve "
        "householder_product geqrf geqp3 ormqr hessenberg schur symmetric_product fft "
        # sums and products of many terms (means, variances, losses)
        "reduce_sum reduce_prod cumsum cumprod cumlogsumexp reduce_window_sum select_and_scatter_add",
    ),
    # scatters that sum or multiply many updates into one place (segment sums, bincount, MoE combine)
    _group("float32", "scatter-add scatter-sub scatter-mul", reduction_body=True),
    _group("arithmetic", "add sub mul div max min", broadcasting=True, upcastable=True, same_type=True),
    _group("arithmetic", "rem atan2 nextafter clamp", broadcasting=True, same_type=True),
    _group("arithmetic", "select_n", broadcasting=True, upcastable=True, same_type=True),
    _group("arithmetic", "neg abs square integer_pow", upcastable=True, same_type=True),
    _group("arithmetic", "sign tanh", same_type=True),
    _group(
        "arithmetic",
        "sin cos atan floor ceil round is_finite reduce_precision conj real imag complex add_any zeros_like "
        "eq ne lt le gt ge",
        pointwise=True,
    ),
    _group("arithmetic", "sort top_k approx_top_k select_and_gather_add"),
    _group("arithmetic", "reduce_max reduce_min", summing_grad=True, upcastable=True),
    _group("arithmetic", "argmax argmin", upcastable=True),
    _group("arithmetic", "cummax cummin reduce_window_max reduce_window_min", summing_grad=True),
    _group("movement", "reshape transpose squeeze", moves=True, layout=True, upcastable=True, same_type=True),
    _group("movement", "copy", moves=True, layout=True, same_type=True),
    _group("movement", "stop_gradient", moves=True, upcastable=True, same_type=True),
    _group("movement", "broadcast_in_dim", moves=True, summing_grad=True, upcastable=True, free=True),
    _group("movement", "slice dynamic_slice rev pad", moves=True, same_type=True),
    _group("movement", "concatenate dynamic_update_slice split scatter stack unstack", moves=True),
    _group("movement", "tile", moves=True, summing_grad=True, upcastable=True),
    _group("movement", "gather", moves=True, summing_grad=True),
    _group("movement", "scatter-min scatter-max", moves=True, reduction_body=True),
    # a dtype change the program asked for: the engine's own business
    _group("movement", "convert_element_type", layout=True),
    _group(
        "communication",
        "psum pmax pmin psum_invariant all_gather all_gather_invariant ppermute all_to_all ragged_all_to_all "
        "reduce_scatter pbroadcast pvary preduced unreduced_psum unreduced_reduce_scatter reshard "
        "with_memory_space_constraint inspect_sharding axis_index host_local_array_to_global_array "
        "global_array_to_host_local_array "
        "device_put reduced_vary_cast_p vary_unreduced_cast_p psend precv "
        # the asynchronous halves of the collectives above
        "psum_start psum_done psum_invariant_start all_gather_start all_gather_done all_gather_reduced "
        "all_gather_reduced_start ppermute_start ppermute_done all_to_all_start all_to_all_done "
        "reduce_scatter_start reduce_scatter_done pbroadcast_start pbroadcast_done unreduced_psum_start "
        "unreduced_reduce_scatter_start",
    ),
    _group("communication", "sharding_constraint layout_constraint", identity=True),
    _group("annotation", "name", identity=True),
    _group("annotation", "debug_callback debug_print shape_assertion"),
    _group("annotation", "optimization_barrier jmp_lite_mark", uncached=True),
    _group(
        "integer",
        "and or not xor shift_left shift_right_arithmetic shift_right_logical population_count clz mulhi",
        pointwise=True,
    ),
    _group(
        "integer",
        "reduce_and reduce_or reduce_xor platform_index dimension_size dim_as_value iota_2x32_shape "
        "threefry2x32 threefry4x32 philox2x32 philox4x32 lu_pivots_to_permutation eq_to le_to lt_to "
        "after_all create_token",
    ),
    _group("integer", "iota", free=True, uncached=True),
    _group(
        "integer",
        "random_seed random_bits random_split random_fold_in random_wrap random_unwrap random_clone "
        "rng_bit_generator rng_uniform",
        uncached=True,
    ),
    # bodies a rewrite evaluates under its rules (interpret.rewrite_body); the rest run as written
    _group("control", "jit", subprogram="jaxpr", call=True, inlined=True, body="jitted"),
    _group("control", "remat2", subprogram="jaxpr", call=True, checkpoint=True, body="recomputed"),
    _group("control", "closed_call", subprogram="call_jaxpr", call=True, inlined=True, body="called"),
    _group("control", "custom_jvp_call", subprogram="call_jaxpr", uncached=True, call=True, body="jvp_rule"),
    _group("control", "custom_vjp_call", subprogram="call_jaxpr", uncached=True, call=True, body="vjp_rule"),
    _group("control", "shard_map", subprogram="jaxpr", body="mapped"),
    _group("control", "scan", subprogram="jaxpr", body="scanned"),
    _group("control", "while", subprogram="body_jaxpr", body="while_loop"),
    _group("control", "cond", subprogram="branches", body="switch"),
    _group(
        "control",
        "custom_lin custom_vmap_call custom_linear_solve custom_partitioning run_state composite core_map "
        "linear_call reduce reduce_window select_and_scatter call custom_jvp_call_jaxpr eval_jaxpr remat_opt",
    ),
    _group(
        "as_written",
        "bitcast_convert_type random_gamma pure_callback io_callback ffi_call call_exported cudnn_fusion "
        # a kernel of the user's (Pallas, Mosaic): its dtypes are the kernel's
        "pallas_call tpu_custom_call "
        "scaled_matmul scaled_matmul_wrapper scaled_dot dot_product_attention_fwd dot_product_attention_bwd "
        "dot_product_attention_fwd_wrapper dot_product_attention_bwd_wrapper dot_product_attention_fp8_fwd "
        "dot_product_attention_fp8_bwd dot_product_attention_fp8_fwd_wrapper "
        "dot_product_attention_fp8_bwd_wrapper "
        # mutable references (jax's state primitives) hold values of the dtype they were created with
        "get swap addupdate new_ref freeze empty_ref free_ref accum_grad_in_ref broadcast_to create_linear "
        "pin unpin "
        # jax's internals: uninitialised buffers, hijax boxes and logs, staging, checkify, extended dtypes
        "empty empty2 tie dce_sink stage unreachable check box_get box_set new_box new_log log_extend "
        "log_read call_hi_primitive call_hi_primitive_linearized to_edtype from_edtype "
        # jax.experimental.sparse (which Hugging Face transformers imports): index arrays and sparse layouts
        # the engine has no rule for, so a sparse product runs in the dtypes the program gives it
        "bcoo_dot_general bcoo_dot_general_sampled bcoo_extract bcoo_fromdense bcoo_sort_indices "
        "bcoo_spdot_general bcoo_sum_duplicates bcoo_todense bcoo_transpose bcsr_dot_general bcsr_extract "
        "bcsr_fromdense bcsr_todense coo_fromdense coo_matmat coo_matvec coo_spmm coo_spmv coo_todense "
        "csr_fromdense csr_matmat csr_matvec csr_spmm csr_spmv csr_todense spsolve todense",
    ),
)


def _build() -> dict[str, Primitive]:
    table: dict[str, Primitive] = {}
    for entry in (e for group in _GROUPS for e in group):
        if entry.name in table:
            raise AssertionError(f"primitive {entry.name!r} is listed twice in primitive_rules")
        table[entry.name] = entry
    return table


TABLE: dict[str, Primitive] = _build()

_MODE_OF_CLASS = {
    "contraction": "compute",
    "float32": "float32",
    "arithmetic": "follow",
    "movement": "follow",
    "communication": "follow",
    "annotation": "follow",
    "integer": "follow",
    "control": "as_written",
    "as_written": "as_written",
}
# Classes whose ops take each operand as it comes, with no cast around them (several operands,
# one output per operand: psum of a tuple, device_put, optimization_barrier).
PASS_THROUGH = frozenset({"communication", "annotation"})


def passes_through(eqn: object) -> bool:
    """Whether an equation's primitive takes each operand as it arrives (no casts around it)."""
    entry = TABLE.get(eqn.primitive.name)  # type: ignore[attr-defined]
    return entry is not None and entry.kind in PASS_THROUGH


def lookup(name: str) -> Primitive | None:
    """The table's entry for a primitive name (``None`` when it does not know it)."""
    return TABLE.get(name)


def kind(name: str) -> str | None:
    """The class of a primitive (``None`` when the table does not know it)."""
    entry = TABLE.get(name)
    return None if entry is None else entry.kind


def default_mode(primitive_name: str) -> str:
    """The mode a primitive gets when no rule overrides it (``as_written`` when unknown)."""
    entry = TABLE.get(primitive_name)
    return "as_written" if entry is None else _MODE_OF_CLASS[entry.kind]


def has(name: str, prop: str) -> bool:
    """Whether the table gives primitive ``name`` the property ``prop`` (a ``Primitive`` field)."""
    entry = TABLE.get(name)
    return entry is not None and bool(getattr(entry, prop))


def names_with(prop: str) -> frozenset[str]:
    """Every primitive with property ``prop``."""
    return frozenset(n for n, e in TABLE.items() if getattr(e, prop))


def names_of(*kinds: str) -> frozenset[str]:
    """Every primitive of the given classes."""
    return frozenset(n for n, e in TABLE.items() if e.kind in kinds)


# Frozen views for the hot paths (set membership per equation).
CONTRACTIONS = names_of("contraction")
MOVES = names_with("moves")
LAYOUT = names_with("layout")
SUMMING_GRAD = names_with("summing_grad")
BROADCASTING = names_with("broadcasting")
UPCASTABLE = names_with("upcastable")
SAME_TYPE = names_with("same_type")
FREE = names_with("free")
IDENTITY = names_with("identity")
POINTWISE = names_with("pointwise")
UNCACHED = names_with("uncached")
RANDOM = frozenset(n for n in TABLE if n.startswith(("random_", "rng_", "threefry", "philox")))
SUBPROGRAMS = {n: e.subprogram for n, e in TABLE.items() if e.subprogram}
CALLS = {n: e.subprogram for n, e in TABLE.items() if e.call}
INLINED = names_with("inlined")
BODIES = {n: e.body for n, e in TABLE.items() if e.body}  # primitive -> the kind of body it carries
CHECKPOINTS = names_with("checkpoint")


def primitive_names(refresh: bool = False) -> frozenset[str]:
    """Names of every primitive defined so far (the table names only such primitives).

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
