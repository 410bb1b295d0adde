"""``suggest_rules``: the rules a ``PrecisionReport`` calls for, each with the measurement behind it."""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import numpy as np

from jmp_lite._src import primitive_rules
from jmp_lite._src.base import validate
from jmp_lite._src.tools import report_format
from jmp_lite._src.tools.precision_report import CLOSED, PrecisionReport

__all__ = ["RuleSuggestion", "suggest_rules"]

_SMALLEST_LOG2 = {"float16": -24, "bfloat16": -126}  # float16's smallest subnormal; XLA flushes below 2^-126


class RuleSuggestion(NamedTuple):
    """What ``suggest_rules`` returns.

    ``rules``: the report's own rules plus the new ones, usable as they are (``autocast(fun, policy,
    rules=...)`` for a plain function, ``apply_policy(model, policy, rules=...)`` for a Flax model);
    ``added``: only the new ones; ``loss_scale``: ``(low, high)``, the powers of two a static or
    dynamic loss scale should stay within (``None``: no 16-bit gradients, or no scale serves both
    ends); ``reasons``: one line per suggestion, naming the measurement and the threshold.
    """

    rules: dict
    added: dict
    loss_scale: tuple[float, float] | None
    reasons: tuple[str, ...]
    front_end: str

    def __jmp_lite_rules__(self) -> dict:
        """What ``rules=`` takes from a suggestion: ``apply_policy(model, policy, rules=suggestion)``."""
        return self.rules

    def __str__(self) -> str:
        where = (
            "autocast(fun, policy, rules=...)"
            if self.front_end == "autocast"
            else "apply_policy(model, policy, rules=...)"
        )
        shown = {getattr(k, "__name__", k): str(v) for k, v in self.rules.items()}
        lines = [f"suggested rules for {where}: {shown}"]
        if self.loss_scale is not None:
            lo, hi = self.loss_scale
            lines.append(f"loss scale between 2^{int(math.log2(lo))} and 2^{int(math.log2(hi))}")
        return "\n".join(lines + [f"- {r}" for r in self.reasons])


def _narrowest(names: str) -> tuple[str, float]:
    """The dtype with the smallest range among a group's (``"float16+float32"``) and its largest value."""
    import jax.numpy as jnp

    return min(((n, float(jnp.finfo(np.dtype(n)).max)) for n in names.split("+")), key=lambda nm: nm[1])


_ARGUMENTS = ("params", "argument", CLOSED)


def _offenders(report: PrecisionReport, h: dict, underflow: float, error: float | None) -> dict[int, str]:
    """Group index -> why it should run in float32 (one line: the measurement and the threshold)."""
    groups = report.groups
    scale_log2 = math.log2(float(np.asarray(report.loss_scale)))
    pct = report_format.percent
    found: dict[int, str] = {}
    for i, g in enumerate(groups):
        dtype, top = _narrowest(g.dtypes)
        if h["act_overflow"][i] > 0:
            past = -h["act_headroom_bits"][i]
            found[i] = (
                f"{pct(h['act_overflow'][i])} of its activations overflow {dtype}, up to {past:.1f} "
                f"doublings past its largest value {top:.6g} (threshold: any overflow)"
            )
        elif h["grad_count"][i] and h["grad_headroom_bits"][i] + scale_log2 < 0 and g.kind not in _ARGUMENTS:
            unscaled = h["grad_max_abs"][i] / 2**scale_log2
            found[i] = (
                f"its unscaled gradients reach {unscaled:.3g}, past {dtype}'s largest value {top:.6g}: "
                "no loss scale helps (threshold: any overflow at scale 1)"
            )
        elif h["act_underflow"][i] > underflow:
            found[i] = (
                f"{pct(h['act_underflow'][i])} of its nonzero activations flush to zero in {dtype} "
                f"(threshold: {100 * underflow:g}%); a loss scale lifts gradients, not activations"
            )
        elif error is not None and h["act_error"][i] > error:
            found[i] = (
                f"its activations are {h['act_error'][i]:.3g} off float32, relatively (threshold: {error:g})"
            )
    forward = [i for i, g in enumerate(groups) if h["act_nonfinite"][i] > 0 and g.kind not in _ARGUMENTS]
    if forward:  # where the forward pass first turned non-finite, if no overflow explains it
        origin = min(forward, key=lambda i: h["act_onset"][i])
        if h["act_onset"][origin] < min((h["act_onset"][i] for i in found), default=math.inf):
            found[origin] = (
                f"it is where the {_narrowest(groups[origin].dtypes)[0]} forward pass first turns non-finite "
                f"({pct(h['act_nonfinite'][origin])} inf/NaN) while its float32 values fit (threshold: any)"
            )
    return found


