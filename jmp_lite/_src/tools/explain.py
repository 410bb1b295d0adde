"""``explain``: what the engine decided for each operation of a function, and why."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import primitive_rules
from jmp_lite._src.base import reports, validate
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.engine.explain_record import Decision
from jmp_lite._src.frontends.options import check_recompute

__all__ = ["Decision", "Explanation", "explain"]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What ``explain`` found: every decision of the engine for one call, and the residuals kept.

    Attributes:
        policy: the policy the function ran under (a Flax model's own).
        events: one ``Decision`` per distinct decision (``kind``, ``primitive``, ``scope``, ``mode``,
            ``traced``/``ran``/``outputs`` dtypes and ``reason``), in program order, with
            ``counts[i]`` the number of operations it stands for.
        counts: how many operations each event stands for (a model's repeated layers).
        residuals: ``jmp_lite.memory.residual_bytes`` of the same call (``None`` where not
            measured: an NNX view, or a function without floating arguments).

    ``str()`` gives the report; ``find`` selects events.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> e = jmp_lite.explain(lambda x, w: jnp.exp(x @ w).sum(), "p=f32,c=bf16,o=f32")(
        ...     jnp.ones((4, 8)), jnp.ones((8, 2)))
        >>> [(ev.primitive, ev.mode, ev.ran) for ev in e.find(mode="compute")]
        [('dot_general', 'compute', ('bfloat16', 'bfloat16'))]
        >>> e.find(primitive="exp")[0].reason
        'range- or accumulation-sensitive: float32'
    """

    policy: Policy
    events: tuple[Decision, ...]
    counts: tuple[int, ...]
    residuals: Any = None

    def find(self, *, primitive: str | None = None, mode: str | None = None, kind: str | None = None,
             scope: str | None = None) -> list[Decision]:  # fmt: skip
        """The events matching every given field (``scope``: a substring of the scope path)."""
        return [
            e
            for e in self.events
            if (primitive is None or e.primitive == primitive)
            and (mode is None or e.mode == mode)
            and (kind is None or e.kind == kind)
            and (scope is None or scope in e.scope)
        ]

    @property
    def unknown_primitives(self) -> tuple[str, ...]:
        """Primitives jmp_lite has no rule for that ran as written (operands cast back)."""
        return tuple(
            sorted({e.primitive for e in self.events if e.reason.startswith("jmp_lite has no rule")})
        )

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The policy, each event with its count, and the residuals' bytes, as JSON-ready values."""
        events = [{**reports.plain(e), "count": n} for e, n in zip(self.events, self.counts)]
        residuals = None if self.residuals is None else self.residuals.to_dict()
        return {"policy": str(self.policy), "events": events, "residuals": residuals}

    def table(self) -> str:
        """The report ``str()`` gives: contractions, float32 ops, ops as written, attention chains."""
        lines = [f"jmp_lite.explain under {self.policy}"]
        ops = [(e, n) for e, n in zip(self.events, self.counts) if e.kind == "op"]
        contractions = [(e, n) for e, n in ops if primitive_rules.kind(e.primitive) == "contraction"]
        lines.append(f"\nContractions ({sum(n for _, n in contractions)}):")
        lines += [_row(e, n) for e, n in contractions] or ["  none"]
        float32 = [(e, n) for e, n in ops if e.mode == "float32" and (e, n) not in contractions]
        lines.append(f"\nfloat32 ({sum(n for _, n in float32)} ops):")
        lines += _grouped(float32) or ["  none"]
        written = [(e, n) for e, n in ops if e.mode == "as_written"]
        lines.append(f"\nAs written ({sum(n for _, n in written)} ops):")
        lines += _grouped(written) or ["  none"]
        follow = collections.Counter()
        for e, n in ops:
            if e.mode == "follow":
                follow[", ".join(sorted(set(e.outputs)))] += n
        lines.append(f"\nFollow their operands ({sum(follow.values())} ops): " + (
            "; ".join(f"{k}: {v}" for k, v in follow.most_common()) or "none"))  # fmt: skip
        attention = [(e, n) for e, n in zip(self.events, self.counts) if e.kind.startswith("attention")]
        lines.append(f"\nAttention chains ({sum(n for _, n in attention)}):")
        lines += [
            f"  {'kernel  ' if e.kind == 'attention' else 'declined'} {e.scope or '(top)'}"
            + (f" x{n}" if n > 1 else "") + ("" if e.kind == "attention" else f": {e.reason}")
            for e, n in attention
        ] or ["  none found"]  # fmt: skip
        if self.unknown_primitives:
            lines.append(
                f"\nPrimitives without a rule (ran as written): {', '.join(self.unknown_primitives)}"
            )
        if self.residuals is not None:
            dtypes = ", ".join(f"{k} {_size(v)}" for k, v in self.residuals.by_dtype.items())
            lines.append(f"\nKept for the backward pass: {_size(self.residuals.total)} ({dtypes or 'none'})")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _row(e: Decision, n: int) -> str:
    where = f"{e.scope or '(top)'}{f' x{n}' if n > 1 else ''}"
    return f"  {e.primitive:<20} {where}: {'/'.join(e.ran)} -> {'/'.join(e.outputs)}; {e.reason}"


def _grouped(rows: list) -> list[str]:
    groups: dict = collections.Counter()
    for e, n in rows:
        groups[(e.primitive, e.reason)] += n
    return [f"  {p:<20} x{n}: {why}" for (p, why), n in groups.items()]


