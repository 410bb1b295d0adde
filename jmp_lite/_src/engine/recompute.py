"""Recomputed wide contractions (``recompute="wide_contractions"``): the 16-bit checkpoint keeps the
narrow input of a contraction whose result is wider than every operand (an MLP's up-projection)
instead of its result, and runs the contraction again in the backward pass.

A *region* is such a contraction and the elementwise math that reads its result, up to the
contractions that read that math (``gelu(x @ w1 + b1) @ w2``). The engine runs each region as a
checkpoint of its own inside the 16-bit one: the region's backward pass starts only once its
output's cotangent has arrived (JAX puts an optimization barrier around a checkpoint's inputs and
cotangents), so the compiler rebuilds one layer's wide values at a time. Without the region, the
rebuilt values of every layer depend on the saved ones only, and XLA rebuilt all of them at the start
of the backward pass (GPT-2 small compiled for a v5e chip: 12 x 50 MB live together, 2.49 GB of
temporaries against 2.37 GB kept).

This is selective recomputation in the sense of Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models", applied to what the contraction's shape says is cheap to
rebuild (MaxText's ``save_dot_except_mlpwi`` remat policy keeps the same set in a Transformer).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from jax.extend import core as jcore

from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base import caches
from jmp_lite._src.engine import decisions

WIDE_CONTRACTIONS = "wide_contractions"
CHOICES = (None, WIDE_CONTRACTIONS)  # the values of the front-ends' ``recompute=``
_PULL_DEPTH = 4  # elementwise steps between a region's math and another wide contraction it reads


def is_wide(prim_name: str, operand_sizes: Collection[int], result_size: int) -> bool:
    """Whether a contraction's result has more elements than each of its operands."""
    return prim_name in _rules.CONTRACTIONS and result_size > max(operand_sizes, default=0)


def wide_equation(eqn: Any) -> bool:
    """``is_wide`` of one equation of a program."""
    if eqn.primitive.name not in _rules.CONTRACTIONS:
        return False
    return is_wide(eqn.primitive.name, [v.aval.size for v in eqn.invars], eqn.outvars[0].aval.size)


class Region(NamedTuple):
    """Equations of one program level run as one checkpoint: ``members`` (indices, in program order),
    the values they read from outside (``inputs``) and those read after them (``outputs``)."""

    members: tuple[int, ...]
    inputs: tuple
    outputs: tuple


def regions(jaxpr: Any, taken: Collection[int], eligible: Callable[[Any], bool]) -> dict[int, Region]:
    """The regions of ``jaxpr``, by the index of their last member (where the engine runs them).

    A region grows from an ``eligible`` wide contraction along the values it computes: elementwise
    equations join it and are followed, contractions that are not wide join it and end it. Any other
    reader (a reduction, a loop, an output of the program, an equation in ``taken``) leaves the
    contraction kept as before, since then the region would have to hand a wide value out.
    """
    eqns = jaxpr.eqns
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    readers: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if decisions.is_var(v):
                readers.setdefault(v, []).append(i)
    leaving = {v for v in jaxpr.outvars if decisions.is_var(v)}
    seeds = [i for i, e in enumerate(eqns) if i not in taken and wide_equation(e) and eligible(e)]
    found: dict[int, Region] = {}
    claimed: set[int] = set()
    for seed in seeds:
        if seed in claimed:
            continue
        grown = _grow(seed, eqns, made, readers, leaving, taken, claimed, eligible)
        if grown is None:
            continue
        members, ends = grown
        order = sorted(members)
        last = order[-1]
        values = {v for i in order for v in eqns[i].outvars}
        outputs = tuple(v for i in order for v in eqns[i].outvars if i in ends or i == last)
        if any(r <= last for v in outputs for r in readers.get(v, ()) if r not in members):
            continue  # read before the region's end: it cannot run as one block there
        inputs = tuple(
            dict.fromkeys(v for i in order for v in eqns[i].invars if decisions.is_var(v) and v not in values)
        )
        claimed.update(members)
        found[last] = Region(tuple(order), inputs, outputs)
    return found


def _grow(
    seed: int,
    eqns: Any,
    made: dict,
    readers: dict,
    leaving: set,
    taken: Collection[int],
    claimed: set[int],
    eligible: Callable[[Any], bool],
) -> tuple[set[int], set[int]] | None:
    """The members of the region grown from ``seed`` and its ends, or ``None`` when it cannot be one."""
    members, ends = {seed}, set()
    work = [seed]

    def pull(v: Any, depth: int) -> bool:
        """Whether the math that made ``v`` joins the region: another wide contraction (a gated MLP's
        second projection), or elementwise math on one (its bias added)."""
        j = made.get(v) if decisions.is_var(v) else None
        if j is None or j in members:
            return j is not None
        e = eqns[j]
        if j in taken or j in claimed:
            return False
        joins = wide_equation(e) and eligible(e)
        if not joins and depth and elementwise(e):
            joins = any([pull(u, depth - 1) for u in e.invars])
        if joins:
            members.add(j)
            work.append(j)
        return joins

    while work:
        i = work.pop()
        for v in eqns[i].outvars:
            if v in leaving:
                return None
            for r in readers.get(v, ()):
                if r in members:
                    continue
                if r in taken or r in claimed:
                    return None
                e = eqns[r]
                if e.primitive.name in _rules.CONTRACTIONS:
                    if wide_equation(e) or not eligible(e):
                        return None
                    members.add(r)
                    ends.add(r)
                elif elementwise(e):
                    members.add(r)
                    work.append(r)
                    for u in e.invars:
                        pull(u, _PULL_DEPTH)
                else:
                    return None
    return (members, ends) if ends else None


def elementwise(eqn: Any) -> bool:
    """Math a region rebuilds for the price of reading its operands: pointwise primitives (arithmetic,
    comparisons, special functions), casts and names, relayouts and slices (``same_type``), and calls
    whose bodies hold only these (``jax.nn.gelu`` is a ``jit``, ``relu`` a ``custom_jvp``)."""
    name = eqn.primitive.name
    if name in _rules.SAME_TYPE or name in _rules.POINTWISE or name in _rules.IDENTITY:
        return True
    if name == "convert_element_type":
        return True
    return elementwise_call(name, eqn.params)


def elementwise_call(name: str, params: Any) -> bool:
    """Whether a call (``jit``, ``custom_jvp_call``, ...) with these parameters holds only elementwise
    math."""
    if name not in _rules.CALLS or name in _rules.CHECKPOINTS:
        return False
    body = params.get(_rules.CALLS[name])
    return body is not None and _pointwise_body(getattr(body, "jaxpr", body))


@caches.lru_cache("engine.pointwise_bodies", 256)
def _pointwise_body(jaxpr: Any) -> bool:
    shapes = {tuple(v.aval.shape) for v in (*jaxpr.invars, *jaxpr.outvars) if hasattr(v.aval, "shape")}
    if len(shapes - {()}) > 1:
        return False
    for e in jaxpr.eqns:
        if e.primitive.name == "broadcast_in_dim" and all(
            isinstance(v, jcore.Literal) or v.aval.shape == () for v in e.invars
        ):
            continue  # a scalar constant spread over the values
        if not elementwise(e):
            return False
    return True
