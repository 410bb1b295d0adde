"""The one interpreter: a jaxpr evaluated again, equation by equation, by every program rewrite.

Every rewrite of jmp_lite (the engine's dtype rules, FSDP's gathers at first use, the precision
report's lifted constants, float32 accumulation in a transposed contraction) is a function that says
what one equation becomes; ``evaluate`` is the loop all of them share, the one place that reads
operands, re-emits an equation under its own name stack and source location, and writes its results.
It is the genre of ``jax.core.eval_jaxpr`` (and of Equinox's jaxpr finalisation), with the two things a
rewrite needs on top: names that survive the re-emission (XLA's op names, ``jax.named_scope`` paths,
profiles read them), and a hook per equation.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._src import interpret
    >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    >>> interpret.evaluate(closed.jaxpr, closed.consts, [0.0], lambda i, eqn, env: None)
    [Array(0., dtype=float32, weak_type=True)]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jmp_lite._src import primitive_rules
from jmp_lite._src.base import compat
from jmp_lite._src.base.compat import source_info_util  # JAX's name stacks: the one internal a rewrite needs

__all__ = [
    "Bodies",
    "Env",
    "bind",
    "current_name_stack",
    "current_scope",
    "evaluate",
    "reemitted",
    "rewrite_body",
    "spec_of",
    "zeros",
]


class Env(dict):
    """The values of one evaluation, by variable; a literal reads as its value."""

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else self[v]


# equation(index, eqn, env) -> the equation's outputs, or None: bound as written (``bind``), unless the hook
# wrote the outputs itself or left them unwritten on purpose (``SKIP``)
Equation = Callable[[int, Any, Env], "Sequence[Any] | None"]
SKIP: list = []  # a hook's answer for "nothing to write": the equation is replaced elsewhere


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    equation: Equation,
    *,
    names: Callable[[Any], Any] | None = None,
    env: Env | None = None,
    read_out: Callable[[Env, Any], Any] | None = None,
) -> list:
    """Evaluates ``jaxpr`` on ``args``: each equation ``jaxpr.eqns[index]`` re-emitted by
    ``equation(index, eqn, env)``, under its name stack (``names(stack)`` rewrites it first, e.g. to drop
    marks) appended to the current one and its source location, so that the re-emitted program keeps
    the names the user's program had.

    ``equation`` returns the outputs (a list), ``None`` for "bind it as written", or ``SKIP`` when it
    wrote nothing (an equation replaced by another one). ``read_out(env, v)`` reads the program's
    outputs (default: ``env.read``).
    """
    env = Env() if env is None else env
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
        with reemitted(eqn, names):
            outs = equation(index, eqn, env)
            if outs is None:
                outs = bind(eqn, [env.read(v) for v in eqn.invars])
        if outs is not SKIP:
            env.update(zip(eqn.outvars, outs))
    read = env.read if read_out is None else (lambda v: read_out(env, v))
    return [read(v) for v in jaxpr.outvars]


def reemitted(
    eqn: Any, names: Callable[[Any], Any] | None = None, base: Any = None
) -> contextlib.AbstractContextManager:
    """A context in which emitted operations take ``eqn``'s name stack (below the current one, or below
    ``base``, a ``current_name_stack()`` taken earlier) and source location: JAX's own ``user_context``,
    entered once per equation, with no wrapper of ours around it."""
    own = eqn.source_info.name_stack
    below = source_info_util.current_name_stack() if base is None else base
    stack = below + (own if names is None else names(own))
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)


def current_name_stack() -> Any:
    """The name stack operations emitted now take (for ``reemitted``'s ``base``)."""
    return source_info_util.current_name_stack()


def current_scope() -> str:
    """The name stack operations are emitted under now (``jax.named_scope`` paths, as a string)."""
    return str(source_info_util.current_name_stack())


def bind(eqn: Any, args: Sequence[Any], params: Mapping[str, Any] | None = None) -> list:
    """``eqn``'s primitive bound on ``args`` (with ``params`` instead of its own, where given), as
    ``jax.core.eval_jaxpr`` binds it: call-like primitives take other parameters than they record
    (``get_bind_params``), and the equation's context (a ``jax.named_scope`` it opened) is re-entered."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


class Bodies(Protocol):
    """How a rewrite evaluates the bodies of one equation, for ``rewrite_body``."""

    def run(self, body: Any, args: Sequence[Any]) -> list:
        """``body`` (a ``ClosedJaxpr``, or a ``Jaxpr`` without constants) evaluated under the rewrite."""
        ...

    def probe(self, body: Any, args: Sequence[Any]) -> list:
        """The same evaluation, only to learn the output types: nothing is recorded."""
        ...

    def in_place(self) -> Callable[[Any, Sequence[Any]], list] | None:
        """How to evaluate a ``jit``'s body in place (an observer sees each operation), or ``None``:
        the body is re-emitted as a ``jit`` of its own."""
        ...

    def memoized(self, kind: str, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The rewritten body ``make()`` builds, made once per program and rewrite (a model repeats
        its layers, and one function object lets JAX's caches hit)."""
        ...

    def as_written(self, args: Sequence[Any]) -> list:
        """The equation bound as the program traced it (its custom derivative rule kept)."""
        ...

    def cast(self, x: Any, dtype: Any) -> Any:
        """``x`` in ``dtype`` where the rewrite may change its dtype; otherwise ``x``."""
        ...

    def warn(self, key: str, message: str) -> None:
        """Tells the user once (per ``key``) that a body was rewritten otherwise than asked."""
        ...


def rewrite_body(eqn: Any, args: Sequence[Any], bodies: Bodies) -> list:
    """``eqn`` (a call, loop, branch, checkpoint, custom derivative or ``shard_map``) re-emitted as the same
    construct around its rewritten body. The carries of loops and the outputs of branches take the dtypes
    at which the rewritten body is stable (``promote_types`` of what it returns); a custom derivative's
    rule keeps its math."""
    return _BODY_REWRITES[primitive_rules.BODIES[eqn.primitive.name]](eqn, list(args), bodies)


def _join_dtypes(a: list, b: list) -> list:
    return [jnp.promote_types(x, y) if _is_float(x) and _is_float(y) else x for x, y in zip(a, b)]


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _cast_all(xs: Any, dtypes: list, bodies: Bodies) -> list:
    return [bodies.cast(x, d) for x, d in zip(xs, dtypes)]


def _jit(eqn: Any, args: list, bodies: Bodies) -> list:
    p = eqn.params
    in_place = bodies.in_place()
    if in_place is not None:
        return in_place(p["jaxpr"], args)
    shardings = (*p["in_shardings"], *p["out_shardings"])
    if any(type(s).__name__ != "UnspecifiedValue" for s in shardings):
        # Shardings say where values live, not their dtype: the rewritten body is bound as the same
        # call, with the same shardings, layouts and donations.
        closed = jax.make_jaxpr(lambda *xs: bodies.run(p["jaxpr"], xs))(*map(jax.typeof, args))
        return bind(eqn, args, {**p, "jaxpr": closed})

    def make() -> Callable[..., Any]:
        def body(*xs: Any) -> list:
            return bodies.run(p["jaxpr"], xs)

        body.__name__ = p["name"]
        return jax.jit(body, inline=p["inline"], keep_unused=p["keep_unused"])

    return list(bodies.memoized("jit", make)(*args))


def _call(eqn: Any, args: list, bodies: Bodies) -> list:
    return bodies.run(eqn.params["call_jaxpr"], args)


def _checkpoint(eqn: Any, args: list, bodies: Bodies) -> list:
    p = eqn.params

    def body(*xs: Any) -> list:
        return bodies.run(p["jaxpr"], xs)

    return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*args))


