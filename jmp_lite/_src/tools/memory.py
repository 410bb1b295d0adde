"""``residual_bytes``: the bytes JAX keeps between the forward and the backward pass; ``state_bytes``:
the bytes of the parameters and the optimizer state, per parameter and by component.

Reverse-mode differentiation (``jax.vjp``, ``jax.grad``) runs the forward pass, keeps
some of its values (the *residuals*: activations, masks, casts of the weights) and reads
them again in the backward pass. Their size is the activation memory of training, and it
is what mixed precision promises to halve (Micikevicius et al., 2018, "Mixed Precision
Training"). This module counts them on the traced program, before XLA compiles or
allocates anything, so the number is the same on every backend and inputs may be
``jax.ShapeDtypeStruct``: a model far larger than the machine's memory can be measured.
XLA may rematerialize or fuse some residuals afterwards; ``jax.checkpoint`` policies are
visible here, since they decide the residuals before XLA runs.

The residuals are JAX's own: ``jax.vjp`` traced with ``jax.make_jaxpr``, described by the
function behind ``jax.ad_checkpoint.print_saved_residuals``. This module adds the bytes,
the grouping by dtype and by ``jax.named_scope`` (Flax modules open one per call), and
the split between values the forward pass computes and arguments that are kept as well.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules
from jmp_lite._src.base import compat, reports
from jmp_lite._src.engine import engine
from jmp_lite._src.optim import low_precision, quantized_state

__all__ = ["Residual", "ResidualBytes", "StateBytes", "residual_bytes", "state_bytes"]

COMPUTED = "computed"
# Transformations JAX writes around a scope name ("jvp(Block_0)", "transpose(jvp(mlp))"): not scopes.
_TRANSFORMS = ("jvp", "transpose", "vmap", "rematted_computation", "remat", "checkpoint", "pmap")
_WRAPPED = re.compile(rf"^(?:{'|'.join(_TRANSFORMS)})\((.*)\)$")
# Call-like primitives whose outputs are outputs of one inner jaxpr: a residual made inside is
# attributed to the scope of the equation that made it, not to the call.
_CALLS = primitive_rules.CALLS


def _jax_describe(jaxpr: Any, arg_names: Sequence[str]) -> list[tuple[Any, str]]:
    """``(aval, description)`` per residual (the outputs of ``jaxpr``), as JAX reports them.

    The one use of a JAX internal in jmp_lite's memory measure (through ``compat``): JAX's
    public entry point, ``jax.ad_checkpoint.print_saved_residuals``, only prints, and the
    function behind it (``jax._src.ad_checkpoint.saved_residuals``) returns a description but
    not the equation, so no named scope. Its helper ``_saved_residuals`` takes the jaxpr,
    which this module already holds: ``_attribute`` calls it once per residual, on a jaxpr
    cut down to the equation that made it, so each description belongs to a known equation.
    ``tests/test_memory.py`` checks that it still exists and still agrees with
    ``print_saved_residuals``.
    """
    return compat.saved_residuals_with_equations()(jaxpr, arg_names)


def clean_scope(name_stack: str) -> str:
    """``"jvp(GPT)/Block_0"`` -> ``"GPT/Block_0"``: the scope names without JAX's transformations."""
    parts = []
    for part in name_stack.split("/"):
        while (m := _WRAPPED.match(part)) is not None:
            part = m.group(1)
        part = engine.without_marks(part)  # the policy a jmp_lite front-end attached to the scope
        if part:
            parts.append(part)
    return "/".join(parts)


def _join(outer: str, inner: str) -> str:
    return "/".join(p for p in (outer, inner) if p)


