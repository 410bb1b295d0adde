"""The mixed-precision engine: every dtype decision of jmp_lite is made here.

``transform(fun, scope)`` traces ``fun`` to a jaxpr and evaluates that program
again with per-primitive dtype rules, in the spirit of ``torch.autocast``
(PyTorch's automatic mixed precision, after Micikevicius et al., 2018, "Mixed
Precision Training"):

* ``dot_general`` and ``conv_general_dilated`` (matmul, einsum, Dense, Conv,
  attention scores) take operands in the compute dtype, accumulate in float32
  and return the compute dtype (``jmp_lite.accumulate``, forward and backward);
* range- and accumulation-sensitive ops (exp, log, rsqrt, pow, erf, sums,
  cumulative sums, ...) run in float32;
* everything else runs in the dtype its operands arrive in, the widest winning;
* integer, boolean, PRNG-key and float64 values are never changed.

Front-ends say *where* a policy applies; the engine decides what it means:

* ``module_scope(label, scope)`` opens a ``jax.named_scope`` that carries a
  ``Scope`` (a policy, and whether 16-bit contractions accumulate in float32).
  Every op traced inside takes that scope's compute dtype; a scope whose compute
  dtype is float32 keeps everything inside in float32 (normalization layers).
  ``leave_scope`` casts a module's outputs to its policy's output dtype.
* ``transform(..., inputs=)`` names the arguments that are parameters and the
  dtype each enters the computation in (its module's compute dtype: a parameter
  is cast where it is used, as Flax's ``dtype`` and jmp's ``cast_to_compute``
  do); the argument itself, returned unchanged, keeps its dtype.

The rewrite goes inside nested ``jax.jit``, ``lax.scan``, ``lax.while_loop``,
``lax.cond``/``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp``
and ``shard_map``. Differentiation is JAX's own: the casts are part of the
program, so ``jax.grad`` returns gradients in the dtype of the arguments.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jmp_lite._src import accumulate, attention_kernels, caches, compat, interpret, scopes, validate
from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.compat import source_info_util  # name stacks of re-emitted ops (JAX internal)
from jmp_lite._src.policy import Policy
from jmp_lite._src.scopes import (  # noqa: F401  (the engine's vocabulary, re-exported for its front-ends)
    FLOAT32_SCOPE,
    SCOPE_RULE_PREFIX,
    Context,
    Scope,
    context,
    entering,
    leave_scope,
    mark_p,
    module_scope,
    scope_name,
    without_marks,
)

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
# Dtypes the rules may change; float64 (x64) and fp8 values are left alone.
_CASTABLE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), _F32)
_CASTABLE_NAMES = tuple(map(str, _CASTABLE))
_CACHE_SIZE = 64
CONTRACTION = "jmp_lite_contraction"  # the name of a contraction's result under the 16-bit checkpoint
DRAWN_MASK = "jmp_lite_drawn_mask"  # the name of a boolean drawn from random bits (a dropout mask), kept


class _Decision(NamedTuple):
    """What the named scopes around an op decide (folded from the outermost name inwards)."""

    scope: Scope
    scoped: bool  # inside a module scope
    region: bool  # inside float32_region
    override: str | None  # a "scope:<name>" rule's mode

    @property
    def float32(self) -> bool:
        """Everything runs in float32: a float32_region, or a module scope computing in float32."""
        return self.region or (self.scoped and self.compute == _F32)

    @property
    def compute(self) -> np.dtype:
        return np.dtype(self.scope.policy.compute)

    @property
    def accumulate(self) -> bool:
        return self.scope.accumulate


class _Ctx(NamedTuple):
    base: _Decision  # the decision of the scopes around the current jaxpr
    rules: Mapping[str, str]  # primitive name or "scope:<name>" -> mode
    memo: dict  # (base, name stack) -> _Decision; (kind, program, base, ...) -> rewritten callable
    constant: frozenset = frozenset()  # vars of the current jaxpr computed from literals only
    upcast: frozenset = frozenset()  # vars of the current jaxpr only float32 ops read
    weights: Mapping = {}  # vars of the top-level jaxpr that are a parameter (moved, cast) -> its input index
    fp8_states: Mapping = {}  # input index of a parameter -> its Fp8State (values)
    observe: Any = None  # Observer: sees (and may replace) every equation's outputs; calls inlined
    record: Any = None  # called with an Decision per decision (jmp_lite.explain)
    nested: bool = False  # inside a loop, branch, checkpoint or custom-derivative body
    attention: bool = True  # run recognised attention chains as the kernel without T x T arrays
    remat: bool = False  # under the 16-bit checkpoint: contraction results are named for it to keep
    drawn_in: tuple = ()  # per invar of the current jaxpr: drawn from random bits (see _drawn)
    drawn: frozenset = frozenset()  # vars of the current jaxpr drawn from random bits (under remat only)


def _fold(base: _Decision, name_stack: Any, rules: Mapping[str, str]) -> _Decision:
    scope, scoped, region, override = base
    for name in (p for p in str(name_stack).split("/") if p):
        marks = scopes.MARK_RE.findall(name)
        if marks and not scope.decided:  # inside a decided region, inner scopes were decided with it
            scope, scoped = scopes.interned(int(marks[-1])), True
        if FLOAT32_SCOPE in name:
            region = True
        for key, mode in rules.items():
            # transformed scopes read e.g. "jvp(block)" or "transpose(jvp(block))"
            wanted = key[len(SCOPE_RULE_PREFIX) :] if key.startswith(SCOPE_RULE_PREFIX) else None
            if wanted is not None and (
                name == wanted or f"({wanted})" in name or name.startswith(f"{wanted}#")
            ):
                override = mode
    return _Decision(scope, scoped, region, override)


def _decision(eqn: Any, ctx: _Ctx) -> _Decision:
    name_stack = eqn.source_info.name_stack
    key = (ctx.base, name_stack)
    found = ctx.memo.get(key)
    if found is None:
        found = ctx.memo[key] = _fold(ctx.base, name_stack, ctx.rules)
    return found


def _mode(eqn: Any, ctx: _Ctx, decision: _Decision) -> str:
    if decision.scope.decided:
        return "as_written"
    if decision.float32:
        return "float32"
    if decision.override is not None:
        return decision.override
    mode = ctx.rules.get(eqn.primitive.name) or _rules.default_mode(eqn.primitive.name)
    if mode == "follow" and eqn.outvars and eqn.outvars[0] in ctx.upcast and not _rules.passes_through(eqn):
        return "float32"  # its result only feeds float32 ops: compute it there (``x - max(x)`` of a softmax)
    return mode


def _feeding_float32(jaxpr: Any, ctx: _Ctx) -> frozenset:
    """Values only float32 ops read, directly or through exact or elementwise ops that then run
    in float32 too (``x - max(x)`` of a softmax, attention logits: not rounded to 16 bits first)."""
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    only_f32: dict = {}
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in _HIGHER_ORDER and name not in _rules.SUMMING_GRAD | _rules.BROADCASTING:
            reads_f32 = False
        elif (name in _rules.UPCASTABLE or name in _rules.IDENTITY) and eqn.outvars:
            # (a name or sharding constraint is transparent: with or without it, the same values)
            reads_f32 = all(only_f32.get(o, False) and o not in outputs for o in eqn.outvars)
        else:  # contractions read their operands in their own dtype, whoever reads the result
            reads_f32 = _mode(eqn, ctx, _decision(eqn, ctx)) == "float32"
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                only_f32[v] = only_f32.get(v, True) and reads_f32
    return frozenset(v for v, f in only_f32.items() if f and v not in outputs)


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def cast(x: Any, dtype: Any) -> Any:
    """Casts a castable floating value to ``dtype``; everything else passes through."""
    if not (_is_float(x.dtype) and _is_float(dtype)):  # integers, booleans, PRNG keys: never cast
        return x
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype or np.dtype(x.dtype) not in _CASTABLE or dtype not in _CASTABLE:
        return x
    return _binder(lax.convert_element_type_p, {"new_dtype": dtype, "weak_type": False, "sharding": None})(x)


def _as_array(x: Any, aval: Any) -> Any:
    """Literals come as numpy/Python scalars; give them the dtype they were traced with."""
    return x if hasattr(x, "shape") else np.asarray(x, aval.dtype)


def _bind(eqn: Any, args: list, params: Mapping[str, Any] | None = None) -> list:
    # call-like primitives are bound with other params than they record (as in eval_jaxpr)
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if eqn.effects:
        out = eqn.primitive.bind(*args, **bind_params)
    else:
        out = _binder(eqn.primitive, bind_params)(*args)
    return list(out) if eqn.primitive.multiple_results else [out]


_BINDERS = caches.BoundedCache("engine.binders", 4096)


def _binder(primitive: Any, params: dict) -> Callable[..., Any]:
    """``primitive.bind`` with ``params``, as one inlined ``jax.jit`` per (primitive, params).

    Under differentiation JAX linearizes a jitted call once per program and input types and
    reuses it (as it does for ``jax.numpy``'s own functions); a bare bind is linearized
    afresh every time, which makes re-emitting a large program several times slower.
    """
    if primitive.name in _HIGHER_ORDER or primitive.name in _rules.UNCACHED:
        return functools.partial(primitive.bind, **params)
    try:
        key = (primitive, tuple(sorted(params.items())))
        found = _BINDERS.get(key)
    except TypeError:  # unhashable parameters
        return functools.partial(primitive.bind, **params)
    if found is None:
        found = _BINDERS[key] = jax.jit(functools.partial(primitive.bind, **params), inline=True)
    return found


def _as_written(eqn: Any, args: list) -> list:
    return _bind(eqn, [cast(a, v.aval.dtype) for a, v in zip(args, eqn.invars)])


def _is_weak(v: Any, ctx: _Ctx) -> bool:
    # The jaxpr has already made Python scalars strong ("mul a 2.0:f32[]"); a literal, or a
    # value computed from literals only (``x / jnp.sqrt(64)``), is a constant written in the
    # code, so it must not widen the op (as in jnp's promotion of Python scalars).
    return isinstance(v, jcore.Literal) or v.aval.weak_type or v in ctx.constant


@caches.lru_cache("engine.literal_values", 512)
def _literal_derived(jaxpr: Any) -> frozenset:
    found: set = set()
    for eqn in jaxpr.eqns:
        if (
            eqn.invars
            and not eqn.effects
            and all(isinstance(v, jcore.Literal) or v in found for v in eqn.invars)
        ):
            found.update(eqn.outvars)
    return frozenset(found)


@caches.lru_cache("engine.drawn_values", 512)
def _drawn(jaxpr: Any, drawn_in: tuple) -> frozenset:
    """Values of ``jaxpr`` drawn from random bits: the outputs of random primitives, and what is
    computed from them and from literals and values smaller than the result only (``uniform``'s
    bounds, the keep probability), through calls too. A ``bernoulli`` mask is drawn; once a drawn
    value meets data of its size (``where(keep, x, 0)``, ``relu`` after dropout), the result is not."""
    found = {v for v, d in zip(jaxpr.invars, drawn_in) if d}
    constant = _literal_derived(jaxpr)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = tuple(_is_var(v) and v in found for v in eqn.invars)
        if name in _rules.RANDOM:
            found.update(eqn.outvars)
        elif name in _rules.CALLS:  # a call (jax.random's own functions are jits): its body decides
            body = eqn.params[_rules.CALLS[name]]
            body = getattr(body, "jaxpr", body)
            inner = _drawn(body, ins)
            found.update(o for o, v in zip(eqn.outvars, body.outvars) if _is_var(v) and v in inner)
        elif any(ins) and eqn.outvars and _rules.kind(name) != "control":  # loops, branches: not followed
            size = max(o.aval.size for o in eqn.outvars)
            if all(
                d or not _is_var(v) or v in constant or v.aval.size < size for v, d in zip(eqn.invars, ins)
            ):
                found.update(eqn.outvars)
    return frozenset(found)


def _keep_drawn_masks(eqn: Any, outs: list, ctx: _Ctx) -> list:
    """Booleans drawn from random bits (dropout's keep mask), named for the 16-bit checkpoint to keep.

    Other masks (causal ones, from iotas) are rebuilt for nothing; a drawn one would be rebuilt from
    its random bits, which the checkpoint would keep at 4 bytes per element (``uint32``) where float32
    JAX keeps the 1-byte mask. Relayouts and broadcasts of the mask are rebuilt from it."""
    name = eqn.primitive.name
    if _rules.kind(name) not in ("arithmetic", "integer") or name in _rules.RANDOM:
        return outs  # comparisons and logic only: not movements, calls, or the random primitives
    return [
        checkpoint_name(o, DRAWN_MASK) if v in ctx.drawn and v.aval.dtype == np.bool_ else o
        for o, v in zip(outs, eqn.outvars)
    ]


def _widest(args: list, eqn: Any, ctx: _Ctx) -> Any:
    strong = [a.dtype for a, v in zip(args, eqn.invars) if _is_float(a.dtype) and not _is_weak(v, ctx)]
    dtypes = strong or [a.dtype for a in args if _is_float(a.dtype)]
    return functools.reduce(jnp.promote_types, dtypes) if dtypes else None


def _target(eqn: Any, args: list, mode: str, compute: np.dtype, ctx: _Ctx) -> Any:
    if mode in ("compute", "compute_no_accumulate"):
        return compute
    if mode == "float32":
        widest = _widest(args, eqn, ctx)
        return _F32 if widest in _CASTABLE else widest
    return _widest(args, eqn, ctx)


def _precision_request(precision: Any) -> str | None:
    """``"float32"`` for ``precision=HIGHEST`` (or ``"highest"``/``"float32"``, which JAX
    records as HIGHEST) on either operand, ``"algorithm"`` for an explicit dot algorithm."""
    if isinstance(precision, (tuple, list)):
        return "float32" if lax.Precision.HIGHEST in precision else None
    if precision is None or isinstance(precision, lax.Precision):
        return "float32" if precision == lax.Precision.HIGHEST else None
    if precision == lax.DotAlgorithmPreset.DEFAULT:
        return None
    return "algorithm"


def _contract(eqn: Any, args: list, dtype: np.dtype, accumulate_f32: bool, ctx: _Ctx) -> list:
    """The one place a contraction's operand, accumulation and result dtypes are decided."""
    request = _precision_request(eqn.params.get("precision"))
    if request == "algorithm":
        return _as_written(eqn, args)  # the operand and accumulation dtypes are the algorithm's
    if request == "float32":
        dtype = _F32  # an explicit precision=HIGHEST is honoured: this contraction runs in float32
    lhs, rhs = (cast(a, dtype) for a in args)
    recipe = _decision(eqn, ctx).scope.fp8
    if recipe is None and all(a.dtype == v.aval.dtype for a, v in zip((lhs, rhs), eqn.invars)):
        return _bind(eqn, [lhs, rhs])  # the program's own contraction (all-float32 policy)
    params = dict(eqn.params)
    pet = params.pop("preferred_element_type", None)
    if pet is not None and not (_is_float(pet) and np.dtype(pet) in _CASTABLE):
        return _as_written(eqn, args)  # integer or fp8 accumulation: not ours to change
    if recipe is not None and request is None and eqn.primitive is lax.dot_general_p and accumulate_f32:
        # the weight: a parameter operand (x @ w: rhs first, when both operands are arguments)
        side = next((i for i in (1, 0) if eqn.invars[i] in ctx.weights), None)
        if side is not None:
            weight = ctx.weights[eqn.invars[side]]
            return [_fp8_contract(lhs, rhs, params, recipe, weight, ctx, weight_first=side == 0)]
    if accumulate_f32 and accumulate.is_accumulated(lhs.dtype, rhs.dtype):
        fn = accumulate.dot_general if eqn.primitive is lax.dot_general_p else accumulate.conv_general_dilated
        if eqn.outvars[0] in ctx.upcast:  # only float32 ops read it (softmax logits): keep the accumulator
            return [accumulate.float32_result(fn, lhs, rhs, **params)]
        return [fn(lhs, rhs, **params)]
    return _bind(eqn, [lhs, rhs], {**params, "preferred_element_type": None})


def _fp8_contract(
    lhs: Any, rhs: Any, params: dict, recipe: Any, weight: int, ctx: _Ctx, weight_first: bool = False
) -> Any:
    """A contraction with a parameter operand under an fp8 recipe (``jmp_lite.fp8.dot_general``).

    Block recipes give the rhs the B x B (or MXFP8's 1 x 32) weight tiles: a program that writes the
    weight first (``w @ x``, as Equinox's ``Linear`` does) is contracted with the operands swapped and
    the result transposed back, so that the activation keeps its 1 x B tiles along K."""
    from jmp_lite._src import fp8_ops  # fp8 pulls in ml_dtypes' fp8 tables: only when asked for

    state = ctx.fp8_states.get(weight)
    found = context().fp8_weights
    if found is not None:
        found.add(weight)
    elif state is None and recipe.scaling == "delayed":
        raise ValueError(
            "jmp_lite: delayed fp8 scaling needs a state for every parameter an fp8 contraction reads, "
            f"and argument {weight} has none: create the states with the front-end's init (Linen "
            "apply_policy(...).init, NNX apply_policy) or jmp_lite.fp8.init_fp8_state"
        )
    dims = params["dimension_numbers"]
    state = state if found is None else None
    if weight_first and recipe.block_scaled and state is None:
        (lc, rc), (lb, rb) = dims
        out = fp8_ops.dot_general(rhs, lhs, ((rc, lc), (rb, lb)), recipe=recipe)
        # out: (batch, rhs free, lhs free); dot_general's order is (batch, lhs free, rhs free)
        nb, nr = len(lb), rhs.ndim - len(rc) - len(rb)
        order = [*range(nb), *range(nb + nr, out.ndim), *range(nb, nb + nr)]
        return lax.transpose(out, order)
    return fp8_ops.dot_general(lhs, rhs, dims, recipe=recipe, state=state)


def _fp8_state(fields: list) -> Any:
    from jmp_lite._src.fp8 import Fp8State

    return Fp8State(*fields)


def _eval_eqn(eqn: Any, args: list, ctx: _Ctx) -> list:
    handler = _HIGHER_ORDER.get(eqn.primitive.name)
    if handler is not None:
        try:
            return handler(eqn, args, ctx)
        except (TypeError, ValueError, NotImplementedError) as e:
            # a parameter layout this version does not know: run it as written, and say so
            _warn_round_trip(eqn, args, _decision(eqn, ctx), f"its body could not be rewritten: {e}")
            return _as_written(eqn, args)
    if eqn.primitive is accumulate.dot_p:
        return _as_written(eqn, args)  # a contraction already decided (jmp_lite.accumulate)
    if eqn.primitive is mark_p:
        tag = eqn.params["tag"]
        if tag.startswith("out"):
            return [cast(args[0], scopes.interned(int(tag[3:])).policy.output)]
        return args
    if eqn.primitive.name == "convert_element_type":
        (x,) = args
        if np.dtype(eqn.invars[0].aval.dtype) == np.dtype(eqn.params["new_dtype"]) and _is_float(x.dtype):
            return [x]  # a weak-type change in the traced program, not a dtype change
        return _bind(eqn, args)
    floats = {np.dtype(v.aval.dtype) for v in eqn.invars if _is_float(v.aval.dtype)}
    if not floats:
        return _bind(eqn, args)
    decision = _decision(eqn, ctx)
    mode = _mode(eqn, ctx, decision)
    name = eqn.primitive.name
    entry = _rules.lookup(name)
    if mode == "follow" and entry is not None and entry.kind in _rules.PASS_THROUGH:
        return _bind(eqn, args)  # a collective, a sharding, a name: each operand as it arrives, no casts
    if mode == "as_written" or len(floats) > 1 or _F64 in floats:
        if entry is None and name not in ctx.rules and not decision.scope.decided:
            _warn_round_trip(eqn, args, decision, "jmp_lite has no rule for it")
        return _as_written(eqn, args)
    if entry is not None and entry.kind == "contraction":
        if mode == "float32":
            dtype, accumulated = _F32, False
        elif mode != "follow":
            dtype, accumulated = decision.compute, mode == "compute" and decision.accumulate
        else:
            dtype, accumulated = _widest(args, eqn, ctx), False
        if eqn.primitive in (lax.dot_general_p, lax.conv_general_dilated_p):
            outs = _contract(eqn, args, dtype, accumulated, ctx)
        else:
            outs = _contract_other(eqn, args, dtype, accumulated)
        # Named, so that the checkpoint keeps a contraction's result even where it comes out of a
        # custom_vjp (fp8, convolutions), whose outputs the checkpoint policy is never asked about.
        return [checkpoint_name(o, CONTRACTION) for o in outs] if ctx.remat else outs
    target = _target(eqn, args, mode, decision.compute, ctx)
    cast_args = [cast(a, target) if _is_float(v.aval.dtype) else a for a, v in zip(args, eqn.invars)]
    params = _retyped(eqn, cast_args) if entry is not None and entry.reduction_body else None
    try:
        return _bind(eqn, cast_args, params)
    except (TypeError, ValueError) as e:
        _warn_round_trip(eqn, cast_args, decision, f"it refused these dtypes ({e})")
        return _as_written(eqn, args)


_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _warn_round_trip(eqn: Any, args: list, decision: _Decision, why: str) -> None:
    """Once per primitive: a 16-bit value was cast back to the program's dtype for an op run as written."""
    name = eqn.primitive.name
    if name in _WARNED or decision.compute not in _CASTABLE[:2]:
        return
    if all(
        np.dtype(a.dtype) == np.dtype(v.aval.dtype) for a, v in zip(args, eqn.invars) if hasattr(a, "dtype")
    ):
        return  # no value changes dtype: nothing to warn about
    _WARNED.add(name)
    warnings.warn(
        f"jmp_lite: primitive {name!r} ran as written under a {decision.compute} policy ({why}): its "
        "operands were cast back to the dtypes the program was traced with. Give it a rule, e.g. "
        f"rules={{{name!r}: 'follow'}} (runs in the dtype its operands arrive in) or 'float32', and "
        "tell jmp_lite which class it belongs to.",
        _rules.UnknownPrimitiveWarning,
        stacklevel=2,
    )


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
    cast_args = [cast(a, dtype) if _is_float(v.aval.dtype) else a for a, v in zip(args, eqn.invars)]
    params = dict(eqn.params)
    if "preferred_element_type" not in params or dtype not in _CASTABLE:
        return _as_written(eqn, args)
    wide = accumulate_f32 and dtype in _CASTABLE[:2]
    params["preferred_element_type"] = _F32 if wide else dtype
    return [cast(o, dtype) for o in _bind(eqn, cast_args, params)]


def _eval_jaxpr(
    jaxpr: Any, consts: list, args: list, ctx: _Ctx, uses: Mapping[Any, Any] = {}, weights: Mapping = {}
) -> list:
    """Evaluates ``jaxpr`` under the rules. ``uses``: invars whose uses read another value
    (a parameter in its compute dtype); outputs that are those invars return them unchanged.
    ``weights``: invars that are parameters, by input index (for fp8)."""

    def get(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return _as_array(v.val, v.aval)
        return uses[v] if v in uses else env[v]

    def read_out(env: interpret.Env, v: Any) -> Any:
        return _as_array(v.val, v.aval) if isinstance(v, jcore.Literal) else env[v]

    env = interpret.Env()
    ctx = ctx._replace(constant=_literal_derived(jaxpr), upcast=frozenset(), weights=dict(weights))
    ctx = ctx._replace(upcast=_feeding_float32(jaxpr, ctx))
    if ctx.remat:
        ctx = ctx._replace(drawn=_drawn(jaxpr, ctx.drawn_in))
    skip, emit = _attention_plan(jaxpr, consts, ctx) if ctx.attention else ((), {})

    def equation(i: int, eqn: Any, env: interpret.Env) -> list:
        if i in skip:
            return interpret.SKIP
        # a relayout or cast of a parameter is still that parameter (fp8 finds its weights so)
        if (
            ctx.weights
            and eqn.primitive.name in _rules.LAYOUT
            and _is_var(eqn.invars[0])
            and eqn.invars[0] in ctx.weights
        ):
            ctx.weights[eqn.outvars[0]] = ctx.weights[eqn.invars[0]]
        kernel = None  # the attention implementation an emitted chain ran as (explain reports it)
        if i in emit:
            ins = []
            out, kernel = _attention(emit[i], get, _decision(eqn, ctx).compute, ctx.record is not None)
            outs = [out]
        else:
            ins = [get(v) for v in eqn.invars]
            outs = _eval_eqn(eqn, ins, ctx)
            if ctx.drawn:
                outs = _keep_drawn_masks(eqn, outs, ctx)
        if ctx.observe is not None and not ctx.nested:
            outs = ctx.observe(eqn, outs, _decision(eqn, ctx))
        if ctx.record is not None:
            _record(eqn, ins, outs, ctx, interpret.current_scope(), kernel)
        return outs

    return interpret.evaluate(
        jaxpr, consts, args, equation, names=scopes.unmarked, env=env, read_out=read_out
    )


class Decision(NamedTuple):
    """One decision of the engine, as ``jmp_lite.explain`` reports it."""

    kind: str  # "op", "attention" (a chain run as the kernel) or "attention_declined"
    primitive: str
    scope: str  # named-scope path, as the user wrote it
    mode: str  # compute, float32, follow, as_written, fp8, kernel, declined
    traced: tuple  # operand dtypes as the program was traced
    ran: tuple  # operand dtypes as the op ran
    outputs: tuple  # output dtypes
    reason: str


def _dtype_names(xs: Sequence[Any]) -> tuple:
    return tuple(str(x.dtype) if hasattr(x, "dtype") else type(x).__name__ for x in xs)


def _record(eqn: Any, ins: list, outs: list, ctx: _Ctx, scope: str, kernel: str | None) -> None:
    """``kernel``: the attention implementation this equation's chain ran as, or None."""
    name = eqn.primitive.name
    if kernel:
        ran = "cuDNN's fused attention" if kernel == "cudnn" else f"the {kernel} attention kernel"
        why = f"softmax(q k^T + bias, masks) v run as {ran} (no T x T array kept)"
        compute = (str(_decision(eqn, ctx).compute),)
        ctx.record(Decision("attention", name, scope, "kernel", (), compute, _dtype_names(outs), why))
        return
    if _rules.kind(name) == "control" and name in _HIGHER_ORDER or eqn.primitive is mark_p:
        return  # a body: its own ops are recorded; a module output mark: its cast is the next op's input
    traced = tuple(str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))
    if not any(_is_float(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")):
        return  # integer, boolean and key ops are never changed
    mode, reason = _why(eqn, ins, ctx)
    ran = _dtype_names(ins)
    target = {"compute": _decision(eqn, ctx).compute, "float32": _F32}.get(mode)
    if mode == "compute_no_accumulate" or mode == "compute" and "fp8" not in reason:
        target = _decision(eqn, ctx).compute
    if target is not None:  # the dtype _eval_eqn cast its floating operands to
        ran = tuple(str(np.dtype(target)) if d in _CASTABLE_NAMES else d for d in ran)
    elif mode == "fp8":
        ran = tuple(str(_decision(eqn, ctx).scope.fp8).join("()") for _ in ran)
    ctx.record(Decision("op", name, scope, mode, traced, ran, _dtype_names(outs), reason))


def _why(eqn: Any, args: list, ctx: _Ctx) -> tuple[str, str]:
    """The mode ``_eval_eqn`` took for ``eqn`` and why, in its order of checks."""
    name = eqn.primitive.name
    if eqn.primitive is accumulate.dot_p:
        return "as_written", "a contraction already decided by jmp_lite.accumulate"
    if name == "convert_element_type":
        return "as_written", "the program's own dtype change"
    decision = _decision(eqn, ctx)
    mode = _mode(eqn, ctx, decision)
    entry = _rules.lookup(name)
    if decision.scope.decided:
        return mode, "emitted by a nested autocast or apply_policy, whose policy decided it"
    if mode == "follow" and entry is not None and entry.kind in _rules.PASS_THROUGH:
        return mode, f"{entry.kind}: runs in the dtype each operand arrives in, no casts around it"
    floats = {np.dtype(v.aval.dtype) for v in eqn.invars if _is_float(v.aval.dtype)}
    source = _mode_source(eqn, ctx, decision)
    if mode == "as_written":
        if entry is None and name not in ctx.rules:
            return mode, "jmp_lite has no rule for this primitive: operands cast back to their traced dtypes"
        return mode, source or f"{entry.kind if entry else 'its'} ops are written for their dtypes"
    if len(floats) > 1 or _F64 in floats:
        return "as_written", "operands of several floating dtypes, or float64: run as written"
    if entry is not None and entry.kind == "contraction":
        request = _precision_request(eqn.params.get("precision"))
        if request == "algorithm":
            return "as_written", "an explicit dot algorithm fixes its dtypes"
        if request == "float32":
            return "float32", "precision=HIGHEST asked for float32"
        if mode == "float32":
            return mode, source
        if decision.scope.fp8 is not None and any(v in ctx.weights for v in eqn.invars):
            return "fp8", f"a parameter operand under the fp8 recipe {decision.scope.fp8}"
        ran = _dtype_names(args)
        if mode == "compute" and decision.accumulate and decision.compute in _CASTABLE[:2]:
            return mode, f"operands in {decision.compute}, accumulated in float32 ({source or 'contraction'})"
        return mode, f"operands in {', '.join(sorted(set(ran)))} ({source or mode})"
    if mode == "float32":
        return mode, source or "range- or accumulation-sensitive: float32"
    return mode, source or "runs in the dtype its operands arrive in, the widest winning"


def _mode_source(eqn: Any, ctx: _Ctx, decision: _Decision) -> str:
    """Where a mode came from, when not from the primitive's class."""
    if decision.region:
        return "inside float32_region"
    if decision.scoped and decision.compute == _F32:
        return f"its module computes in float32 ({decision.scope.policy})"
    if decision.override is not None:
        return f"a scope rule sets {decision.override!r}"
    if eqn.primitive.name in ctx.rules:
        return f"rule {eqn.primitive.name!r}: {ctx.rules[eqn.primitive.name]!r}"
    if eqn.outvars and eqn.outvars[0] in ctx.upcast and _rules.default_mode(eqn.primitive.name) == "follow":
        return "only float32 ops read its result: computed in float32"
    return ""


def _attention_plan(jaxpr: Any, consts: list, ctx: _Ctx) -> tuple:
    """Which equations are attention chains the kernel runs: (indices to skip, {index: match})."""
    skip: set = set()
    emit: dict = {}
    matched = _attention_matches(jaxpr, consts, ctx.memo)
    for match in matched:
        declined = _declines(match, jaxpr, ctx)
        if declined is None:
            skip.update(set(match.eqns) - {match.emit_at})
            emit[match.emit_at] = match
        elif ctx.record is not None:
            _record_declined(jaxpr.eqns[match.emit_at], declined, ctx)
    if ctx.record is not None:  # explain: also the softmax chains the matcher did not take, and why
        from jmp_lite._src.attention_pattern import declined_attention

        taken = {i for m in matched for i in m.eqns}
        for index, reason in declined_attention(jaxpr, consts):
            if index not in taken:
                _record_declined(jaxpr.eqns[index], reason, ctx)
    return skip, emit


def _record_declined(eqn: Any, reason: str, ctx: _Ctx) -> None:
    scope = str(scopes.unmarked(source_info_util.current_name_stack() + eqn.source_info.name_stack))
    ctx.record(Decision("attention_declined", eqn.primitive.name, scope, "declined", (), (), (), reason))


def _declines(match: Any, jaxpr: Any, ctx: _Ctx) -> str | None:
    """Why an attention chain the matcher found runs as written (``None``: it runs as the kernel).

    The whole chain must compute as the rules say under one 16-bit policy: no float32 region, no rule
    of the user's on any of its ops (``{"exp": "follow"}`` asks for the softmax as written)."""
    if match.fallback is not None:
        return match.fallback
    eqn = jaxpr.eqns[match.emit_at]
    decision = _decision(eqn, ctx)
    chain = [jaxpr.eqns[i] for i in match.eqns]
    ruled = sorted({e.primitive.name for e in chain if e.primitive.name in ctx.rules})
    if ruled:
        return f"a rule names its ops ({', '.join(ruled)})"
    if any(_decision(e, ctx) != decision for e in chain):
        return "its ops lie in scopes with different policies"
    if decision.scope.decided:
        return "a nested autocast or apply_policy decided it"
    if decision.float32:
        return "it lies in a float32 region or a module computing in float32"
    if decision.override is not None:
        return f"a scope rule sets {decision.override!r}"
    if not decision.accumulate:
        return "float32 accumulation is off (accumulate=False)"
    if decision.compute not in _CASTABLE[:2]:
        return f"the policy computes in {decision.compute}: the kernel runs under 16-bit policies only"
    if _mode(eqn, ctx, decision) != "compute":
        return "a rule changes the contraction's mode"
    return None


def _attention_matches(jaxpr: Any, consts: list, memo: dict) -> list:
    """``find_attention`` once per program, kept in the transform's memo (each entry keeps its program
    and constants alive, so their ids stay theirs). Bounded: custom-derivative rules are traced to a
    new program on every outer trace."""
    from jmp_lite._src.attention_pattern import find_attention

    found_by_program = memo.setdefault("attention", {})
    key = (id(jaxpr), *map(id, consts))
    found = found_by_program.get(key)
    if found is None or found[0] is not jaxpr:
        if len(found_by_program) >= _CACHE_SIZE:
            found_by_program.pop(next(iter(found_by_program)))
        found = found_by_program[key] = (jaxpr, list(consts), find_attention(jaxpr, list(consts)))
    return found[2]


def _attention(match: Any, read: Callable[[Any], Any], compute: np.dtype, named: bool) -> tuple:
    """One attention chain as one call that keeps no T x T matrix: cuDNN's fused attention where the
    program runs on a CUDA GPU and cuDNN takes the call, the blockwise kernel elsewhere
    (``attention_kernels.choose_implementation``). Returns the output and, when ``named``, the
    implementation's name (else None)."""
    from jmp_lite._src.attention_kernels import choose_implementation, dot_product_attention

    a = match.kernel_arguments(read, dtype=compute)
    platform = context().platform
    ran = None
    if named:
        ran = choose_implementation(
            *(a[k] for k in ("query", "key", "value", "bias", "mask")),
            is_causal=a["is_causal"],
            mask_value=a["mask_value"],
            backend=platform,
        )
    return match.output(dot_product_attention(**a, backend=platform)), ran


def _quiet(ctx: _Ctx) -> _Ctx:
    """``ctx`` for a probe evaluation (output dtypes of a body): nothing recorded twice."""
    return ctx if ctx.record is None else ctx._replace(record=None)


def _inner(eqn: Any, ctx: _Ctx) -> _Ctx:
    drawn = ()
    if ctx.drawn and eqn.primitive.name in _rules.CALLS:  # a call's body reads its operands as its inputs
        drawn = tuple(_is_var(v) and v in ctx.drawn for v in eqn.invars)
    return ctx._replace(base=_decision(eqn, ctx), nested=True, drawn_in=drawn if any(drawn) else ())


def _memoized(kind: str, eqn: Any, inner: _Ctx, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The rewrite of a sub-program, made once per (program, enclosing decision): a model repeats
    its layers, and one function object lets JAX's own caches (jit traces, linearizations) hit."""
    program = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("branches")))
    key = (
        kind,
        id(program),
        inner.base,
        inner.drawn_in,
        tuple(sorted((k, str(v)) for k, v in eqn.params.items() if k in _STATIC)),
        context().platform,  # the attention implementation inside may differ per platform
    )
    found = inner.memo.get(key)
    if found is None or found[0] is not program:
        found = inner.memo[key] = (program, make())
    return found[1]


_STATIC = ("name", "inline", "keep_unused", "prevent_cse", "policy")


class _Bodies(NamedTuple):
    """The engine's evaluation of one equation's bodies (``interpret.Bodies``): under the decision of
    the enclosing scope, memoized per program and decision."""

    eqn: Any
    ctx: _Ctx
    inner: _Ctx

    def run(self, body: Any, args: Sequence[Any]) -> list:
        return self._eval(body, args, self.inner)

    def probe(self, body: Any, args: Sequence[Any]) -> list:
        return self._eval(body, args, _quiet(self.inner))

    def in_place(self) -> Callable[[Any, Sequence[Any]], list] | None:
        if self.ctx.observe is None:
            return None
        # an observer sees every operation: evaluated in place, observed as the enclosing level
        level = self.inner._replace(nested=self.ctx.nested)
        return lambda body, args: self._eval(body, args, level)

    def memoized(self, kind: str, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        return _memoized(kind, self.eqn, self.inner, make)

    def as_written(self, args: Sequence[Any]) -> list:
        return _as_written(self.eqn, list(args))

    def cast(self, x: Any, dtype: Any) -> Any:
        return cast(x, dtype)

    def warn(self, key: str, message: str) -> None:
        _warn_once(key, message)

    @staticmethod
    def _eval(body: Any, args: Sequence[Any], ctx: _Ctx) -> list:
        if isinstance(body, jcore.ClosedJaxpr):
            return _eval_jaxpr(body.jaxpr, list(body.consts), list(args), ctx)
        return _eval_jaxpr(body, [], list(args), ctx)


def _body(eqn: Any, args: list, ctx: _Ctx) -> list:
    return interpret.rewrite_body(eqn, args, _Bodies(eqn, ctx, _inner(eqn, ctx)))


def _through_float32(bind: Callable[..., Any], args: list) -> Any:
    """``bind(*args)`` (a 16-bit first operand, the rest non-floating) run on a float32 copy.

    JAX's derivative rules of these ops sum (a broadcast transposes to a sum, ``reduce_max``
    counts and sums its maxima, a gather transposes to a scatter-add). On float32 copies
    those sums run in float32 under ``jax.grad`` and are rounded once (the table's rule
    for sums); the values are the same (the copy is exact), XLA fuses the conversions
    into the op, and forward-mode differentiation still works.
    """
    x, *rest = args
    return cast(bind(cast(x, _F32), *rest), x.dtype)


def _expanded(x: Any, shape: tuple) -> Any:
    """``x`` broadcast to ``shape`` explicitly (its transpose, a sum, in float32)."""
    if x.shape == shape:
        return x
    dims = tuple(range(len(shape))) if x.ndim == len(shape) else tuple(range(len(shape) - x.ndim, len(shape)))
    params = {"shape": shape, "broadcast_dimensions": dims, "sharding": None}
    return _through_float32(_binder(lax.broadcast_in_dim_p, params), [x])


def _summing_grad(eqn: Any, args: list, ctx: _Ctx) -> list:
    # The table's rule for the op, as for any other op; on 16-bit values, the sums of its
    # derivative run in float32 (see _through_float32).
    floats = [_is_float(v.aval.dtype) for v in eqn.invars]
    traced = {np.dtype(v.aval.dtype) for v, f in zip(eqn.invars, floats) if f}
    if len(traced) != 1 or not traced <= set(_CASTABLE) or eqn.primitive.multiple_results:
        return _as_written(eqn, args)  # no floats, several dtypes, float64: as the general path does
    decision = _decision(eqn, ctx)
    mode = _mode(eqn, ctx, decision)
    if mode == "as_written":
        return _as_written(eqn, args)
    target = _target(eqn, args, mode, decision.compute, ctx)
    args = [cast(a, target) if f else a for a, f in zip(args, floats)]
    if np.dtype(target) not in _CASTABLE[:2]:
        return _bind(eqn, args)
    if eqn.primitive.name in _rules.SUMMING_GRAD:
        if floats[0] and not any(floats[1:]):
            return [_through_float32(lambda *xs: _bind(eqn, list(xs))[0], args)]
        return _bind(eqn, args)
    # elementwise ops broadcast size-1 axes implicitly and sum them in their transposes (a constant
    # has no gradient to sum)
    shape = tuple(eqn.outvars[0].aval.shape)
    expand = [f and not _is_weak(v, ctx) for v, f in zip(eqn.invars, floats)]
    return _bind(eqn, [_expanded(a, shape) if e else a for a, e in zip(args, expand)])


# Ops whose derivative rules sum (see _through_float32), elementwise ops whose implicit size-1
# broadcasting transposes to a sum, and the bodies the engine rewrites.
_HIGHER_ORDER: dict[str, Callable[[Any, list, _Ctx], list]] = {
    **dict.fromkeys(_rules.SUMMING_GRAD | _rules.BROADCASTING, _summing_grad),
    **dict.fromkeys(_rules.BODIES, _body),
}


_CONTRACTION_HELP = (
    "jmp_lite: the backend has no kernel for a 16-bit contraction with float32 accumulation "
    "in this layout. Work around it with rules={'dot_general': 'compute_no_accumulate', "
    "'conv_general_dilated': 'compute_no_accumulate'} (16-bit contractions as jax.lax runs "
    "them) and report the shapes to jmp_lite."
)


# The rebuilt float32 math stays rebuilt in the compiled program: without the barrier JAX puts around
# it, XLA merges it with the forward pass's identical math and keeps that math's float32 results for the
# backward pass after all (GPT-2 small's step compiled for an H100: 7.00 GB of temporaries through
# autocast with merging, 4.92 GB without).
_REMAT_PREVENTS_CSE = True


def _keeps_16_bit(prim: Any, *avals: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of a 16-bit program: what the backward pass may keep.

    16-bit results of contractions and other non-elementwise ops, and float32 values no bigger than
    an eighth of an operand (per-row statistics of a norm or a softmax); not elementwise results or
    relayouts (rebuilt from what they read: keeping one would round it where XLA's fusion of the
    plain call does not, so a value under ``grad`` would differ from the call's), float32
    activations, boolean masks or broadcasts (rebuilt from the iotas and scalars they came from).
    Booleans drawn from random bits (dropout masks, named ``DRAWN_MASK``) are kept, at 1 byte per
    element, as float32 JAX keeps them: rebuilt, they would keep their 4-byte random bits instead.
    """
    name = prim.name
    if name in _rules.FREE:
        return False
    if name == "name" and params.get("name") == attention_kernels.RESIDUALS:
        return True  # the attention kernel's output and float32 row statistics: else its loops run again
    if name == "name" and params.get("name") == CONTRACTION:
        (aval,) = avals  # a contraction's result: kept when 16-bit (rebuilding it is a matmul)
        return _saveable(np.dtype(aval.dtype), aval.size, aval.size)
    if name == "name" and params.get("name") == DRAWN_MASK:
        return True  # a dropout mask: 1 byte per element, where rebuilding it keeps its 4-byte random bits
    if name in _rules.IDENTITY:
        # The program's own names and constraints: what they annotate is kept (or not) where it is made;
        # keeping a named elementwise result would round it, as below.
        return False
    if name in _rules.SAME_TYPE or name == "convert_element_type":
        # Elementwise math and relayouts are rebuilt from what they read. Keeping their 16-bit results
        # would also round values that XLA computes without rounding in a plain call (a 16-bit add
        # fused into a float32 reduction): the value under grad would differ from the call's.
        return False
    try:
        outs, _ = prim.abstract_eval(*avals, **params)
    except Exception:  # noqa: BLE001 - a primitive without a plain abstract rule: keep what it makes
        return True
    biggest = max((getattr(a, "size", 0) for a in avals), default=0)
    for out in outs if prim.multiple_results else [outs]:
        try:
            dtype = np.dtype(out.dtype)
        except (AttributeError, TypeError):  # PRNG keys, tokens: kept
            continue
        if not _saveable(dtype, out.size, biggest):
            return False
    return True


def _saveable(dtype: np.dtype, size: int, biggest: int) -> bool:
    if dtype == np.bool_:
        return False
    return dtype != _F32 or size * 8 <= biggest


class ModelUnderPolicy(NamedTuple):
    """What a front-end's model says of itself to the tools that run it again under other engine options
    (``precision_report``, ``explain``): the protocol is a method ``__jmp_lite_model__()`` returning this.
    The tools read nothing else of the model: no private attribute, no front-end module."""

    kind: str  # "linen" or "nnx": the front-end's name
    name: str  # the model class's name, the root of its module paths
    policy: Policy
    rules: tuple  # ((regex pattern or module class, Policy), ...), as apply_policy was given them
    fp8: Any  # its Fp8Recipe, or None
    # variant(policy=None, **engine options) -> the model's call under them (every module under
    # ``policy`` when given: a float32 reference keeps the same program)
    variant: Callable[..., Callable[..., Any]]
    # roles(*args, **kwargs) -> the call's argument roles, a pytree prefix of (args, kwargs):
    # Param(name=<parameter path>) for a parameter, Fp8StateField for fp8 scaling state, None otherwise
    roles: Callable[..., Any] | None = None


def model_under_policy(obj: Any) -> ModelUnderPolicy | None:
    """The protocol's answer for a front-end model, or for its bound ``apply``; None for anything else."""
    owner = getattr(obj, "__self__", obj)
    describe = getattr(type(owner), "__jmp_lite_model__", None)
    return None if describe is None else describe(owner)


class Param(NamedTuple):
    """The role of a parameter argument (``transform(inputs=)``): its uses read it in ``dtype`` (its
    module's compute dtype; ``None``: as it is) and fp8 contractions may read it; ``name`` ties it to
    its fp8 state (``Fp8StateField``)."""

    dtype: Any = None
    name: str | None = None


class Fp8StateField(NamedTuple):
    """The role of one field (``"fp8_scale"``, ...) of the ``Fp8State`` of the parameter ``name``."""

    name: str
    field: str


def _is_role(x: Any) -> bool:
    return x is None or isinstance(x, (Param, Fp8StateField))


class Inputs(NamedTuple):
    """The roles of the array arguments, one per argument, as the engine reads them."""

    casts: tuple  # per argument: the dtype a parameter's uses read (its module's compute dtype), or None
    weights: tuple  # per argument: a parameter an fp8 contraction may read
    fp8_states: Mapping[int, tuple[int, ...]] = {}  # parameter -> the arguments of its Fp8State fields


def spread_roles(roles: Any, arguments: tuple) -> list:
    """The role of each leaf of ``arguments`` (``(args, kwargs)``), from a pytree of roles that is a
    prefix of it: a role holds for every leaf below it; ``None`` is a plain argument."""
    try:
        spread = jax.tree_util.tree_map(
            lambda role, sub: [role] * len(jax.tree_util.tree_leaves(sub)), roles, arguments, is_leaf=_is_role
        )
    except ValueError as e:
        raise ValueError(f"jmp_lite: the input roles do not match the arguments' structure: {e}") from None
    lists = jax.tree_util.tree_leaves(spread, is_leaf=lambda x: isinstance(x, list))
    return [r for rs in lists for r in rs]


def _inputs(roles: Any, arguments: tuple, dynamic: Sequence[int]) -> Inputs:
    """``Inputs`` of the array leaves ``dynamic`` of ``arguments`` from their roles (``spread_roles``)."""
    per_leaf = spread_roles(roles, arguments)
    found = [per_leaf[i] for i in dynamic]
    params = {r.name: i for i, r in enumerate(found) if isinstance(r, Param) and r.name is not None}
    fields: dict[str, dict[str, int]] = {}
    for i, r in enumerate(found):
        if isinstance(r, Fp8StateField):
            fields.setdefault(r.name, {})[r.field] = i
    states = {}
    if fields:
        from jmp_lite._src.fp8 import Fp8State  # fp8 pulls in ml_dtypes' fp8 tables: only when states come
    for name, f in fields.items():
        if name in params:  # a state of a parameter this call never reads is not needed
            if set(f) != set(Fp8State._fields):
                raise ValueError(f"jmp_lite: the fp8 state of {name!r} has the fields {sorted(f)}")
            states[params[name]] = tuple(f[k] for k in Fp8State._fields)
    return Inputs(
        tuple(r.dtype if isinstance(r, Param) else None for r in found),
        tuple(isinstance(r, Param) for r in found),
        states,
    )


# (*args, **kwargs) -> a pytree of roles (Param, Fp8StateField, None) that is a prefix of (args, kwargs)
InputRoles = Callable[..., Any]
Observer = Callable[[Any, list, _Decision], list]
OutputRule = Callable[[Any], Any]


class _Entry(NamedTuple):
    closed: Any  # the program as traced
    out_tree: Any
    inputs: Inputs
    to_output: tuple  # per output: cast to the policy's output dtype (else to its traced dtype)
    jitted: Callable[..., Any]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _check_output(fun: Callable[..., Any], out: Any) -> None:
    if not isinstance(out, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        name = getattr(fun, "__qualname__", None) or repr(fun)
        raise TypeError(
            f"jmp_lite: {name} returned a {type(out).__name__} ({out!r:.60}); a function run "
            "under a policy must return arrays, Python or NumPy scalars, or pytrees of them "
            "(a tuple, list or dict of arrays; None leaves are fine)"
        )


def transform(
    fun: Callable[..., Any],
    root: Scope,
    *,
    rules: Mapping[str, str] | None = None,
    inputs: InputRoles | None = None,
    outputs: OutputRule | None = None,
    remat_float32: bool = True,
    observe: Observer | None = None,
    attention: bool = True,
    record: Callable[[Decision], None] | None = None,
) -> Callable[..., Any]:
    """``fun`` evaluated under ``root`` (and the module scopes it opens).

    Array leaves of the arguments are traced; other leaves are static (hashable, a new
    value retraces). The traced program is cached per input signature.

    Args:
        fun: the function; it may open ``module_scope``s while it is traced.
        root: the scope of everything outside module scopes.
        rules: ``{primitive name or "scope:<name>": mode}`` overriding the rule table.
        inputs: called once per trace, after ``fun`` is traced (so module scopes it opened are
            known), with ``fun``'s arguments; returns their roles, a pytree that is a prefix of
            ``(args, kwargs)``: ``Param(dtype, name)`` for a parameter (its uses read it in
            ``dtype``; fp8 contractions may read it), ``Fp8StateField(name, field)`` for a field of
            the fp8 state of the parameter ``name``, ``None`` for any other argument.
        outputs: called with the output pytree; returns a matching pytree of bools,
            ``True`` where a floating output takes ``root.policy.output`` (default: all);
            elsewhere an output keeps the dtype it was traced with (updated state).
        remat_float32: under a 16-bit policy, the backward pass keeps the 16-bit results of
            contractions and other non-elementwise ops and small float32 statistics only, and
            rebuilds elementwise math (norm and softmax math, activations, residual sums) and
            boolean masks from them (``jax.checkpoint`` with ``_keeps_16_bit``). Values are the
            same with and without it.
        observe: ``observe(eqn, outs, decision) -> outs`` is called after every equation of the
            program (calls to jitted functions are evaluated in place, so it sees those too; the
            bodies of loops, branches, checkpoints and custom derivatives are seen as their one
            equation): the hook of measurements such as a precision report.
            ``decision`` says the scope (policy) and whether the op ran in float32.
    """
    ctx = _Ctx(
        _Decision(root, False, False, None),
        dict(rules or {}),
        {},
        observe=observe,
        attention=attention,
        record=record,
    )
    output = np.dtype(root.policy.output)
    remat = remat_float32 and np.dtype(root.policy.compute) in _CASTABLE[:2]
    cache: dict = {}

    def evaluate(entry: _Entry, *values: Any) -> list:
        jaxpr, roles = entry.closed.jaxpr, entry.inputs
        weights = {v: i for i, (v, w) in enumerate(zip(jaxpr.invars, roles.weights)) if w}
        states = {i: _fp8_state([values[j] for j in fields]) for i, fields in roles.fp8_states.items()}
        run = ctx._replace(fp8_states=states, remat=remat)

        def program(*values: Any) -> list:
            uses = {v: cast(x, d) for v, x, d in zip(jaxpr.invars, values, roles.casts) if d is not None}
            return _eval_jaxpr(jaxpr, list(entry.closed.consts), list(values), run, uses, weights)

        if remat:
            # 16-bit values for the backward pass; float32 ones (norm and softmax math) rebuilt from them
            program = jax.checkpoint(program, policy=_keeps_16_bit, prevent_cse=_REMAT_PREVENTS_CSE)
        outs = program(*values)
        return [
            cast(o, output if flag else v.aval.dtype) if _is_float(o.dtype) else o
            for o, v, flag in zip(outs, jaxpr.outvars, entry.to_output)
        ]

    def trace(leaves: list, dynamic: list[int], treedef: Any, values: list) -> _Entry:
        out_tree: list = []

        def flat(*xs: Any) -> list:
            full = list(leaves)
            for i, x in zip(dynamic, xs):
                full[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
            outs, tree = jax.tree_util.tree_flatten(fun(*args, **kwargs))
            for out in outs:
                _check_output(fun, out)
            out_tree.append(tree)
            return outs

        with entering(tracing=True):
            closed = jax.make_jaxpr(flat)(*values)
        if inputs is None:
            roles = Inputs((None,) * len(values), (False,) * len(values))
        else:
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            roles = _inputs(inputs(*args, **kwargs), (args, kwargs), dynamic)
        if outputs is None:
            to_output = (True,) * len(closed.jaxpr.outvars)
        else:
            marks = outputs(jax.tree_util.tree_unflatten(out_tree[0], [True] * out_tree[0].num_leaves))
            to_output = tuple(bool(m) for m in jax.tree_util.tree_leaves(marks))
        entry = _Entry(closed, out_tree[0], roles, to_output, lambda *xs: None)
        return entry._replace(jitted=jax.jit(functools.partial(evaluate, entry)))

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
        static = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
        values = [leaves[i] for i in dynamic]
        # full avals (weak types, shard_map's varying axes) and the mesh in context
        key = (
            treedef,
            static,
            tuple(jax.typeof(x) for x in values),
            str(jax.sharding.get_abstract_mesh()),
            context().platform,
        )
        try:
            entry = cache.get(key)
        except TypeError as e:  # an unhashable static leaf
            raise TypeError(f"jmp_lite: non-array arguments must be hashable (they are static): {e}") from e
        if entry is None:
            entry = trace(leaves, dynamic, treedef, values)
            if not any(isinstance(c, jax.core.Tracer) for c in entry.closed.consts):
                if len(cache) >= _CACHE_SIZE:
                    cache.pop(next(iter(cache)))
                cache[key] = entry
        traced = any(isinstance(x, jax.core.Tracer) for x in values) or entry is not cache.get(key)
        try:
            if traced and context().tracing:
                # Inside another transform's trace (a nested autocast or apply_policy): the innermost
                # policy decides, so the ops emitted here are marked as decided and run as written there.
                with jax.named_scope(scope_name("", root._replace(decided=True))):
                    outs = evaluate(entry, *values)
            elif traced and (entry is not cache.get(key) or compat.staging_a_jaxpr()):
                # Under jit (or another staging trace) the rules are evaluated into it.
                outs = evaluate(entry, *values)
            else:
                # Called eagerly, or under an eager jax.grad / vmap: compiled once, so the values are
                # jit's, bit for bit (op by op, XLA would round where a fused program does not).
                outs = entry.jitted(*values)
        except jax.errors.JaxRuntimeError as e:
            if "DotThunk" in str(e) or "Unsupported element type" in str(e):
                e.add_note(_CONTRACTION_HELP)
            raise
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    return wrapped


def check_rules(rules: Mapping[str, str] | None) -> dict[str, str]:
    """Validates ``{primitive name or "scope:<name>": mode}``; unknown names are errors."""
    import difflib

    rules = validate.rules(rules)  # a suggest_rules result as the mapping it holds
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a mapping of str to mode, got {type(rules).__name__}")
    for key, value in rules.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"rules keys must be primitive names (e.g. 'exp') or 'scope:<name>', got {key!r}")
        if key.startswith(SCOPE_RULE_PREFIX) and not key[len(SCOPE_RULE_PREFIX) :].strip():
            raise ValueError(
                f"rule key {key!r} names no scope: write 'scope:<name>' with the jax.named_scope name "
                "(e.g. 'scope:attention')"
            )
        if not key.startswith(SCOPE_RULE_PREFIX) and key not in _rules.primitive_names():
            known = _rules.primitive_names(refresh=True)  # a primitive defined since
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
                raise ValueError(
                    f"rule key {key!r} is not a JAX primitive name; {hint}"
                    f"keys are primitive names as jax.make_jaxpr prints them (e.g. 'exp', "
                    f"'dot_general', 'reduce_sum') or 'scope:<jax.named_scope name>'"
                )
        if value not in _rules.MODES:
            raise ValueError(f"rule {key!r}: {value!r} is not a mode; accepted: {', '.join(_rules.MODES)}")
    return dict(rules)
