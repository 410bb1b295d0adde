"""``precision_report``: where a 16-bit (or fp8) run of a model loses range or precision, per module.

The model runs twice in one compiled program, forward and backward: under a float32 policy (the
reference) and under the policy being checked (with its loss scale and fp8 recipe). Both runs evaluate
the same traced program (``engine.transform(..., observe=)``), so the engine hands the observer the
same operations in the same order, and each observation of the 16-bit run has its float32 twin.

At every top-level operation the observer keeps the output and adds a zero *probe* to it; the gradient
of the (scaled) loss with respect to that probe is the cotangent the backward pass carries there, in
the dtype the operation ran in. From the pairs of values the report counts, per group of operations
(a module or named scope, and an operation kind such as ``matmul``, ``logits`` or ``add``):

* ``max_abs``: the largest finite magnitude of the float32 values;
* ``headroom_bits``: doublings left between ``max_abs`` and the largest value of the dtype the
  operation ran in (negative: it does not fit);
* ``overflow``, ``underflow``, ``subnormal``: the fractions of the float32 values that become inf,
  zero, or subnormal when rounded to that dtype (Micikevicius et al., 2018, "Mixed Precision
  Training", Figure 2, per layer);
* ``nonfinite``: the fraction the 16-bit run actually produced as inf/NaN where float32 is finite;
* ``error``: the relative error ``|low - ref|_2 / |ref|_2`` of the 16-bit values (the largest over
  the group's operations); ``abs_error``: ``|low - ref|_2`` over all of the group's values.

Gradients are measured the same way on the cotangents, multiplied by the loss scale as the real step
sees them. A relative error needs a reference that is not itself noise: a key bias's exact gradient is
zero (it shifts a whole softmax row), and float32 computes it as a sum that cancels to ~1e-9 of
rounding, against which any 16-bit run is "1e3 off". So the float32 backward pass runs a second time
with its loss cotangent times 3 (every cotangent divided by 3 again): the same gradients in exact
arithmetic, rounded elsewhere. An operation (or argument) whose float32 gradient moves by
``report_format.NOISE`` (2^-4) of its norm or more is rounding noise (``noise``: the fraction of the
group's gradient values that are): fewer of its bits are reliable than either 16-bit format keeps.
Its values count in no ``underflow``, ``subnormal`` or ``error``; a row with no relative error left
ranks after those with one, by ``abs_error``. The forward pass runs once: activations have no noise.

Values at or beyond ``2**120`` in float32 (``finfo.min`` used as a mask) are sentinels that become
-inf on purpose: they are not counted.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jmp_lite._src import interpret, primitive_rules
from jmp_lite._src.base import validate
from jmp_lite._src.base.policy import Policy, get_policy
from jmp_lite._src.engine import attention_pattern, engine
from jmp_lite._src.fp8.fp8 import Fp8State
from jmp_lite._src.optim.loss_scale import LossScale
from jmp_lite._src.tools import report_format
from jmp_lite._src.tools.diagnostics import gradient_diagnostics, replicated
from jmp_lite._src.tools.memory import clean_scope

__all__ = ["Measurements", "PrecisionReport", "precision_report"]

_F32 = np.dtype(np.float32)
_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_MEASURED = (*_HALF, _F32)
_F32_TINY = float(np.finfo(np.float32).tiny)
SENTINEL = 2.0**120
# Ops a softmax's input passes through on its way from a contraction to ``exp`` (scaling, masking,
# ``x - max(x)``): the contraction's result is then the softmax's logits.
_TO_EXP = attention_pattern.SOFTMAX_LOGIT_STEPS
_CONTRACTIONS = {lax.dot_general_p.name: "matmul", lax.conv_general_dilated_p.name: "conv"}  # report kinds
# Ops that only move or repeat their operand's values (measured where they were made); stop_gradient's
# cotangent is zero by definition.
_MOVES = primitive_rules.MOVES
ROOT = "(root)"


def _measured(dtype: Any) -> bool:
    """A 16-bit or float32 value (PRNG keys and other extended dtypes are not numbers)."""
    return not jnp.issubdtype(dtype, jax.dtypes.extended) and np.dtype(dtype) in _MEASURED


class Measurements(NamedTuple):
    """Per group of operations, arrays of shape ``[groups]`` (see ``PrecisionReport``).

    ``count`` values were measured; ``max_abs`` is the largest finite float32 magnitude;
    ``headroom_bits`` the doublings between it and the dtype's largest value (``inf`` for all
    zeros); ``overflow``, ``underflow``, ``subnormal``, ``nonfinite`` are fractions of ``count``;
    ``error`` is the largest relative error of the group's operations. ``onset`` is the program
    position of the group's first operation (for gradients: the last, as the backward pass runs in
    reverse) whose values overflow or turn non-finite (``inf`` when none does). ``noise`` is the
    fraction of ``count`` whose float32 gradient is rounding noise (gradients only: 0 for
    activations), left out of ``underflow``, ``subnormal`` and ``error``; ``abs_error`` is
    ``|low - ref|_2`` over all of the group's values (the measure of a row that is all noise).
    """

    count: jax.Array
    max_abs: jax.Array
    headroom_bits: jax.Array
    overflow: jax.Array
    underflow: jax.Array
    subnormal: jax.Array
    nonfinite: jax.Array
    error: jax.Array
    onset: jax.Array
    noise: jax.Array
    abs_error: jax.Array


class Group(NamedTuple):
    """What one row of a report measures (static: it is part of the report's tree structure)."""

    name: str  # "path [kind]"
    path: str  # module path or named scope ("" at the root)
    kind: str  # "matmul", "conv", "logits", "softmax", "ops", "params" or "argument"
    dtypes: str  # the dtypes its operations ran in, e.g. "float16" or "float16+float32"
    order: int  # program order of its first operation (arguments after all operations)
    primitives: tuple[str, ...] = ()  # the primitives of its operations (for rules outside any scope)
    instance: str = ""  # the module instance, when a scope is called by several (``arg0.blocks[0].attn``)


class Source(NamedTuple):
    """Where a report came from: what ``suggest_rules`` needs to write rules for it (static)."""

    front_end: str  # "autocast", "linen" or "nnx"
    policy: Policy
    rules: tuple  # the front-end's rules: ((key, value), ...)
    loss_scaled: bool  # a loss scale other than 1 was given
    fp8: str | None
    fp8_states: int = 0  # arrays of fp8 scaling state among the arguments: not measured (no rows)
    unmeasured: tuple[str, ...] = ()  # floating arrays closed over where a report cannot lift them


@jax.tree_util.register_pytree_node_class
class PrecisionReport:
    """What ``precision_report`` returns: a pytree of arrays (``jit``-friendly) with its table.

    Fields: ``activations`` and ``gradients`` (``Measurements``, one entry per group), ``loss``
    (float32 and 16-bit: ``[2]``), ``loss_scale``, and over all 16-bit gradient values (unscaled,
    float32 run): ``gradient_histogram`` (counts per ``floor(log2 |g|)`` in ``log2_bins``),
    ``gradient_max`` and ``recommended_scale`` (``jmp_lite.gradient_diagnostics``). ``groups`` and
    ``source`` are static.

    Worst first (``ranking``): overflow and non-finite values, then underflow, then error. In detail:
    groups whose float32 activations overflow the dtype they ran in, then groups whose checked forward
    pass turned non-finite, both in order of ``onset`` (where it started: the first one is the
    cause, those after it inherit it); then groups whose scaled gradients overflow, then groups
    whose gradients turned non-finite, both latest ``onset`` first (the backward pass runs the
    program in reverse); then underflow, activations or gradients (the larger fraction first); then
    the rest by relative error (the larger first); last the rows with no relative error, by the
    absolute error of their gradients: those whose float32 gradients are all rounding noise
    (``gradients.noise`` 1, a key bias's) and those that are exact.

    Example:
        >>> import json, jax, jax.numpy as jnp, jmp_lite
        >>> def loss(w, x):
        ...     with jax.named_scope("layer"):
        ...         y = (x @ w) * (x @ w)  # 400 * 400: past float16's 65504, not bfloat16's
        ...     return jnp.mean(jnp.tanh(y))
        >>> w, x = jnp.full((4, 4), 100.0, jnp.float32), jnp.ones((2, 4), jnp.float32)
        >>> report = jmp_lite.precision_report(loss, "p=f32,c=bf16,o=f32")(w, x)
        >>> float(report.activations.overflow.max()), report.groups[1].dtypes
        (0.0, 'bfloat16')
        >>> logged = json.loads(report.to_json())
        >>> logged["policy"], sorted(logged["groups"][0]["activations"])[:3]
        ('p=f32,c=bf16,o=f32', ['abs_error', 'count', 'error'])
    """

    def __init__(
        self,
        activations: Measurements,
        gradients: Measurements,
        loss: jax.Array,
        loss_scale: jax.Array,
        gradient_histogram: jax.Array,
        log2_bins: jax.Array,
        gradient_max: jax.Array,
        recommended_scale: jax.Array,
        groups: tuple[Group, ...],
        source: Source,
    ) -> None:
        self.activations = activations
        self.gradients = gradients
        self.loss = loss
        self.loss_scale = loss_scale
        self.gradient_histogram = gradient_histogram
        self.log2_bins = log2_bins
        self.gradient_max = gradient_max
        self.recommended_scale = recommended_scale
        self.groups = groups
        self.source = source

    _ARRAYS = ("activations", "gradients", "loss", "loss_scale", "gradient_histogram", "log2_bins",
               "gradient_max", "recommended_scale")  # fmt: skip

    def tree_flatten(self) -> tuple[tuple, tuple]:
        """The measured arrays are the leaves; group names and the source are static."""
        return tuple(getattr(self, f) for f in self._ARRAYS), (self.groups, self.source)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> PrecisionReport:
        """The inverse of ``tree_flatten`` (JAX calls it when a report leaves ``jit``)."""
        return cls(*children, *aux)

    @property
    def names(self) -> list[str]:
        """The group names, in program order (arguments last)."""
        return [g.name for g in self.groups]

    def ranking(self) -> list[str]:
        """The group names, worst first (the order is in the class docstring)."""
        return [self.groups[i].name for i in report_format.ranked(self)]

    def table(self, top: int | None = 20) -> str:
        """The ranked table as plain text (``top`` rows; ``None``: all)."""
        return report_format.plain_table(self, top)

    def show(self, top: int | None = 20) -> None:
        """Prints the ranked table: with ``rich`` in a terminal when it is installed, else plain text."""
        report_format.show(self, top)

    def to_dict(self) -> dict[str, Any]:
        """Everything in the report as plain Python values, groups worst first."""
        return report_format.to_dict(self)

    def to_json(self) -> str:
        """``to_dict()`` as JSON; non-finite numbers are the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
        return report_format.to_json(self)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"PrecisionReport({len(self.groups)} groups, {self.source.front_end}, {self.source.policy})"


class _Op(NamedTuple):
    path: str
    kind: str
    dtype: np.dtype
    shape: tuple
    out: Any  # the jaxpr variable it defines
    ins: tuple  # the variables it reads
    primitive: str  # the primitive's name (what a rule outside any scope names)
    position: int  # which equation of the program it is (of ``_Observation.calls``)


class _Observation:
    """One run's operations (Python, static) and values (traced), in program order."""

    def __init__(self, probes: Sequence[jax.Array] | None, clean: Callable[[str], str]) -> None:
        self.probes, self.clean = probes, clean
        self.ops: list[_Op] = []
        self.values: list[jax.Array] = []
        self.links: dict = {}  # a variable -> the variable it is (marks, jit boundaries)
        self.calls: list[tuple[str, str]] = []  # every equation seen: (primitive, group path)

    def __call__(self, eqn: Any, outs: list, decision: Any) -> list:
        name = eqn.primitive.name
        path = self.clean(str(source_info_util.current_name_stack()))
        position = len(self.calls)
        self.calls.append((name, path))
        if name in primitive_rules.INLINED:  # its body's operations were observed one by one
            inner = eqn.params[primitive_rules.SUBPROGRAMS[name]].jaxpr
            self.links.update(_pairs(eqn.outvars, inner.outvars))
            self.links.update(_pairs(inner.invars, eqn.invars))
            return outs
        if eqn.primitive is engine.mark_p or name in _MOVES:  # the same values as their operand's
            self.links.update(_pairs(eqn.outvars, eqn.invars[:1]))
            return outs
        ins = tuple(v for v in eqn.invars if not isinstance(v, jcore.Literal))
        new = []
        for var, out in zip(eqn.outvars, outs):
            if hasattr(out, "dtype") and _measured(out.dtype) and out.size:
                k = len(self.values)
                kind = _CONTRACTIONS.get(name, name)
                self.ops.append(_Op(path, kind, np.dtype(out.dtype), out.shape, var, ins, name, position))
                self.values.append(lax.stop_gradient(out))
                if self.probes is not None:
                    if k >= len(self.probes):
                        raise _Mismatch(k)
                    out = out + self.probes[k].astype(out.dtype)
            new.append(out)
        return new


class _Mismatch(Exception):
    pass


def _pairs(keys: Sequence[Any], values: Sequence[Any]) -> list[tuple]:
    return [
        (k, v)
        for k, v in zip(keys, values)
        if not isinstance(k, jcore.Literal) and not isinstance(v, jcore.Literal)
    ]


def _observe(eqn: Any, outs: list, decision: Any) -> list:
    """The observer every reporting program is built with: hands each op to the current observation."""
    current = engine.context().observation
    return outs if current is None else current(eqn, outs, decision)


def _kinds(obs: _Observation) -> list[str]:
    """Each op's kind: ``matmul``/``conv`` for contractions, ``logits`` for a contraction whose result
    reaches an ``exp`` through ``_TO_EXP`` ops (scaling, masking, ``x - max(x)``), ``softmax`` for those
    ops, the ``exp`` and the normalization after it, ``ops`` for everything else."""
    producer = {op.out: i for i, op in enumerate(obs.ops)}
    readers: dict[int, list[int]] = {}

    def source(v: Any) -> int | None:
        for _ in range(64):  # through marks and jit boundaries
            if v in producer:
                return producer[v]
            if v not in obs.links:
                return None
            v = obs.links[v]
        return None

    for j, op in enumerate(obs.ops):
        for v in op.ins:
            i = source(v)
            if i is not None:
                readers.setdefault(i, []).append(j)
    kinds = [op.kind if op.kind in ("matmul", "conv") else "ops" for op in obs.ops]
    for e, op in enumerate(obs.ops):
        if op.kind not in attention_pattern.EXPONENTIALS:
            continue
        back, seen = [e], set()
        while back and len(seen) < 64:  # the logits and the ops between them and the exp
            i = back.pop()
            if i in seen:
                continue
            seen.add(i)
            if obs.ops[i].kind in ("matmul", "conv"):
                kinds[i] = "logits"
                continue
            if i == e or obs.ops[i].kind in _TO_EXP:
                kinds[i] = "softmax"
                back.extend(j for j in map(source, obs.ops[i].ins) if j is not None)
        ahead = list(readers.get(e, ()))
        while ahead and len(seen) < 128:  # the sum of the exponentials and the division by it
            i = ahead.pop()
            if i in seen or obs.ops[i].kind not in _NORMALIZE:
                continue
            seen.add(i)
            kinds[i] = "softmax"
            ahead.extend(readers.get(i, ()))
    return kinds


_NORMALIZE = attention_pattern.SOFTMAX_NORMALIZE


def _cleaner(strip: str | None) -> Callable[[str], str]:
    """A name stack -> the group path: JAX's transformation wrappers and the engine's marks removed,
    einsum subscripts dropped (the kind says what the op is), the model's own root name removed (a
    Flax model's scopes then spell module paths, as apply_policy's path rules do)."""

    @functools.lru_cache(maxsize=4096)
    def clean(name_stack: str) -> str:
        parts = [p for p in clean_scope(name_stack).split("/") if p and "->" not in p]
        if strip is not None and parts and parts[0] == strip:
            parts = parts[1:]
        return "/".join(parts)

    return clean


class _Values(NamedTuple):
    """The values of one measured point in both runs, and the dtype the checked run held it in;
    ``again``: the float32 values once more, rounded differently (``_again``; gradients only)."""

    low: jax.Array
    ref: jax.Array
    dtype: np.dtype
    again: jax.Array | None = None


# A second float32 backward pass seeds the loss's cotangent with 3 times the first's, then divides every
# cotangent by 3: the same gradients in exact arithmetic, but every rounding of the pass lands elsewhere.
# Where the two passes disagree by report_format.NOISE of the first's norm or more, the float32 gradient
# is rounding noise, and a relative error against it is noise over noise.
_REROUND = 3.0


def _again(vjp: Callable[[jax.Array], tuple], seed: jax.Array) -> tuple:
    """The cotangents of ``vjp`` at ``seed``, computed as ``vjp(3 * seed) / 3``."""
    return jax.tree_util.tree_map(lambda c: c / jnp.asarray(_REROUND, c.dtype), vjp(seed * _REROUND))


def _per_op(points: list[_Values]) -> jax.Array:
    """``[ops, 8]``: count, max_abs, headroom, overflow, underflow, subnormal, nonfinite (counts) and
    relative error per point. The points of one dtype are concatenated and reduced by segment, so the
    program has a fixed number of operations however many points there are."""
    out = [None] * len(points)
    for dtype in sorted({p.dtype for p in points}, key=str):
        index = [i for i, p in enumerate(points) if p.dtype == dtype]
        sizes = np.asarray([points[i].low.size for i in index])
        low = jnp.concatenate([replicated(points[i].low.astype(_F32)).ravel() for i in index])
        ref = jnp.concatenate([replicated(points[i].ref.astype(_F32)).ravel() for i in index])
        twice = [points[i].ref if points[i].again is None else points[i].again for i in index]
        again = jnp.concatenate([replicated(x.astype(_F32)).ravel() for x in twice])
        seg = _segment_ids(sizes)
        for k, row in zip(index, _segment_stats(low, ref, again, seg, len(index), dtype, sizes)):
            out[k] = row
    return jnp.stack(out)


def _segment_ids(sizes: np.ndarray) -> jax.Array:
    """``k`` for each of the ``sizes[k]`` values of point ``k``, computed at run time: XLA would fold a
    constant expression into a constant as large as all the values, slowly (a barrier keeps it out)."""
    starts = np.cumsum(sizes)[:-1]
    marks = lax.optimization_barrier(jnp.zeros(int(sizes.sum()), jnp.int32))
    return jnp.cumsum(marks.at[starts].add(1))


def _segment_stats(
    low: jax.Array,
    ref: jax.Array,
    again: jax.Array,
    seg: jax.Array,
    n: int,
    dtype: np.dtype,
    sizes: np.ndarray,
) -> jax.Array:
    finfo = jnp.finfo(dtype)
    real = jnp.isfinite(ref) & (jnp.abs(ref) < SENTINEL)
    mag = jnp.where(real & (jnp.abs(ref) >= _F32_TINY), jnp.abs(ref), 0.0)  # XLA flushes float32 denormals
    rounded = mag.astype(dtype).astype(_F32)
    masks = [
        real & ~jnp.isfinite(rounded),  # overflow
        (mag > 0) & (rounded < _F32_TINY),  # underflow
        (rounded >= _F32_TINY) & (rounded < float(finfo.tiny)),  # subnormal
        real & ~jnp.isfinite(low),  # non-finite in the checked run
    ]
    counts = [jax.ops.segment_sum(m.astype(_F32), seg, n) for m in masks]
    top = jax.ops.segment_max(mag, seg, n).clip(0.0)
    scale = jnp.maximum(top, _F32_TINY)
    raw = jnp.where(real & jnp.isfinite(low), low - ref, 0.0)
    off = jnp.sqrt(jax.ops.segment_sum(jnp.square(raw / scale[seg]), seg, n))
    norm = jnp.sqrt(jax.ops.segment_sum(jnp.square(mag / scale[seg]), seg, n))
    largest = jnp.maximum(jax.ops.segment_max(jnp.abs(raw), seg, n), _F32_TINY)
    absolute = largest * jnp.sqrt(jax.ops.segment_sum(jnp.square(raw / largest[seg]), seg, n))
    moved = jnp.where(real & jnp.isfinite(again), again - ref, 0.0) / scale[seg]
    wobble = jnp.sqrt(jax.ops.segment_sum(jnp.square(moved), seg, n))  # float32's own rounding
    noise = (wobble >= report_format.NOISE * norm) & ((norm > 0) | (off > 0))
    error = jnp.where(norm > 0, off / jnp.maximum(norm, _F32_TINY), jnp.where(off > 0, jnp.inf, 0.0))
    error = jnp.where(counts[3] > 0, jnp.inf, jnp.where(noise, 0.0, error))
    counts[1] = jnp.where(noise, 0.0, counts[1])  # a noise value that flushes to zero loses nothing
    counts[2] = jnp.where(noise, 0.0, counts[2])
    headroom = jnp.where(top > 0, np.log2(float(finfo.max)) - jnp.log2(scale), jnp.inf)
    sizes = jnp.asarray(sizes, _F32)
    return jnp.stack([sizes, top, headroom, *counts, error, jnp.where(noise, sizes, 0.0), absolute], axis=1)


def _grouped(table: jax.Array, ids: np.ndarray, n: int, last: bool) -> Measurements:
    """Per-op rows summed into groups; ``onset`` is the first (``last``: the latest) op with a problem."""
    ids = jnp.asarray(ids)
    total = jax.ops.segment_sum(table, ids, n)
    count = total[:, 0]
    per = jnp.where(count > 0, count, 1.0)
    position = jnp.arange(table.shape[0], dtype=_F32)
    bad = (table[:, 3] + table[:, 6]) > 0
    if last:
        onset = jax.ops.segment_max(jnp.where(bad, position, -jnp.inf), ids, n)
        onset = jnp.where(jnp.isfinite(onset), onset, jnp.inf)
    else:
        onset = jax.ops.segment_min(jnp.where(bad, position, jnp.inf), ids, n)
    return Measurements(
        count=count,
        max_abs=jax.ops.segment_max(table[:, 1], ids, n).clip(0.0),
        headroom_bits=jnp.where(count > 0, jax.ops.segment_min(table[:, 2], ids, n), jnp.inf),
        overflow=total[:, 3] / per,
        underflow=total[:, 4] / per,
        subnormal=total[:, 5] / per,
        nonfinite=total[:, 6] / per,
        error=jax.ops.segment_max(table[:, 7], ids, n).clip(0.0),
        onset=onset,
        noise=total[:, 8] / per,
        abs_error=jnp.sqrt(jax.ops.segment_sum(jnp.square(table[:, 9]), ids, n)),
    )


# --- plain functions: closed-over arrays lifted into arguments, and module instances ------------

CLOSED = "closed over"  # the kind of a closed-over array's row, and the head of its key path
_LIBRARIES = ("jax", "jaxlib", "numpy", "flax", "optax", "equinox", "jmp_lite", "builtins", "functools")


def _closure_names(fun: Any, depth: int = 3) -> dict[int, tuple]:
    """``id(array) -> (name, *key path)`` for the arrays ``fun`` reaches by name: the globals and
    nonlocals its code (nested functions and lambdas included) names (``PARAMS["w1"]``,
    ``model.blocks[0]``), those of the functions it names (``depth`` levels; jitted ones unwrapped),
    ``self`` of a bound method, the arguments of a ``functools.partial``, and ``fun`` itself when it is
    a pytree (an Equinox module, named ``self``). What is not found keeps a numbered name."""
    found: dict[int, tuple] = {}
    seen: set[int] = set()

    def add(name: str, value: Any) -> None:
        try:
            leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        except Exception:  # noqa: BLE001 (a value JAX cannot flatten names nothing)
            return
        for path, x in leaves:
            if isinstance(x, (jax.Array, np.ndarray)):
                found.setdefault(id(x), (name, *path))

    todo = [(fun, depth, "self")]
    while todo:
        f, left, name = todo.pop(0)
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            for i, a in enumerate(f.args):
                add(f"partial{i}", a)
            for k, a in f.keywords.items():
                add(k, a)
            todo.append((f.func, left, name))
            continue
        if hasattr(f, "__self__") and not inspect.ismodule(f.__self__):
            add("self", f.__self__)
            f = getattr(f, "__func__", f)
        try:
            f = inspect.unwrap(f)
        except ValueError:
            pass
        if not inspect.isfunction(f):
            add(name, f)  # a callable pytree: an Equinox module called as the function
            continue
        if (getattr(f, "__module__", None) or "").split(".")[0] in _LIBRARIES:
            continue
        for key, value in _referenced(f).items():
            if inspect.ismodule(value):
                continue
            if callable(value) and _is_function(value):
                if left > 1:
                    todo.append((value, left - 1, key))
            else:
                add(key, value)
    return found


def _is_function(value: Any) -> bool:
    """A Python function, maybe wrapped (``jax.jit``) or partially applied."""
    if isinstance(value, functools.partial):
        return True
    try:
        return inspect.isfunction(inspect.unwrap(value))
    except ValueError:
        return False


def _referenced(f: Any) -> dict[str, Any]:
    """The nonlocals and globals a function's code names, its nested functions' and lambdas' too."""
    names: set[str] = set()
    codes = [f.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    out: dict[str, Any] = {}
    for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # not yet assigned
            pass
    for name in names:
        if name in f.__globals__:
            out.setdefault(name, f.__globals__[name])
    return out


class _Flow(NamedTuple):
    """What each equation of a traced program reads, in the order the engine's observer sees them
    (a jitted call's body, then the call)."""

    names: tuple[str, ...]  # its primitive
    reads: tuple[tuple[int, ...], ...]  # the leaves (lifted arrays, then arguments) it reads, moved or not
    feeds: tuple[tuple[int, ...], ...]  # the equations whose results it reads


class _Program:
    """A plain function traced once, with every array it closes over lifted into an argument: the report
    then differentiates with respect to closed-over parameters too (``PARAMS`` in ``loss(batch)``), and
    its data flow says which parameters each operation reads, which tells two instances of one module
    class apart. Arrays closed over by a jitted function's body are lifted as well (the call is bound
    again, with them as arguments); those inside loop, branch or custom-derivative bodies are not
    (``unlifted``). Hashable by identity: ``_lifted`` takes it as a static argument."""

    def __init__(self, fun: Callable[..., Any], rebuild: Callable[[list], tuple], values: list) -> None:
        def flat(*xs: Any) -> Any:
            args, kwargs = rebuild(list(xs))
            return fun(*args, **kwargs)

        with engine.entering(tracing=True):  # as the engine traces it: a nested transform marks its decisions
            closed, shape = jax.make_jaxpr(flat, return_shape=True)(*values)
        self.jaxpr = closed.jaxpr
        self.out_tree = jax.tree_util.tree_structure(shape)
        self.consts: list = []  # the lifted arrays, each once
        self._index: dict[int, int] = {}
        self.top = [self._lift(c) for c in closed.consts]
        self.bodies: dict[int, list[int]] = {}  # id(a jitted body closing over arrays) -> their indices
        self._unlifted: list = []  # floating arrays closed over where they cannot be lifted
        self._scan(closed.jaxpr)
        names = _closure_names(fun)
        self.names = tuple((CLOSED, *names.get(id(c), (f"constant{i}",))) for i, c in enumerate(self.consts))
        self.unlifted = tuple(
            ("/".join(_key(k) for k in names[id(c)]) + " " if id(c) in names else "")
            + f"{np.dtype(c.dtype).name}{list(c.shape)}"
            for c in {id(c): c for c in self._unlifted}.values()
        )

    def _lift(self, const: Any) -> int:
        if id(const) not in self._index:
            self._index[id(const)] = len(self.consts)
            self.consts.append(const)
        return self._index[id(const)]

    def _scan(self, jaxpr: Any, liftable: bool = True) -> None:
        """Finds the arrays closed over by jitted bodies ``_evaluate`` binds again (``liftable``: not
        inside a loop, branch or custom-derivative body, which are bound as they are)."""
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "jit" and liftable:
                body = eqn.params["jaxpr"]
                if body.consts and id(body) not in self.bodies:
                    self.bodies[id(body)] = [self._lift(c) for c in body.consts]
                self._scan(body.jaxpr)
                continue
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        self._unlifted += [
                            c
                            for c in sub.consts
                            if hasattr(c, "dtype") and _measured(c.dtype) and getattr(c, "size", 0) > 1
                        ]
                        self._scan(sub.jaxpr, False)
                    elif isinstance(sub, jcore.Jaxpr):
                        self._scan(sub, False)

    def flow(self) -> _Flow:
        names: list[str] = []
        reads: list[tuple] = []
        feeds: list[tuple] = []

        def source(env: interpret.Env, v: Any) -> Any:
            return None if isinstance(v, jcore.Literal) else env.get(v)

        def walk(jaxpr: Any, consts: list, args: list) -> list:
            # an abstract evaluation: each value is its source, ("leaf", i) or ("op", k), or None
            def equation(i: int, eqn: Any, env: interpret.Env) -> list:
                name = eqn.primitive.name
                ins = [source(env, v) for v in eqn.invars]
                if name in primitive_rules.INLINED:  # observed as its body's operations, then the call
                    body = eqn.params[primitive_rules.SUBPROGRAMS[name]]
                    lifted = self.bodies.get(id(body), [None] * len(body.consts))
                    outs = walk(body.jaxpr, [None if k is None else ("leaf", k) for k in lifted], ins)
                    names.append(name), reads.append(()), feeds.append(())
                    return outs
                sources = [s for s in ins if s is not None]
                k = len(names)
                names.append(name)
                reads.append(tuple(sorted({i for kind, i in sources if kind == "leaf"})))
                feeds.append(tuple(sorted({i for kind, i in sources if kind == "op"})))
                if eqn.primitive is engine.mark_p or name in _MOVES:  # the values of its operand
                    return [ins[0], *[None] * (len(eqn.outvars) - 1)]
                return [("op", k)] * len(eqn.outvars)

            return interpret.evaluate(jaxpr, consts, args, equation, read_out=source)

        top = [("leaf", i) for i in self.top]
        walk(self.jaxpr, top, [("leaf", len(self.consts) + i) for i in range(len(self.jaxpr.invars))])
        return _Flow(tuple(names), tuple(reads), tuple(feeds))


def _lifted(program: _Program, consts: list, *values: Any) -> Any:
    """The traced function, its closed-over arrays (``program.consts``) given as ``consts``."""
    outs = _evaluate(program, program.jaxpr, [consts[i] for i in program.top], list(values), consts)
    return jax.tree_util.tree_unflatten(program.out_tree, outs)


def _evaluate(program: _Program, jaxpr: Any, consts: list, args: list, lifted: list) -> list:
    """``jax.core.eval_jaxpr``, except that a jitted call whose body closes over arrays is bound as a jit of
    its body taking them as arguments (``lifted``: all lifted arrays' values)."""

    def equation(i: int, eqn: Any, env: interpret.Env) -> list | None:
        body = eqn.params.get("jaxpr") if eqn.primitive.name == "jit" else None
        if body is None or id(body) not in program.bodies:
            return None  # bound as written
        own = [lifted[k] for k in program.bodies[id(body)]]

        def call(own: list, *xs: Any) -> list:
            return _evaluate(program, body.jaxpr, own, list(xs), lifted)

        call.__name__ = str(eqn.params.get("name", "jit"))
        return jax.jit(call)(own, *[env.read(v) for v in eqn.invars])

    return interpret.evaluate(jaxpr, consts, args, equation)


def _module_keys(path: tuple) -> tuple[str, ...]:
    """A leaf's key path (an argument's within ``(args, kwargs)``, or a lifted array's) -> its module's:
    ``("arg0", ".blocks", "[0]", ".attn")`` for ``arg0.blocks[0].attn.weight``."""
    if path and isinstance(path[0], str):  # (CLOSED, name, *keys)
        head, rest = str(path[1]), path[2:]
    else:
        head = f"arg{_key(path[1])}" if _key(path[0]) == "0" else _key(path[1])
        rest = path[2:]
    keys = (head, *(jax.tree_util.keystr((k,)) for k in rest))
    return keys[:-1] if len(keys) > 1 else keys


def _instances(calls: list[tuple[str, str]], flow: _Flow, modules: list[tuple]) -> list[str | None]:
    """Per observed equation, the instance of its scope's call: the common module path of the
    parameters read by that call (the equations under that scope joined by data flow, its nested
    scopes' included), or None (it reads none). ``eqx.nn.Linear`` called as ``blocks[0].q`` and as
    ``blocks[1].q`` gives two instances."""
    paths = [p for _, p in calls]
    members: dict[str, list[int]] = {}
    for k, path in enumerate(paths):
        parts = path.split("/") if path else []
        for d in range(1, len(parts) + 1):
            members.setdefault("/".join(parts[:d]), []).append(k)
    found: list[str | None] = [None] * len(paths)
    for scope, ks in members.items():
        inside = set(ks)
        parent = {k: k for k in ks}

        def root(k: int, parent: dict = parent) -> int:
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        for k in ks:
            for j in flow.feeds[k]:
                if j in inside:
                    parent[root(k)] = root(j)
        read: dict[int, list[tuple]] = {}
        for k in ks:  # a bare argument (the batch, ``w``) belongs to no module
            read.setdefault(root(k), []).extend(modules[i] for i in flow.reads[k] if len(modules[i]) > 1)
        for k in ks:
            if paths[k] == scope and read.get(root(k)):
                common = functools.reduce(_common_prefix, read[root(k)])
                found[k] = "".join(common) if len(common) > 1 else None
    return found


def _common_prefix(a: tuple, b: tuple) -> tuple:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class _Target(NamedTuple):
    """How to run the function: its float32 reference and the checked run, both observed."""

    reference: Callable[..., Any]
    checked: Callable[..., Any]
    clean: Callable[[str], str]
    source: Source
    # (*args, **kwargs) -> the arguments' roles (engine.Param: a parameter, engine.Fp8StateField: fp8
    # scaling state), a pytree prefix of (args, kwargs), as the model's front-end says (None: plain)
    roles: Callable[..., Any] | None = None
    fun: Callable[..., Any] | None = None  # a plain function, traced to lift the arrays it closes over
    lifted: tuple = ()  # its float32 reference and checked run, evaluating a ``_Program`` (``_lifted``)


def _key(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _argument_group(path: tuple) -> tuple[str, str]:
    """``(args, kwargs)`` key path -> ``("arg0/w", "argument")`` or ``("x", "argument")`` (a keyword);
    a closed-over array's (``(CLOSED, name, *keys)``) -> ``("PARAMS/w", "closed over")``."""
    keys = [_key(k) for k in path]
    if path and isinstance(path[0], str):  # (CLOSED, name, *keys)
        return "/".join(keys[1:]), CLOSED
    head = f"arg{keys[1]}" if keys[0] == "0" else keys[1]
    return "/".join([head, *keys[2:]]), "argument"


def _group(role: Any, path: tuple) -> tuple[str, str]:
    """An argument leaf's group: a parameter's module path (its role names it, ``"Dense_0/kernel"``),
    else the argument's own path."""
    if isinstance(role, engine.Param) and role.name is not None:
        return role.name.rsplit("/", 1)[0] if "/" in role.name else "", "params"
    return _argument_group(path)


def _fp8_state_leaves(with_path: list, tree: Any, roles: list) -> set[int]:
    """The leaves (indices into ``with_path``) that are fp8 scaling state: fields of an ``Fp8State``
    anywhere in the arguments, or what the front-end says is (a Linen model's ``"fp8"`` collection).
    Amax histories and scales are not values a 16-bit run rounds, and their cotangents are the
    observed amaxes (the fp8 contractions' report), not gradients: they are not measured."""
    states = [
        p
        for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Fp8State))[0]
        if isinstance(x, Fp8State)
    ]
    return {
        i
        for i, (path, _) in enumerate(with_path)
        if isinstance(roles[i], engine.Fp8StateField) or any(path[: len(p)] == p for p in states)
    }


def _model_target(model: engine.ModelUnderPolicy, loss_scaled: bool, fp8: Any) -> _Target:
    """A Flax model under ``apply_policy``, through the front-ends' protocol (``__jmp_lite_model__``)."""
    if fp8 is not None:
        raise ValueError("precision_report: a Flax model's fp8 recipe is apply_policy's; leave fp8=None")
    options = {"observe": _observe, "remat_float32": False, "attention": False}
    reference = model.variant(get_policy("f32"), **options)
    checked = model.variant(None, **options)
    recipe = None if model.fp8 is None else str(model.fp8)
    source = Source(model.kind, model.policy, model.rules, loss_scaled, recipe)
    return _Target(reference, checked, _cleaner(model.name), source, model.roles)


def _autocast_target(
    fun: Callable[..., Any], policy: Policy, rules: Mapping[str, str] | None, loss_scaled: bool, fp8: Any
) -> _Target:
    checked_rules = engine.check_rules(rules)
    recipe = None
    inputs = lifted_inputs = None
    if fp8 is not None:
        from jmp_lite._src.fp8 import fp8 as fp8_lib

        recipe = fp8_lib.as_fp8_recipe(fp8, "precision_report.fp8")
        fp8_lib.check_compute_dtype(policy.compute, "precision_report(fp8=...)")
        if recipe.stateful:  # a report has no history to delay by: the current amax
            recipe = recipe.replace(scaling="current")

        def inputs(*args: Any, **kwargs: Any) -> Any:  # every array argument may be a weight
            return engine.Param()

        def lifted_inputs(program: Any, consts: list, *values: Any) -> Any:  # not what it closes over
            return ((None, None, *(engine.Param() for _ in values)), None)

    # both runs observe the same program: attention as written (the kernel runs only under 16 bits)
    options = {"rules": checked_rules, "observe": _observe, "remat_float32": False, "attention": False}
    f32, scope = engine.Scope(get_policy("f32")), engine.Scope(policy, True, recipe)
    reference = engine.transform(fun, f32, **options)
    checked = engine.transform(fun, scope, inputs=inputs, **options)
    lifted = (
        engine.transform(_lifted, f32, **options),
        engine.transform(_lifted, scope, inputs=lifted_inputs, **options),
    )
    source = Source(
        "autocast", policy, tuple(sorted(checked_rules.items())), loss_scaled, str(recipe) if recipe else None
    )
    return _Target(reference, checked, _cleaner(None), source, None, fun, lifted)


def _front_end(
    fun: Any, policy: Policy | str | None, rules: Mapping[str, str] | None, loss_scaled: bool, fp8: Any
) -> _Target:
    model = engine.model_under_policy(fun)
    if model is not None:
        given = validate.policy(policy, "precision_report's policy", optional=True)
        if given is not None and given != model.policy:
            raise ValueError(
                f"precision_report: the model runs under its own policy {model.policy}; leave policy=None "
                "(or build it with apply_policy(module, policy))"
            )
        if rules is not None:
            raise ValueError("precision_report: a Flax model's rules are apply_policy's; leave rules=None")
        return _model_target(model, loss_scaled, fp8)
    if policy is None:
        raise TypeError(
            "precision_report(fun, policy): a plain function needs a policy (a jmp_lite.Policy or a string "
            "such as 'p=f32,c=f16,o=f32'); a Flax model carries its own: pass apply_policy(...).apply or an "
            "NNX view"
        )
    policy = validate.policy(policy, "precision_report's policy")
    return _autocast_target(fun, policy, rules, loss_scaled, fp8)


def _scale(loss_scale: Any) -> tuple[jax.Array, bool]:
    if loss_scale is None:
        return jnp.float32(1.0), False
    if isinstance(loss_scale, LossScale):
        return jnp.asarray(loss_scale.loss_scale, _F32), True
    scale = validate.positive_scale(loss_scale, "precision_report.loss_scale")
    return jnp.asarray(scale, _F32), not (not validate.is_tracer(loss_scale) and float(scale) == 1.0)


def _scalar_loss(out: Any, loss: Callable[[Any], Any] | None) -> jax.Array:
    value = out if loss is None else loss(out)
    if not (isinstance(value, jax.Array) and value.shape == () and jnp.issubdtype(value.dtype, jnp.floating)):
        what = "the function" if loss is None else "loss(outputs)"
        shape = getattr(value, "shape", None)
        raise TypeError(
            f"precision_report: {what} must return a floating scalar to differentiate, got "
            f"{type(value).__name__} with shape {shape}; for a model that returns logits pass "
            "loss=lambda out: ... (e.g. a mean cross-entropy against sample labels)"
        )
    return value.astype(_F32)


def precision_report(
    fun: Callable[..., Any],
    policy: Policy | str | None = None,
    *,
    rules: Mapping[str, str] | None = None,
    loss: Callable[[Any], jax.Array] | None = None,
    loss_scale: LossScale | float | None = None,
    fp8: Any = None,
) -> Callable[..., PrecisionReport]:
    """Measures, per module, what running ``fun`` under ``policy`` does to its values and gradients.

    ``precision_report(fun, policy)(*args, **kwargs)`` runs ``fun`` forward and backward twice in one
    compiled program, under a float32 policy and under ``policy``, and returns a ``PrecisionReport``:
    per group of operations (module or named scope, and operation kind) the largest magnitude, the
    headroom before the dtype's largest value, the fractions that overflow, underflow and become
    subnormal in the dtype each operation ran in, non-finite values, and the relative error against
    float32, for activations and for gradients. ``jmp_lite.suggest_rules(report)`` turns it into rules.

    Args:
        fun: a Linen ``apply_policy(module, policy, rules).apply`` (its policy and rules are used),
            an NNX ``PolicyView``, or any JAX function, run as ``jmp_lite.autocast`` would run it.
        policy: the policy to check (plain functions only).
        rules: ``autocast`` rules (plain functions only): ``{"exp": "follow", "scope:attn": "float32"}``.
        loss: maps ``fun``'s outputs to the scalar loss; without it ``fun`` must return the loss.
        loss_scale: a ``LossScale`` or number; the gradients are measured multiplied by it, as the
            training step sees them (default 1: no loss scaling).
        fp8: a ``jmp_lite.Fp8Recipe`` or its string (plain functions): contractions reading an array
            argument run in fp8 (delayed scaling runs as current scaling: a report has no amax
            history; block scaling as it is).

    The report covers the operations of ``fun`` at its top level (calls of jitted functions
    included); a loop, branch, ``jax.checkpoint`` or custom-derivative body is one operation. The
    gradients of floating arguments are rows too: for a Linen model one row per module's parameters
    (``kind`` ``"params"``), else one per argument leaf (``"argument"``), measured against the
    policy's compute dtype, in which the backward pass forms them; fp8 scaling state is not
    measured. A plain function's closed-over arrays are lifted into arguments and measured the
    same way (``"closed over"``, named by the variable holding them: ``PARAMS/w1``), except inside
    loop, branch or custom-derivative bodies (``source.unmeasured``: ``suggest_rules`` then gives
    no loss scale range). Where several instances of one module class share a named scope (two
    ``eqx.nn.MultiheadAttention`` blocks), each gets its own rows, named by its path in the model
    (``arg0.blocks[1].attn (eqx.nn.MultiheadAttention) [logits]``). Memory: the program keeps
    every measured value of both runs.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def loss(w, x):
        ...     with jax.named_scope("layer"):
        ...         y = (x @ w) * (x @ w)  # 400 * 400: past float16's 65504
        ...     return jnp.mean(jnp.tanh(y))
        >>> w, x = jnp.full((4, 4), 100.0, jnp.float32), jnp.ones((2, 4), jnp.float32)
        >>> report = jax.jit(jmp_lite.precision_report(loss, "p=f32,c=f16,o=f32"))(w, x)
        >>> report.names
        ['layer [matmul]', 'layer [ops]', '(root) [ops]', 'arg0 [argument]', 'arg1 [argument]']
        >>> worst = report.ranking()[0]
        >>> worst, float(report.activations.overflow[1]), float(report.activations.headroom_bits[1])
        ('layer [ops]', 1.0, -1.288...)
        >>> float(jmp_lite.precision_report(loss, "f32")(w, x).activations.error.max())
        0.0
    """
    validate.function(fun, "precision_report.fun")
    if loss is not None:
        validate.function(loss, "precision_report.loss")
    scale, scaled = _scale(loss_scale)
    target = _front_end(fun, policy, rules, scaled, fp8)

    def measure(static: tuple, dynamic: list, scale: jax.Array) -> PrecisionReport:
        treedef, fixed, where, floats, paths, groups, n_states = static

        def rebuild(values: list) -> tuple:
            leaves = [None] * (len(fixed) + len(where))
            for i, x in fixed:
                leaves[i] = x
            for i, x in zip(where, values):
                leaves[i] = x
            return jax.tree_util.tree_unflatten(treedef, leaves)

        def call(fn: Callable[..., Any], values: list) -> Any:
            args, kwargs = rebuild(values)
            return fn(*args, **kwargs)

        reference, checked, program = target.reference, target.checked, None
        if target.fun is not None:  # a plain function: what it closes over becomes arguments
            try:
                program = _Program(target.fun, rebuild, list(dynamic))
            except Exception:  # noqa: BLE001 (the engine's own trace below says what is wrong)
                program = None
        if program is not None:
            lifted = len(program.consts)
            reference, checked = target.lifted
            dynamic = [*program.consts, *dynamic]
            floats = (*(_measured(c.dtype) for c in program.consts), *floats)
            paths = (*program.names, *paths)
            groups = (*(_argument_group(p) for p in program.names), *groups)

            def call(fn: Callable[..., Any], values: list) -> Any:
                return fn(program, list(values[:lifted]), *values[lifted:])

        def run(fn: Callable[..., Any], probes: Any, values: list) -> tuple:
            obs = _Observation(probes, target.clean)
            with engine.entering(observation=obs):
                value = _scalar_loss(call(fn, values), loss)
            return obs, value

        diff = [i for i, f in enumerate(floats) if f]

        def differentiated(fn: Callable[..., Any], probes: list, again: bool = False) -> tuple:
            """The run, its loss, values and cotangents; ``again``: and the cotangents of a second
            backward pass whose only difference is rounding (``_again``)."""
            box: list = []

            def f(probes: list, xs: list) -> tuple:
                values = list(dynamic)
                for i, x in zip(diff, xs):
                    values[i] = x
                obs, value = run(fn, probes, values)
                box.append(obs)
                return value, obs.values

            value, vjp, values = jax.vjp(f, probes, [dynamic[i] for i in diff], has_aux=True)
            ct_probes, ct_args = vjp(scale.astype(value.dtype))
            if not again:
                return box[0], value, values, ct_probes, ct_args
            return box[0], value, values, ct_probes, ct_args, _again(vjp, scale.astype(value.dtype))

        shapes = jax.eval_shape(lambda: run(reference, None, list(dynamic))[0].values)
        probes = [jnp.zeros(s.shape, _F32) for s in shapes]
        ref = differentiated(reference, probes, again=True)
        try:
            low = differentiated(checked, probes)
        except _Mismatch:
            low = None
        if low is None or [(o.kind, o.shape) for o in low[0].ops] != [(o.kind, o.shape) for o in ref[0].ops]:
            raise RuntimeError(
                "precision_report: the float32 reference and the checked run traced different programs; "
                "this is a jmp_lite bug (please report it with the model)"
            )
        arguments = [(groups[i], dynamic[i]) for i in diff]
        instances = None
        if program is not None:
            flow = program.flow()
            if (
                tuple(name for name, _ in low[0].calls) == flow.names
            ):  # the same program, equation by equation
                instances = _instances(low[0].calls, flow, [_module_keys(p) for p in paths])
        given = target.source
        source = Source(
            given.front_end, given.policy, given.rules, given.loss_scaled, given.fp8, n_states,
            tuple(program.unlifted) if program is not None else (),
        )  # fmt: skip
        return _assemble(target, source, ref, low, arguments, scale, instances)

    compiled = jax.jit(measure, static_argnums=0)

    def report(*args: Any, **kwargs: Any) -> PrecisionReport:
        with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaves = [x for _, x in with_path]
        where = tuple(i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray)))
        fixed = tuple((i, x) for i, x in enumerate(leaves) if i not in set(where))
        dynamic = [leaves[i] for i in where]
        roles = engine.spread_roles(target.roles(*args, **kwargs), (args, kwargs)) if target.roles else None
        roles = roles or [None] * len(leaves)
        states = _fp8_state_leaves(with_path, (args, kwargs), roles)
        floats = tuple(_measured(leaves[i].dtype) and i not in states for i in where)
        n_states = sum(1 for i in where if i in states)
        if not dynamic:
            raise ValueError(
                "precision_report: the function got no array argument; pass the batch (and the parameters, "
                "to measure their gradients) as arguments: report = precision_report(fun, policy)(batch)"
            )
        paths = tuple(with_path[i][0] for i in where)
        groups = tuple(_group(roles[i], with_path[i][0]) for i in where)
        static = (treedef, fixed, where, floats, paths, groups, n_states)
        try:
            hash(static)
        except TypeError as e:
            raise TypeError(
                f"precision_report: non-array arguments must be hashable (they are static): {e}"
            ) from e
        return compiled(static, dynamic, scale)

    return functools.wraps(fun)(report) if hasattr(fun, "__name__") else report


