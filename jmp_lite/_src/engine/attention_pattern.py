"""Recognising attention in a jaxpr, so that it can be re-emitted as one call of the blockwise kernel.

The engine only sees primitives. ``find_attention(jaxpr)`` looks, in one level of a jaxpr, for the chain
that every attention implementation traces to::

    logits  = dot_general(q, k)                  (any layout einsum gives; q or k may be pre-scaled)
    logits  = logits * c, logits / c             (a positive constant)
    logits  = logits + bias, logits - bias       (any number of times, before or after the scale)
    logits  = select_n(mask, big_negative, logits)   (jnp.where; masks combined with and/or/not)
    weights = softmax(logits, key axis)          (plain ops, or inside jax.nn.softmax's custom_jvp_call)
    out     = dot_general(weights, v)

with transposes, unit reshapes and dtype conversions anywhere on the way. Calls without a matmul inside
(the ``jit`` eqns of ``jnp.where`` and ``jnp.tril``, the ``custom_jvp_call`` of ``jax.nn.softmax``) are
inlined for the analysis; a match covers such a call whole or not at all. Every axis of the logits gets a
label (a batch axis shared by q and k, a query axis, the key axis); the labels say how to bring q, k, v,
biases and masks to the kernel layout of ``attention_kernels.dot_product_attention`` ([batch..., T, heads,
depth]) and how to bring its output back.

A mask that is a constant of the program (built from iotas and literals) is evaluated once, at analysis time,
and recognised as causal when it is ``tril``; the kernel then builds it per block (``is_causal=True``) and
the T x T mask is never formed. The analysis is one pass over the level plus a bounded walk per ``exp``.

A match computes the chain's math: masked logits take the program's fill (``mask_value``; a row whose keys
are all masked gives what the program gives), and a chain the kernel cannot compute as written is declined
with the reason in ``AttentionMatch.fallback``: ``precision=HIGHEST`` or a float32 dot algorithm on either
matmul, masks with different fills, a bias added after a finite fill, dropout, weights used elsewhere.
``declined_attention`` lists those and the softmax chains that were not matched at all, with why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules
from jmp_lite._src.base import caches

# A jnp.where fill at or below this marks a mask (above it, a soft mask: the program's own math). Only a
# recognition rule: the fill's value itself goes to the kernel (``AttentionMatch.mask_value``).
BIG_NEGATIVE = -1e4
# Constant masks are evaluated up to this many elements (a [16, 1024, 1024] causal mask is 16.8M).
EVAL_LIMIT = 1 << 26
_MAX_WALK = 64  # ops visited per backward walk (the logits path is a handful of ops)
# Calls whose bodies the analysis reads as part of the level (jnp functions, jax.nn.softmax's custom_jvp).
_CALL_BODY = {n: primitive_rules.SUBPROGRAMS[n] for n in ("jit", "custom_jvp_call")}
_RANDOM = primitive_rules.RANDOM
# Ops that change a value's type only, not its value: shard_map's cast to "varying over an axis" (a
# causal mask built inside FSDP's shard_map), which cannot run eagerly outside one.
_TYPE_ONLY = ("pvary",)
# Between a max or sum over the key axis and its use: the kept axis, dtype changes.
_KEEPDIMS = ("broadcast_in_dim", "reshape", "transpose", "convert_element_type", "stop_gradient")
# Relayouts and casts, and broadcasts (which only repeat values): what a chain's operands pass through.
_LAYOUT = primitive_rules.LAYOUT | {"broadcast_in_dim"}
_WEIGHT_STEPS = _LAYOUT | {"dot_general", "mul", "div", "select_n"}
# A softmax as the precision report names its ops: the exponentials, what the logits pass through on
# their way from a contraction to one (scaling, masking, x - max(x); tanh: logit soft-capping), and what
# normalizes the exponentials after it (their sum, the division by it, a log-softmax's log).
EXPONENTIALS = frozenset({"exp", "exp2"})
SOFTMAX_LOGIT_STEPS = primitive_rules.UPCASTABLE | primitive_rules.LAYOUT | {"tanh"}
SOFTMAX_NORMALIZE = frozenset(
    {"reduce_sum", "broadcast_in_dim", "reshape", "div", "convert_element_type", "log", "sub"}
)


class Relayout(NamedTuple):
    """Steps ``("reshape" | "transpose" | "broadcast", shape-or-permutation)`` applied in order."""

    steps: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __call__(self, x: Any) -> jax.Array:
        for op, arg in self.steps:
            if op == "reshape":
                x = jnp.reshape(x, arg)
            elif op == "transpose":
                x = jnp.transpose(x, arg)
            else:
                x = jnp.broadcast_to(x, arg)
        return x


class Operand(NamedTuple):
    """A value of the analysed jaxpr level and how it enters the kernel.

    ``var``: a ``jax.extend.core.Var`` of that level (or a ``Literal``). ``layout``: from its value to the
    kernel layout. ``factor``: biases only, the constant the program multiplied it by after adding it.
    ``negate``: masks only, True when the value marks the keys to drop rather than keep.
    """

    var: Any
    layout: Relayout
    factor: float = 1.0
    negate: bool = False


class AttentionMatch(NamedTuple):
    """One attention chain, and how to run it as ``attention_kernels.dot_product_attention``.

    ``eqns``: indices into ``jaxpr.eqns`` that the call replaces; ``emit_at`` (the largest of them, the
    value matmul) is where it goes, and it defines ``out``. Every input (query, key, value, biases,
    masks) is computed by an eqn that is not in ``eqns``. ``fallback`` is None when the kernel can
    serve the chain, else the reason it cannot (then run the eqns as written): the kernel computes
    the chain's math or the match says why not.

    ``mask_value`` is what every masked logit equals when it reaches the softmax (the ``jnp.where``
    fill after the scales and constant shifts that follow it, -inf included), or None when nothing is
    masked; the kernel gives masked logits this value, so rows whose keys are all masked come out as
    the program's (the mean of the values for a finite fill, NaN for -inf).
    """

    query: Operand  # kernel layout [batch..., Tq, heads, depth]
    key: Operand  # [batch..., Tk, kv_heads, depth]
    value: Operand  # [batch..., Tk, kv_heads, depth_v]
    biases: tuple[Operand, ...]  # each [batch..., heads, Tq, Tk], axes 1 or full; summed
    masks: tuple[Operand, ...]  # same layout; True = attend after ``astype(bool)`` and ``negate``; and-ed
    scale: float  # the product of every constant the logits (or q, k) were multiplied by
    scale_sites: tuple[str, ...]  # where the program applied it: "query", "key", "logits"
    is_causal: bool  # a constant mask equal to tril(ones(Tq, Tk)) was found (and is not in ``masks``)
    dropout: bool  # the weights are multiplied by a random mask before the value matmul
    fallback: str | None
    out: Any  # the Var the value matmul defines
    out_layout: Relayout  # from the kernel output [batch..., Tq, heads, depth_v] to ``out``'s layout
    eqns: frozenset[int]
    emit_at: int
    precision: tuple[Any, Any]  # the ``precision`` parameters of the two matmuls
    mask_value: float | None = None  # every masked logit's value at the softmax; None: nothing masked

    def kernel_arguments(self, read: Callable[[Any], Any], dtype: Any = None) -> dict[str, Any]:
        """Keyword arguments of ``dot_product_attention`` from ``read(var) -> value``.

        q, k and v are cast to ``dtype`` (default: their promoted dtype; the kernel takes one).
        """

        def get(operand: Operand) -> Any:
            v = operand.var
            return operand.layout(
                np.asarray(v.val, v.aval.dtype) if isinstance(v, jcore.Literal) else read(v)
            )

        q, k, v = get(self.query), get(self.key), get(self.value)
        dtype = jnp.result_type(q, k, v) if dtype is None else dtype
        bias = None
        for b in self.biases:
            term = get(b)
            term = term if b.factor == 1.0 else term * b.factor
            bias = term if bias is None else bias + term
        if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
        mask = None
        for m in self.masks:
            term = get(m).astype(bool)
            term = ~term if m.negate else term
            mask = term if mask is None else mask & term
        return {
            "query": q.astype(dtype),
            "key": k.astype(dtype),
            "value": v.astype(dtype),
            "bias": bias,
            "mask": mask,
            "scale": self.scale,
            "is_causal": self.is_causal,
            "mask_value": self.mask_value,
        }

    def output(self, out: jax.Array) -> jax.Array:
        """The kernel's output in the layout of ``out`` (its dtype is left to the caller)."""
        return self.out_layout(out)


