"""Rule parsing and matching shared by the Linen and NNX integrations.

A rule maps a module class (``isinstance``) or a module path regex
(``re.fullmatch`` against ``"encoder/layers/0/attn"``) to a ``Policy``. Path rules
win over class rules, class rules over the defaults; a module no rule matches runs
under the policy of the module that calls it.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from jmp_lite._src import engine
from jmp_lite._src.policy import Policy, get_policy

RuleKey = type | str | re.Pattern
Rules = tuple[tuple[type | re.Pattern, Policy], ...]


def as_policy(value: Policy | str | None, what: str) -> Policy | None:
    if value is None or isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return get_policy(value)
    raise TypeError(f"{what} must be a Policy, a policy string or None, got {type(value).__name__}")


def parse_rules(rules: Mapping[RuleKey, Policy | str] | None, base: type, kind: str) -> Rules:
    """Validates ``rules``: keys are ``base`` subclasses or regexes, values policies."""
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


def own_policy(
    rules: Rules, path: str, module: Any, policy: Policy, float32_classes: tuple[type, ...] | None
) -> Policy | None:
    """The policy of the rule that matches ``module`` at ``path`` itself, or ``None``.

    ``float32_classes=None`` turns the defaults off.
    """
    hits = [(k, p) for k, p in rules if isinstance(k, re.Pattern) and k.fullmatch(path)]
    if len(hits) > 1:
        raise ValueError(
            f"module path {path!r} matches several path rules: {[k.pattern for k, _ in hits]}; "
            "make the patterns disjoint"
        )
    if hits:
        return hits[0][1]
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
        return classes[0][1]
    if float32_classes and isinstance(module, float32_classes):
        return Policy(jnp.float32, jnp.float32, policy.compute)
    return None


# While a front-end traces a model: module path -> the scope its ops ran under.
_TRACE: contextvars.ContextVar[dict[str, engine.Scope] | None] = contextvars.ContextVar(
    "jmp_lite_module_trace", default=None
)
# The scopes of the module calls being traced, innermost last.
_STACK: contextvars.ContextVar[tuple[engine.Scope, ...]] = contextvars.ContextVar(
    "jmp_lite_module_stack", default=()
)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, engine.Scope]]:
    """Collects, while a model is traced, the scope each module path ran under."""
    token = _TRACE.set({})
    try:
        yield _TRACE.get()
    finally:
        _TRACE.reset(token)


def recorded() -> Mapping[str, engine.Scope]:
    """What the innermost ``recording()`` has collected so far."""
    return _TRACE.get() or {}


def call_module(
    label: str, path: str, own: engine.Scope | None, root: engine.Scope, call: Callable[[], Any], cast: bool
) -> Any:
    """Runs one module call inside its engine scope (its own rule's, else its caller's)."""
    stack = _STACK.get()
    effective = own if own is not None else (stack[-1] if stack else root)
    trace = _TRACE.get()
    if trace is not None:
        trace.setdefault(path, effective)
    token = _STACK.set((*stack, effective))
    try:
        with engine.module_scope(label, own):
            out = call()
    finally:
        _STACK.reset(token)
    return engine.leave_scope(out, own) if cast and own is not None else out


def owner(owners: Mapping[str, engine.Scope], names: Sequence[str]) -> engine.Scope | None:
    """The scope of the module that holds the variable at ``names`` (its longest recorded prefix)."""
    for end in range(len(names) - 1, -1, -1):
        found = owners.get("/".join(names[:end]))
        if found is not None:
            return found
    return None
