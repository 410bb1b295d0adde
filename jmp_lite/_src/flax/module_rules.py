"""Rule parsing and matching shared by the Linen and NNX integrations.

A rule maps a module class (``isinstance``) or a module path regex
(``re.fullmatch`` against ``"encoder/layers/0/attn"``) to a ``Policy``. Path rules
win over class rules, class rules over the defaults; a module no rule matches runs
under the policy of the module that calls it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from jmp_lite._src.base import validate
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine

RuleKey = type | str | re.Pattern
Rules = tuple[tuple[type | re.Pattern, Policy], ...]


def as_policy(value: Policy | str | None, what: str) -> Policy | None:
    return validate.policy(value, what, optional=True)


def parse_rules(rules: Mapping[RuleKey, Policy | str] | None, base: type, kind: str) -> Rules:
    """Validates ``rules``: keys are ``base`` subclasses or regexes, values policies."""
    rules = validate.rules(rules)  # a suggest_rules result as the mapping it holds
    if rules is not None and not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a mapping {{class or regex: policy}}, not {type(rules).__name__}")
    parsed = []
    for key, value in (rules or {}).items():
        rule = as_policy(value, f"rule for {key!r}")
        if rule is None:
            raise TypeError(f"rule for {key!r} is None; give a Policy or a policy string")
        if isinstance(key, str):
            try:
                key = re.compile(key)
            except re.error as e:
                raise ValueError(f"rule key {key!r} is not a valid regular expression: {e}") from None
        elif not (isinstance(key, re.Pattern) or (isinstance(key, type) and issubclass(key, base))):
            raise TypeError(f"rule keys must be {kind} module classes or path regexes, got {key!r}")
        parsed.append((key, rule))
    return tuple(parsed)


def own_rule(rules: Rules, path: str | None, module: Any) -> tuple[type | re.Pattern, Policy] | None:
    """The rule (key and policy) that matches ``module`` at ``path`` itself, or ``None``: a path rule,
    else the most derived class rule. ``path=None``: a module without a path (path rules cannot reach it).
    """
    hits = [(k, p) for k, p in rules if isinstance(k, re.Pattern) and path is not None and k.fullmatch(path)]
    if len(hits) > 1:
        raise ValueError(
            f"module path {path!r} matches several path rules: {[k.pattern for k, _ in hits]}; "
            "make the patterns disjoint"
        )
    if hits:
        return hits[0]
    classes = [(k, p) for k, p in rules if isinstance(k, type) and isinstance(module, k)]
    if classes:
        # The most derived class wins; unrelated classes both matching is ambiguous.
        classes.sort(key=lambda kp: len(kp[0].__mro__), reverse=True)
        best = classes[0][0]
        for other, _ in classes[1:]:
            if not issubclass(best, other):
                raise ValueError(
                    f"module {path or type(module).__name__!r} matches class rules for both "
                    f"{best.__name__} and {other.__name__}; add a path rule for it"
                )
        return classes[0]
    return None


def own_policy(
    rules: Rules, path: str | None, module: Any, policy: Policy, float32_classes: tuple[type, ...] | None
) -> Policy | None:
    """The policy of the rule that matches ``module`` at ``path`` itself (``own_rule``), else of the
    float32 default for ``float32_classes`` (``None`` turns the defaults off), else ``None``."""
    rule = own_rule(rules, path, module)
    if rule is not None:
        return rule[1]
    if float32_classes and isinstance(module, float32_classes):
        return Policy(jnp.float32, jnp.float32, policy.compute)
    return None


class Trace(NamedTuple):
    """What a front-end saw while it traced a model, per module path."""

    scopes: dict[str, engine.Scope]  # the scope its ops ran under
    classes: dict[str, type]
    unpathed: dict[type, str]  # modules without a path (path=None): class -> where it was called


@contextlib.contextmanager
def recording() -> Iterator[Trace]:
    """Collects, while a model is traced, the scope and class of each module path."""
    with engine.entering(modules=Trace({}, {}, {})) as context:
        yield context.modules


def recorded() -> Mapping[str, engine.Scope]:
    """The scopes the innermost ``recording()`` has collected so far."""
    trace = engine.context().modules
    return {} if trace is None else trace.scopes


def call_module(
    module: Any,
    path: str | None,
    own: engine.Scope | None,
    root: engine.Scope,
    call: Callable[[], Any],
    cast: bool,
    label: str,
    where: str = "",
) -> Any:
    """Runs one module call inside its engine scope (its own rule's, else its caller's); with ``own``
    and ``cast``, its outputs are cast to that rule's output dtype. ``label`` names the scope
    (empty where the library names its modules' scopes itself). ``path=None``: a module without a
    path, recorded for the class rules only, with ``where`` saying how it was called."""
    stack, trace = engine.context().module_stack, engine.context().modules
    effective = own if own is not None else (stack[-1] if stack else root)
    if trace is not None and path is None:
        trace.unpathed.setdefault(type(module), where)
    elif trace is not None:
        trace.scopes.setdefault(path, effective)
        trace.classes.setdefault(path, type(module))
    with engine.entering(module_stack=(*stack, effective)), engine.module_scope(label, own):
        out = call()
    return out if own is None or not cast else engine.leave_scope(out, own)


def unmatched(
    rules: Rules, modules: Mapping[str, type], unpathed: Mapping[type, str] | None = None
) -> list[str]:
    """The rules (as written) that match none of ``modules`` (path -> class) and, for class rules, none
    of the ``unpathed`` modules' classes either."""
    missing = []
    for key, _ in rules:
        if isinstance(key, re.Pattern):
            hit = any(key.fullmatch(path) for path in modules)
        else:
            hit = any(issubclass(cls, key) for cls in [*modules.values(), *(unpathed or ())])
        if not hit:
            missing.append(repr(key.pattern) if isinstance(key, re.Pattern) else key.__name__)
    return missing


def unmatched_message(
    missing: list[str], modules: Mapping[str, type], model: str, unpathed: Mapping[type, str] | None = None
) -> str:
    paths = sorted(p for p in modules if p)
    shown = ", ".join(repr(p) for p in paths[:12]) + (", ..." if len(paths) > 12 else "")
    message = (
        f"apply_policy rules {', '.join(missing)} match no module of {model}: path rules are regular "
        f"expressions matched in full (and case-sensitively) against module paths, which here are "
        f"{shown or 'none'}; class rules match instances of the class or its subclasses"
    )
    if unpathed and any(m[:1] in "'\"" for m in missing):  # a path rule (written as its repr) missed
        where = "; ".join(f"{cls.__name__} {how}" for cls, how in unpathed.items())
        message += (
            f". Modules without a path ({where}) are out of reach of path rules: a module applied with "
            ".apply() inside another one has a path only where Flax named it (an attribute assigned in "
            f"setup, a submodule made in a compact method); give it a class rule, e.g. "
            f"{{{next(iter(unpathed)).__name__}: ...}}"
        )
    return message


def owner(owners: Mapping[str, engine.Scope], names: Sequence[str]) -> engine.Scope | None:
    """The scope of the module that holds the variable at ``names`` (its longest recorded prefix)."""
    for end in range(len(names) - 1, -1, -1):
        found = owners.get("/".join(names[:end]))
        if found is not None:
            return found
    return None