def _nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    if shape is None:  # tokens and other values without a shape hold no array
        return 0
    dtype = aval.dtype
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:  # pragma: no cover - extended dtypes without an itemsize
        itemsize = np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value that the forward pass keeps for the backward pass.

    Attributes:
        shape: the array's shape.
        dtype: its dtype name (``"float32"``, ``"bfloat16"``, ``"bool"``, ...).
        bytes: ``prod(shape) * itemsize``.
        scope: the ``jax.named_scope`` path of the equation that made it, with JAX's
            transformation wrappers removed (``"GPT/Block_0/Dense_1"``; ``""`` outside any scope).
        kind: ``"computed"`` (made by the forward pass: the memory that ``total`` counts),
            or ``"argument"``, ``"constant"``, ``"literal"`` (kept as well, but in memory anyway).
        description: JAX's own description, as ``jax.ad_checkpoint.print_saved_residuals``
            prints it (``"output of cos from model.py:12:8 (f)"``).
        primitive: the primitive that made it (inside ``jit`` calls too), ``""`` for inputs.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> r = jmp_lite.memory.residual_bytes(jnp.sin, jnp.ones(8)).residuals[0]
        >>> r.shape, r.dtype, r.bytes, r.primitive
        ((8,), 'float32', 32, 'cos')
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    scope: str
    kind: str
    description: str
    primitive: str = ""


