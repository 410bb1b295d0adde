"""The dtype pass: what one equation becomes under the rules (casts, float32 math, contractions with
float32 accumulation, module output casts, sums of derivatives in float32).

``evaluate_equation(eqn, args, ctx)`` is the engine's hook for every equation that is not an attention
chain; bodies (calls, loops, branches) go to ``ctx.bodies``, the engine's ``interpret.rewrite_body``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base import caches
from jmp_lite._src.engine import decisions, fp8_contract, recompute, remat16, scopes
from jmp_lite._src.engine.scopes import mark_p
from jmp_lite._src.kernels import accumulate

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def precision_request(precision: Any) -> str | None:
    """``"float32"`` for ``precision=HIGHEST`` (or ``"highest"``/``"float32"``, which JAX
    records as HIGHEST) on either operand, ``"algorithm"`` for an explicit dot algorithm."""
    if isinstance(precision, (tuple, list)):
        return "float32" if lax.Precision.HIGHEST in precision else None
    if precision is None or isinstance(precision, lax.Precision):
        return "float32" if precision == lax.Precision.HIGHEST else None
    if precision == lax.DotAlgorithmPreset.DEFAULT:
        return None
    return "algorithm"


def contract(eqn: Any, args: list, dtype: np.dtype, accumulate_f32: bool, ctx: decisions.Ctx) -> list:
    """The one place a contraction's operand, accumulation and result dtypes are decided."""
    request = precision_request(eqn.params.get("precision"))
    if request == "algorithm":
        return decisions.as_written(eqn, args)  # the operand and accumulation dtypes are the algorithm's
    if request == "float32":
        dtype = _F32  # an explicit precision=HIGHEST is honoured: this contraction runs in float32
    lhs, rhs = (decisions.cast(a, dtype) for a in args)
    recipe = decisions.decision(eqn, ctx).scope.fp8
    if recipe is None and all(a.dtype == v.aval.dtype for a, v in zip((lhs, rhs), eqn.invars)):
        return decisions.bind(eqn, [lhs, rhs])  # the program's own contraction (all-float32 policy)
    params = dict(eqn.params)
    pet = params.pop("preferred_element_type", None)
    if pet is not None and not (decisions.is_float(pet) and np.dtype(pet) in decisions.CASTABLE):
        return decisions.as_written(eqn, args)  # integer or fp8 accumulation: not ours to change
    if recipe is not None and request is None and eqn.primitive is lax.dot_general_p and accumulate_f32:
        # the weight: a parameter operand (x @ w: rhs first, when both operands are arguments)
        side = next((i for i in (1, 0) if eqn.invars[i] in ctx.weights), None)
        if side is not None:
            weight = ctx.weights[eqn.invars[side]]
            return [fp8_contract.contract(lhs, rhs, params, recipe, weight, ctx, weight_first=side == 0)]
    if accumulate_f32 and accumulate.is_accumulated(lhs.dtype, rhs.dtype):
        fn = accumulate.dot_general if eqn.primitive is lax.dot_general_p else accumulate.conv_general_dilated
        if eqn.outvars[0] in ctx.leaving and eqn.primitive is lax.dot_general_p:  # (on a TPU)
            return [_leaving_in_float32(lhs, rhs, params)]
        if eqn.outvars[0] in ctx.upcast:  # only float32 ops read it (softmax logits): keep the accumulator
            return [accumulate.float32_result(fn, lhs, rhs, **params)]
        return [fn(lhs, rhs, **params)]
    return decisions.bind(eqn, [lhs, rhs], {**params, "preferred_element_type": None})


def on_tpu() -> bool:
    """Whether the program being traced is compiled for a TPU (``scopes.Context.platform``)."""
    platform = scopes.context().platform or jax.default_backend()
    return platform == "tpu"


def _leaving_in_float32(lhs: jax.Array, rhs: jax.Array, params: dict) -> jax.Array:
    """A 16-bit contraction whose result only leaves the program as a float32 output (a model's
    logits under ``o=float32``), on a TPU: its float32 accumulator, unrounded, differentiated by JAX's
    own rule.

    Rounded to 16 bits and widened again, the output is two arrays to XLA:TPU wherever a loss gathers
    from it (the label's logit): the gather reads a float32 copy, and the 16-bit one is kept for the
    backward pass (GPT-2 small: 1.65 GB beside 0.82 GB at the step's peak). Its accumulator is one
    array. The backward pass multiplies the float32 cotangent straight into the 16-bit operands, which
    the matrix unit reads in one bfloat16 pass at the default precision, as it reads float32 operands,
    so no 16-bit copy of the cotangent is made either."""
    dims = params["dimension_numbers"]
    return lax.dot_general(lhs, rhs, dims, params.get("precision"), preferred_element_type=_F32)