def _loop_carry_dtypes(step: Callable[[list], list], init: list) -> list:
    """Carry dtypes at which a loop body is stable: widen until the body returns them."""
    dtypes = [x.dtype for x in init]
    for _ in range(3):
        spec = [spec_of(jax.typeof(x), d) for x, d in zip(init, dtypes)]
        out = [o.dtype for o in jax.eval_shape(lambda *c: step(list(c)), *spec)]
        widened = _join_dtypes(dtypes, out)
        if widened == dtypes:
            break
        dtypes = widened
    return dtypes


def _scan(eqn: Any, args: list, bodies: Bodies) -> list:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]
    x0 = [spec_of(jax.typeof(x), shape=x.shape[1:]) for x in xs]

    def carry_step(carry: list) -> list:
        fake_x = [zeros(s) for s in x0]
        return bodies.probe(p["jaxpr"], [*consts, *carry, *fake_x])[:nk]

    dtypes = _loop_carry_dtypes(carry_step, init)

    def body(carry: list, x: list) -> tuple:
        outs = bodies.run(p["jaxpr"], [*consts, *carry, *x])
        return _cast_all(outs[:nk], dtypes, bodies), outs[nk:]

    carry, ys = lax.scan(
        body,
        _cast_all(init, dtypes, bodies),
        list(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carry, *ys]


def _while(eqn: Any, args: list, bodies: Bodies) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]
    dtypes = _loop_carry_dtypes(lambda c: bodies.probe(p["body_jaxpr"], [*bconsts, *c]), init)
    out = lax.while_loop(
        lambda c: bodies.run(p["cond_jaxpr"], [*cconsts, *c])[0],
        lambda c: _cast_all(bodies.run(p["body_jaxpr"], [*bconsts, *c]), dtypes, bodies),
        _cast_all(init, dtypes, bodies),
    )
    return list(out)