def _sum_by(residuals: Sequence[Residual], key: Callable[[Residual], str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in residuals:
        out[key(r)] = out.get(key(r), 0) + r.bytes
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def format_bytes(n: float) -> str:
    """Decimal units (1 kB = 1000 bytes), the units the benchmark tables use."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class ResidualBytes:
    """What ``residual_bytes`` measured: the bytes kept for the backward pass, and each residual.

    Attributes:
        total: bytes of the residuals the forward pass computes (kind ``"computed"``): the memory
            that differentiating adds. Arguments, constants and literals that the backward pass
            reads are not counted: they are in memory whether or not anything is differentiated.
        by_dtype: ``total`` split by dtype name, largest first.
        by_scope: ``total`` split by full named-scope path, largest first (``""``: no scope).
        inputs: bytes of the arguments and constants that the backward pass reads (not in ``total``).
        residuals: every residual, inputs included, in JAX's order.

    ``str()`` gives a table; ``find`` selects residuals, ``by_scope_prefix`` groups scopes.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> m = jmp_lite.memory.residual_bytes(lambda x, w: jnp.sin(x) * w, jnp.ones(4), jnp.ones(4))
        >>> m.total, m.inputs, m.by_dtype  # cos(x) and sin(x) computed; w kept as it is
        (32, 16, {'float32': 32})
    """

    total: int
    by_dtype: dict[str, int]
    by_scope: dict[str, int]
    inputs: int
    residuals: tuple[Residual, ...] = dataclasses.field(repr=False)

    def find(
        self,
        *,
        dtype: Any = None,
        scope: str | None = None,
        trailing_shape: Sequence[int] | None = None,
        kinds: Sequence[str] = (COMPUTED,),
    ) -> list[Residual]:
        """The residuals that match every given filter (by default only the computed ones).

        Args:
            dtype: a dtype or dtype name (``"bfloat16"``, ``jnp.float32``).
            scope: a named-scope prefix: ``"GPT/Block_0"`` matches that scope and those inside it.
            trailing_shape: the last axes, e.g. ``(T, T)`` for attention matrices ``[..., T, T]``.
            kinds: the kinds to include (``"computed"``, ``"argument"``, ``"constant"``, ``"literal"``).
        """
        name = None if dtype is None else np.dtype(dtype).name
        tail = None if trailing_shape is None else tuple(trailing_shape)
        out = []
        for r in self.residuals:
            if r.kind not in kinds or (name is not None and r.dtype != name):
                continue
            if scope is not None and not (r.scope == scope or r.scope.startswith(scope.rstrip("/") + "/")):
                continue
            if tail is not None and (len(r.shape) < len(tail) or r.shape[len(r.shape) - len(tail) :] != tail):
                continue
            out.append(r)
        return out

    def by_scope_prefix(self, depth: int) -> dict[str, int]:
        """``total`` split by the first ``depth`` names of each scope (``1``: the top-level modules)."""
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        computed = [r for r in self.residuals if r.kind == COMPUTED]
        return _sum_by(computed, lambda r: "/".join(r.scope.split("/")[:depth]))

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The totals and every residual, as JSON-ready values."""
        return reports.plain(self)

    def table(self, max_scopes: int = 20) -> str:
        """The readable summary that ``str()`` prints, with at most ``max_scopes`` scope rows."""
        computed = [r for r in self.residuals if r.kind == COMPUTED]
        lines = [
            f"kept for the backward pass: {format_bytes(self.total)} in {len(computed)} residuals "
            f"(plus {format_bytes(self.inputs)} of arguments, constants and literals, not counted)"
        ]

        def rows(title: str, groups: dict[str, int], limit: int | None = None) -> None:
            shown = list(groups.items())[:limit]
            width = max([len(title)] + [len(k or "(no scope)") for k, _ in shown])
            lines.append(f"{title.ljust(width)}  {'bytes':>10}  share")
            for key, n in shown:
                share = n / self.total if self.total else 0.0
                lines.append(f"{(key or '(no scope)').ljust(width)}  {format_bytes(n):>10}  {share:6.1%}")
            rest = list(groups.values())[len(shown) :]
            if rest:
                lines.append(f"({len(rest)} more scopes: {format_bytes(sum(rest))})")

        rows("dtype", self.by_dtype)
        rows("scope", self.by_scope, max_scopes)
        return "\n".join(lines)


def _argument_names(fun: Callable, args: tuple, kwargs: dict) -> list[str]:
    """A readable name per flattened leaf of ``(args, kwargs)``: ``params['Dense_0']['kernel']``."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        which, key, rest = path[0].idx, path[1], path[2:]  # type: ignore[attr-defined]
        if which == 0:
            i = key.idx  # type: ignore[attr-defined]
            head = positional[i] if i < len(positional) else f"args[{i}]"
        else:
            head = str(key.key)  # type: ignore[attr-defined]
        names.append(head + jax.tree_util.keystr(rest))
    return names


def _check_leaves(leaves: list, names: list[str]) -> None:
    for leaf, name in zip(leaves, names):
        ok = isinstance(leaf, (bool, int, float, complex, jax.ShapeDtypeStruct)) or (
            hasattr(leaf, "shape") and hasattr(leaf, "dtype")
        )
        if not ok:
            raise TypeError(
                f"residual_bytes: argument {name} is a {type(leaf).__name__}; every argument leaf must be "
                "an array, a jax.ShapeDtypeStruct or a Python number. Close over other arguments "
                "(functools.partial(fun, flag=...)) instead of passing them."
            )


def _differentiated(args: tuple, kwargs: dict, argnums: int | Sequence[int] | None) -> list[bool]:
    """Per flattened leaf of ``(args, kwargs)``: whether the backward pass differentiates it."""
    if argnums is None:
        chosen = set(range(len(args)))
    else:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        if not nums or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
            raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
        bad = [i for i in nums if not -len(args) <= i < len(args)]
        if bad:
            raise ValueError(f"argnums {bad} out of range for {len(args)} positional argument(s)")
        chosen = {i % len(args) for i in nums}
    flags = []
    for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        which, key = path[0].idx, path[1]  # type: ignore[attr-defined]
        flags.append(argnums is None if which == 1 else key.idx in chosen)  # type: ignore[attr-defined]
    return flags


def residual_bytes(
    fun: Callable, *args: Any, argnums: int | Sequence[int] | None = None, **kwargs: Any
) -> ResidualBytes:
    """The bytes that reverse-mode differentiation of ``fun`` keeps for its backward pass.

    Traces ``jax.vjp(fun, *args)`` with ``jax.make_jaxpr``: nothing is compiled or allocated,
    and any argument may be a ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape(model.init,
    ...)``), so a model larger than the machine can be measured. The residuals are those of
    ``jax.ad_checkpoint.print_saved_residuals``; each is attributed to the ``jax.named_scope``
    of the equation that made it (Flax Linen and NNX open one per module call), inside nested
    ``jax.jit`` calls too. The count is taken before XLA runs, so it does not depend on the
    backend, and later XLA rematerialization or fusion can only lower the real peak.

    Args:
        fun: the function you differentiate (for ``jax.grad(f, has_aux=True)`` pass
            ``lambda *a: f(*a)[0]``). Its output may be any pytree.
        *args: its positional arguments: arrays, ``jax.ShapeDtypeStruct`` or Python numbers
            (close over anything else with ``functools.partial``).
        argnums: the positional arguments that are differentiated, as in ``jax.grad``; the
            default, ``None``, differentiates every argument and keyword argument, as
            ``print_saved_residuals`` does. Differentiating fewer can only keep fewer residuals
            (e.g. ``argnums=0`` for parameters, so nothing is kept for a gradient of the data).
        **kwargs: its keyword arguments.

    Returns:
        A ``ResidualBytes``: ``total`` (computed residuals, in bytes), ``by_dtype``, ``by_scope``,
        ``inputs`` (the arguments kept as well, not in ``total``) and every ``Residual``.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def f(x, w):
        ...     with jax.named_scope("layer"):
        ...         return jnp.tanh(x @ w).sum()
        >>> x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)  # abstract: nothing is allocated
        >>> w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
        >>> m = jmp_lite.memory.residual_bytes(f, x, w)
        >>> m.total, m.by_dtype, m.by_scope  # tanh's output and 1 - tanh^2, bfloat16 [1024, 256] each
        (1048576, {'bfloat16': 1048576}, {'layer': 1048576})
        >>> [r.kind for r in m.residuals]  # x and w are read by the backward pass as they are
        ['argument', 'argument', 'computed', 'computed']
    """
    if not callable(fun):
        raise TypeError(f"residual_bytes expects a callable as its first argument, got {type(fun).__name__}")
    names = _argument_names(fun, args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    _check_leaves(leaves, names)
    diff = _differentiated(args, kwargs, argnums)
    where = [i for i, d in enumerate(diff) if d]

    def forward_and_vjp(*flat: Any) -> Any:
        def f(*differentiated: Any) -> Any:
            merged = list(flat)
            for i, x in zip(where, differentiated):
                merged[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, merged)
            return fun(*a, **k)

        return jax.vjp(f, *[flat[i] for i in where])

    closed, shapes = jax.make_jaxpr(forward_and_vjp, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    count = len(jax.tree_util.tree_leaves(shapes[1]))  # the vjp function's leaves are the residuals
    outvars = jaxpr.outvars[len(jaxpr.outvars) - count :] if count else []
    residuals = tuple(_attribute(jaxpr, outvars, names))
    computed = [r for r in residuals if r.kind == COMPUTED]
    return ResidualBytes(
        total=sum(r.bytes for r in computed),
        by_dtype=_sum_by(computed, lambda r: r.dtype),
        by_scope=_sum_by(computed, lambda r: r.scope),
        inputs=sum(r.bytes for r in residuals if r.kind != COMPUTED),
        residuals=residuals,
    )


class _Producers:
    """Which equation made each variable, per jaxpr (built once per jaxpr, on first use)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[Any, dict]] = {}

    def of(self, jaxpr: Any, v: Any) -> Any:
        key = id(jaxpr)
        if key not in self._maps:
            self._maps[key] = (jaxpr, {o: e for e in jaxpr.eqns for o in e.outvars})
        return self._maps[key][1].get(v)


