"""Where a policy applies: the scopes a front-end opens around a model's modules, the marks that carry
them through a traced program, and the one dynamic context of a trace.

A front-end opens ``module_scope(label, scope)`` around each module call (a ``jax.named_scope`` whose
name carries an interned ``Scope``) and ends a rule-matched module's call with ``leave_scope(out,
scope)`` (an identity primitive, ``mark_p``, that the engine turns into the cast to the scope's output
dtype). The engine reads the scopes back from each equation's name stack, and ``unmarked`` gives the
names as the user wrote them.

Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src.engine import scopes
    >>> from jmp_lite._src.base.policy import get_policy
    >>> name = scopes.scope_name("Dense_0", scopes.Scope(get_policy("p=f32,c=bf16,o=f32")))
    >>> scopes.without_marks(name)
    'Dense_0'
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jmp_lite._src.base import caches
from jmp_lite._src.base.compat import source_info_util  # name stacks of re-emitted ops (JAX internal)
from jmp_lite._src.base.policy import Policy

FLOAT32_SCOPE = "jmp_lite_float32_region"
SCOPE_RULE_PREFIX = "scope:"


class Context(NamedTuple):
    """What holds while a user's function is traced: jmp_lite's one piece of dynamic context.

    A front-end cannot pass arguments through a user's model to its own hooks (Flax calls them), so what
    those hooks need during a trace lives here, in one engine-owned ``ContextVar``, read with
    ``context()`` and set for a block with ``entering(field=value)``. No other module keeps one
    (``tests/test_architecture.py`` checks). Each field has one writer:

    * ``tracing``: the engine (or a precision report acting as it) is tracing a user function; a nested
      transform then marks its ops decided, and ``float32_region`` warns outside one;
    * ``fp8_weights``: a set that collects the parameter inputs fp8 contractions read
      (``fp8_weights.discover``);
    * ``observation``: the precision report's observer of the run being traced (``precision_report``);
    * ``modules``: the module-call record of the model being traced (``flax/module_rules.recording``);
    * ``module_stack``: the scopes of the module calls being traced, innermost last (``module_rules``);
    * ``frontend``: the running front-end's own record of the trace (Linen: module trees and callers;
      NNX: the view's modules, the calls running and the parameter paths);
    * ``platform``: the platform the program being traced is compiled for, when that is not the backend
      JAX computes on (``tools/compiled``, compiling for a TPU or GPU target without it): the attention
      kernel is chosen for it. Programs are cached per platform.
    """

    tracing: bool = False
    fp8_weights: Any = None
    observation: Any = None
    modules: Any = None
    module_stack: tuple = ()
    frontend: Any = None
    platform: str | None = None


# a NamedTuple: immutable, so one default shared by every thread is safe
_CONTEXT: contextvars.ContextVar[Context] = contextvars.ContextVar("jmp_lite_context", default=Context())  # noqa: B039


def context() -> Context:
    """The ``Context`` of the trace running in this thread (the defaults outside one)."""
    return _CONTEXT.get()


@contextlib.contextmanager
def entering(**fields: Any) -> Iterator[Context]:
    """Sets ``fields`` of the ``Context`` while the block runs (restored after, also on error)."""
    token = _CONTEXT.set(_CONTEXT.get()._replace(**fields))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


class Scope(NamedTuple):
    """What a stretch of a program runs under: a policy, float32 accumulation of 16-bit contractions,
    and an fp8 recipe for the contractions with a parameter operand (``None``: 16-bit ones).

    ``decided``: the ops inside were emitted by another transform (a nested ``autocast`` or
    ``apply_policy``), whose policy already decided their dtypes: they run as written."""

    policy: Policy
    accumulate: bool = True
    fp8: Any = None  # jmp_lite.Fp8Recipe
    decided: bool = False


# Scopes are interned: a named scope carries the index (names must be strings).
_SCOPES: list[Scope] = []
_SCOPE_IDS: dict[Scope, int] = {}
_SCOPES_LOCK = threading.Lock()
_MARK = "#jmp"
MARK_RE = re.compile(re.escape(_MARK) + r"(\d+)")


def without_marks(name: str) -> str:
    """A named-scope name as the user wrote it: ``"Dense_0#jmp3"`` -> ``"Dense_0"``, ``"#jmp3"`` -> ``""``."""
    return MARK_RE.sub("", name)


@caches.lru_cache("engine.name_stacks", 4096)
def unmarked(stack: Any) -> Any:
    """A name stack without the engine's marks: the names compiled ops (and profiles) show are the
    user's (``"Dense_0#jmp3"`` -> ``"Dense_0"``; a scope that only carried a mark is dropped)."""
    if _MARK not in str(stack):
        return stack
    kept = []
    for entry in stack.stack:
        if isinstance(entry, source_info_util.Scope):
            name = without_marks(entry.name)
            if not name:
                continue
            entry = source_info_util.Scope(name)
        kept.append(entry)
    return source_info_util.NameStack(tuple(kept))


def scope_name(label: str, scope: Scope | None) -> str:
    """The ``jax.named_scope`` name of a module scope (``label`` alone when it sets no policy)."""
    if scope is None:
        return label
    with _SCOPES_LOCK:
        index = _SCOPE_IDS.get(scope)
        if index is None:
            index = _SCOPE_IDS[scope] = len(_SCOPES)
            _SCOPES.append(scope)
    return f"{label}{_MARK}{index}"


@contextlib.contextmanager
def module_scope(label: str, scope: Scope | None) -> Iterator[None]:
    """Ops traced inside run under ``scope`` (innermost scope wins; ``None``: only a name, and no
    scope at all without a label, as for Linen, which names its modules' scopes itself)."""
    if not label and scope is None:
        yield
        return
    with jax.named_scope(scope_name(label, scope)):
        yield


# An identity that marks a value for the engine: the traced program keeps its dtype (so
# loops and branches written for one dtype still trace), and the engine rewrites it.
mark_p = jcore.Primitive("jmp_lite_mark")
mark_p.def_impl(lambda x, *, tag: x)
mark_p.def_abstract_eval(lambda x, *, tag: x)
ad.deflinear2(mark_p, lambda ct, x, *, tag: [ct])
batching.defvectorized(mark_p)
mlir.register_lowering(mark_p, lambda ctx, x, *, tag: [x])


def mark(tree: Any, tag: str) -> Any:
    def one(x: Any) -> Any:
        return (
            mark_p.bind(x, tag=tag)
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
            else x
        )

    return jax.tree_util.tree_map(one, tree)


def leave_scope(out: Any, scope: Scope) -> Any:
    """A module's outputs, to be cast to the output dtype of its scope's policy by the engine."""
    return mark(out, "out" + scope_name("", scope)[len(_MARK) :])


def interned(index: int) -> Scope:
    """The scope a mark's index names."""
    return _SCOPES[index]
