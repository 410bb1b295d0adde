"""The attention pass: recognised ``softmax(q k^T) v`` chains of one program level re-emitted as one
call of the attention kernel (``attention_kernels.dot_product_attention``), where the rules allow it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jmp_lite._src.engine import decisions, explain_record
from jmp_lite._src.engine.scopes import context

_CACHE_SIZE = 64


def plan(jaxpr: Any, consts: list, ctx: decisions.Ctx) -> tuple:
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
            explain_record.record_declined(jaxpr.eqns[match.emit_at], declined, ctx)
    if ctx.record is not None:  # explain: also the softmax chains the matcher did not take, and why
        from jmp_lite._src.engine.attention_pattern import declined_attention

        taken = {i for m in matched for i in m.eqns}
        for index, reason in declined_attention(jaxpr, consts):
            if index not in taken:
                explain_record.record_declined(jaxpr.eqns[index], reason, ctx)
    return skip, emit


def _declines(match: Any, jaxpr: Any, ctx: decisions.Ctx) -> str | None:
    """Why an attention chain the matcher found runs as written (``None``: it runs as the kernel).

    The whole chain must compute as the rules say under one 16-bit policy: no float32 region, no rule
    of the user's on any of its ops (``{"exp": "follow"}`` asks for the softmax as written)."""
    if match.fallback is not None:
        return match.fallback
    eqn = jaxpr.eqns[match.emit_at]
    decision = decisions.decision(eqn, ctx)
    chain = [jaxpr.eqns[i] for i in match.eqns]
    ruled = sorted({e.primitive.name for e in chain if e.primitive.name in ctx.rules})
    if ruled:
        return f"a rule names its ops ({', '.join(ruled)})"
    if any(decisions.decision(e, ctx) != decision for e in chain):
        return "its ops lie in scopes with different policies"
    if decision.scope.decided:
        return "a nested autocast or apply_policy decided it"
    if decision.float32:
        return "it lies in a float32 region or a module computing in float32"
    if decision.override is not None:
        return f"a scope rule sets {decision.override!r}"
    if not decision.accumulate:
        return "float32 accumulation is off (accumulate=False)"
    if decision.compute not in decisions.CASTABLE[:2]:
        return f"the policy computes in {decision.compute}: the kernel runs under 16-bit policies only"
    if decisions.mode(eqn, ctx, decision) != "compute":
        return "a rule changes the contraction's mode"
    if (
        ctx.in_checkpoint
        and (context().platform or jax.default_backend()) in ("cuda", "gpu")
        and not _cudnn_takes(match, decision.compute)
    ):
        # XLA:GPU then recomputes every block's forward pass at once, not one block at a time (GPT-2
        # small with nn.remat blocks on an H100: 2.06 GB of temporaries with the kernel, 1.24 without)
        return "it lies in a checkpoint of the program's own on a GPU, where cuDNN does not take it"
    return None


def _cudnn_takes(match: Any, compute: np.dtype) -> bool:
    """Whether cuDNN's fused attention takes the chain, from its operands' shapes and dtypes."""
    from jmp_lite._src.kernels.attention_kernels import choose_implementation

    operands = [match.query, match.key, match.value, *match.biases, *match.masks]
    variables = [o.var for o in operands if decisions.is_var(o.var)]  # literals are read as they are

    def arguments(*values: Any) -> tuple:
        found = dict(zip(variables, values))
        a = match.kernel_arguments(found.__getitem__, dtype=compute)
        return tuple(a[k] for k in ("query", "key", "value", "bias", "mask"))

    shapes = jax.eval_shape(arguments, *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in variables))
    q, k, v, bias, mask = shapes  # the rule reads shapes and dtypes only
    chosen = choose_implementation(
        q, k, v, bias, mask, is_causal=match.is_causal, mask_value=match.mask_value, backend="cuda"
    )
    return chosen == "cudnn"


def _attention_matches(jaxpr: Any, consts: list, memo: dict) -> list:
    """``find_attention`` once per program, kept in the transform's memo (each entry keeps its program
    and constants alive, so their ids stay theirs). Bounded: custom-derivative rules are traced to a
    new program on every outer trace."""
    from jmp_lite._src.engine.attention_pattern import find_attention

    found_by_program = memo.setdefault("attention", {})
    key = (id(jaxpr), *map(id, consts))
    found = found_by_program.get(key)
    if found is None or found[0] is not jaxpr:
        if len(found_by_program) >= _CACHE_SIZE:
            found_by_program.pop(next(iter(found_by_program)))
        found = found_by_program[key] = (jaxpr, list(consts), find_attention(jaxpr, list(consts)))
    return found[2]


def emit(match: Any, read: Callable[[Any], Any], compute: np.dtype, named: bool) -> tuple:
    """One attention chain as one call that keeps no T x T matrix: cuDNN's fused attention where the
    program runs on a CUDA GPU and cuDNN takes the call, the blockwise kernel elsewhere
    (``attention_kernels.choose_implementation``). Returns the output and, when ``named``, the
    implementation's name (else None)."""
    from jmp_lite._src.kernels.attention_kernels import choose_implementation, dot_product_attention

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
