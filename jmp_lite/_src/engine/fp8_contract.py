"""The fp8 pass: a contraction with a parameter operand under an fp8 recipe, and the state it reads."""

from __future__ import annotations

from typing import Any

from jax import lax

from jmp_lite._src.engine import decisions
from jmp_lite._src.engine.scopes import context


def contract(
    lhs: Any, rhs: Any, params: dict, recipe: Any, weight: int, ctx: decisions.Ctx, weight_first: bool = False
) -> Any:
    """A contraction with a parameter operand under an fp8 recipe (``jmp_lite.fp8.dot_general``).

    Block recipes give the rhs the B x B (or MXFP8's 1 x 32) weight tiles: a program that writes the
    weight first (``w @ x``, as Equinox's ``Linear`` does) is contracted with the operands swapped and
    the result transposed back, so that the activation keeps its 1 x B tiles along K."""
    from jmp_lite._src.fp8 import fp8_ops  # fp8 pulls in ml_dtypes' fp8 tables: only when asked for

    state = ctx.fp8_states.get(weight)
    found = context().fp8_weights
    if found is not None:
        found.add(weight)
    elif state is None and recipe.stateful:
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


def state(fields: list) -> Any:
    from jmp_lite._src.fp8.fp8 import Fp8State

    return Fp8State(*fields)
