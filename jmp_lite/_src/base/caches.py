"""Every cache jmp_lite keeps between calls: each bounded, each owned by the module that fills it, and
all emptied by one call, ``jmp_lite.clear_caches()``.

A cache holds what tracing found (jitted binders, transposed programs, attention analyses), so that a
model's repeated layers and repeated steps are traced once. None holds arrays a user passed in, except
the constant-mask analysis of ``attention_pattern``, which is bounded in bytes.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["BoundedCache", "cache_info", "clear_caches", "lru_cache", "register"]

F = TypeVar("F", bound=Callable[..., Any])
_REGISTRY: dict[str, tuple[Callable[[], None], Callable[[], int], int]] = {}


def register(name: str, clear: Callable[[], None], size: Callable[[], int], bound: int) -> None:
    """Registers a cache with its own bound (e.g. in bytes): ``clear_caches`` calls ``clear``."""
    _REGISTRY[name] = (clear, size, bound)  # a module imported again replaces its own entry


class BoundedCache:
    """A dict-like cache of at most ``max_entries`` entries; the least recently used goes first.

    Example:
        >>> from jmp_lite._src.base.caches import BoundedCache
        >>> c = BoundedCache("doctest.example", 2)
        >>> c["a"], c["b"] = 1, 2
        >>> c.get("a"), len(c)
        (1, 2)
        >>> c["c"] = 3  # evicts "b", the least recently used
        >>> sorted(c.keys())
        ['a', 'c']
    """

    def __init__(self, name: str, max_entries: int) -> None:
        self._data: collections.OrderedDict = collections.OrderedDict()
        self._max = max_entries
        register(name, self.clear, self.__len__, max_entries)

    def get(self, key: Hashable, default: Any = None) -> Any:
        try:
            value = self._data[key]
        except KeyError:
            return default
        self._data.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> Any:
        return self._data.keys()

    def clear(self) -> None:
        self._data.clear()


def lru_cache(name: str, maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered so that ``clear_caches`` empties it."""

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(name, cached.cache_clear, lambda: cached.cache_info().currsize, maxsize)
        return cached  # type: ignore[return-value]

    return wrap


def clear_caches() -> None:
    """Empties every cache jmp_lite keeps (traced binders, transposes, attention analyses, ...).

    Nothing needs it for correctness: the caches are bounded and keyed by what they depend on. Call
    it to release memory after tracing many different models in one process, or between benchmark
    rounds that must trace from scratch. JAX's own caches are ``jax.clear_caches()``.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> _ = jmp_lite.autocast(lambda x: x @ x, "p=f32,c=bf16,o=f32")(jnp.ones((2, 2)))
        >>> jmp_lite.clear_caches()
        >>> all(entries == 0 for entries, _ in jmp_lite._src.base.caches.cache_info().values())
        True
    """
    for clear, _, _ in _REGISTRY.values():
        clear()


def cache_info() -> dict[str, tuple[int, int]]:
    """``{cache name: (entries now, bound)}`` for every registered cache."""
    return {name: (size(), bound) for name, (_, size, bound) in _REGISTRY.items()}