def _cond(eqn: Any, args: list, bodies: Bodies) -> list:
    branches = eqn.params["branches"]
    index, ops = args[0], args[1:]
    shapes = [jax.eval_shape(lambda *o, b=b: bodies.probe(b, o), *ops) for b in branches]
    dtypes = functools.reduce(_join_dtypes, [[s.dtype for s in out] for out in shapes])
    fns = [lambda *o, b=b: _cast_all(bodies.run(b, o), dtypes, bodies) for b in branches]
    return list(lax.switch(index, fns, *ops))


def spec_of(aval: Any, dtype: Any = None, shape: Any = None) -> jax.ShapeDtypeStruct:
    """``aval`` as a spec to trace with (of another ``dtype`` or ``shape`` if given), keeping its
    shard_map axes (varying or not) where it has any: traced without them, an invariant stand-in
    meets a varying operand and JAX refuses the op."""
    dtype = aval.dtype if dtype is None else dtype
    shape = aval.shape if shape is None else tuple(shape)
    mat = getattr(aval, "mat", None)
    if mat is None or mat.empty:
        return jax.ShapeDtypeStruct(shape, dtype)
    sharding = aval.sharding if shape == tuple(aval.shape) else None
    if sharding is None:  # a slice: the same mesh, nothing split
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)


