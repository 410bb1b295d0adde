"""The mixed-precision engine: every dtype decision of jmp_lite is made by it, here and in the passes
this module runs for each equation of a program (``attention_rewrite``, ``dtype_rules`` with
``decisions`` and ``fp8_contract``, ``remat16``, ``explain_record``), on ``interpret``'s one loop.

``transform(fun, scope)`` traces ``fun`` to a jaxpr and evaluates that program
again with per-primitive dtype rules, in the spirit of ``torch.autocast``
(PyTorch's automatic mixed precision, after Micikevicius et al., 2018, "Mixed
Precision Training"):

* ``dot_general`` and ``conv_general_dilated`` (matmul, einsum, Dense, Conv,
  attention scores) take operands in the compute dtype, accumulate in float32
  and return the compute dtype (``jmp_lite.accumulate``, forward and backward);
* range- and accumulation-sensitive ops (exp, log, rsqrt, pow, erf, sums,
  cumulative sums, ...) run in float32;
* everything else runs in the dtype its operands arrive in, the widest winning;
* integer, boolean, PRNG-key and float64 values are never changed.

Front-ends say *where* a policy applies; the engine decides what it means:

* ``module_scope(label, scope)`` opens a ``jax.named_scope`` that carries a
  ``Scope`` (a policy, and whether 16-bit contractions accumulate in float32).
  Every op traced inside takes that scope's compute dtype; a scope whose compute
  dtype is float32 keeps everything inside in float32 (normalization layers).
  ``leave_scope`` casts a module's outputs to its policy's output dtype.
* ``transform(..., inputs=)`` names the arguments that are parameters and the
  dtype each enters the computation in (its module's compute dtype: a parameter
  is cast where it is used, as Flax's ``dtype`` and jmp's ``cast_to_compute``
  do); the argument itself, returned unchanged, keeps its dtype.

The rewrite goes inside nested ``jax.jit``, ``lax.scan``, ``lax.while_loop``,
``lax.cond``/``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp``
and ``shard_map``. Differentiation is JAX's own: the casts are part of the
program, so ``jax.grad`` returns gradients in the dtype of the arguments.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jmp_lite._src import interpret
from jmp_lite._src import primitive_rules as _rules
from jmp_lite._src.base import compat, validate
from jmp_lite._src.engine import (
    attention_rewrite,
    decisions,
    dtype_rules,
    explain_record,
    fp8_contract,
    recompute,
    remat16,
    scopes,
)
from jmp_lite._src.engine.explain_record import Decision  # noqa: F401  (re-exported: explain reads it here)
from jmp_lite._src.engine.roles import (  # noqa: F401  (re-exported for the front-ends)
    Fp8StateField,
    Inputs,
    ModelUnderPolicy,
    Param,
    inputs_of,
    model_under_policy,
    spread_roles,
)
from jmp_lite._src.engine.scopes import (  # noqa: F401  (the engine's vocabulary, re-exported for its front-ends)
    FLOAT32_SCOPE,
    SCOPE_RULE_PREFIX,
    Context,
    Scope,
    context,
    entering,
    leave_scope,
    mark_p,
    module_scope,
    scope_name,
    without_marks,
)

_CACHE_SIZE = 64
RECOMPUTE_CHOICES = recompute.CHOICES  # transform's ``recompute=`` (and every front-end's)


def _leaving(jaxpr: Any, to_output: tuple, output: np.dtype) -> frozenset:
    """The program's results that take a float32 output dtype and that no equation reads (a model's
    logits): where such a result is a 16-bit contraction's, ``dtype_rules.contract`` hands out its
    float32 accumulator instead of rounding it and widening it again. Built for a TPU only
    (``dtype_rules.on_tpu``; ``_leaving_in_float32`` says why), empty elsewhere."""
    if output != np.dtype(np.float32):
        return frozenset()
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if decisions.is_var(v)}
    outs = [v for v in jaxpr.outvars if decisions.is_var(v)]
    return frozenset(
        v
        for v, flag in zip(jaxpr.outvars, to_output)
        if flag and decisions.is_var(v) and v not in read and outs.count(v) == 1
    )


def _after_checkpoint(jaxpr: Any, ctx: decisions.Ctx) -> tuple[Any, Any] | None:
    """``jaxpr`` split in two, ``(inner, after)``: the contractions whose float32 result only leaves
    the program (``ctx.leaving``) move after the 16-bit checkpoint, and ``inner`` returns their
    operands after its own results.

    Inside the checkpoint, the cotangent of such a result (a model's logits, from the user's loss)
    would reach its backward contractions through the checkpoint's optimization barrier, where
    XLA:TPU writes it out as a 16-bit copy beside the float32 logits (GPT-2 small: 0.82 GB at the
    step's peak); outside it, XLA fuses the loss's gradient into those contractions."""
    after = [
        e
        for e in jaxpr.eqns
        if e.primitive is lax.dot_general_p
        and e.outvars[0] in ctx.leaving
        and all(decisions.is_var(v) for v in e.invars)
        and decisions.decision(e, ctx).scope.fp8 is None
    ]
    if not after:
        return None
    moved = {id(e) for e in after}
    results = {e.outvars[0] for e in after}
    operands = list(dict.fromkeys(v for e in after for v in e.invars))
    inner = jaxpr.replace(
        eqns=[e for e in jaxpr.eqns if id(e) not in moved],
        outvars=[v for v in jaxpr.outvars if not (decisions.is_var(v) and v in results)] + operands,
    )
    tail = jaxpr.replace(constvars=[], invars=operands, eqns=after, outvars=[e.outvars[0] for e in after])
    return inner, tail


def _run_after(jaxpr: Any, split: tuple[Any, Any], outs: list, ctx: decisions.Ctx) -> list:
    """The program's results in order: ``inner``'s own, and ``after``'s run on the operands it returned."""
    inner, after = split
    n = len(inner.outvars) - len(after.invars)
    done = dict(zip(after.outvars, _eval_jaxpr(after, [], outs[n:], ctx)))
    kept = iter(outs[:n])
    return [done[v] if decisions.is_var(v) and v in done else next(kept) for v in jaxpr.outvars]


def _eval_jaxpr(
    jaxpr: Any,
    consts: list,
    args: list,
    ctx: decisions.Ctx,
    uses: Mapping[Any, Any] = {},
    weights: Mapping = {},
) -> list:
    """Evaluates ``jaxpr`` under the rules. ``uses``: invars whose uses read another value
    (a parameter in its compute dtype); outputs that are those invars return them unchanged.
    ``weights``: invars that are parameters, by input index (for fp8)."""

    def read_out(env: interpret.Env, v: Any) -> Any:
        return decisions.as_array(v.val, v.aval) if isinstance(v, jcore.Literal) else env[v]

    env = interpret.Env()
    ctx = ctx._replace(constant=decisions.literal_derived(jaxpr), upcast=frozenset(), weights=dict(weights))
    ctx = ctx._replace(upcast=decisions.feeding_float32(jaxpr, ctx))
    if ctx.remat:
        ctx = ctx._replace(drawn=remat16.drawn(jaxpr, ctx.drawn_in))
    skip, emit = attention_rewrite.plan(jaxpr, consts, ctx) if ctx.attention else ((), {})
    regions = _regions(jaxpr, ctx, {*skip, *emit}) if ctx.recompute else {}
    in_region = {j for r in regions.values() for j in r.members}
    names_here = interpret.current_name_stack()
    local: dict = {}  # a region's values while its checkpoint traces

    def get(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return decisions.as_array(v.val, v.aval)
        if v in local:
            return local[v]
        return uses[v] if v in uses else env[v]

    def run_region(region: recompute.Region, env: interpret.Env) -> list:
        def body(*xs: Any) -> list:
            local.update(zip(region.inputs, xs))
            try:
                for j in region.members:
                    eqn = jaxpr.eqns[j]
                    with interpret.reemitted(eqn, scopes.unmarked, base=names_here):
                        local.update(zip(eqn.outvars, equation(j, eqn, env, recomputed=True)))
                return [local[v] for v in region.outputs]
            finally:
                local.clear()

        # its own checkpoint: its backward pass waits for its outputs' cotangents (module docstring)
        outs = jax.checkpoint(body, prevent_cse=True)(*(get(v) for v in region.inputs))
        env.update(zip(region.outputs, outs))
        last = jaxpr.eqns[region.members[-1]]
        return [env[v] for v in last.outvars]

    def equation(i: int, eqn: Any, env: interpret.Env, recomputed: bool = False) -> list:
        if i in skip:
            return interpret.SKIP
        if i in in_region and not recomputed:
            return run_region(regions[i], env) if i in regions else interpret.SKIP
        # a relayout or cast of a parameter is still that parameter (fp8 finds its weights so)
        if (
            ctx.weights
            and eqn.primitive.name in _rules.LAYOUT
            and decisions.is_var(eqn.invars[0])
            and eqn.invars[0] in ctx.weights
        ):
            ctx.weights[eqn.outvars[0]] = ctx.weights[eqn.invars[0]]
        kernel = None  # the attention implementation an emitted chain ran as (explain reports it)
        if i in emit:
            ins = []
            out, kernel = attention_rewrite.emit(
                emit[i], get, decisions.decision(eqn, ctx).compute, ctx.record is not None
            )
            outs = [out]
        else:
            ins = [get(v) for v in eqn.invars]
            at = ctx
            if uses and _checkpointing(eqn):
                # The program's own checkpoint (or a scan of checkpointed layers) reads the parameters
                # as they came in and casts them in its body: the 16-bit copies are rebuilt in the
                # backward pass, not kept beside the float32 parameters for all of it.
                casts = tuple(
                    uses[v].dtype if decisions.is_var(v) and v in uses else None for v in eqn.invars
                )
                ins = [env[v] if d is not None else x for v, x, d in zip(eqn.invars, ins, casts)]
                at = ctx._replace(entry_casts=casts)
            outs = dtype_rules.evaluate_equation(eqn, ins, at)
            if ctx.recompute and not recomputed and recompute.wide_equation(eqn):
                # a wide result no region rebuilds, whatever path it took: kept, by its name (the
                # policy, remat16.keeps_16_bit_but_wide, drops wide results it is asked about)
                outs = [checkpoint_name(o, remat16.CONTRACTION) for o in outs]
            if ctx.drawn:
                outs = remat16.keep_drawn_masks(eqn, outs, ctx)
        if ctx.observe is not None and not ctx.nested:
            outs = ctx.observe(eqn, outs, decisions.decision(eqn, ctx))
        if ctx.record is not None:
            at_eqn = ctx._replace(recomputing=recomputed)
            explain_record.record(eqn, ins, outs, at_eqn, interpret.current_scope(), kernel)
        return outs

    return interpret.evaluate(
        jaxpr, consts, args, equation, names=scopes.unmarked, env=env, read_out=read_out
    )


def _regions(jaxpr: Any, ctx: decisions.Ctx, taken: set[int]) -> dict[int, recompute.Region]:
    """The regions of one level whose wide contractions are recomputed: those that run in a 16-bit
    compute dtype with float32 accumulation and no fp8 recipe (an fp8 contraction's scaling runs in its
    own derivative)."""

    def eligible(eqn: Any) -> bool:
        decision = decisions.decision(eqn, ctx)
        return (
            decision.scope.fp8 is None
            and decisions.mode(eqn, ctx, decision) == "compute"
            and decision.compute in decisions.CASTABLE[:2]
            and dtype_rules.precision_request(eqn.params.get("precision")) is None
        )

    return recompute.regions(jaxpr, frozenset(taken), eligible)


def _checkpointing(eqn: Any) -> bool:
    """A checkpoint of the program's own, or a scan whose body holds one (``nn.scan`` of ``nn.remat``)."""
    if eqn.primitive.name in _rules.CHECKPOINTS:
        return True
    return eqn.primitive.name == "scan" and remat16.has_checkpoint(eqn.params["jaxpr"].jaxpr)


def _memoized(
    kind: str, eqn: Any, inner: decisions.Ctx, make: Callable[[], Callable[..., Any]]
) -> Callable[..., Any]:
    """The rewrite of a sub-program, made once per (program, enclosing decision): a model repeats
    its layers, and one function object lets JAX's own caches (jit traces, linearizations) hit."""
    program = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("branches")))
    key = (
        kind,
        id(program),
        inner.base,
        inner.drawn_in,
        inner.in_checkpoint,  # attention inside the program's own checkpoint may run otherwise on a GPU
        tuple(sorted((k, str(v)) for k, v in eqn.params.items() if k in _STATIC)),
        context().platform,  # the attention implementation inside may differ per platform
    )
    found = inner.memo.get(key)
    if found is None or found[0] is not program:
        found = inner.memo[key] = (program, make())
    return found[1]