def explain(
    fun: Callable[..., Any],
    policy: Policy | str | None = None,
    *,
    rules: Mapping[str, str] | None = None,
    remat_float32: bool = True,
    recompute: str | None = None,
    attention: bool = True,
    residuals: bool = True,
) -> Callable[..., Explanation]:
    """``explain(fun, policy)(*args, **kwargs)``: what the engine decides for ``fun`` under ``policy``.

    Traces ``fun`` as ``autocast(fun, policy, rules=..., ...)`` runs it (nothing is compiled) and
    reports each decision with its reason: the dtypes every contraction takes and accumulates in,
    the float32 ops and what put them there (their class, a ``float32_region``, a module rule,
    ``precision=HIGHEST``), attention chains run as the kernel or declined (with the reason), ops
    run as written and primitives jmp_lite has no rule for, and (``residuals=True``) the bytes the
    backward pass keeps (``jmp_lite.memory.residual_bytes``).

    Nothing runs, so any argument (or leaf of one) may be a ``jax.ShapeDtypeStruct``, as for
    ``jmp_lite.memory.residual_bytes``: variables from ``jax.eval_shape(model.init, ...)`` will do.

    ``remat_float32``, ``recompute`` and ``attention`` are ``autocast``'s; with
    ``recompute="wide_contractions"`` each contraction whose result is rebuilt in the backward pass
    says so.

    ``fun`` may also be a Flax model under a policy: a Linen ``apply_policy(...)`` (or its
    ``.apply``), called with its variables first, or an NNX view; leave ``policy=None`` and
    ``rules=None`` then (the model carries both).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def f(x, w):
        ...     with jmp_lite.float32_region():
        ...         y = jnp.tanh(x @ w)
        ...     return (y @ w.T).sum()
        >>> e = jmp_lite.explain(f, "p=f32,c=bf16,o=f32")(jnp.ones((4, 8)), jnp.ones((8, 8)))
        >>> [(ev.ran, ev.reason) for ev in e.find(primitive="dot_general")]  # doctest: +NORMALIZE_WHITESPACE
        [(('float32', 'float32'), 'inside float32_region'),
         (('bfloat16', 'bfloat16'), 'operands in bfloat16, accumulated in float32 (contraction)')]
    """

    validate.flags(remat_float32=remat_float32, attention=attention, residuals=residuals)
    options = {"remat_float32": remat_float32, "attention": attention}
    if recompute is not None:  # a model keeps its own choice unless explain is given one
        options["recompute"] = recompute
    model = engine.model_under_policy(fun)
    if model is not None:
        if policy is not None or rules is not None:
            raise ValueError(
                "explain: a Flax model runs under its own policy and rules (apply_policy's); leave "
                "policy=None and rules=None"
            )
    elif policy is None:
        raise TypeError(
            "explain(fun, policy): a plain function needs a policy (a jmp_lite.Policy or a string such as "
            "'p=f32,c=bf16,o=f32'); a Flax model carries its own: pass apply_policy(...) or an NNX view"
        )
    else:
        policy = validate.policy(policy, "explain's policy")
        checked = engine.check_rules(rules)
    check_recompute("explain", recompute, remat_float32, model.policy if model is not None else policy)

    def run(*args: Any, **kwargs: Any) -> Explanation:
        decisions: dict[Decision, int] = {}

        def record(event: Decision) -> None:
            decisions[event] = decisions.get(event, 0) + 1

        if model is None:
            root = engine.Scope(policy)
            recorded = engine.transform(fun, root, rules=checked, record=record, **options)
            measured = engine.transform(fun, root, rules=checked, **options)
            shown = policy
        else:
            recorded, measured, shown = _flax_calls(model, record, options)
        _trace(recorded, args, kwargs)
        kept = _residuals(measured, model, args, kwargs) if residuals else None
        return Explanation(shown, tuple(decisions), tuple(decisions.values()), kept)

    return run


def _trace(call: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Traces ``call(*args, **kwargs)`` without running it. ``jax.ShapeDtypeStruct`` leaves become
    ``eval_shape``'s abstract arguments (as ``residual_bytes`` takes them); every other leaf is closed
    over as given (arrays, and Python values a model branches on: ``train=True``)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    abstract = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]

    def traced(*shaped: Any) -> Any:
        filled = list(leaves)
        for i, x in zip(abstract, shaped):
            filled[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, filled)
        return call(*a, **k)

    jax.eval_shape(traced, *(leaves[i] for i in abstract))


def _flax_calls(model: engine.ModelUnderPolicy, record: Callable[[Decision], None], options: dict) -> tuple:
    """The model's call recording decisions, its plain call (None where residuals are not measured: an NNX
    view reads its parameters from itself, not from an argument), and its policy."""
    recorded = model.variant(None, record=record, **options)
    measured = model.variant(None, **options) if model.kind == "linen" else None
    return recorded, measured, model.policy


def _residuals(call: Callable[..., Any] | None, model: Any, args: tuple, kwargs: dict) -> Any:
    """What the backward pass keeps, w.r.t. the floating arguments (a Linen model's variables)."""
    from jmp_lite._src.tools.memory import residual_bytes

    if call is None:
        return None
    if model is not None:
        return residual_bytes(call, *args, argnums=0, **kwargs)
    floating = [
        i
        for i, a in enumerate(args)
        if jax.tree_util.tree_leaves(a)
        and all(
            jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating) for x in jax.tree_util.tree_leaves(a)
        )
    ]
    if not floating:
        return None
    return residual_bytes(call, *args, argnums=floating, **kwargs)