def zeros(spec: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``spec``, varying over the shard_map axes it varies over."""
    out = jnp.zeros(spec.shape, spec.dtype)
    varying = tuple(getattr(getattr(spec, "manual_axis_type", None), "varying", ()) or ())
    return lax.pcast(out, varying, to="varying") if varying else out


def _custom_jvp(eqn: Any, args: list, bodies: Bodies) -> list:
    # The primal is rewritten. The user's JVP rule is traced at the dtypes the program
    # was traced with and that program is rewritten too, so the rule's math is kept and
    # runs under the same dtype rules (no casts back to the traced dtypes).
    closed = eqn.params["call_jaxpr"]
    in_avals = [v.aval for v in eqn.invars]
    floating = [_is_float(a.dtype) for a in in_avals]
    out_dtypes = [o.dtype for o in jax.eval_shape(lambda *a: bodies.probe(closed, a), *args)]

    def original(*xs: Any) -> tuple:
        return tuple(bodies.as_written(xs))

    def jvp_of(primals: list, tangents: list) -> list:
        full = iter(tangents)
        tans = [next(full) if f else np.zeros(a.shape, jax.dtypes.float0) for a, f in zip(in_avals, floating)]
        out, tan = jax.jvp(original, tuple(primals), tuple(tans))
        return [*out, *tan]

    # with their shard_map axes: a rule traced without them mixes invariant and varying operands
    specs = [spec_of(a) for a in in_avals]
    try:
        jvp_jaxpr = jax.make_jaxpr(jvp_of)(specs, [s for s, f in zip(specs, floating) if f])
        if any(isinstance(c, jax.core.Tracer) for c in jvp_jaxpr.consts):
            raise jax.errors.UnexpectedTracerError("a custom_jvp rule closed over a traced value")
    except jax.errors.UnexpectedTracerError:
        # The rule closes over a value traced with the function (a tracer of a finished trace): it cannot
        # be traced again once tracing ended, by jmp_lite or by jax.extend.core.jaxpr_as_fun. JAX then
        # differentiates the rewritten body instead, and the user hears of it once.
        bodies.warn(
            "custom_jvp_closure",
            "jmp_lite: a jax.custom_jvp function's JVP rule closes over a value computed inside the "
            "function under autocast/apply_policy; such a rule cannot be traced again after tracing ends "
            "(jax.extend.core.jaxpr_as_fun fails the same way), so its body is differentiated instead. "
            "Pass the value as an argument of the custom_jvp function to keep your rule.",
        )
        return bodies.run(closed, args)

    @jax.custom_jvp
    def fn(*xs: Any) -> tuple:
        return tuple(bodies.run(closed, xs))

    @fn.defjvp
    def _(primals: tuple, tangents: tuple) -> tuple:
        tans = [t for t, f in zip(tangents, floating) if f]
        outs = _cast_all(bodies.run(jvp_jaxpr, [*primals, *tans]), out_dtypes * 2, bodies)
        return tuple(outs[: len(out_dtypes)]), tuple(outs[len(out_dtypes) :])

    return list(fn(*args))


def _custom_vjp(eqn: Any, args: list, bodies: Bodies) -> list:
    # The primal is rewritten; under differentiation the forward and the user's backward
    # run as traced (their dtypes), cotangents cast at the boundary.
    closed = eqn.params["call_jaxpr"]
    orig_in = [v.aval.dtype for v in eqn.invars]
    orig_out = [v.aval.dtype for v in eqn.outvars]
    in_dtypes = [a.dtype for a in args]
    out_dtypes = [o.dtype for o in jax.eval_shape(lambda *a: bodies.probe(closed, a), *args)]

    def original(*xs: Any) -> tuple:
        return tuple(bodies.as_written(xs))

    @jax.custom_vjp
    def fn(*xs: Any) -> tuple:
        return tuple(bodies.run(closed, xs))

    def fwd(*xs: Any) -> tuple:
        out, vjp = jax.vjp(original, *_cast_all(xs, orig_in, bodies))
        return tuple(_cast_all(out, out_dtypes, bodies)), vjp

    def bwd(vjp: Any, cts: tuple) -> tuple:
        return tuple(_cast_all(vjp(tuple(_cast_all(cts, orig_out, bodies))), in_dtypes, bodies))

    fn.defvjp(fwd, bwd)
    return list(fn(*args))


def _shard_map(eqn: Any, args: list, bodies: Bodies) -> list:
    p = eqn.params

    def body(*xs: Any) -> tuple:
        return tuple(bodies.run(p["jaxpr"], xs))

    mapped = jax.shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p["check_vma"],
        axis_names=set(compat.shard_map_axis_names(p)),
    )
    return list(mapped(*args))


_BODY_REWRITES: dict[str, Callable[[Any, list, Bodies], list]] = {
    "jitted": _jit,
    "called": _call,
    "recomputed": _checkpoint,
    "scanned": _scan,
    "while_loop": _while,
    "switch": _cond,
    "jvp_rule": _custom_jvp,
    "vjp_rule": _custom_vjp,
    "mapped": _shard_map,
}