def _innermost(producers: _Producers, eqn: Any, v: Any, scope: str) -> tuple[str, str]:
    """(scope, primitive) of the equation that really made ``v``: inside ``jit`` and similar calls."""
    while True:
        scope = _join(scope, clean_scope(str(eqn.source_info.name_stack)))
        field = _CALLS.get(eqn.primitive.name)
        inner = eqn.params.get(field) if field else None
        inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
        if inner is None or len(inner.outvars) != len(eqn.outvars):
            return scope, eqn.primitive.name
        u = inner.outvars[eqn.outvars.index(v)]
        made = None if isinstance(u, jcore.Literal) else producers.of(inner, u)
        if made is None:  # an input passed through the call, or a literal
            return scope, eqn.primitive.name
        eqn, v = made, u


def _attribute(jaxpr: Any, outvars: Sequence[Any], names: list[str]) -> list[Residual]:
    producers = _Producers()
    constvars, invars = set(jaxpr.constvars), set(jaxpr.invars)
    out = []
    for v in outvars:
        eqns: list = []
        kind, scope, primitive = "literal", "", ""
        if not isinstance(v, jcore.Literal):
            made = producers.of(jaxpr, v)
            # JAX reports the value that a reduce_precision rounds, not the rounding: so do we.
            if made is not None and made.primitive.name == "reduce_precision":
                if not isinstance(made.invars[0], jcore.Literal):
                    eqns.append(made)
                    v = made.invars[0]
                    made = producers.of(jaxpr, v)
            kind = "constant" if v in constvars else "argument" if v in invars else COMPUTED
            if made is not None:
                eqns.append(made)
                scope, primitive = _innermost(producers, made, v, "")
        ((aval, description),) = _jax_describe(jaxpr.replace(outvars=[v], eqns=eqns), names)
        out.append(
            Residual(
                shape=tuple(getattr(aval, "shape", ())),
                dtype=str(getattr(aval, "dtype", "")),
                bytes=_nbytes(aval),
                scope=scope,
                kind=kind,
                description=description,
                primitive=primitive,
            )
        )
    return out