def evaluate_equation(eqn: Any, args: list, ctx: decisions.Ctx) -> list:
    handler = ctx.bodies if eqn.primitive.name in _rules.BODIES else _SUMMING.get(eqn.primitive.name)
    if handler is not None:
        try:
            return handler(eqn, args, ctx)
        except (TypeError, ValueError, NotImplementedError) as e:
            # a parameter layout this version does not know: run it as written, and say so
            decisions.warn_round_trip(
                eqn, args, decisions.decision(eqn, ctx), f"its body could not be rewritten: {e}"
            )
            return decisions.as_written(eqn, args)
    if eqn.primitive is accumulate.dot_p:
        return decisions.as_written(eqn, args)  # a contraction already decided (jmp_lite.accumulate)
    if eqn.primitive is mark_p:
        tag = eqn.params["tag"]
        if tag.startswith("out"):
            return [decisions.cast(args[0], scopes.interned(int(tag[3:])).policy.output)]
        return args
    if eqn.primitive.name == "convert_element_type":
        (x,) = args
        if np.dtype(eqn.invars[0].aval.dtype) == np.dtype(eqn.params["new_dtype"]) and decisions.is_float(
            x.dtype
        ):
            return [x]  # a weak-type change in the traced program, not a dtype change
        return decisions.bind(eqn, args)
    floats = {np.dtype(v.aval.dtype) for v in eqn.invars if decisions.is_float(v.aval.dtype)}
    if not floats:
        return decisions.bind(eqn, args)
    decision = decisions.decision(eqn, ctx)
    mode = decisions.mode(eqn, ctx, decision)
    name = eqn.primitive.name
    entry = _rules.lookup(name)
    if mode == "follow" and entry is not None and entry.kind in _rules.PASS_THROUGH:
        return decisions.bind(
            eqn, args
        )  # a collective, a sharding, a name: each operand as it arrives, no casts
    if mode == "as_written" or len(floats) > 1 or _F64 in floats:
        if entry is None and name not in ctx.rules and not decision.scope.decided:
            decisions.warn_round_trip(eqn, args, decision, "jmp_lite has no rule for it")
        return decisions.as_written(eqn, args)
    if entry is not None and entry.kind == "contraction":
        if mode == "float32":
            dtype, accumulated = _F32, False
        elif mode != "follow":
            dtype, accumulated = decision.compute, mode == "compute" and decision.accumulate
        else:
            dtype, accumulated = decisions.widest(args, eqn, ctx), False
        if eqn.primitive in (lax.dot_general_p, lax.conv_general_dilated_p):
            outs = contract(eqn, args, dtype, accumulated, ctx)
        else:
            outs = _contract_other(eqn, args, dtype, accumulated)
        # Named, so that the checkpoint keeps a contraction's result even where it comes out of a
        # custom_vjp (fp8, convolutions), whose outputs the checkpoint policy is never asked about;
        # with recompute=, the engine names the wide ones that no region rebuilds (engine._eval_jaxpr).
        if not ctx.remat or (ctx.recompute and recompute.wide_equation(eqn)):
            return outs
        return [checkpoint_name(o, remat16.CONTRACTION) for o in outs]
    target = decisions.target(eqn, args, mode, decision.compute, ctx)
    cast_args = [
        decisions.cast(a, target) if decisions.is_float(v.aval.dtype) else a for a, v in zip(args, eqn.invars)
    ]
    params = _retyped(eqn, cast_args) if entry is not None and entry.reduction_body else None
    try:
        return decisions.bind(eqn, cast_args, params)
    except (TypeError, ValueError) as e:
        decisions.warn_round_trip(eqn, cast_args, decision, f"it refused these dtypes ({e})")
        return decisions.as_written(eqn, args)


_RETYPED = caches.BoundedCache("engine.scatter_combiners", 256)


def _retyped(eqn: Any, args: list) -> dict | None:
    """A scatter's parameters with its combiner (``update_jaxpr``, e.g. ``add a b``) re-traced for the
    operand dtype it now runs in: the lowering checks that the two agree."""
    body = eqn.params.get("update_jaxpr")
    dtype = np.dtype(args[0].dtype)
    if body is None or np.dtype(body.invars[0].aval.dtype) == dtype:
        return None
    key = (id(body), dtype)
    found = _RETYPED.get(key)
    if found is None or found[0] is not body:
        fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(body, list(eqn.params["update_consts"])))
        scalar = jax.ShapeDtypeStruct((), dtype)
        found = _RETYPED[key] = (body, jax.make_jaxpr(lambda a, b: fn(a, b))(scalar, scalar).jaxpr)
    return {**eqn.params, "update_jaxpr": found[1], "update_consts": ()}