def _cost(report: PrecisionReport, h: dict, offending: set[int], covered: Any) -> float:
    """How many values of groups that are fine a rule would move to float32 too."""
    return sum(h["act_count"][i] for i, g in enumerate(report.groups) if i not in offending and covered(g))


def _scope_key(report: PrecisionReport, h: dict, offending: set[int], path: str) -> str:
    """The one named-scope component of ``path`` whose ``scope:`` rule moves the fewest other values."""
    parts = path.split("/")

    def covers(part: str) -> Any:
        return lambda g: g.kind not in _ARGUMENTS and part in g.path.split("/")

    best = min(reversed(parts), key=lambda p: _cost(report, h, offending, covers(p)))
    return f"scope:{best}"


def _loss_scale(report: PrecisionReport, underflow: float) -> tuple[tuple[float, float] | None, list[str]]:
    compute = np.dtype(report.source.policy.compute).name
    if compute not in _SMALLEST_LOG2:
        return None, [f"compute dtype {compute}: no 16-bit gradients, no loss scaling needed"]
    hist = np.asarray(report.gradient_histogram, np.float64)
    bins = np.asarray(report.log2_bins)
    total = hist.sum()
    if report.source.front_end == "nnx" and not any(g.kind == "params" for g in report.groups):
        return None, [
            "no loss scale range: an NNX view's parameters are not arguments of the report, so their "
            "gradients were not measured, and a range that ignores them can make every step skip; measure "
            "it with the parameters as arguments: graphdef, state = nnx.split(model); "
            "precision_report(lambda state, x: loss(nnx.merge(graphdef, state)(x)), policy)(state, x)"
        ]
    unmeasured = getattr(report.source, "unmeasured", ())
    if unmeasured:  # parameters whose gradients nothing measured: a range could make every step skip
        shown = ", ".join(unmeasured[:3]) + (f" and {len(unmeasured) - 3} more" if unmeasured[3:] else "")
        return None, [
            f"no loss scale range: the gradients of {len(unmeasured)} floating arrays the function closes "
            f"over inside a loop, branch or custom-derivative body ({shown}) were not measured, and a range "
            "that ignores them can make every step skip; pass the parameters as arguments "
            "(precision_report(loss_fn, policy)(params, batch)) to measure them"
        ]
    high = float(np.asarray(report.recommended_scale))
    top = float(np.asarray(report.gradient_max))
    smallest = _SMALLEST_LOG2[compute]

    def lost(j: int) -> float:
        return float(hist[bins + j < smallest].sum() / total) if total else 0.0

    low_log2 = next((j for j in range(0, 25) if lost(j) <= underflow), None)
    high_log2 = int(round(math.log2(high)))
    allowed = f"at most {100 * underflow:g}% of nonzero 16-bit gradients below {compute}'s smallest value"
    if total == 0:
        return None, [f"no nonzero {compute} gradients: nothing for a loss scale to do"]
    if low_log2 is None or low_log2 > high_log2:
        need = "more than 2^24" if low_log2 is None else f"2^{low_log2}"
        return None, [
            f"no loss scale serves both ends: {allowed} needs {need}, but the largest gradient, {top:.3g}, "
            f"comes within 3 doublings of {compute}'s largest value above 2^{high_log2}; keep the modules "
            "whose gradients are smallest in float32"
        ]
    if low_log2 == 0 and compute == "bfloat16":
        return (1.0, 2.0**high_log2), [
            f"bfloat16 has float32's range: {100 * lost(0):.3g}% of gradients are lost at scale 1 (threshold "
            f"{100 * underflow:g}%): no loss scaling needed (NoOpLossScale)"
        ]
    return (2.0**low_log2, 2.0**high_log2), [
        f"loss scale in [2^{low_log2}, 2^{high_log2}]: from 2^{low_log2} {allowed} 2^{smallest} "
        f"({100 * lost(0):.3g}% at scale 1); up to 2^{high_log2} the largest gradient, {top:.3g}, stays 3 "
        f"doublings under {compute}'s largest value"
    ]