# --- state_bytes ------------------------------------------------------------------------------------

# The component of a leaf of an optimizer state, from the NamedTuple field names on its key path (the
# innermost named one decides). Fields of jmp_lite's states; optax's (mu, nu, trace, count, ...) fall to
# the rules by dtype and rank in _component.
_FIELD_COMPONENTS = {
    "quantized_values": "moments",
    "block_scales": "scales",
    "kahan_compensation": "compensation",
    "state_compensation": "compensation",
    "param_rounding_key": "keys",
    "state_rounding_key": "keys",
}
COMPONENTS = ("parameters", "moments", "scales", "compensation", "keys", "accumulated gradients", "other")


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_bytes(x: Any, where: str) -> tuple[int, Any]:
    """``(bytes, dtype)`` of an array, a ``jax.ShapeDtypeStruct`` or a Python number; a typed PRNG key
    counts its raw data (``jax.random.key_data``: its ``nbytes`` is not the memory it holds)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        shape, dtype = tuple(x.shape), x.dtype
    elif isinstance(x, (bool, int, float, complex, np.generic)):
        shape, dtype = (), jnp.result_type(x)
    else:
        raise TypeError(
            f"state_bytes: {where} is a {type(x).__name__}; every leaf must be an array, a "
            "jax.ShapeDtypeStruct or a Python number"
        )
    if _is_key(dtype):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, key_dtype = tuple(data.shape), data.dtype
        return math.prod(shape) * np.dtype(key_dtype).itemsize, dtype
    return math.prod(shape) * np.dtype(dtype).itemsize, dtype


def _component(path: Any, x: Any, dtype: Any) -> str:
    fields = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    accumulated = low_precision.is_accumulator(path)
    for name in reversed(fields):
        if name in _FIELD_COMPONENTS:
            found = _FIELD_COMPONENTS[name]
            return "accumulated gradients" if found == "moments" and accumulated else found
    if _is_key(dtype):
        return "keys"
    if jnp.issubdtype(dtype, jnp.inexact) and len(getattr(x, "shape", ())) >= 1:  # complex too
        return "accumulated gradients" if accumulated else "moments"
    return "other"


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """What ``state_bytes`` counted: the bytes of the parameters and the optimizer state.

    Attributes:
        parameters: how many parameters: the elements of the floating (and complex) arrays of
            ``params``.
        total: bytes of ``params`` and ``opt_state`` together.
        by_component: ``total`` split by component (read-only), in this order, components without
            bytes left out: ``"parameters"``; ``"moments"`` (the optimizer's floating state arrays:
            Adam's ``mu`` and ``nu``, momentum, in any dtype, and the 8-bit values of a
            ``QuantizedArray``); ``"scales"`` (the block scales of ``QuantizedArray``s);
            ``"compensation"`` (Kahan buffers); ``"keys"`` (rounding keys, typed PRNG keys);
            ``"accumulated gradients"`` (``optax.MultiSteps``' ``acc_grads``); ``"other"`` (counts,
            hyperparameters, loss scales, flags).

    ``bytes_per_parameter`` is ``total / parameters``; ``str()`` gives a table.

    Example:
        >>> import jax.numpy as jnp, optax, jmp_lite
        >>> params = {"w": jnp.zeros((1024, 1024))}
        >>> report = jmp_lite.memory.state_bytes(params, optax.adam(1e-3).init(params))
        >>> dict(report.by_component)  # float32 weights and moments; "other": Adam's int32 count
        {'parameters': 4194304, 'moments': 8388608, 'other': 4}
    """

    parameters: int
    total: int
    by_component: Mapping[str, int]

    @property
    def bytes_per_parameter(self) -> float:
        """``total / parameters``."""
        return self.total / self.parameters

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The counts, with ``bytes_per_parameter``, as JSON-ready values."""
        return {**reports.plain(self), "bytes_per_parameter": self.bytes_per_parameter}

    def table(self) -> str:
        """The table ``str()`` gives: bytes by component, per parameter and as a share."""
        lines = [
            f"{self.bytes_per_parameter:.2f} bytes per parameter: {format_bytes(self.total)} for "
            f"{self.parameters:,} parameters",
        ]
        width = max(len("component"), *(len(k) for k in self.by_component))
        lines.append(f"{'component'.ljust(width)}  {'bytes':>10}  {'per parameter':>13}  share")
        for name, n in self.by_component.items():
            lines.append(
                f"{name.ljust(width)}  {format_bytes(n):>10}  {n / self.parameters:13.4f}  "
                f"{n / self.total:6.1%}"
            )
        return "\n".join(lines)