def _contract_other(eqn: Any, args: list, dtype: np.dtype, accumulate_f32: bool) -> list:
    """A contraction other than dot_general/conv (``ragged_dot_general``): floating operands in
    ``dtype``; 16-bit ones accumulate in float32 (``preferred_element_type``), rounded once to ``dtype``."""
    cast_args = [
        decisions.cast(a, dtype) if decisions.is_float(v.aval.dtype) else a for a, v in zip(args, eqn.invars)
    ]
    params = dict(eqn.params)
    if "preferred_element_type" not in params or dtype not in decisions.CASTABLE:
        return decisions.as_written(eqn, args)
    wide = accumulate_f32 and dtype in decisions.CASTABLE[:2]
    params["preferred_element_type"] = _F32 if wide else dtype
    return [decisions.cast(o, dtype) for o in decisions.bind(eqn, cast_args, params)]


def _through_float32(bind: Callable[..., Any], args: list) -> Any:
    """``bind(*args)`` (a 16-bit first operand, the rest non-floating) run on a float32 copy.

    JAX's derivative rules of these ops sum (a broadcast transposes to a sum, ``reduce_max``
    counts and sums its maxima, a gather transposes to a scatter-add). On float32 copies
    those sums run in float32 under ``jax.grad`` and are rounded once (the table's rule
    for sums); the values are the same (the copy is exact), XLA fuses the conversions
    into the op, and forward-mode differentiation still works.
    """
    x, *rest = args
    return decisions.cast(bind(decisions.cast(x, _F32), *rest), x.dtype)


def _expanded(x: Any, shape: tuple) -> Any:
    """``x`` broadcast to ``shape`` explicitly (its transpose, a sum, in float32)."""
    if x.shape == shape:
        return x
    dims = tuple(range(len(shape))) if x.ndim == len(shape) else tuple(range(len(shape) - x.ndim, len(shape)))
    params = {"shape": shape, "broadcast_dimensions": dims, "sharding": None}
    return _through_float32(decisions.binder(lax.broadcast_in_dim_p, params), [x])


def _gathers_each_place_once(eqn: Any) -> bool:
    """A gather whose derivative sums nothing: its indices are unique, or it takes one slice per batch
    element (``take_along_axis`` picking each row's label logit). Its transpose then scatters each
    cotangent into a place of its own, exactly in 16 bits: no float32 copy of the whole operand (for a
    language model's loss, a float32 ``[batch, tokens, vocabulary]`` array of zeros and one value per row)."""
    if eqn.primitive.name != "gather":
        return False
    if eqn.params.get("unique_indices"):
        return True
    indices = eqn.invars[1].aval
    batching = set(eqn.params["dimension_numbers"].start_indices_batching_dims)
    per_batch_element = [n for d, n in enumerate(indices.shape[:-1]) if d not in batching]
    return int(np.prod(per_batch_element, dtype=np.int64)) == 1


def _summing_grad(eqn: Any, args: list, ctx: decisions.Ctx) -> list:
    # The table's rule for the op, as for any other op; on 16-bit values, the sums of its
    # derivative run in float32 (see _through_float32).
    floats = [decisions.is_float(v.aval.dtype) for v in eqn.invars]
    traced = {np.dtype(v.aval.dtype) for v, f in zip(eqn.invars, floats) if f}
    if len(traced) != 1 or not traced <= set(decisions.CASTABLE) or eqn.primitive.multiple_results:
        return decisions.as_written(eqn, args)  # no floats, several dtypes, float64: as the general path does
    decision = decisions.decision(eqn, ctx)
    mode = decisions.mode(eqn, ctx, decision)
    if mode == "as_written":
        return decisions.as_written(eqn, args)
    target = decisions.target(eqn, args, mode, decision.compute, ctx)
    args = [decisions.cast(a, target) if f else a for a, f in zip(args, floats)]
    if np.dtype(target) not in decisions.CASTABLE[:2]:
        return decisions.bind(eqn, args)
    if eqn.primitive.name in _rules.SUMMING_GRAD:
        if floats[0] and not any(floats[1:]) and not _gathers_each_place_once(eqn):
            return [_through_float32(lambda *xs: decisions.bind(eqn, list(xs))[0], args)]
        return decisions.bind(eqn, args)
    # elementwise ops broadcast size-1 axes implicitly and sum them in their transposes (a constant
    # has no gradient to sum)
    shape = tuple(eqn.outvars[0].aval.shape)
    expand = [f and not decisions.is_weak(v, ctx) for v, f in zip(eqn.invars, floats)]
    return decisions.bind(eqn, [_expanded(a, shape) if e else a for a, e in zip(args, expand)])


# Ops whose derivative rules sum (see _through_float32), and elementwise ops whose implicit size-1
# broadcasting transposes to a sum.
_SUMMING: dict[str, Callable[[Any, list, decisions.Ctx], list]] = dict.fromkeys(
    _rules.SUMMING_GRAD | _rules.BROADCASTING, _summing_grad
)


CONTRACTION_HELP = (
    "jmp_lite: the backend has no kernel for a 16-bit contraction with float32 accumulation "
    "in this layout. Work around it with rules={'dot_general': 'compute_no_accumulate', "
    "'conv_general_dilated': 'compute_no_accumulate'} (16-bit contractions as jax.lax runs "
    "them) and report the shapes to jmp_lite."
)
