"""``autocast``: mixed precision for any JAX function, as a program transformation.

``autocast(fun, policy)`` traces ``fun`` to a jaxpr and evaluates it again with
per-primitive dtype rules, in the spirit of ``torch.autocast`` (PyTorch's
automatic mixed precision, after Micikevicius et al., 2018, "Mixed Precision
Training"):

* ``dot_general`` and ``conv_general_dilated`` (matmul, einsum, Dense, Conv,
  attention scores) take operands in the compute dtype, accumulate in float32
  and return the compute dtype (``jmp_lite.accumulate``, forward and backward);
* range- and accumulation-sensitive ops (exp, log, rsqrt, pow, erf, sums,
  cumulative sums, ...) run in float32;
* everything else runs in the dtype its operands arrive in, the widest winning;
* integer, boolean, PRNG-key and float64 values are never changed;
* floating outputs are cast to ``policy.output``.

The rewrite goes inside nested ``jax.jit``, ``lax.scan``, ``lax.while_loop``,
``lax.cond``/``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp``
(the custom rule is kept, see ``autocast``), ``shard_map`` and
``jax.named_scope``s. Differentiation is JAX's own: the casts are part of the
program, so ``jax.grad`` of an autocast function returns gradients in the
dtype of the arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util  # name stacks of re-emitted ops (as jax.core.eval_jaxpr does)
from jax.extend import core as jcore

from jmp_lite._src import accumulate
from jmp_lite._src import primitive_rules as _autocast_rules
from jmp_lite._src.policy import Policy, get_policy

__all__ = ["autocast", "float32_region"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
# Dtypes the rules may change; float64 (x64) and fp8 values are left alone.
_CASTABLE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), _F32)
_FLOAT32_SCOPE = "jmp_lite_float32_region"
_SCOPE_PREFIX = "scope:"
_CACHE_SIZE = 64
# True while autocast traces a user function (set in _trace): float32_region warns otherwise.
TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_lite_autocast_tracing", default=False)


@contextlib.contextmanager
def float32_region() -> Iterator[None]:
    """Keeps the ops traced inside the ``with`` block in float32 under ``autocast``.

    Contractions inside run in float32 too. Outside a function that ``autocast``
    is tracing it changes nothing, so it warns (once per call site).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def f(x, w):
        ...     with jmp_lite.float32_region():
        ...         return x @ w
        >>> x = jnp.ones((2, 3))
        >>> jmp_lite.autocast(f, "p=f32,c=bf16,o=bf16")(x, x.T).dtype
        dtype(bfloat16)
        >>> "bf16" in str(jax.make_jaxpr(jmp_lite.autocast(f, "p=f32,c=bf16,o=f32"))(x, x.T))
        False
    """
    if not TRACING.get():
        warnings.warn(
            "jmp_lite.float32_region() is used outside jmp_lite.autocast, where it changes "
            "nothing: call the function through autocast(fun, policy) (or @autocast(policy)).",
            stacklevel=3,  # the user's `with` line (this generator, contextlib, the caller)
        )
    with jax.named_scope(_FLOAT32_SCOPE):
        yield


class _Ctx(NamedTuple):
    compute: np.dtype
    rules: Mapping[str, str]
    scope: tuple[str, ...]  # named scopes around the current jaxpr (for rule matching)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _cast(x: Any, dtype: Any) -> Any:
    """Casts a castable floating value to ``dtype``; everything else passes through."""
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype or np.dtype(x.dtype) not in _CASTABLE or dtype not in _CASTABLE:
        return x
    return lax.convert_element_type(x, dtype)


def _as_array(x: Any, aval: Any) -> Any:
    """Literals come as numpy/Python scalars; give them the dtype they were traced with."""
    return x if hasattr(x, "shape") else np.asarray(x, aval.dtype)


def _scope_names(scope: tuple[str, ...], name_stack: Any) -> list[str]:
    names = [p for s in scope for p in s.split("/") if p]
    names += [p for p in str(name_stack).split("/") if p]
    return names


def _in_scope(names: list[str], wanted: str) -> bool:
    # transformed scopes read e.g. "jvp(block)" or "transpose(jvp(block))"
    return any(n == wanted or n.endswith(f"({wanted})") or f"({wanted})" in n for n in names)


def _mode(eqn: Any, ctx: _Ctx) -> str:
    names = _scope_names(ctx.scope, eqn.source_info.name_stack)
    mode = None
    for key, value in ctx.rules.items():
        if key.startswith(_SCOPE_PREFIX) and _in_scope(names, key[len(_SCOPE_PREFIX) :]):
            mode = value
    if _in_scope(names, _FLOAT32_SCOPE):
        mode = "float32"
    if mode is not None:
        return mode
    return ctx.rules.get(eqn.primitive.name, _autocast_rules.default_mode(eqn.primitive.name))


def _bind(eqn: Any, args: list, params: Mapping[str, Any] | None = None) -> list:
    # call-like primitives are bound with other params than they record (as in eval_jaxpr)
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    out = eqn.primitive.bind(*args, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _as_written(eqn: Any, args: list) -> list:
    return _bind(eqn, [_cast(a, v.aval.dtype) for a, v in zip(args, eqn.invars)])


def _is_weak(v: Any) -> bool:
    # The jaxpr has already made Python scalars strong ("mul a 2.0:f32[]"); a literal is
    # a constant written in the code, so it must not widen the op (as in jnp's promotion).
    return isinstance(v, jcore.Literal) or v.aval.weak_type


def _widest(args: list, eqn: Any) -> Any:
    strong = [a.dtype for a, v in zip(args, eqn.invars) if _is_float(a.dtype) and not _is_weak(v)]
    dtypes = strong or [a.dtype for a in args if _is_float(a.dtype)]
    return functools.reduce(jnp.promote_types, dtypes) if dtypes else None


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


def _contract(eqn: Any, args: list, dtype: np.dtype, accumulate_f32: bool = True) -> list:
    request = _precision_request(eqn.params.get("precision"))
    if request == "algorithm":
        return _as_written(eqn, args)  # the operand and accumulation dtypes are the algorithm's
    if request == "float32":
        dtype = _F32  # an explicit precision=HIGHEST is honoured: this contraction runs in float32
    lhs, rhs = (_cast(a, dtype) for a in args)
    if all(a.dtype == v.aval.dtype for a, v in zip((lhs, rhs), eqn.invars)):
        return _bind(eqn, [lhs, rhs])  # the program's own contraction (all-float32 policy)
    params = dict(eqn.params)
    pet = params.pop("preferred_element_type", None)
    if pet is not None and not (_is_float(pet) and np.dtype(pet) in _CASTABLE):
        return _as_written(eqn, args)  # integer or fp8 accumulation: not ours to change
    if accumulate_f32 and accumulate.is_accumulated(lhs.dtype, rhs.dtype):
        fn = accumulate.dot_general if eqn.primitive is lax.dot_general_p else accumulate.conv_general_dilated
        return [fn(lhs, rhs, **params)]
    return _bind(eqn, [lhs, rhs], {**params, "preferred_element_type": None})


def _eval_eqn(eqn: Any, args: list, ctx: _Ctx) -> list:
    handler = _HIGHER_ORDER.get(eqn.primitive.name)
    if handler is not None:
        try:
            return handler(eqn, args, ctx)
        except (TypeError, ValueError, NotImplementedError):
            # a parameter layout this version does not know: run it as written
            return _as_written(eqn, args)
    if eqn.primitive.name == "convert_element_type":
        (x,) = args
        if np.dtype(eqn.invars[0].aval.dtype) == np.dtype(eqn.params["new_dtype"]) and _is_float(x.dtype):
            return [x]  # a weak-type change in the traced program, not a dtype change
        return _bind(eqn, args)
    floats = {np.dtype(v.aval.dtype) for v in eqn.invars if _is_float(v.aval.dtype)}
    if not floats:
        return _bind(eqn, args)
    mode = _mode(eqn, ctx)
    if mode == "as_written" or len(floats) > 1 or _F64 in floats:
        return _as_written(eqn, args)
    if eqn.primitive.name in _autocast_rules.COMPUTE:
        if mode == "float32":
            return _contract(eqn, args, _F32)
        if mode != "follow":
            return _contract(eqn, args, ctx.compute, accumulate_f32=mode == "compute")
        target = _widest(args, eqn)
        return _contract(eqn, args, target, accumulate_f32=False)
    if mode in ("compute", "compute_no_accumulate"):
        target = ctx.compute
    elif mode == "float32":
        widest = _widest(args, eqn)
        target = _F32 if widest in _CASTABLE else widest
    else:
        target = _widest(args, eqn)
    cast = [_cast(a, target) if _is_float(v.aval.dtype) else a for a, v in zip(args, eqn.invars)]
    try:
        return _bind(eqn, cast)
    except (TypeError, ValueError):
        return _as_written(eqn, args)


def _eval_jaxpr(jaxpr: Any, consts: list, args: list, ctx: _Ctx) -> list:
    env: dict = {}

    def read(v: Any) -> Any:
        return _as_array(v.val, v.aval) if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
            outs = _eval_eqn(eqn, ins, ctx)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _eval_closed(closed: Any, args: list, ctx: _Ctx) -> list:
    return _eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), ctx)


def _inner(eqn: Any, ctx: _Ctx) -> _Ctx:
    return ctx._replace(scope=(*ctx.scope, str(eqn.source_info.name_stack)))


def _join_dtypes(a: list, b: list) -> list:
    return [jnp.promote_types(x, y) if _is_float(x) and _is_float(y) else x for x, y in zip(a, b)]


def _cast_all(xs: Any, dtypes: list) -> list:
    return [_cast(x, d) for x, d in zip(xs, dtypes)]


def _pjit(eqn: Any, args: list, ctx: _Ctx) -> list:
    p = eqn.params
    shardings = (*p["in_shardings"], *p["out_shardings"])
    if any(type(s).__name__ != "UnspecifiedValue" for s in shardings):
        return _as_written(eqn, args)  # explicit shardings: kept by running the call as written
    inner = _inner(eqn, ctx)

    def body(*xs: Any) -> list:
        return _eval_closed(p["jaxpr"], list(xs), inner)

    body.__name__ = p["name"]
    return list(jax.jit(body, inline=p["inline"], keep_unused=p["keep_unused"])(*args))


def _remat(eqn: Any, args: list, ctx: _Ctx) -> list:
    p, inner = eqn.params, _inner(eqn, ctx)

    def body(*xs: Any) -> list:
        return _eval_jaxpr(p["jaxpr"], [], list(xs), inner)

    return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*args))


def _loop_carry_dtypes(step: Callable[[list], list], init: list) -> list:
    """Carry dtypes at which a loop body is stable: widen until the body returns them."""
    dtypes = [x.dtype for x in init]
    for _ in range(3):
        spec = [jax.ShapeDtypeStruct(x.shape, d) for x, d in zip(init, dtypes)]
        out = [o.dtype for o in jax.eval_shape(lambda *c: step(list(c)), *spec)]
        widened = _join_dtypes(dtypes, out)
        if widened == dtypes:
            break
        dtypes = widened
    return dtypes


def _scan(eqn: Any, args: list, ctx: _Ctx) -> list:
    p, inner = eqn.params, _inner(eqn, ctx)
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]
    x0 = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]

    def carry_step(carry: list) -> list:
        fake_x = [jnp.zeros(s.shape, s.dtype) for s in x0]
        return _eval_closed(p["jaxpr"], [*consts, *carry, *fake_x], inner)[:nk]

    dtypes = _loop_carry_dtypes(carry_step, init)

    def body(carry: list, x: list) -> tuple:
        outs = _eval_closed(p["jaxpr"], [*consts, *carry, *x], inner)
        return _cast_all(outs[:nk], dtypes), outs[nk:]

    carry, ys = lax.scan(
        body,
        _cast_all(init, dtypes),
        list(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carry, *ys]


def _while(eqn: Any, args: list, ctx: _Ctx) -> list:
    p, inner = eqn.params, _inner(eqn, ctx)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]

    def step(carry: list) -> list:
        return _eval_closed(p["body_jaxpr"], [*bconsts, *carry], inner)

    dtypes = _loop_carry_dtypes(step, init)
    out = lax.while_loop(
        lambda c: _eval_closed(p["cond_jaxpr"], [*cconsts, *c], inner)[0],
        lambda c: _cast_all(step(list(c)), dtypes),
        _cast_all(init, dtypes),
    )
    return list(out)


def _cond(eqn: Any, args: list, ctx: _Ctx) -> list:
    p, inner = eqn.params, _inner(eqn, ctx)
    index, ops = args[0], args[1:]
    branches = [functools.partial(_eval_closed, b, ctx=inner) for b in p["branches"]]
    shapes = [jax.eval_shape(lambda *o, f=f: f(list(o)), *ops) for f in branches]
    dtypes = functools.reduce(_join_dtypes, [[s.dtype for s in out] for out in shapes])
    fns = [lambda *o, f=f: _cast_all(f(list(o)), dtypes) for f in branches]
    return list(lax.switch(index, fns, *ops))


def _original(eqn: Any) -> Callable[..., tuple]:
    """The custom-derivative call exactly as the program traced it (with its rule)."""

    def call(*xs: Any) -> tuple:
        return tuple(_as_written(eqn, list(xs)))

    return call


def _custom_jvp(eqn: Any, args: list, ctx: _Ctx) -> list:
    # The primal is rewritten. The user's JVP rule is traced at the dtypes the program
    # was traced with and that program is rewritten too, so the rule's math is kept and
    # runs under the same dtype rules (no casts back to the traced dtypes).
    inner = _inner(eqn, ctx)
    closed = eqn.params["call_jaxpr"]
    in_avals = [v.aval for v in eqn.invars]
    floating = [_is_float(a.dtype) for a in in_avals]
    original = _original(eqn)
    out_dtypes = [o.dtype for o in jax.eval_shape(lambda *a: _eval_closed(closed, list(a), inner), *args)]

    def jvp_of(primals: list, tangents: list) -> list:
        full = iter(tangents)
        tans = [next(full) if f else np.zeros(a.shape, jax.dtypes.float0) for a, f in zip(in_avals, floating)]
        out, tan = jax.jvp(original, tuple(primals), tuple(tans))
        return [*out, *tan]

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    jvp_jaxpr = jax.make_jaxpr(jvp_of)(specs, [s for s, f in zip(specs, floating) if f])

    @jax.custom_jvp
    def fn(*xs: Any) -> tuple:
        return tuple(_eval_closed(closed, list(xs), inner))

    @fn.defjvp
    def _(primals: tuple, tangents: tuple) -> tuple:
        tans = [t for t, f in zip(tangents, floating) if f]
        outs = _cast_all(_eval_closed(jvp_jaxpr, [*primals, *tans], inner), out_dtypes * 2)
        return tuple(outs[: len(out_dtypes)]), tuple(outs[len(out_dtypes) :])

    return list(fn(*args))


def _custom_vjp(eqn: Any, args: list, ctx: _Ctx) -> list:
    # The primal is rewritten; under differentiation the forward and the user's backward
    # run as traced (their dtypes), cotangents cast at the boundary.
    inner = _inner(eqn, ctx)
    closed = eqn.params["call_jaxpr"]
    orig_in = [v.aval.dtype for v in eqn.invars]
    orig_out = [v.aval.dtype for v in eqn.outvars]
    in_dtypes = [a.dtype for a in args]
    original = _original(eqn)
    out_dtypes = [o.dtype for o in jax.eval_shape(lambda *a: _eval_closed(closed, list(a), inner), *args)]

    @jax.custom_vjp
    def fn(*xs: Any) -> tuple:
        return tuple(_eval_closed(closed, list(xs), inner))

    def fwd(*xs: Any) -> tuple:
        out, vjp = jax.vjp(original, *_cast_all(xs, orig_in))
        return tuple(_cast_all(out, out_dtypes)), vjp

    def bwd(vjp: Any, cts: tuple) -> tuple:
        return tuple(_cast_all(vjp(tuple(_cast_all(cts, orig_out))), in_dtypes))

    fn.defvjp(fwd, bwd)
    return list(fn(*args))


def _shard_map(eqn: Any, args: list, ctx: _Ctx) -> list:
    p, inner = eqn.params, _inner(eqn, ctx)

    def body(*xs: Any) -> tuple:
        return tuple(_eval_jaxpr(p["jaxpr"], [], list(xs), inner))

    mapped = jax.shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p["check_vma"],
        axis_names=set(p["newly_manual_axes"]),
    )
    return list(mapped(*args))


def _through_float32(bind: Callable[..., Any], args: list) -> Any:
    """``bind(*args)`` (a 16-bit first operand, the rest non-floating) run on a float32 copy.

    JAX's derivative rules of these ops sum (a broadcast transposes to a sum, ``reduce_max``
    counts and sums its maxima, a gather transposes to a scatter-add). On float32 copies
    those sums run in float32 under ``jax.grad`` and are rounded once (the table's rule
    for sums); the values are the same (the copy is exact), XLA fuses the conversions
    into the op, and forward-mode differentiation still works.
    """
    x, *rest = args
    return bind(x.astype(_F32), *rest).astype(x.dtype)


def _expanded(x: Any, shape: tuple) -> Any:
    """``x`` broadcast to ``shape`` explicitly (its transpose, a sum, in float32)."""
    if x.shape == shape:
        return x
    dims = tuple(range(len(shape))) if x.ndim == len(shape) else tuple(range(len(shape) - x.ndim, len(shape)))
    return _through_float32(lambda y: lax.broadcast_in_dim(y, shape, dims), [x])


def _summing_grad(eqn: Any, args: list, ctx: _Ctx) -> list:
    # The table's rule for the op, as for any other op; on 16-bit values, the sums of its
    # derivative run in float32 (see _through_float32).
    floats = [_is_float(v.aval.dtype) for v in eqn.invars]
    traced = {np.dtype(v.aval.dtype) for v, f in zip(eqn.invars, floats) if f}
    mode = _mode(eqn, ctx)
    if (
        len(traced) != 1
        or not traced <= set(_CASTABLE)
        or mode == "as_written"
        or eqn.primitive.multiple_results
    ):
        return _as_written(eqn, args)  # no floats, several dtypes, float64: as the general path does
    if mode in ("compute", "compute_no_accumulate"):
        target = ctx.compute
    elif mode == "float32":
        target = _F32
    else:
        target = _widest(args, eqn)
    args = [_cast(a, target) if f else a for a, f in zip(args, floats)]
    if np.dtype(target) not in _CASTABLE[:2]:
        return _bind(eqn, args)
    if eqn.primitive.name in _SUMMING_GRAD:
        if floats[0] and not any(floats[1:]):
            return [_through_float32(lambda *xs: _bind(eqn, list(xs))[0], args)]
        return _bind(eqn, args)
    # elementwise ops broadcast size-1 axes implicitly and sum them in their transposes
    shape = tuple(eqn.outvars[0].aval.shape)
    return _bind(eqn, [_expanded(a, shape) if f else a for a, f in zip(args, floats)])


# Ops whose derivative rules sum (see _through_float32), and elementwise ops whose
# implicit size-1 broadcasting transposes to a sum.
_SUMMING_GRAD = ("broadcast_in_dim", "reduce_max", "reduce_min", "cummax", "cummin", "gather",
                 "reduce_window_max", "reduce_window_min")  # fmt: skip
_BROADCASTING = ("add", "sub", "mul", "div", "max", "min", "rem", "atan2", "select_n", "clamp", "nextafter")

_HIGHER_ORDER: dict[str, Callable[[Any, list, _Ctx], list]] = {
    **dict.fromkeys(_SUMMING_GRAD + _BROADCASTING, _summing_grad),
    "jit": _pjit,
    "pjit": _pjit,
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}


def _check_rules(rules: Mapping[str, str] | None) -> dict[str, str]:
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise TypeError(f"autocast rules must be a mapping of str to mode, got {type(rules).__name__}")
    for key, value in rules.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"autocast rules keys must be primitive names (e.g. 'exp') or 'scope:<name>', got {key!r}"
            )
        if not key.startswith(_SCOPE_PREFIX) and key not in _autocast_rules.primitive_names():
            known = _autocast_rules.primitive_names(refresh=True)  # a primitive defined since
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
                raise ValueError(
                    f"autocast rule key {key!r} is not a JAX primitive name; {hint}"
                    f"keys are primitive names as jax.make_jaxpr prints them (e.g. 'exp', "
                    f"'dot_general', 'reduce_sum') or 'scope:<jax.named_scope name>'"
                )
        if value not in _autocast_rules.MODES:
            raise ValueError(
                f"autocast rule {key!r}: {value!r} is not a mode; "
                f"accepted: {', '.join(_autocast_rules.MODES)}"
            )
    return dict(rules)


def _to_policy(policy: Any) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    raise TypeError(
        f"autocast needs a jmp_lite.Policy or a policy string such as 'p=f32,c=bf16,o=f32', "
        f"got {type(policy).__name__}: {policy!r}"
    )


_CONTRACTION_HELP = (
    "jmp_lite.autocast: the backend has no kernel for a 16-bit contraction with float32 "
    "accumulation in this layout. Work around it with autocast(fun, policy, "
    "rules={'dot_general': 'compute_no_accumulate', 'conv_general_dilated': "
    "'compute_no_accumulate'}) (16-bit contractions as jax.lax runs them) and report the "
    "shapes to jmp_lite."
)


class _Decorator:
    """What ``autocast(policy)`` returns: applied to a function, that function under autocast."""

    def __init__(self, policy: Policy, rules: dict[str, str]) -> None:
        self._policy, self._rules = policy, rules

    def __call__(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        return autocast(fun, self._policy, rules=self._rules)

    def __enter__(self) -> None:
        raise TypeError(
            "jmp_lite.autocast is a function transformation, not a context manager: it has to "
            "trace the whole function. Write autocast(fun, policy) or decorate the function with "
            "@jmp_lite.autocast(policy); inside it, `with jmp_lite.float32_region():` keeps a "
            "block in float32."
        )

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"jmp_lite.autocast({self._policy!r}) decorator"


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
    fun: Callable[..., Any] | Policy | str,
    policy: Policy | str | None = None,
    *,
    rules: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """Returns ``fun`` evaluated under mixed-precision dtype rules.

    ``autocast(fun, policy)`` traces ``fun`` for the shapes and dtypes of its
    array arguments (non-array leaves such as Python numbers and strings are
    static: a new value retraces), rewrites the program with the rules below
    and caches the rewritten program per input signature. ``autocast(policy)``
    is the decorator form.

    Rules (``rules`` maps a primitive name, or ``"scope:<named scope>"``, to a
    mode and overrides the defaults; modes: ``"compute"``,
    ``"compute_no_accumulate"`` (16-bit contractions without float32
    accumulation, forward mode works), ``"float32"``, ``"follow"``,
    ``"as_written"``):

    * ``dot_general``/``conv_general_dilated``: operands in ``policy.compute``;
      with a 16-bit compute dtype the product accumulates in float32 and is
      rounded once to the compute dtype, ``y = round_c(sum_k x_ik w_kj)``
      (forward and backward, ``jmp_lite.accumulate``).
    * exp, log, log1p, expm1, logistic, sqrt, rsqrt, pow, erf, erf_inv,
      reduce_sum/prod, cumsum/cumprod/cumlogsumexp, ...: float32.
    * listed elementwise and data-movement ops: the dtype the operands arrive
      in, the widest winning (weak Python scalars never widen).
    * anything else, and integer/boolean/key/float64 values: as written.
    * floating outputs (not float64) are cast to ``policy.output``.

    Under ``jax.grad`` the table holds in the backward pass too: contractions
    accumulate in float32, and the sums that derivative rules add (the transpose
    of a broadcast, of ``reduce_max``, of a gather) run in float32. An explicit
    ``precision=jax.lax.Precision.HIGHEST`` (or ``"highest"``/``"float32"``) on a
    contraction is honoured: it runs in float32; an explicit dot algorithm runs
    as written.

    ``autocast`` is not a context manager (it must trace the whole function):
    ``with autocast(policy):`` raises a ``TypeError`` naming the two forms.

    Higher-order primitives are rewritten inside: nested ``jit`` (without
    explicit shardings), ``scan``, ``while``, ``cond``, ``checkpoint`` and
    ``shard_map``. A ``custom_jvp``/``custom_vjp`` function's primal body is
    rewritten; its derivative rule is the user's own, evaluated at the dtypes
    it was traced with, with casts at its boundary.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> @jmp_lite.autocast("params=float32,compute=bfloat16,output=float32")
        ... def loss(w, x):
        ...     return jnp.mean(jnp.exp(jnp.tanh(x @ w)))
        >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
        >>> loss(w, x).dtype, jax.grad(loss)(w, x).dtype
        (dtype('float32'), dtype('float32'))
        >>> program = str(jax.make_jaxpr(loss)(w, x))
        >>> "bf16[2,4] = convert_element_type" in program  # x cast for the matmul
        True
        >>> def precise(w, x):
        ...     return jnp.matmul(x, w, precision="highest")
        >>> precise = jmp_lite.autocast(precise, "p=f32,c=bf16,o=f32")
        >>> "bf16" in str(jax.make_jaxpr(precise)(w, x))  # precision=HIGHEST is honoured
        False
    """
    if policy is None:
        if callable(fun) and not isinstance(fun, (Policy, str)):
            raise TypeError("autocast(fun, policy): a policy is required")
        return _Decorator(_to_policy(fun), _check_rules(rules))
    if not callable(fun):
        raise TypeError(f"autocast expects a callable as its first argument, got {type(fun).__name__}")
    pol = _to_policy(policy)
    ctx = _Ctx(np.dtype(pol.compute), _check_rules(rules), ())
    output = np.dtype(pol.output)
    cache: dict = {}

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
        static = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
        values = [leaves[i] for i in dynamic]
        # full avals (weak types, shard_map's varying axes) and the mesh in context
        key = (treedef, static, tuple(jax.typeof(x) for x in values), str(jax.sharding.get_abstract_mesh()))
        try:
            entry = cache.get(key)
        except TypeError as e:  # an unhashable static leaf
            raise TypeError(f"autocast: non-array arguments must be hashable (they are static): {e}") from e
        if entry is None:
            entry = _trace(fun, leaves, dynamic, treedef, values, ctx, output)
            if not any(isinstance(c, jax.core.Tracer) for c in entry[0].consts):
                if len(cache) >= _CACHE_SIZE:
                    cache.pop(next(iter(cache)))
                cache[key] = entry
        closed, out_tree = entry
        try:
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *values)
        except jax.errors.JaxRuntimeError as e:
            if "DotThunk" in str(e) or "Unsupported element type" in str(e):
                e.add_note(_CONTRACTION_HELP)
            raise
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


def _trace(
    fun: Callable[..., Any],
    leaves: list,
    dynamic: list[int],
    treedef: Any,
    values: list,
    ctx: _Ctx,
    output: np.dtype,
) -> tuple:
    """Traces ``fun`` and returns (rewritten closed jaxpr, output treedef)."""
    out_tree: list = []

    def flat(*xs: Any) -> list:
        full = list(leaves)
        for i, x in zip(dynamic, xs):
            full[i] = x
        args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        outs, tree = jax.tree_util.tree_flatten(fun(*args, **kwargs))
        for out in outs:
            if not isinstance(out, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
                name = getattr(fun, "__qualname__", None) or repr(fun)
                raise TypeError(
                    f"autocast: {name} returned a {type(out).__name__} ({out!r:.60}); an autocast "
                    "function must return arrays, Python or NumPy scalars, or pytrees of them "
                    "(a tuple, list or dict of arrays; None leaves are fine)"
                )
        out_tree.append(tree)
        return outs

    token = TRACING.set(True)
    try:
        original = jax.make_jaxpr(flat)(*values)
    finally:
        TRACING.reset(token)

    def rewritten(*xs: Any) -> list:
        outs = _eval_closed(original, list(xs), ctx)
        return [_cast(o, output) if _is_float(o.dtype) else o for o in outs]

    return jax.make_jaxpr(rewritten)(*values), out_tree[0]