def suggest_rules(
    report: PrecisionReport, *, underflow: float = 0.01, error: float | None = None
) -> RuleSuggestion:
    """The smallest rules that keep the offending modules of ``report`` in float32, and a loss scale range.

    A group of operations offends when its float32 activations overflow the dtype it ran in (any
    overflow), when its gradients overflow even unscaled, when more than ``underflow`` of its nonzero
    activations flush to zero (loss scaling only lifts gradients), when it is where the run first
    turned non-finite, or, with ``error``, when its relative error exceeds it. Each offending module
    gets one rule at its own path (a rule covers everything the module calls, so an offender inside
    an already kept module adds nothing): ``"scope:<name>": "float32"`` for a plain function (the
    one component of its named-scope path that moves the fewest other values), a module path regex
    mapped to ``"float32"`` for a Flax model. Groups outside any scope get a primitive rule.

    The loss scale range comes from the 16-bit gradients of the float32 run: the lower end is the
    smallest power of two at which at most ``underflow`` of the nonzero ones fall below the dtype's
    smallest value, the upper end the recommended scale of ``jmp_lite.gradient_diagnostics`` (the
    largest gradient 3 doublings under the dtype's largest value).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def loss(w, x):
        ...     with jax.named_scope("layer"):
        ...         y = (x @ w) * (x @ w)  # 400 * 400: past float16's 65504
        ...     return jnp.mean(jnp.tanh(y))
        >>> w, x = jnp.full((4, 4), 100.0, jnp.float32), jnp.ones((2, 4), jnp.float32)
        >>> report = jmp_lite.precision_report(loss, "p=f32,c=f16,o=f32")(w, x)
        >>> suggestion = jmp_lite.suggest_rules(report)
        >>> suggestion.rules
        {'scope:layer': 'float32'}
        >>> print(suggestion.reasons[0])
        layer [ops] -> 'scope:layer': float32, because 100.0% of its activations overflow float16,
        up to 1.3 doublings past its largest value 65504 (threshold: any overflow)
        >>> fixed = jmp_lite.precision_report(loss, "p=f32,c=f16,o=f32", rules=suggestion.rules)(w, x)
        >>> float(fixed.activations.overflow.max())
        0.0
    """
    if not isinstance(report, PrecisionReport):
        what = type(report).__name__
        raise TypeError(f"suggest_rules takes the PrecisionReport of jmp_lite.precision_report, got {what}")
    underflow = validate.fraction(underflow, "suggest_rules.underflow")
    if error is not None:
        error = float(validate.positive_scale(error, "suggest_rules.error"))
    h = report_format.host(report)
    found = _offenders(report, h, underflow, error)
    offending = set(found)
    src = report.source
    added: dict = {}
    reasons: list[str] = []
    ordered = sorted(found, key=lambda i: (report.groups[i].path.count("/"), report.groups[i].order))
    kept: list[str] = []
    for i in ordered:
        g = report.groups[i]
        if g.kind in _ARGUMENTS and src.front_end == "autocast":
            reasons.append(
                f"{g.name}: {found[i]}; an argument has no scope to rule: cast it to float32 where it is read"
            )
            continue
        if src.front_end == "autocast":
            if not g.path:  # no scope to rule: the group's primitives, everywhere
                ruled = [k for k in g.primitives if k in primitive_rules.primitive_names()]
                for key in ruled:
                    added.setdefault(key, "float32")
                shown = ", ".join(map(repr, ruled)) or "no primitive rule"
                reasons.append(
                    f"{g.name} -> {shown}: float32 (outside any named scope: every such op), because "
                    f"{found[i]}; a jax.named_scope around the code makes the rule narrower"
                )
                continue
            key = _scope_key(report, h, offending, g.path)
            if key in added:
                continue
            added[key] = "float32"
            if g.instance:  # one instance offends; a scope rule keeps every call of the scope
                reasons.append(
                    f"{g.name} -> {key!r}: float32 (every instance of the scope), because {found[i]}"
                )
                continue
        else:
            if any(g.path == k or g.path.startswith(k + "/") or not k for k in kept):
                continue  # inside a module already kept in float32
            kept.append(g.path)
            key = re.escape(g.path)
            added[key] = "float32"
        reasons.append(f"{g.name} -> {key!r}: float32, because {found[i]}")
    rules = dict(src.rules)
    for key in list(added):
        if src.front_end != "autocast":
            clash = [
                k for k in rules if isinstance(k, str) and k != key and re.fullmatch(k, key.replace("\\", ""))
            ]
            if clash:
                reasons.append(
                    f"the rule for {key!r} and your rule {clash[0]!r} match the same module: merge them"
                )
    rules.update(added)
    scale, scale_reasons = _loss_scale(report, underflow)
    if not found:
        reasons.insert(
            0,
            "no group overflows, turns non-finite, or loses more than "
            f"{100 * underflow:g}% of its activations to underflow: no rule needed",
        )
    return RuleSuggestion(rules, added, scale, tuple(reasons + scale_reasons), src.front_end)
