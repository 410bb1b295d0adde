"""What ``jmp_lite.explain`` reads: one ``Decision`` per equation the engine evaluated, and why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base.compat import source_info_util  # name stacks of re-emitted ops (JAX internal)
from jmp_lite._src.engine import decisions, dtype_rules, recompute, scopes
from jmp_lite._src.engine.scopes import mark_p
from jmp_lite._src.kernels import accumulate

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


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


def record(eqn: Any, ins: list, outs: list, ctx: decisions.Ctx, scope: str, kernel: str | None) -> None:
    """``kernel``: the attention implementation this equation's chain ran as, or None."""
    name = eqn.primitive.name
    if kernel:
        ran = "cuDNN's fused attention" if kernel == "cudnn" else f"the {kernel} attention kernel"
        why = f"softmax(q k^T + bias, masks) v run as {ran} (no T x T array kept)"
        compute = (str(decisions.decision(eqn, ctx).compute),)
        ctx.record(Decision("attention", name, scope, "kernel", (), compute, _dtype_names(outs), why))
        return
    if name in _rules.BODIES or eqn.primitive is mark_p:
        return  # a body: its own ops are recorded; a module output mark: its cast is the next op's input
    traced = tuple(str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))
    if not any(decisions.is_float(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")):
        return  # integer, boolean and key ops are never changed
    mode, reason = _why(eqn, ins, ctx)
    ran = _dtype_names(ins)
    target = {"compute": decisions.decision(eqn, ctx).compute, "float32": _F32}.get(mode)
    if mode == "compute_no_accumulate" or mode == "compute" and "fp8" not in reason:
        target = decisions.decision(eqn, ctx).compute
    if target is not None:  # the dtype evaluate_equation cast its floating operands to
        ran = tuple(str(np.dtype(target)) if d in decisions.CASTABLE_NAMES else d for d in ran)
    elif mode == "fp8":
        ran = tuple(str(decisions.decision(eqn, ctx).scope.fp8).join("()") for _ in ran)
    ctx.record(Decision("op", name, scope, mode, traced, ran, _dtype_names(outs), reason))


def _why(eqn: Any, args: list, ctx: decisions.Ctx) -> tuple[str, str]:
    """The mode ``dtype_rules.evaluate_equation`` took for ``eqn`` and why, in its order of checks."""
    name = eqn.primitive.name
    if eqn.primitive is accumulate.dot_p:
        return "as_written", "a contraction already decided by jmp_lite.accumulate"
    if name == "convert_element_type":
        return "as_written", "the program's own dtype change"
    decision = decisions.decision(eqn, ctx)
    mode = decisions.mode(eqn, ctx, decision)
    entry = _rules.lookup(name)
    if decision.scope.decided:
        return mode, "emitted by a nested autocast or apply_policy, whose policy decided it"
    if mode == "follow" and entry is not None and entry.kind in _rules.PASS_THROUGH:
        return mode, f"{entry.kind}: runs in the dtype each operand arrives in, no casts around it"
    floats = {np.dtype(v.aval.dtype) for v in eqn.invars if decisions.is_float(v.aval.dtype)}
    source = _mode_source(eqn, ctx, decision)
    if mode == "as_written":
        if entry is None and name not in ctx.rules:
            return mode, "jmp_lite has no rule for this primitive: operands cast back to their traced dtypes"
        return mode, source or f"{entry.kind if entry else 'its'} ops are written for their dtypes"
    if len(floats) > 1 or _F64 in floats:
        return "as_written", "operands of several floating dtypes, or float64: run as written"
    if entry is not None and entry.kind == "contraction":
        request = dtype_rules.precision_request(eqn.params.get("precision"))
        if request == "algorithm":
            return "as_written", "an explicit dot algorithm fixes its dtypes"
        if request == "float32":
            return "float32", "precision=HIGHEST asked for float32"
        if mode == "float32":
            return mode, source
        if decision.scope.fp8 is not None and any(v in ctx.weights for v in eqn.invars):
            return "fp8", f"a parameter operand under the fp8 recipe {decision.scope.fp8}"
        ran = _dtype_names(args)
        if mode == "compute" and decision.accumulate and decision.compute in decisions.CASTABLE[:2]:
            rebuilt = ""
            if ctx.recomputing and recompute.wide_equation(eqn):
                rebuilt = "; its wider result is rebuilt in the backward pass, not kept (recompute=)"
            return mode, (
                f"operands in {decision.compute}, accumulated in float32 ({source or 'contraction'}){rebuilt}"
            )
        return mode, f"operands in {', '.join(sorted(set(ran)))} ({source or mode})"
    if mode == "float32":
        return mode, source or "range- or accumulation-sensitive: float32"
    return mode, source or "runs in the dtype its operands arrive in, the widest winning"


def _mode_source(eqn: Any, ctx: decisions.Ctx, decision: decisions.ScopeDecision) -> str:
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


def record_declined(eqn: Any, reason: str, ctx: decisions.Ctx) -> None:
    scope = str(scopes.unmarked(source_info_util.current_name_stack() + eqn.source_info.name_stack))
    ctx.record(Decision("attention_declined", eqn.primitive.name, scope, "declined", (), (), (), reason))