def find_attention(jaxpr: Any, consts: Sequence[Any] | None = None) -> list[AttentionMatch]:
    """The attention chains in one level of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), in program order.

    ``consts``: values of ``jaxpr.constvars`` (taken from a ``ClosedJaxpr``), so that constant masks
    passed as constants are recognised too. Sub-jaxprs (scan, cond, jit bodies with matmuls) are not
    entered: call this on each.
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    level = _Level(jaxpr, consts)
    found = []
    for i, op in enumerate(level.ops):
        if op.name == "exp":
            try:
                found.append(_Chain(level, i).match())
            except (_NoMatch, KeyError, IndexError, TypeError, ValueError):
                pass  # not attention, or parameters laid out as this analysis does not know: no match
    return sorted(found, key=lambda m: m.emit_at)


def declined_attention(jaxpr: Any, consts: Sequence[Any] | None = None) -> list[tuple[int, str]]:
    """The softmax chains of one level of ``jaxpr`` that look like attention but that the kernel does
    not run, each with the reason: ``[(eqn index, reason)]`` in program order.

    "Look like attention": the softmax's input is computed from a matmul, and its output reaches a
    matmul through layout ops, scales and masks only. The index is that of the level's eqn holding
    the softmax's ``exp`` (the ``custom_jvp_call`` of ``jax.nn.softmax``, or the ``exp`` itself).
    Chains ``find_attention`` matches with a ``fallback`` are here with that reason; chains it does
    not match at all are here with what stopped the analysis. The engine's own reasons to run a
    served chain as written (a float32 policy or region, a rule, ``attention=False``) are not: they
    are the engine's. As costly as ``find_attention``: for explanations, not for every trace.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite._src.engine.attention_pattern import declined_attention
        >>> q = jnp.ones((2, 16, 4, 8))
        >>> def attention(q, k, v):
        ...     s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest")
        ...     return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        >>> [reason for _, reason in declined_attention(jax.make_jaxpr(attention)(q, q, q))]
        ['precision=HIGHEST requested on the logits matmul: the program runs as written']
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    level = _Level(jaxpr, consts)
    found: dict[int, str] = {}
    for i, op in enumerate(level.ops):
        if op.name != "exp" or op.top in found:
            continue
        try:
            reason = _Chain(level, i).match().fallback
        except _NoMatch as e:
            reason = str(e) if _looks_like_attention(level, i) else None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            layout = f"the analysis does not know this layout ({type(e).__name__})"
            reason = layout if _looks_like_attention(level, i) else None
        if reason is not None:
            found[op.top] = reason
    return sorted(found.items())


# From a softmax's exp forward to the value matmul: what attention weights pass through.
_TO_VALUES = _LAYOUT | {"mul", "div", "select_n", "reduce_sum", "dot_general"}


def _looks_like_attention(level: _Level, exp_index: int) -> bool:
    """A bounded walk each way from an ``exp``: a matmul before it, and one after it that its output
    reaches through ``_TO_VALUES`` ops (a classifier's softmax reaches a loss, not a matmul)."""

    def reaches(start: list, step: Callable[[Any], list], passable: Callable[[_Op], bool]) -> bool:
        todo, seen = list(start), 0
        while todo and seen < _MAX_WALK:
            op = todo.pop()
            seen += 1
            if op.name == "dot_general":
                return True
            if passable(op):
                todo.extend(step(op))
        return False

    def producers(op: _Op) -> list:
        return [level.op_of(k) for k in op.ins if level.op_of(k) is not None]

    def consumers(op: _Op) -> list:
        return [level.ops[i] for k in op.outs for i in level.uses.get(k, [])]

    exp = level.ops[exp_index]
    before = reaches(producers(exp), producers, lambda op: True)
    return before and reaches(consumers(exp), consumers, lambda op: op.name in _TO_VALUES)


class _NoMatch(Exception):
    """Not a chain the kernel can take; the message says why (``declined_attention`` reports it)."""


def _require(condition: Any, reason: str = "its ops are laid out in a way the matcher does not know") -> None:
    if not condition:
        raise _NoMatch(reason)


# ---------------------------------------------------------------------------------------------------
# One level of a jaxpr, with helper calls inlined: a flat list of ops over hashable value keys
# (a Var of the level, or (expansion, inner Var) for values inside an inlined call).
# ---------------------------------------------------------------------------------------------------


class _Op(NamedTuple):
    eqn: Any
    ins: tuple  # value keys or Literals
    outs: tuple
    top: int  # the index of the level's eqn it belongs to
    inlined: bool  # inside a helper call

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


