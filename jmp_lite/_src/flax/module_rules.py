"""Rule parsing and matching shared by the Linen and NNX integrations.

A rule maps a module class (``isinstance``) or a module path regex
(``re.fullmatch`` against ``"encoder/layers/0/attn"``) to a ``Policy``. Path rules
win over class rules, class rules over the defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

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


def match(
    rules: Rules, path: str, module: Any, policy: Policy, float32_classes: tuple[type, ...] | None
) -> Policy:
    """The policy ``module`` at ``path`` runs under; ``float32_classes=None`` turns defaults off."""
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
    return policy
