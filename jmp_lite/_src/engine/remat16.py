"""The 16-bit checkpoint (``remat_float32=True``): what the backward pass of a 16-bit program keeps.

Contraction results (named ``CONTRACTION``), the attention kernel's residuals and dropout masks drawn
from random bits (named ``DRAWN_MASK``) are kept; float32 math is rebuilt from them, so a policy's
float32 regions cost no float32 activations. ``keeps_16_bit`` is the ``jax.checkpoint`` policy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base import caches
from jmp_lite._src.engine import decisions, recompute
from jmp_lite._src.kernels import attention_kernels

_F32 = np.dtype(np.float32)
CONTRACTION = "jmp_lite_contraction"  # the name of a contraction's result under the 16-bit checkpoint
DRAWN_MASK = "jmp_lite_drawn_mask"  # the name of a boolean drawn from random bits (a dropout mask), kept


@caches.lru_cache("engine.own_checkpoints", 256)
def has_checkpoint(jaxpr: Any) -> bool:
    """Whether the program checkpoints anything itself (``jax.checkpoint``, Flax's ``nn.remat``,
    Equinox's ``filter_checkpoint``), at any depth.

    Such a program gets no 16-bit checkpoint: JAX lets the outermost checkpoint's policy decide inside
    every nested one, so ``keeps_16_bit`` would keep each block's contraction results where the user
    asked to keep only the block's inputs (GPT-2 small with ``nn.remat`` blocks, compiled for a v5e
    chip: 2.47 GB of temporaries with the lean loss, 0.90 GB without the 16-bit checkpoint).
    """
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _rules.CHECKPOINTS:
            return True
        if any(has_checkpoint(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


@caches.lru_cache("engine.drawn_values", 512)
def drawn(jaxpr: Any, drawn_in: tuple) -> frozenset:
    """Values of ``jaxpr`` drawn from random bits: the outputs of random primitives, and what is
    computed from them and from literals and values smaller than the result only (``uniform``'s
    bounds, the keep probability), through calls too. A ``bernoulli`` mask is drawn; once a drawn
    value meets data of its size (``where(keep, x, 0)``, ``relu`` after dropout), the result is not."""
    found = {v for v, d in zip(jaxpr.invars, drawn_in) if d}
    constant = decisions.literal_derived(jaxpr)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = tuple(decisions.is_var(v) and v in found for v in eqn.invars)
        if name in _rules.RANDOM:
            found.update(eqn.outvars)
        elif name in _rules.CALLS:  # a call (jax.random's own functions are jits): its body decides
            body = eqn.params[_rules.CALLS[name]]
            body = getattr(body, "jaxpr", body)
            inner = drawn(body, ins)
            found.update(o for o, v in zip(eqn.outvars, body.outvars) if decisions.is_var(v) and v in inner)
        elif any(ins) and eqn.outvars and _rules.kind(name) != "control":  # loops, branches: not followed
            size = max(o.aval.size for o in eqn.outvars)
            if all(
                d or not decisions.is_var(v) or v in constant or v.aval.size < size
                for v, d in zip(eqn.invars, ins)
            ):
                found.update(eqn.outvars)
    return frozenset(found)


def keep_drawn_masks(eqn: Any, outs: list, ctx: decisions.Ctx) -> list:
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


# The rebuilt float32 math stays rebuilt in the compiled program: without the barrier JAX puts around
# it, XLA merges it with the forward pass's identical math and keeps that math's float32 results for the
# backward pass after all (GPT-2 small's step compiled for an H100: 7.00 GB of temporaries through
# autocast with merging, 4.92 GB without).
PREVENTS_CSE = True


def keeps_16_bit(prim: Any, *avals: Any, **params: Any) -> bool:
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
    if name in _rules.SAME_TYPE or name == "convert_element_type" or recompute.elementwise_call(name, params):
        # Elementwise math and relayouts are rebuilt from what they read, as are calls of it with rules of
        # their own (jax.nn.relu is a custom_jvp: its output was kept beside the input it is rebuilt
        # from, which the policy has no abstract rule to judge). Keeping their 16-bit results
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


def keeps_16_bit_but_wide(prim: Any, *avals: Any, **params: Any) -> bool:
    """``keeps_16_bit``, less the results of wide contractions (``recompute="wide_contractions"``): a
    wide result is kept only by its name, which the engine gives it where no region rebuilds it."""
    if _wide_result(prim, avals, params):
        return False
    return keeps_16_bit(prim, *avals, **params)


def _wide_result(prim: Any, avals: tuple, params: dict) -> bool:
    if prim.name not in _rules.CONTRACTIONS:
        return False
    try:
        out, _ = prim.abstract_eval(*avals, **params)
    except Exception:  # noqa: BLE001 - no plain abstract rule: not ours to judge
        return False
    return recompute.is_wide(prim.name, [a.size for a in avals], out.size)


def policy(recomputing_wide: bool) -> Any:
    """The 16-bit checkpoint's policy: ``keeps_16_bit``, or ``keeps_16_bit_but_wide``."""
    return keeps_16_bit_but_wide if recomputing_wide else keeps_16_bit


def _saveable(dtype: np.dtype, size: int, biggest: int) -> bool:
    if dtype == np.bool_:
        return False
    return dtype != _F32 or size * 8 <= biggest