def state_bytes(params: Any, opt_state: Any) -> StateBytes:
    """The bytes of ``params`` and ``opt_state``, per parameter and by component.

    Counts what a training step keeps between steps (gradients aside, which have the parameters'
    dtypes): every leaf's ``shape`` times its dtype's item size, a typed PRNG key by its raw data. Each
    leaf of ``opt_state`` is given a component from the ``NamedTuple`` field names on its key path,
    never from its position: ``block_scales`` are scales, ``kahan_compensation`` and
    ``state_compensation`` compensation, ``param_rounding_key`` and ``state_rounding_key`` keys,
    ``quantized_values`` and other floating arrays with at least one dimension (``mu``, ``nu``,
    ``trace``) moments (accumulated gradients under ``optax.MultiSteps``' ``acc_grads``), and the
    rest (counts, scalar hyperparameters, loss scales) other. Nothing is computed on a device, and
    leaves may be ``jax.ShapeDtypeStruct`` (``jax.eval_shape(tx.init, params)``), so a model larger
    than the machine can be counted.

    Args:
        params: the parameters (any pytree of arrays or ``jax.ShapeDtypeStruct``).
        opt_state: the optimizer state, e.g. ``tx.init(params)``.

    Returns:
        A ``StateBytes``: ``parameters`` (the floating and complex elements of ``params``), ``total``,
        ``bytes_per_parameter`` and ``by_component``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> params = {"w": jnp.zeros((1024, 1024), jnp.bfloat16)}
        >>> adam8 = jmp_lite.low_precision_state(optax.adam(1e-3), "int8")  # 8-bit moments
        >>> tx = optax.chain(adam8, jmp_lite.kahan_summation())
        >>> print(jmp_lite.memory.state_bytes(params, jax.eval_shape(tx.init, params)))
        6.03 bytes per parameter: 6.32 MB for 1,048,576 parameters
        component          bytes  per parameter  share
        parameters       2.10 MB         2.0000  33.2%
        moments          2.10 MB         2.0000  33.2%
        scales          32.77 kB         0.0312   0.5%
        compensation     2.10 MB         2.0000  33.2%
        keys                 8 B         0.0000   0.0%
        other                4 B         0.0000   0.0%
    """
    counts: dict[str, int] = {}
    n = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        size, dtype = _leaf_bytes(x, f"params{jax.tree_util.keystr(path)}")
        counts["parameters"] = counts.get("parameters", 0) + size
        if jnp.issubdtype(dtype, jnp.inexact):  # a complex parameter is one parameter, of 8 or 16 bytes
            n += math.prod(getattr(x, "shape", ()))
    if n == 0:
        raise ValueError(
            "state_bytes: params holds no floating or complex array, so there is no parameter to count "
            "per; pass the parameters the optimizer state was made for"
        )
    # nnx.Optimizer's state holds a QuantizedArray as a mapping of its fields: count it as one
    for path, x in jax.tree_util.tree_flatten_with_path(quantized_state.rebuilt(opt_state))[0]:
        size, dtype = _leaf_bytes(x, f"opt_state{jax.tree_util.keystr(path)}")
        name = _component(path, x, dtype)
        counts[name] = counts.get(name, 0) + size
    by_component = {c: counts[c] for c in COMPONENTS if counts.get(c)}
    return StateBytes(n, sum(counts.values()), types.MappingProxyType(by_component))