def _assemble(
    target: _Target,
    source: Source,
    ref: tuple,
    low: tuple,
    arguments: list,
    scale: jax.Array,
    instances: list | None = None,
) -> PrecisionReport:
    ref_obs, ref_loss, ref_values, ref_cts, ref_args, (again_cts, again_args) = ref
    low_obs, low_loss, low_values, low_cts, low_args = low
    kinds = _kinds(low_obs)
    compute = np.dtype(source.policy.compute)
    # a row per module instance where one scope holds several (two blocks of one Equinox class)
    owner = [None if instances is None else instances[op.position] for op in low_obs.ops]
    seen: dict[tuple[str, str], set] = {}
    for i, op in enumerate(low_obs.ops):
        seen.setdefault((op.path, kinds[i]), set()).add(owner[i])
    keys: dict[tuple[str, str, str], int] = {}
    dtypes: dict[int, set] = {}
    primitives: dict[int, set] = {}
    ids, act, grad = [], [], []
    for i, op in enumerate(low_obs.ops):
        split = len(seen[op.path, kinds[i]] - {None}) > 1
        g = keys.setdefault((op.path, kinds[i], (owner[i] or "") if split else ""), len(keys))
        dtypes.setdefault(g, set()).add(op.dtype.name)
        primitives.setdefault(g, set()).add(op.primitive)
        ids.append(g)
        act.append(_Values(low_values[i], ref_values[i], op.dtype))
        grad.append(_Values(low_cts[i], ref_cts[i], op.dtype, again_cts[i]))
    first_arg = len(keys)
    for (group, value), low_g, ref_g, again_g in zip(arguments, low_args, ref_args, again_args):
        g = keys.setdefault((*group, ""), len(keys))
        dtypes.setdefault(g, set()).add(compute.name)
        ids.append(g)
        act.append(_Values(value.astype(compute), value, compute))  # the argument, read in the compute dtype
        grad.append(_Values(low_g, ref_g, compute, again_g))  # formed there by the backward pass
    groups = tuple(
        Group(
            f"{instance} ({path.rsplit('/', 1)[-1]}) [{kind}]" if instance else f"{path or ROOT} [{kind}]",
            path,
            kind,
            "+".join(sorted(dtypes[g])),
            g if g < first_arg else 10**9 + g,
            tuple(sorted(primitives.get(g, ()))),
            instance,
        )
        for (path, kind, instance), g in keys.items()
    )
    n, ids_np = len(groups), np.asarray(ids, np.int32)
    halves = [replicated(v.ref.astype(_F32)).ravel() for v in grad if v.dtype in _HALF]
    if halves:  # one leaf: gradient_diagnostics compiles per leaf
        unscaled = jnp.concatenate(halves) / scale
        d = gradient_diagnostics(unscaled, compute if compute in _HALF else _HALF[1], log2_range=(-100, 40))
        hist, bins, top, best = d.histogram, d.log2_bins, d.max_abs, d.recommended_scale
    else:  # nothing runs in 16 bits: no loss scale to choose
        hist, bins = jnp.zeros((140,), _F32), jnp.arange(-100, 40)
        top, best = jnp.float32(0.0), jnp.float32(1.0)
    return PrecisionReport(
        activations=_grouped(_per_op(act), ids_np, n, last=False),
        gradients=_grouped(_per_op(grad), ids_np, n, last=True),
        loss=jnp.stack([ref_loss, low_loss]),
        loss_scale=scale,
        gradient_histogram=hist,
        log2_bins=bins,
        gradient_max=top,
        recommended_scale=best,
        groups=groups,
        source=source,
    )