_STATIC = ("name", "inline", "keep_unused", "prevent_cse", "policy")


class _Bodies(NamedTuple):
    """The engine's evaluation of one equation's bodies (``interpret.Bodies``): under the decision of
    the enclosing scope, memoized per program and decision."""

    eqn: Any
    ctx: decisions.Ctx
    inner: decisions.Ctx

    def run(self, body: Any, args: Sequence[Any]) -> list:
        return self._eval(body, args, self.inner)

    def probe(self, body: Any, args: Sequence[Any]) -> list:
        return self._eval(body, args, decisions.quiet(self.inner))

    def in_place(self) -> Callable[[Any, Sequence[Any]], list] | None:
        if self.ctx.observe is None:
            return None
        # an observer sees every operation: evaluated in place, observed as the enclosing level
        level = self.inner._replace(nested=self.ctx.nested)
        return lambda body, args: self._eval(body, args, level)

    def memoized(self, kind: str, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        return _memoized(kind, self.eqn, self.inner, make)

    def as_written(self, args: Sequence[Any]) -> list:
        return decisions.as_written(self.eqn, list(args))

    def cast(self, x: Any, dtype: Any) -> Any:
        return decisions.cast(x, dtype)

    def warn(self, key: str, message: str) -> None:
        decisions.warn_once(key, message)

    @staticmethod
    def _eval(body: Any, args: Sequence[Any], ctx: decisions.Ctx) -> list:
        jaxpr, consts = (body.jaxpr, list(body.consts)) if isinstance(body, jcore.ClosedJaxpr) else (body, [])
        if not ctx.entry_casts:
            return _eval_jaxpr(jaxpr, consts, list(args), ctx)
        # parameters as they came in: their uses in the body read them cast
        uses = {
            v: decisions.cast(x, d) for v, x, d in zip(jaxpr.invars, args, ctx.entry_casts) if d is not None
        }
        return _eval_jaxpr(jaxpr, consts, list(args), ctx._replace(entry_casts=()), uses)


def _body(eqn: Any, args: list, ctx: decisions.Ctx) -> list:
    return interpret.rewrite_body(eqn, args, _Bodies(eqn, ctx, decisions.inner(eqn, ctx)))


# (*args, **kwargs) -> a pytree of roles (Param, Fp8StateField, None) that is a prefix of (args, kwargs)
InputRoles = Callable[..., Any]
Observer = Callable[[Any, list, decisions.ScopeDecision], list]
OutputRule = Callable[[Any], Any]


class _Entry(NamedTuple):
    closed: Any  # the program as traced
    out_tree: Any
    inputs: Inputs
    to_output: tuple  # per output: cast to the policy's output dtype (else to its traced dtype)
    jitted: Callable[..., Any]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _check_output(fun: Callable[..., Any], out: Any) -> None:
    if not isinstance(out, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        name = getattr(fun, "__qualname__", None) or repr(fun)
        raise TypeError(
            f"jmp_lite: {name} returned a {type(out).__name__} ({out!r:.60}); a function run "
            "under a policy must return arrays, Python or NumPy scalars, or pytrees of them "
            "(a tuple, list or dict of arrays; None leaves are fine)"
        )


def transform(
    fun: Callable[..., Any],
    root: Scope,
    *,
    rules: Mapping[str, str] | None = None,
    inputs: InputRoles | None = None,
    outputs: OutputRule | None = None,
    remat_float32: bool = True,
    observe: Observer | None = None,
    attention: bool = True,
    record: Callable[[explain_record.Decision], None] | None = None,
    recompute: str | None = None,
) -> Callable[..., Any]:
    """``fun`` evaluated under ``root`` (and the module scopes it opens).

    Array leaves of the arguments are traced; other leaves are static (hashable, a new
    value retraces). The traced program is cached per input signature.

    Args:
        fun: the function; it may open ``module_scope``s while it is traced.
        root: the scope of everything outside module scopes.
        rules: ``{primitive name or "scope:<name>": mode}`` overriding the rule table.
        inputs: called once per trace, after ``fun`` is traced (so module scopes it opened are
            known), with ``fun``'s arguments; returns their roles, a pytree that is a prefix of
            ``(args, kwargs)``: ``Param(dtype, name)`` for a parameter (its uses read it in
            ``dtype``; fp8 contractions may read it), ``Fp8StateField(name, field)`` for a field of
            the fp8 state of the parameter ``name``, ``None`` for any other argument.
        outputs: called with the output pytree; returns a matching pytree of bools,
            ``True`` where a floating output takes ``root.policy.output`` (default: all);
            elsewhere an output keeps the dtype it was traced with (updated state).
        remat_float32: under a 16-bit policy, the backward pass keeps the 16-bit results of
            contractions and other non-elementwise ops and small float32 statistics only, and
            rebuilds elementwise math (norm and softmax math, activations, residual sums) and
            boolean masks from them (``jax.checkpoint`` with ``remat16.keeps_16_bit``). Values are the
            same with and without it.
        recompute: ``"wide_contractions"``: under the 16-bit checkpoint, a contraction whose result
            is wider than its operands (an MLP's up-projection) is run again in the backward pass from
            its input, with the elementwise math that reads it, instead of kept (``recompute.py``).
            Values are the same.
        observe: ``observe(eqn, outs, decision) -> outs`` is called after every equation of the
            program (calls to jitted functions are evaluated in place, so it sees those too; the
            bodies of loops, branches, checkpoints and custom derivatives are seen as their one
            equation): the hook of measurements such as a precision report.
            ``decision`` says the scope (policy) and whether the op ran in float32.
    """
    ctx = decisions.Ctx(
        decisions.ScopeDecision(root, False, False, None),
        dict(rules or {}),
        {},
        observe=observe,
        attention=attention,
        record=record,
        bodies=_body,
    )
    output = np.dtype(root.policy.output)
    remat = remat_float32 and np.dtype(root.policy.compute) in decisions.CASTABLE[:2]
    cache: dict = {}
    told: list = []  # whether this function heard that recompute= changes nothing in it

    def evaluate(entry: _Entry, *values: Any) -> list:
        jaxpr, roles = entry.closed.jaxpr, entry.inputs
        weights = {v: i for i, (v, w) in enumerate(zip(jaxpr.invars, roles.weights)) if w}
        states = {
            i: fp8_contract.state([values[j] for j in fields]) for i, fields in roles.fp8_states.items()
        }
        leaving = _leaving(jaxpr, entry.to_output, output) if dtype_rules.on_tpu() else frozenset()
        # a program that checkpoints itself keeps its own choices (``remat16.has_checkpoint``)
        remat_here = remat and not remat16.has_checkpoint(jaxpr)
        if remat and recompute is not None and not remat_here and not told:
            told.append(True)  # once per transformed function
            warnings.warn(
                f"jmp_lite: recompute={recompute!r} has no effect on this program: it holds "
                "checkpoints of its own (jax.checkpoint, nn.remat, or a nested autocast or "
                "apply_policy), and they decide what the backward pass keeps (docs/memory.md)",
                stacklevel=2,
            )
        rebuilt = remat_here and recompute is not None
        run = ctx._replace(fp8_states=states, remat=remat_here, leaving=leaving, recompute=rebuilt)
        split = _after_checkpoint(jaxpr, run) if remat_here and leaving else None
        inner = jaxpr if split is None else split[0]

        def program(*values: Any) -> list:
            uses = {
                v: decisions.cast(x, d) for v, x, d in zip(jaxpr.invars, values, roles.casts) if d is not None
            }
            return _eval_jaxpr(inner, list(entry.closed.consts), list(values), run, uses, weights)

        if remat_here:
            # 16-bit values for the backward pass; float32 ones (norm and softmax math) rebuilt from them
            keeps = remat16.policy(rebuilt)
            program = jax.checkpoint(program, policy=keeps, prevent_cse=remat16.PREVENTS_CSE)
        outs = program(*values)
        if split is not None:
            outs = _run_after(jaxpr, split, outs, run._replace(remat=False, recompute=False))
        return [
            decisions.cast(o, output if flag else v.aval.dtype) if decisions.is_float(o.dtype) else o
            for o, v, flag in zip(outs, jaxpr.outvars, entry.to_output)
        ]

    def trace(leaves: list, dynamic: list[int], treedef: Any, values: list) -> _Entry:
        out_tree: list = []

        def flat(*xs: Any) -> list:
            full = list(leaves)
            for i, x in zip(dynamic, xs):
                full[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
            outs, tree = jax.tree_util.tree_flatten(fun(*args, **kwargs))
            for out in outs:
                _check_output(fun, out)
            out_tree.append(tree)
            return outs

        with entering(tracing=True):
            closed = jax.make_jaxpr(flat)(*values)
        if inputs is None:
            roles = Inputs((None,) * len(values), (False,) * len(values))
        else:
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            roles = inputs_of(inputs(*args, **kwargs), (args, kwargs), dynamic)
        if outputs is None:
            to_output = (True,) * len(closed.jaxpr.outvars)
        else:
            marks = outputs(jax.tree_util.tree_unflatten(out_tree[0], [True] * out_tree[0].num_leaves))
            to_output = tuple(bool(m) for m in jax.tree_util.tree_leaves(marks))
        entry = _Entry(closed, out_tree[0], roles, to_output, lambda *xs: None)
        return entry._replace(jitted=jax.jit(functools.partial(evaluate, entry)))

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
        static = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
        values = [leaves[i] for i in dynamic]
        # full avals (weak types, shard_map's varying axes) and the mesh in context
        key = (
            treedef,
            static,
            tuple(jax.typeof(x) for x in values),
            str(jax.sharding.get_abstract_mesh()),
            context().platform,
        )
        try:
            entry = cache.get(key)
        except TypeError as e:  # an unhashable static leaf
            raise TypeError(f"jmp_lite: non-array arguments must be hashable (they are static): {e}") from e
        if entry is None:
            entry = trace(leaves, dynamic, treedef, values)
            if not any(isinstance(c, jax.core.Tracer) for c in entry.closed.consts):
                if len(cache) >= _CACHE_SIZE:
                    cache.pop(next(iter(cache)))
                cache[key] = entry
        traced = any(isinstance(x, jax.core.Tracer) for x in values) or entry is not cache.get(key)
        try:
            if traced and context().tracing:
                # Inside another transform's trace (a nested autocast or apply_policy): the innermost
                # policy decides, so the ops emitted here are marked as decided and run as written there.
                with jax.named_scope(scope_name("", root._replace(decided=True))):
                    outs = evaluate(entry, *values)
            elif traced and (entry is not cache.get(key) or compat.staging_a_jaxpr()):
                # Under jit (or another staging trace) the rules are evaluated into it.
                outs = evaluate(entry, *values)
            else:
                # Called eagerly, or under an eager jax.grad / vmap: compiled once, so the values are
                # jit's, bit for bit (op by op, XLA would round where a fused program does not).
                outs = entry.jitted(*values)
        except jax.errors.JaxRuntimeError as e:
            if "DotThunk" in str(e) or "Unsupported element type" in str(e):
                e.add_note(dtype_rules.CONTRACTION_HELP)
            raise
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    return wrapped


def check_rules(rules: Mapping[str, str] | None) -> dict[str, str]:
    """Validates ``{primitive name or "scope:<name>": mode}``; unknown names are errors."""
    import difflib

    rules = validate.rules(rules)  # a suggest_rules result as the mapping it holds
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a mapping of str to mode, got {type(rules).__name__}")
    for key, value in rules.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"rules keys must be primitive names (e.g. 'exp') or 'scope:<name>', got {key!r}")
        if key.startswith(SCOPE_RULE_PREFIX) and not key[len(SCOPE_RULE_PREFIX) :].strip():
            raise ValueError(
                f"rule key {key!r} names no scope: write 'scope:<name>' with the jax.named_scope name "
                "(e.g. 'scope:attention')"
            )
        if not key.startswith(SCOPE_RULE_PREFIX) and key not in _rules.primitive_names():
            known = _rules.primitive_names(refresh=True)  # a primitive defined since
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
                raise ValueError(
                    f"rule key {key!r} is not a JAX primitive name; {hint}"
                    f"keys are primitive names as jax.make_jaxpr prints them (e.g. 'exp', "
                    f"'dot_general', 'reduce_sum') or 'scope:<jax.named_scope name>'"
                )
        if value not in _rules.MODES:
            raise ValueError(f"rule {key!r}: {value!r} is not a mode; accepted: {', '.join(_rules.MODES)}")
    return dict(rules)