@caches.lru_cache("attention.contracts", 256)
def _contracts(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in primitive_rules.CONTRACTIONS:
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if _contracts(sub):
                return True
    return False


def _helper_body(eqn: Any) -> Any:
    """The body of a call worth looking through (``_where``, ``tril``, a softmax): no matmul, no effects."""
    field = _CALL_BODY.get(eqn.primitive.name)
    body = eqn.params.get(field) if field else None
    if not isinstance(body, jcore.ClosedJaxpr) or eqn.effects or _contracts(body.jaxpr):
        return None
    return body


def _is_lit(v: Any) -> bool:
    return isinstance(v, jcore.Literal)


# Static values (causal masks, iotas) computed from literals only, by the ops that computed them: each
# layer of a model builds the same mask, and each trace of the model builds it again. Bounded in bytes.
_STATIC_VALUES: dict = {}
_STATIC_BYTES_LIMIT = 1 << 28
caches.register(
    "attention.static_values",
    _STATIC_VALUES.clear,
    lambda: sum(o.nbytes for v in _STATIC_VALUES.values() for o in v),
    _STATIC_BYTES_LIMIT,
)
# What _Chain._classify found for a static mask, by the mask's signature and layout.
_CLASSIFIED = caches.BoundedCache("attention.classified", 1024)


def _op_signature(op: Any, inputs: list) -> Any:
    """A hashable key for ``op`` applied to values with these signatures, or None."""
    if any(i is None for i in inputs):
        return None
    try:
        key = (op.eqn.primitive.name, tuple(sorted(op.eqn.params.items())), tuple(inputs))
        hash(key)
    except TypeError:  # a parameter that is not hashable
        return None
    return key


class _Level:
    def __init__(self, jaxpr: Any, consts: Sequence[Any] | None) -> None:
        self.ops: list[_Op] = []
        self.readable: dict = {}  # key of an inlined call's output -> the level's Var
        self.known: dict = {}  # constants' values
        self.top_outs: dict[int, list] = {}
        self.avals: dict = {}
        if consts is not None:
            self.known.update(zip(jaxpr.constvars, consts))
        self._flatten(jaxpr.eqns, {}, None, None)
        alias = self._alias
        self.outputs = {alias.get(v, v) for v in jaxpr.outvars if not _is_lit(v)}
        self.producer: dict = {}
        self.uses: dict = {}
        for i, op in enumerate(self.ops):
            for k in op.outs:
                self.producer[k] = i
            for k in op.ins:
                if not _is_lit(k):
                    self.uses.setdefault(k, []).append(i)
        self.static = self._static()
        self.values: dict = {}
        self.signatures: dict = {}  # value -> its structural signature (see _signature)

    def _flatten(self, eqns: Sequence[Any], names: dict, tag: Any, top: int | None) -> None:
        def name(v: Any) -> Any:
            if _is_lit(v):
                return v
            return names.get(v, v if tag is None else (tag, v))

        if tag is None:
            self._alias = names
        for index, eqn in enumerate(eqns):
            t = index if top is None else top
            ins = tuple(name(v) for v in eqn.invars)
            body = _helper_body(eqn)
            if body is None:
                outs = tuple(name(v) for v in eqn.outvars)
                for v, k in zip(eqn.outvars, outs):
                    self.avals[k] = v.aval
                self.ops.append(_Op(eqn, ins, outs, t, top is not None))
            else:
                inner_tag = object()
                inner = dict(zip(body.jaxpr.invars, ins))
                for cv, c in zip(body.jaxpr.constvars, body.consts):
                    inner[cv] = (inner_tag, cv)
                    self.known[inner[cv]] = c
                    self.avals[inner[cv]] = cv.aval
                self._flatten(body.jaxpr.eqns, inner, inner_tag, t)
                for v, inner_out in zip(eqn.outvars, body.jaxpr.outvars):
                    k = inner_out if _is_lit(inner_out) else inner.get(inner_out, (inner_tag, inner_out))
                    names[v] = k
                    if top is None and not _is_lit(k) and isinstance(k, tuple):
                        self.readable.setdefault(k, v)
            if top is None:
                self.top_outs[index] = [name(v) for v in eqn.outvars]

    def aval(self, k: Any) -> Any:
        return k.aval if _is_lit(k) or not isinstance(k, tuple) else self.avals.get(k, k[1].aval)

    def var(self, k: Any) -> Any:
        """The level's Var (or Literal) holding ``k``, or None for a value inside an inlined call."""
        if _is_lit(k) or not isinstance(k, tuple):
            return k
        return self.readable.get(k)

    def op_of(self, k: Any) -> _Op | None:
        i = None if _is_lit(k) else self.producer.get(k)
        return None if i is None else self.ops[i]

    def _static(self) -> set:
        """Values computed from literals and constants only (iotas, tril, finfo.min, sqrt(depth))."""
        static = set(self.known)
        for op in self.ops:
            if op.eqn.effects or op.name in _RANDOM or op.name in _CALL_BODY:
                continue
            if all(_is_lit(k) or k in static for k in op.ins) and all(
                isinstance(self.aval(k), jax.core.ShapedArray)
                and not jax.dtypes.issubdtype(self.aval(k).dtype, jax.dtypes.extended)
                for k in op.outs
            ):
                static.update(op.outs)
        return static

    def value(self, k: Any, limit: int = EVAL_LIMIT) -> np.ndarray | None:
        """The value of a static ``k`` (evaluated once, eagerly), or None."""
        if _is_lit(k):
            return np.asarray(k.val, k.aval.dtype)
        if k in self.values:
            return self.values[k]
        if k not in self.static or math.prod(self.aval(k).shape) > limit:
            return None
        if k in self.known:
            self.values[k] = np.asarray(self.known[k])
            return self.values[k]
        op = self.ops[self.producer[k]]
        args = [self.value(a, limit) for a in op.ins]
        if any(a is None for a in args):
            return None
        memo_key = _op_signature(op, [self._signature(i) for i in op.ins])
        outs = _STATIC_VALUES.get(memo_key) if memo_key is not None else None
        if outs is None and op.name in _TYPE_ONLY:
            outs = [np.asarray(a) for a in args]
        if outs is None:
            with jax.ensure_compile_time_eval():
                outs = op.eqn.primitive.bind(*args, **op.eqn.primitive.get_bind_params(op.eqn.params))
            outs = [np.asarray(o) for o in (outs if op.eqn.primitive.multiple_results else [outs])]
            if memo_key is not None:
                if sum(o.nbytes for v in _STATIC_VALUES.values() for o in v) > _STATIC_BYTES_LIMIT:
                    _STATIC_VALUES.clear()
                _STATIC_VALUES[memo_key] = outs
        for j, (key, out) in enumerate(zip(op.outs, outs)):
            self.values[key] = out
            if memo_key is not None:
                self.signatures[key] = (memo_key, j)
        return self.values[k]

    def _signature(self, k: Any) -> Any:
        """What makes a static value the same in another layer or program: a literal's value, or (for
        values computed from literals only) the ops that computed it; None for anything else."""
        if _is_lit(k):
            value = np.asarray(k.val, k.aval.dtype)
            return ("literal", value.dtype.str, value.shape, value.tobytes())
        return self.signatures.get(k)

    def scalar(self, k: Any) -> float | None:
        """A floating constant that is one number broadcast (a mask fill, a scale), or None."""
        while (op := self.op_of(k)) is not None and op.name in (
            "broadcast_in_dim",
            "reshape",
            "convert_element_type",
            *_TYPE_ONLY,
        ):
            k = op.ins[0]
        c = self.value(k, limit=4096)
        if c is None or c.size == 0 or not jnp.issubdtype(c.dtype, jnp.number):  # bfloat16 is not np.inexact
            return None
        first = c.reshape(-1)[0]
        return float(first) if np.all(c == first) else None

    def from_random(self, k: Any) -> bool:
        """Whether ``k`` is computed from random bits (a dropout mask), within a few ops."""
        todo, seen = [k], 0
        while todo and seen < _MAX_WALK:
            op = self.op_of(todo.pop())
            seen += 1
            if op is not None:
                if op.name in _RANDOM:
                    return True
                todo.extend(a for a in op.ins if not _is_lit(a))
        return False


# ---------------------------------------------------------------------------------------------------
# Axis labels. The logits' axes are ("b", j) (the j-th batch axis of the first matmul, shared by q and
# k), ("l", a) / ("r", a) (free axis a of its left / right operand), or None (a size-1 axis).
# ---------------------------------------------------------------------------------------------------

Labels = tuple


def _unit_reshape(shape: Sequence[int], labels: Labels, new_shape: Sequence[int]) -> Labels:
    """Labels after a reshape that only inserts or removes size-1 axes."""
    real = [(s, label) for s, label in zip(shape, labels) if s != 1]
    slots = [i for i, s in enumerate(new_shape) if s != 1]
    _require([s for s, _ in real] == [new_shape[i] for i in slots])
    out: list = [None] * len(new_shape)
    for i, (_, label) in zip(slots, real):
        out[i] = label
    return tuple(out)


def _forward_labels(op: _Op, labels: Labels, in_shape: Sequence[int]) -> Labels:
    """Labels of an op's output from those of the operand on the attention path."""
    out_shape = op.eqn.outvars[0].aval.shape
    p = op.eqn.params
    if op.name == "transpose":
        return tuple(labels[i] for i in p["permutation"])
    if op.name == "reshape":
        _require(p.get("dimensions") is None)
        return _unit_reshape(in_shape, labels, out_shape)
    if op.name == "squeeze":
        return tuple(label for i, label in enumerate(labels) if i not in p["dimensions"])
    if op.name == "broadcast_in_dim":  # only adding size-1 axes: no values repeated
        dims = p["broadcast_dimensions"]
        _require(all(out_shape[d] == s for d, s in zip(dims, in_shape)))
        _require(all(out_shape[i] == 1 for i in range(len(out_shape)) if i not in dims))
        out: list = [None] * len(out_shape)
        for d, label in zip(dims, labels):
            out[d] = label
        return tuple(out)
    _require(tuple(out_shape) == tuple(in_shape))  # elementwise: the path operand is not broadcast
    return labels


def _backward_labels(op: _Op, labels: Labels) -> Labels:
    """Labels of a layout op's operand from those of its output (for biases and masks)."""
    in_shape = op.eqn.invars[0].aval.shape
    p = op.eqn.params
    if op.name == "transpose":
        out: list = [None] * len(labels)
        for j, i in enumerate(p["permutation"]):
            out[i] = labels[j]
        return tuple(out)
    if op.name == "reshape":
        _require(p.get("dimensions") is None)
        return _unit_reshape(op.eqn.outvars[0].aval.shape, labels, in_shape)
    if op.name == "squeeze":
        out = list(labels)
        for d in sorted(p["dimensions"]):
            out.insert(d, None)
        return tuple(out)
    if op.name == "broadcast_in_dim":
        return tuple(labels[d] for d in p["broadcast_dimensions"])
    return labels


def _steps(shape: tuple, *steps: tuple[str, tuple]) -> Relayout:
    """A Relayout of ``steps`` from ``shape``, without those that change nothing; a transpose that only
    moves size-1 axes is a reshape (no data moves), and consecutive reshapes are one."""
    kept: list = []
    shapes = [shape]  # before each kept step, and after the last
    for op, arg in steps:
        if op == "transpose":
            moved = [i for i in arg if shape[i] != 1]
            if moved != sorted(moved):
                kept.append((op, arg))
                shape = tuple(shape[i] for i in arg)
                shapes.append(shape)
                continue
            op, arg = "reshape", tuple(shape[i] for i in arg)
        if op == "reshape" and kept and kept[-1][0] == "reshape":
            kept.pop()
            shapes.pop()
        if arg != shapes[-1]:
            kept.append((op, arg))
            shapes.append(arg)
        shape = arg
    return Relayout(tuple(kept))


def _to_groups(labels: Labels, shape: tuple, groups: list[tuple], sizes: dict, full: bool) -> Relayout:
    """From an array with labelled axes to one axis per group (a group's labels merged, in order).

    An axis whose label is in no group must have size 1. ``full``: every labelled axis has its full
    size (q, k, v); otherwise an axis may be 1 (broadcast), and a merged group is broadcast to full
    size only when one of its labels is full and another is not.
    """
    order = [label for g in groups for label in g]
    where = {label: i for i, label in enumerate(labels) if label is not None}
    for i, label in enumerate(labels):
        _require(label in order and shape[i] in (1, sizes[label]) or shape[i] == 1)
        _require(not full or label not in order or shape[i] == sizes[label])
    present = [where[label] for label in order if label in where]
    perm = tuple(present + [i for i in range(len(labels)) if i not in present])
    expanded = tuple(shape[where[label]] if label in where else 1 for label in order)
    wide, final, start = list(expanded), [], 0
    for g in groups:
        part = slice(start, start + len(g))
        if len(g) > 1 and any(s != 1 for s in wide[part]):
            wide[part] = [sizes[label] for label in g]
        final.append(math.prod(wide[part]))
        start += len(g)
    return _steps(
        tuple(shape),
        ("transpose", perm),
        ("reshape", expanded),
        ("broadcast", tuple(wide)),
        ("reshape", tuple(final)),
    )


def _from_groups(groups: list[tuple], sizes: dict, labels: Labels, shape: tuple) -> Relayout:
    """From one axis per group (the kernel output) to an array with labelled axes ``labels``."""
    order = [label for g in groups for label in g]
    split = tuple(sizes[label] for label in order)
    wanted = [label for label in labels if label in order]
    for label in labels:
        _require(label in order or label is None or sizes[label] == 1)
    _require(all(sizes[label] == 1 for label in order if label not in wanted))
    perm = tuple(
        [order.index(label) for label in wanted] + [i for i, lb in enumerate(order) if lb not in wanted]
    )
    grouped = tuple(math.prod(sizes[label] for label in g) for g in groups)
    return _steps(grouped, ("reshape", split), ("transpose", perm), ("reshape", tuple(shape)))


# ---------------------------------------------------------------------------------------------------
# One chain, found from the exp of its softmax.
# ---------------------------------------------------------------------------------------------------


# Dot algorithms that are the kernel's own contraction: 16-bit operands, float32 accumulation (what
# jax.nn.dot_product_attention asks for with bfloat16 or float16 inputs).
_KERNEL_ALGORITHMS = (
    lax.DotAlgorithmPreset.DEFAULT,
    lax.DotAlgorithmPreset.BF16_BF16_F32,
    lax.DotAlgorithmPreset.F16_F16_F32,
)


def _precision_asked(precision: Any) -> str | None:
    """What a matmul's ``precision`` asks for beyond the policy's dtypes, or None: ``precision=HIGHEST``
    (``"highest"``, ``"float32"``) on either operand asks for float32 math, and a dot algorithm other
    than the kernel's own (``_KERNEL_ALGORITHMS``) fixes other operand or accumulation dtypes. The engine
    honours both, so the kernel must not run."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)):
        found = [_precision_asked(p) for p in precision]
        return next((f for f in found if f is not None), None)
    if isinstance(precision, lax.Precision):
        return "precision=HIGHEST" if precision == lax.Precision.HIGHEST else None
    if isinstance(precision, lax.DotAlgorithmPreset) and precision in _KERNEL_ALGORITHMS:
        return None
    return f"the dot algorithm {precision}"


def _fill_after(fill: float | None, name: str, c: float | None, dtype: Any) -> float | None:
    """A masked logit's value after ``op(fill, c)`` (mul, div, add, sub or a dtype convert), rounded to
    the op's dtype as the program rounds it; None when unknown (a bias: then it varies per key)."""
    if fill is None:
        return None
    if name in ("add", "sub") and c is None:
        return fill if fill == -math.inf else None  # -inf + bias stays -inf
    dtype = np.dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else np.dtype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to -inf is the program's value too
        x, y = np.asarray(fill, dtype), np.asarray(0.0 if c is None else c, dtype)
        out = {"mul": lambda: x * y, "div": lambda: x / y, "add": lambda: x + y, "sub": lambda: x - y}
        return float(out.get(name, lambda: x)())


def _blocked_reason(lv: _Level, op: _Op) -> str:
    """Why the walk from the softmax back to the logits matmul cannot pass ``op``."""
    if op.name == "select_n" and len(op.ins) == 3:
        fills = [f for f in (lv.scalar(c) for c in op.ins[1:]) if f is not None]
        if fills:
            return (
                f"a jnp.where fill of {fills[0]:g} is above {BIG_NEGATIVE:g}: not taken for a mask "
                "(a soft mask is the program's own math)"
            )
        return "the logits pass through a jnp.where between two arrays"
    if op.name in ("mul", "div"):
        return f"the logits pass through a {op.name} by a value that is not a positive constant"
    return f"the logits pass through {op.name}"


class _Term(NamedTuple):
    key: Any
    labels: Labels
    factor: float = 1.0
    negate: bool = False


class _Chain:
    def __init__(self, level: _Level, exp_index: int) -> None:
        self.level = level
        self.exp = exp_index
        self.chain: set[int] = set()  # op indices of the chain
        self.budget = _MAX_WALK
        self.blocked: str | None = None  # why the walk back from the softmax stopped, if it did

    # -- the softmax ----------------------------------------------------------------------------

    def _through(self, k: Any, names: Sequence[str], stop: Any = None) -> tuple[Any, list[int]]:
        """Follows producers of ``k`` through ``names`` (and ``max`` with -inf) until ``stop``; returns the
        key reached and the ops passed."""
        passed: list[int] = []
        while (op := self.level.op_of(k)) is not None and (stop is None or k != stop):
            i = self.level.producer[k]
            if op.name == "max" and len(op.ins) == 2:
                consts = [self.level.scalar(a) for a in op.ins]
                if consts[0] != -np.inf and consts[1] != -np.inf:
                    break
                k = op.ins[1] if consts[0] == -np.inf else op.ins[0]
            elif op.name in names:
                k = op.ins[0]
            else:
                break
            passed.append(i)
        return k, passed

    def _softmax(self) -> tuple[Any, Any, int]:
        """(logits key, weights key, key axis) of ``exp(x - max(x)) / sum(exp(x - max(x)))``.

        The max may be taken before a transpose of x (vmap moves axes) and the sum in float32 (jnp.sum
        of 16-bit values); ``self.max_at`` keeps (the max's operand, its axes) to check the axis later.
        """
        lv = self.level
        exp = lv.ops[self.exp]
        e, x = exp.outs[0], exp.ins[0]
        self.chain.add(self.exp)
        self.max_at = None
        sub = lv.op_of(x)
        if sub is not None and sub.name == "sub":
            reached, passed = self._through(sub.ins[1], _KEEPDIMS)
            red = lv.op_of(reached)
            if red is not None and red.name == "reduce_max":
                source, _ = self._through(
                    sub.ins[0], ("transpose", "reshape", "convert_element_type"), red.ins[0]
                )
                if source == red.ins[0]:
                    self.chain.update([lv.producer[x], lv.producer[reached], *passed])
                    x, self.max_at = sub.ins[0], (red.ins[0], tuple(red.eqn.params["axes"]))
        divs = [i for i in lv.uses.get(e, []) if lv.ops[i].name == "div" and lv.ops[i].ins[0] == e]
        _require(
            len(divs) == 1 and len(lv.uses[e]) == 2, "the exp is not normalized as a softmax (exp / sum exp)"
        )
        reached, passed = self._through(lv.ops[divs[0]].ins[1], _KEEPDIMS)
        total = lv.op_of(reached)
        _require(total is not None and total.name == "reduce_sum", "the exp is not divided by its own sum")
        source, upcast = self._through(total.ins[0], ("convert_element_type",))
        axes = tuple(total.eqn.params["axes"])
        _require(source == e and len(axes) == 1, "the softmax's sum is not over one axis of the same exp")
        self.chain.update([lv.producer[reached], divs[0], *passed, *upcast])
        return x, lv.ops[divs[0]].outs[0], axes[0]

    # -- from the logits back to the first matmul ------------------------------------------------------

    def _back(self, k: Any) -> list[tuple[int, int]] | None:
        """[(op index, position of the path operand)] from the first matmul's consumer to ``k``'s producer,
        the matmul itself first as (index, -1); None if ``k`` is not computed from one that way."""
        lv = self.level
        self.budget -= 1
        op = lv.op_of(k)
        if op is None or self.budget < 0:
            return None
        i = lv.producer[k]
        if op.name == "dot_general":
            return [(i, -1)]
        candidates: list[int] = []
        if op.name in _LAYOUT:
            candidates = [0]
        elif op.name == "mul":
            candidates = [p for p in (0, 1) if (s := lv.scalar(op.ins[1 - p])) is not None and s > 0]
        elif op.name == "div":
            candidates = [0] if (s := lv.scalar(op.ins[1])) is not None and s > 0 else []
        elif op.name == "add":
            candidates = [0, 1]
        elif op.name == "sub":
            candidates = [0]
        elif op.name == "select_n" and len(op.ins) == 3:
            fills = [lv.scalar(c) for c in op.ins[1:]]
            candidates = [2 - j for j, f in enumerate(fills) if f is not None and f <= BIG_NEGATIVE]
        if op.name == "convert_element_type" and not jnp.issubdtype(lv.aval(op.outs[0]).dtype, jnp.floating):
            return None
        if not candidates and self.blocked is None:  # the first op the walk cannot pass: the explanation
            self.blocked = _blocked_reason(lv, op)
        for p in candidates:
            found = self._back(op.ins[p])
            if found is not None:
                return [*found, (i, p)]
        return None

    # -- masks ----------------------------------------------------------------------------------------

    def _classify(self, k: Any, labels: Labels, negate: bool) -> str | tuple | None:
        """ "true" (keeps everything), ("causal", query label), or None, for a constant mask."""
        c = self.level.value(k) if _is_lit(k) or k in self.level.static else None
        if c is None:
            return None
        # every layer (and every trace) checks the same mask: once per value signature and layout
        signature = self.level._signature(k)
        sizes = tuple(self.sizes[label] for label in (self.key_label, *self.q_free))
        memo = (
            None
            if signature is None
            else (signature, labels, negate, self.key_label, tuple(self.q_free), sizes)
        )
        if memo is not None and memo in _CLASSIFIED:
            return _CLASSIFIED.get(memo)
        kind = self._classify_value(c, labels, negate)
        if memo is not None:
            _CLASSIFIED[memo] = kind
        return kind

    def _classify_value(self, c: np.ndarray, labels: Labels, negate: bool) -> str | tuple | None:
        c = c.astype(bool) != negate
        if c.all():
            return "true"
        keys = [i for i, label in enumerate(labels) if label == self.key_label]
        for row_label in self.q_free:
            rows = [i for i, label in enumerate(labels) if label == row_label]
            if len(rows) != 1 or len(keys) != 1:
                continue
            r, col = rows[0], keys[0]
            if c.shape[r] != self.sizes[row_label] or c.shape[col] != self.sizes[self.key_label]:
                continue
            first = c[tuple(slice(None) if i in (r, col) else slice(0, 1) for i in range(c.ndim))]
            if not np.array_equal(np.broadcast_to(first, c.shape), c):
                continue  # varies along another axis
            plane = (
                first.reshape(c.shape[r], c.shape[col])
                if r < col
                else first.reshape(c.shape[col], c.shape[r]).T
            )
            if np.array_equal(plane, np.tril(np.ones(plane.shape, bool))):
                return ("causal", row_label)
        return None

    def _mask_terms(self, k: Any, labels: Labels, negate: bool) -> list | None:
        """The conjuncts of a boolean mask: _Term, ("causal", query label), or nothing for all-true.

        None when ``k`` cannot be read at this level and does not decompose into values that can.
        """
        lv = self.level
        op = lv.op_of(k)
        parts: list | None = None
        try:
            if op is not None and (
                op.name in ("broadcast_in_dim", "transpose", "reshape", "squeeze")
                or op.name == "convert_element_type"
                and bool in (lv.aval(op.outs[0]).dtype, lv.aval(op.ins[0]).dtype)
            ):  # layout first: a constant is then evaluated at its smallest
                parts = self._mask_terms(op.ins[0], _backward_labels(op, labels), negate)
            elif op is not None and op.name == "ne" and lv.scalar(op.ins[1]) == 0:
                parts = self._mask_terms(op.ins[0], labels, negate)
            elif (kind := self._classify(k, labels, negate)) is not None:
                parts = [] if kind == "true" else [kind]
            elif op is None:
                pass
            elif op.name == "not" and lv.aval(k).dtype == bool:
                parts = self._mask_terms(op.ins[0], labels, not negate)
            elif (op.name == "and" and not negate) or (op.name == "or" and negate):
                a, b = (self._mask_terms(x, labels, negate) for x in op.ins)
                parts = None if a is None or b is None else a + b
            elif op.name == "select_n" and len(op.ins) == 3 and not negate and lv.scalar(op.ins[1]) == 0:
                a, b = (self._mask_terms(x, labels, negate) for x in (op.ins[0], op.ins[2]))  # pred & case 1
                parts = None if a is None or b is None else a + b
        except _NoMatch:
            parts = None
        if parts is not None:
            return parts
        return [_Term(k, labels, negate=negate)] if lv.var(k) is not None else None

    def _bias_term(self, k: Any, labels: Labels, factor: float) -> _Term:
        """A bias with its size-1 broadcasts looked through, at a value the level can read."""
        lv = self.level
        best = _Term(k, labels, factor) if lv.var(k) is not None else None
        while (op := lv.op_of(k)) is not None and op.name in (
            "broadcast_in_dim",
            "transpose",
            "reshape",
            "squeeze",
        ):
            try:
                labels = _backward_labels(op, labels)
            except _NoMatch:
                break
            k = op.ins[0]
            if lv.var(k) is not None:
                best = _Term(k, labels, factor)
        _require(best is not None)
        return best

    # -- the whole chain --------------------------------------------------------------------------------

    def match(self) -> AttentionMatch:
        logits, weights, axis = self._softmax()
        labels = self._logits_path(logits, axis)
        rows = self._masks()
        labels = self._to_value_matmul(weights, labels)
        out_labels = self._value_matmul(labels)
        return self._emit(rows, out_labels)

    def _logits_path(self, logits: Any, axis: int) -> Labels:
        """Finds the first matmul, labels the logits' axes, and collects the scales, biases and mask
        sites on the way to the softmax; returns the labels of the softmax's input."""
        lv = self.level
        path = self._back(logits)
        _require(path is not None, self.blocked or "the softmax's input is not computed from a matmul")
        self.dot1 = lv.ops[path[0][0]]
        self.chain.add(path[0][0])
        (lc, rc), (lb, rb) = self.dot1.eqn.params["dimension_numbers"]
        lhs, rhs = (lv.aval(k).shape for k in self.dot1.ins)
        self.free = {
            "l": [a for a in range(len(lhs)) if a not in (*lc, *lb)],
            "r": [a for a in range(len(rhs)) if a not in (*rc, *rb)],
        }
        self.batch_labels = [("b", j) for j in range(len(lb))]
        self.depth = tuple(("c", j) for j in range(len(lc)))
        labels: Labels = (
            *self.batch_labels,
            *(("l", a) for a in self.free["l"]),
            *(("r", a) for a in self.free["r"]),
        )
        self.sizes = {("b", j): lhs[a] for j, a in enumerate(lb)}
        self.sizes.update({("l", a): lhs[a] for a in self.free["l"]})
        self.sizes.update({("r", a): rhs[a] for a in self.free["r"]})
        self.sizes.update({("c", j): lhs[a] for j, a in enumerate(lc)})

        self.scale, self.sites, self.biases, self.mask_sites = 1.0, [], [], []
        # per mask site, the value its masked logits have when they reach the softmax (None: it varies)
        self.fills: list[float | None] = []
        labels_at = {self.dot1.outs[0]: labels}
        for i, p in path[1:]:
            op = lv.ops[i]
            self.chain.add(i)
            new = _forward_labels(op, labels, lv.aval(op.ins[p]).shape)
            dtype = lv.aval(op.outs[0]).dtype
            if op.name in ("mul", "div"):
                c = lv.scalar(op.ins[1 - p])
                s = c if op.name == "mul" else 1.0 / c
                self.scale *= s
                self.biases = [b._replace(factor=b.factor * s) for b in self.biases]  # added before: scaled
                self.sites.append("logits")
                self.fills = [_fill_after(f, op.name, c, dtype) for f in self.fills]
            elif op.name in ("add", "sub"):
                other = op.ins[1 - p]
                rank = lv.aval(other).ndim
                _require(rank in (0, len(labels)), "a bias of lower rank than the logits")
                factor = -1.0 if op.name == "sub" else 1.0
                self.biases.append(self._bias_term(other, labels if rank else (), factor))
                c = lv.scalar(other)  # a constant shift moves a fill exactly; a bias makes it vary per key
                self.fills = [_fill_after(f, op.name, c, dtype) for f in self.fills]
            elif op.name == "select_n":
                self.mask_sites.append((op.ins[0], labels, p == 1))  # the path in case 0: the pred drops keys
                self.fills.append(_fill_after(lv.scalar(op.ins[3 - p]), "convert", None, dtype))
            elif op.name == "convert_element_type":
                self.fills = [_fill_after(f, "convert", None, dtype) for f in self.fills]
            labels = labels_at[op.outs[0]] = new

        self.key_label = labels[axis]
        _require(
            self.key_label is not None and self.key_label[0] in "lr",
            "the softmax is not over a free axis of the logits matmul",
        )
        if self.max_at is not None:  # the softmax's max was over the key axis too
            before, axes = self.max_at
            _require(
                before in labels_at and [labels_at[before][a] for a in axes] == [self.key_label],
                "the softmax's max is over other axes than its sum",
            )
        self.key_side = self.key_label[0]
        self.q_side = "r" if self.key_side == "l" else "l"
        others = [
            (self.key_side, a) for a in self.free[self.key_side] if (self.key_side, a) != self.key_label
        ]
        _require(all(self.sizes[label] == 1 for label in others), "the key side has more than one long axis")
        self.q_free = [(self.q_side, a) for a in self.free[self.q_side]]
        # the sequence, and a head group
        _require(sum(self.sizes[label] > 1 for label in self.q_free) <= 2, "more than two long query axes")
        return labels

    def _masks(self) -> Any:
        """Splits the masks into terms for the kernel and a causal one; returns the causal mask's query
        label, or None. Sets ``mask_value`` (the one value every masked logit has at the softmax, or
        None when nothing is masked) and ``fill_problem`` (why there is no such value, or None)."""
        self.masks, causal, fills = [], set(), set()
        for (pred, labels, negate), fill in zip(self.mask_sites, self.fills):
            parts = self._mask_terms(pred, labels, negate)
            _require(parts is not None, "a mask that is computed inside the chain or cannot be read")
            for part in parts:
                if isinstance(part, _Term):
                    self.masks.append(part)
                else:
                    causal.add(part[1])
            if parts:
                fills.add(fill)
        _require(len(causal) <= 1, "causal masks along two query axes")
        self.mask_value, self.fill_problem = None, None
        if None in fills:
            self.fill_problem = (
                "a bias is added after a mask with a finite fill (masked logits differ per key)"
            )
        elif len(fills) > 1:
            values = ", ".join(f"{f:g}" for f in sorted(fills))
            self.fill_problem = f"masks with different fill values ({values}); the kernel takes one"
        elif fills and (math.isnan(f := next(iter(fills))) or f == math.inf):
            self.fill_problem = f"masked logits are {f:g} at the softmax"
        elif fills:
            self.mask_value = next(iter(fills))
        return next(iter(causal), None)

    def _to_value_matmul(self, weights: Any, labels: Labels) -> Labels:
        """Follows the weights to the second matmul (through layout ops and a dropout) and returns the
        labels of its weights operand."""
        lv = self.level
        self.dropout, k, modified = False, weights, False
        while True:
            steps = [i for i in lv.uses.get(k, []) if lv.ops[i].name in _WEIGHT_STEPS]
            _require(len(steps) == 1, "the attention weights do not reach exactly one matmul")
            op = lv.ops[steps[0]]
            self.chain.add(steps[0])
            if op.name == "dot_general":
                # weights changed otherwise: not attention we know
                _require(not modified or self.dropout, "the weights are changed before the value matmul")
                self.dot2 = op
                _require(op.ins.count(k) == 1)
                self.weights_pos = op.ins.index(k)
                return labels
            p = op.ins.index(k)
            if op.name in ("mul", "div", "select_n"):  # changes the weights: only a dropout is known
                _require((op.name, p) not in (("div", 1), ("select_n", 0)))
                _require(tuple(lv.aval(op.outs[0]).shape) == tuple(lv.aval(k).shape))
                others = [a for j, a in enumerate(op.ins) if j != p and not _is_lit(a)]
                self.dropout = self.dropout or any(lv.from_random(a) for a in others)
                modified = True
            else:
                labels = _forward_labels(op, labels, lv.aval(k).shape)
            k = op.outs[0]

    def _value_matmul(self, labels: Labels) -> Labels:
        """Labels the value operand of the second matmul and returns the labels of its output."""
        lv = self.level
        (cl, cr), (bl, br) = self.dot2.eqn.params["dimension_numbers"]
        w_c, v_c, w_b, v_b = (cl, cr, bl, br) if self.weights_pos == 0 else (cr, cl, br, bl)
        self.v_key = self.dot2.ins[1 - self.weights_pos]
        shape = lv.aval(self.v_key).shape
        _require(
            len(w_c) == 1 and labels[w_c[0]] == self.key_label,
            "the value matmul does not contract the key axis",
        )
        batch = [labels[a] for a in w_b]
        _require(sorted(batch) == sorted(label for label in self.batch_labels if label in labels))
        _require(all(label in batch or self.sizes[label] == 1 for label in self.batch_labels))
        w_free = [labels[a] for a in range(len(labels)) if a not in (*w_c, *w_b)]
        _require(all(label is None or label[0] == self.q_side for label in w_free))
        _require(all(self.sizes[label] == 1 or label in labels for label in self.q_free))
        v_free = [a for a in range(len(shape)) if a not in (*v_c, *v_b)]
        v_labels: list = [None] * len(shape)
        for wa, va in zip(w_b, v_b):
            v_labels[va] = labels[wa]
        v_labels[v_c[0]] = self.key_label
        for j, a in enumerate(v_free):
            v_labels[a] = ("v", j)
            self.sizes[("v", j)] = shape[a]
        self.v_labels = tuple(v_labels)
        self.value_depth = tuple(("v", j) for j in range(len(v_free)))
        free = [*w_free, *self.value_depth] if self.weights_pos == 0 else [*self.value_depth, *w_free]
        return (*batch, *free)

    def _emit(self, causal_rows: Any, out_labels: Labels) -> AttentionMatch:
        """Chooses the kernel layout and builds the match."""
        lv, sizes = self.level, self.sizes
        (lc, rc), (lb, rb) = self.dot1.eqn.params["dimension_numbers"]
        q_pos = 0 if self.q_side == "l" else 1
        q_batch = lb if q_pos == 0 else rb
        # the query sequence axis: the causal mask's rows, else the first long query axis; a second one
        # is a group of query heads sharing a k/v head (jax's grouped-query layout [B, T, K, G, D])
        big = [label for label in self.q_free if sizes[label] > 1]
        rows = causal_rows or (big or self.q_free)[0]
        group = next((label for label in big if label != rows), None)
        # the heads: a batch axis after the sequence in q ([B, T, H, D]), else the last batch axis
        q_axis = dict(zip(self.q_free, self.free[self.q_side]))
        after = [("b", j) for j, a in enumerate(q_batch) if a > q_axis[rows]]
        heads = (after or self.batch_labels or [None])[-1]
        batch = [(label,) for label in self.batch_labels if label != heads]
        hq = tuple(x for x in (heads, group) if x is not None)
        hk = (heads,) if heads is not None else ()

        q_key, q_labels = self._input("query", q_pos, lb if q_pos == 0 else rb, lc if q_pos == 0 else rc)
        k_key, k_labels = self._input("key", 1 - q_pos, rb if q_pos == 0 else lb, rc if q_pos == 0 else lc)

        def operand(key: Any, labels: Labels, groups: list, full: bool, **extra: Any) -> Operand:
            var = lv.var(key)
            _require(var is not None)
            return Operand(var, _to_groups(labels, tuple(lv.aval(key).shape), groups, sizes, full), **extra)

        extra = [*batch, hq, (rows,), (self.key_label,)]
        out = self.dot2.outs[0]
        return AttentionMatch(
            query=operand(q_key, q_labels, [*batch, (rows,), hq, self.depth], True),
            key=operand(k_key, k_labels, [*batch, (self.key_label,), hk, self.depth], True),
            value=operand(self.v_key, self.v_labels, [*batch, (self.key_label,), hk, self.value_depth], True),
            biases=tuple(operand(b.key, b.labels, extra, False, factor=b.factor) for b in self.biases),
            masks=tuple(operand(m.key, m.labels, extra, False, negate=m.negate) for m in self.masks),
            scale=float(self.scale),
            scale_sites=tuple(self.sites),
            is_causal=causal_rows is not None,
            dropout=self.dropout,
            fallback=self._fallback(out, [self.v_key, *(t.key for t in self.biases + self.masks)]),
            out=out,
            out_layout=_from_groups(
                [*batch, (rows,), hq, self.value_depth], sizes, out_labels, tuple(lv.aval(out).shape)
            ),
            eqns=frozenset(lv.ops[i].top for i in self.chain),
            emit_at=self.dot2.top,
            precision=(self.dot1.eqn.params.get("precision"), self.dot2.eqn.params.get("precision")),
            mask_value=self.mask_value,
        )

    def _input(self, role: str, pos: int, batch_axes: Sequence[int], contract: Sequence[int]) -> tuple:
        """(key, labels) of q or k: the matmul's operand, or the operand of a constant scale just before
        it, which then belongs to the kernel's scale."""
        lv = self.level
        key = self.dot1.ins[pos]
        side = "l" if pos == 0 else "r"
        op = lv.op_of(key)
        if (
            op is not None
            and op.name in ("mul", "div")
            and not op.inlined
            and key not in lv.outputs
            and len(lv.uses[key]) == 1
        ):
            p = 0 if op.name == "div" or lv.scalar(op.ins[0]) is None else 1
            s = lv.scalar(op.ins[1 - p])
            if s and tuple(lv.aval(op.ins[p]).shape) == tuple(lv.aval(key).shape):
                self.scale *= s if op.name == "mul" else 1.0 / s
                self.sites.insert(0, role)
                self.chain.add(lv.producer[key])
                key = op.ins[p]
        labels: list = [(side, a) for a in range(lv.aval(key).ndim)]
        for j, a in enumerate(batch_axes):
            labels[a] = ("b", j)
        for j, a in enumerate(contract):
            labels[a] = ("c", j)
        return key, tuple(labels)

    def _fallback(self, final: Any, inputs: list) -> str | None:
        """Why the kernel cannot replace the chain, or None."""
        lv = self.level
        made = {k for i in self.chain for k in lv.ops[i].outs}
        # ``s + s``: no input of the kernel
        _require(not any(not _is_lit(k) and k in made for k in inputs), "an input is computed from the chain")
        for name, dot in (("logits", self.dot1), ("value", self.dot2)):
            asked = _precision_asked(dot.eqn.params.get("precision"))
            if asked is not None:
                return f"{asked} requested on the {name} matmul: the program runs as written"
        if self.fill_problem is not None:
            return self.fill_problem
        if self.dropout:
            return "dropout on the attention weights (the kernel forms no weights to drop)"
        for k in made - {final}:
            if k in lv.outputs or any(i not in self.chain for i in lv.uses.get(k, [])):
                return "the attention weights or logits are also used outside it (returned, sown or read)"
        for t in {lv.ops[i].top for i in self.chain}:
            for k in lv.top_outs[t]:
                if not _is_lit(k) and k not in made and (k in lv.outputs or lv.uses.get(k)):
                    return "a call inside the attention also computes values used elsewhere"
        return None
