"""Gives re-exported names the public module they are documented under."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def export(module: str, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Sets ``__module__`` of the classes and functions in ``names`` to ``module``.

    Reprs, docs and pickles then name ``jmp_lite.policy.Policy``, not the private
    ``jmp_lite._src.policy.Policy``, so the private layout never becomes API.
    """
    for name in names:
        obj = namespace[name]
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            try:
                obj.__module__ = module
            except (AttributeError, TypeError):  # builtins and C types keep theirs
                pass
