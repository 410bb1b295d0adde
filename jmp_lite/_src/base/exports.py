"""Gives re-exported names the public module they are documented under."""

from __future__ import annotations

import importlib
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def export(module: str, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Sets ``__module__`` of the classes and functions in ``names`` to ``module``.

    Reprs, docs and pickles then name ``jmp_lite.policy.Policy``, not the private
    ``jmp_lite._src.base.policy.Policy``, so the private layout never becomes API.
    """
    for name in names:
        obj = namespace[name]
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            try:
                obj.__module__ = module
            except (AttributeError, TypeError):  # builtins and C types keep theirs
                pass


def lazy(module: str, namespace: dict[str, Any], names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names`` (``{name: the module holding it}``, or the
    submodule ``module.name`` itself) on first use, so that importing ``module`` loads only the
    core. Each is kept in ``namespace``; one read from a private module is exported to ``module``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        source = importlib.import_module(names[name])
        value = source if names[name] == f"{module}.{name}" else getattr(source, name)
        namespace[name] = value
        if "._" in names[name] and not isinstance(value, types.ModuleType):
            export(module, namespace, [name])
        return value

    return __getattr__


def moved(module: str, names: Iterable[str], source: Any, advice: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved: each of ``names`` is still read from ``source``
    with a ``DeprecationWarning`` saying ``advice`` (``{name}`` is filled in); any other name is the
    usual ``AttributeError``."""
    kept = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name in kept:
            warnings.warn(advice.format(name=name), DeprecationWarning, stacklevel=2)
            return getattr(source, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
