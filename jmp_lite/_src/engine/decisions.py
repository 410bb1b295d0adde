"""What the engine decides for one equation: the scopes around it (``ScopeDecision``), the mode its
primitive runs in, and the dtypes it computes in; the evaluation state of one program level (``Ctx``),
and the casts and binds every pass shares.

The decision folds the equation's name stack from the outside in: module scopes (their policies, read
from the marks ``scopes`` puts in the names), ``float32_region``, and ``"scope:<name>"`` rules; the
mode is the user's rule for the primitive or its class's default (``primitive_rules``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base import caches
from jmp_lite._src.engine import scopes
from jmp_lite._src.engine.scopes import FLOAT32_SCOPE, SCOPE_RULE_PREFIX, Scope

_F32 = np.dtype(np.float32)
# Ops with a rewrite of their own (bodies; sums in a derivative), bound directly rather than cached
REWRITTEN = frozenset(_rules.BODIES) | _rules.SUMMING_GRAD | _rules.BROADCASTING


# Dtypes the rules may change; float64 (x64) and fp8 values are left alone.
CASTABLE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), _F32)


CASTABLE_NAMES = tuple(map(str, CASTABLE))


class ScopeDecision(NamedTuple):
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


class Ctx(NamedTuple):
    base: ScopeDecision  # the decision of the scopes around the current jaxpr
    rules: Mapping[str, str]  # primitive name or "scope:<name>" -> mode
    memo: dict  # (base, name stack) -> ScopeDecision; (kind, program, base, ...) -> rewritten callable
    constant: frozenset = frozenset()  # vars of the current jaxpr computed from literals only
    upcast: frozenset = frozenset()  # vars of the current jaxpr only float32 ops read
    leaving: frozenset = frozenset()  # on a TPU: top-level vars that only leave the program, in float32
    weights: Mapping = {}  # vars of the top-level jaxpr that are a parameter (moved, cast) -> its input index
    fp8_states: Mapping = {}  # input index of a parameter -> its Fp8State (values)
    observe: Any = None  # Observer: sees (and may replace) every equation's outputs; calls inlined
    record: Any = None  # called with an Decision per decision (jmp_lite.explain)
    nested: bool = False  # inside a loop, branch, checkpoint or custom-derivative body
    attention: bool = True  # run recognised attention chains as the kernel without T x T arrays
    remat: bool = False  # under the 16-bit checkpoint: contraction results are named for it to keep
    drawn_in: tuple = ()  # per invar of the current jaxpr: drawn from random bits (see remat16.drawn)
    drawn: frozenset = frozenset()  # vars of the current jaxpr drawn from random bits (under remat only)
    bodies: Any = None  # (eqn, args, ctx) -> outputs: how the engine re-emits a body (interpret.rewrite_body)
    entry_casts: tuple = ()  # per operand of a checkpoint: the dtype its body casts it to first (or None)
    in_checkpoint: bool = False  # inside a checkpoint of the program's own (nn.remat, jax.checkpoint)
    recompute: bool = False  # under the 16-bit checkpoint, wide contractions are rebuilt (recompute.py)
    recomputing: bool = False  # the equation is one of a region that recompute.py rebuilds


def fold(base: ScopeDecision, name_stack: Any, rules: Mapping[str, str]) -> ScopeDecision:
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
    return ScopeDecision(scope, scoped, region, override)


def decision(eqn: Any, ctx: Ctx) -> ScopeDecision:
    name_stack = eqn.source_info.name_stack
    key = (ctx.base, name_stack)
    found = ctx.memo.get(key)
    if found is None:
        found = ctx.memo[key] = fold(ctx.base, name_stack, ctx.rules)
    return found


def mode(eqn: Any, ctx: Ctx, decision: ScopeDecision) -> str:
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


def feeding_float32(jaxpr: Any, ctx: Ctx) -> frozenset:
    """Values only float32 ops read, directly or through exact or elementwise ops that then run
    in float32 too (``x - max(x)`` of a softmax, attention logits: not rounded to 16 bits first)."""
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    only_f32: dict = {}
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in _rules.BODIES:
            reads_f32 = False
        elif (name in _rules.UPCASTABLE or name in _rules.IDENTITY) and eqn.outvars:
            # (a name or sharding constraint is transparent: with or without it, the same values)
            reads_f32 = all(only_f32.get(o, False) and o not in outputs for o in eqn.outvars)
        else:  # contractions read their operands in their own dtype, whoever reads the result
            reads_f32 = mode(eqn, ctx, decision(eqn, ctx)) == "float32"
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                only_f32[v] = only_f32.get(v, True) and reads_f32
    return frozenset(v for v, f in only_f32.items() if f and v not in outputs)


def is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def cast(x: Any, dtype: Any) -> Any:
    """Casts a castable floating value to ``dtype``; everything else passes through."""
    if not (is_float(x.dtype) and is_float(dtype)):  # integers, booleans, PRNG keys: never cast
        return x
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype or np.dtype(x.dtype) not in CASTABLE or dtype not in CASTABLE:
        return x
    return binder(lax.convert_element_type_p, {"new_dtype": dtype, "weak_type": False, "sharding": None})(x)


def as_array(x: Any, aval: Any) -> Any:
    """Literals come as numpy/Python scalars; give them the dtype they were traced with."""
    return x if hasattr(x, "shape") else np.asarray(x, aval.dtype)


def bind(eqn: Any, args: list, params: Mapping[str, Any] | None = None) -> list:
    # call-like primitives are bound with other params than they record (as in eval_jaxpr)
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if eqn.effects:
        out = eqn.primitive.bind(*args, **bind_params)
    else:
        out = binder(eqn.primitive, bind_params)(*args)
    return list(out) if eqn.primitive.multiple_results else [out]


_BINDERS = caches.BoundedCache("engine.binders", 4096)


def binder(primitive: Any, params: dict) -> Callable[..., Any]:
    """``primitive.bind`` with ``params``, as one inlined ``jax.jit`` per (primitive, params).

    Under differentiation JAX linearizes a jitted call once per program and input types and
    reuses it (as it does for ``jax.numpy``'s own functions); a bare bind is linearized
    afresh every time, which makes re-emitting a large program several times slower.
    """
    if primitive.name in REWRITTEN or primitive.name in _rules.UNCACHED:
        return functools.partial(primitive.bind, **params)
    try:
        key = (primitive, tuple(sorted(params.items())))
        found = _BINDERS.get(key)
    except TypeError:  # unhashable parameters
        return functools.partial(primitive.bind, **params)
    if found is None:
        found = _BINDERS[key] = jax.jit(functools.partial(primitive.bind, **params), inline=True)
    return found


def as_written(eqn: Any, args: list) -> list:
    return bind(eqn, [cast(a, v.aval.dtype) for a, v in zip(args, eqn.invars)])


def is_weak(v: Any, ctx: Ctx) -> bool:
    # The jaxpr has already made Python scalars strong ("mul a 2.0:f32[]"); a literal, or a
    # value computed from literals only (``x / jnp.sqrt(64)``), is a constant written in the
    # code, so it must not widen the op (as in jnp's promotion of Python scalars).
    return isinstance(v, jcore.Literal) or v.aval.weak_type or v in ctx.constant


@caches.lru_cache("engine.literal_values", 512)
def literal_derived(jaxpr: Any) -> frozenset:
    found: set = set()
    for eqn in jaxpr.eqns:
        if (
            eqn.invars
            and not eqn.effects
            and all(isinstance(v, jcore.Literal) or v in found for v in eqn.invars)
        ):
            found.update(eqn.outvars)
    return frozenset(found)


def widest(args: list, eqn: Any, ctx: Ctx) -> Any:
    strong = [a.dtype for a, v in zip(args, eqn.invars) if is_float(a.dtype) and not is_weak(v, ctx)]
    dtypes = strong or [a.dtype for a in args if is_float(a.dtype)]
    return functools.reduce(jnp.promote_types, dtypes) if dtypes else None


def target(eqn: Any, args: list, mode: str, compute: np.dtype, ctx: Ctx) -> Any:
    if mode in ("compute", "compute_no_accumulate"):
        return compute
    if mode == "float32":
        wide = widest(args, eqn, ctx)
        return _F32 if wide in CASTABLE else wide
    return widest(args, eqn, ctx)


WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in WARNED:
        WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def warn_round_trip(eqn: Any, args: list, decision: ScopeDecision, why: str) -> None:
    """Once per primitive: a 16-bit value was cast back to the program's dtype for an op run as written."""
    name = eqn.primitive.name
    if name in WARNED or decision.compute not in CASTABLE[:2]:
        return
    if all(
        np.dtype(a.dtype) == np.dtype(v.aval.dtype) for a, v in zip(args, eqn.invars) if hasattr(a, "dtype")
    ):
        return  # no value changes dtype: nothing to warn about
    WARNED.add(name)
    warnings.warn(
        f"jmp_lite: primitive {name!r} ran as written under a {decision.compute} policy ({why}): its "
        "operands were cast back to the dtypes the program was traced with. Give it a rule, e.g. "
        f"rules={{{name!r}: 'follow'}} (runs in the dtype its operands arrive in) or 'float32', and "
        "tell jmp_lite which class it belongs to.",
        _rules.UnknownPrimitiveWarning,
        stacklevel=2,
    )


def quiet(ctx: Ctx) -> Ctx:
    """``ctx`` for a probe evaluation (output dtypes of a body): nothing recorded twice."""
    return ctx if ctx.record is None else ctx._replace(record=None)


def inner(eqn: Any, ctx: Ctx) -> Ctx:
    drawn = ()
    if ctx.drawn and eqn.primitive.name in _rules.CALLS:  # a call's body reads its operands as its inputs
        drawn = tuple(is_var(v) and v in ctx.drawn for v in eqn.invars)
    in_checkpoint = ctx.in_checkpoint or eqn.primitive.name in _rules.CHECKPOINTS
    return ctx._replace(
        base=decision(eqn, ctx),
        nested=True,
        drawn_in=drawn if any(drawn) else (),
        in_checkpoint=in_checkpoint,
    )
