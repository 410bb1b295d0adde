"""What jmp_lite reads from JAX beyond its public API, and what differs between the JAX versions it supports.

jmp_lite supports jax from the floor in ``pyproject.toml`` (``jax>=0.10.2``, the newest on PyPI) upward
(``.ci/run`` runs the fast tier on the floor too whenever it is older than the newest). jax 0.10.0 and
0.10.1 are handled below where they differ, so that the engine runs there. Everything that reaches into
JAX's internals, or that JAX changed within that range, goes through this module and nowhere else
(``tests/test_jax_versions.py`` checks that no other module of ``jmp_lite`` imports ``jax._src`` or reads
a ``shard_map`` equation's axis parameter):

* ``shard_map_axis_names(params)``: the mesh axes a ``shard_map`` equation makes manual, which the engine
  passes back as ``jax.shard_map(axis_names=...)`` when it re-emits the body. jax 0.10.0 and 0.10.1 call
  the parameter ``manual_axes`` (the axes the call names); jax 0.10.2 renamed it ``newly_manual_axes`` (the
  same axes less those an enclosing ``shard_map`` already made manual). On a jax with neither it raises
  ``NotImplementedError``, and the engine runs the ``shard_map`` as written, with an
  ``UnknownPrimitiveWarning`` (``dtype_rules.evaluate_equation``).
* ``source_info_util``: JAX's name stacks (``jax._src.source_info_util``). ``jax.extend.source_info_util``
  exports the same functions but not ``Scope``, the entry type the engine rewrites to drop its own marks
  from the names of re-emitted operations. The same in every supported version.
* ``staging_a_jaxpr()``: whether the current trace stages a jaxpr (``jax._src.core.trace_ctx``; JAX has no
  public view of the trace stack). The same in every supported version; on a jax without it the answer is
  the conservative ``True``.
* ``saved_residuals_with_equations()``: ``jax._src.ad_checkpoint._saved_residuals``, the function behind
  ``jax.ad_checkpoint.print_saved_residuals`` that takes a jaxpr (``jmp_lite.memory.residual_bytes``). The
  same in every supported version; on a jax without it the memory tool raises a ``RuntimeError`` naming it.
* ``persistent_cache_off()``: compiles within it skip JAX's persistent compilation cache. JAX decides once
  per process whether it uses the cache (``jax._src.compilation_cache.is_cache_used`` remembers its first
  answer), so turning ``jax_enable_compilation_cache`` off later has no effect; this sets the remembered
  answer for the block and restores it. The same in every supported version; on a jax without that
  module state it only turns the flag off.

Anything else jmp_lite calls is JAX's public API (``jax``, ``jax.lax``, ``jax.extend``,
``jax.interpreters``). A primitive of a newer JAX that ``primitive_rules`` does not classify runs as
written, with a one-time ``UnknownPrimitiveWarning`` (docs/autocast.md, "JAX versions").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax._src import source_info_util  # noqa: F401  (re-exported: the engine's and fsdp's name stacks)

__all__ = ["saved_residuals_with_equations", "shard_map_axis_names", "source_info_util", "staging_a_jaxpr"]

# shard_map's parameter holding the axes it makes manual, newest name first:
# "newly_manual_axes" from jax 0.10.2, "manual_axes" in jax 0.10.0 and 0.10.1.
SHARD_MAP_AXES_PARAMS = ("newly_manual_axes", "manual_axes")


def shard_map_axis_names(params: Mapping[str, Any]) -> frozenset:
    """The mesh axes a ``shard_map`` equation (its ``params``) makes manual: its ``axis_names``.

    Raises ``NotImplementedError`` on a jax whose ``shard_map`` names them otherwise.
    """
    for name in SHARD_MAP_AXES_PARAMS:
        if name in params:
            return frozenset(params[name])
    raise NotImplementedError(
        f"jmp_lite does not know where jax {jax.__version__}'s shard_map keeps its manual axes "
        f"(parameters {sorted(params)}; it knows {list(SHARD_MAP_AXES_PARAMS)})"
    )


def staging_a_jaxpr() -> bool:
    """Whether the current trace stack stages a jaxpr (jit, make_jaxpr, a loop body), rather than
    evaluating eagerly under grad, jvp or vmap."""
    from jax._src import core  # no public view of the trace stack

    trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
    if trace is None:  # a jax without trace_ctx: the conservative answer keeps the op-by-op path
        return True
    while trace is not None:
        if type(trace).__name__ == "DynamicJaxprTrace":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def saved_residuals_with_equations() -> Callable[..., Any]:
    """``jax._src.ad_checkpoint._saved_residuals(jaxpr, arg_names)``: ``(aval, description)`` per residual.

    JAX's public ``jax.ad_checkpoint.print_saved_residuals`` only prints, and ``saved_residuals`` behind
    it takes a function, not the jaxpr the memory tool holds. ``tests/test_memory.py`` checks that it
    still agrees with ``print_saved_residuals``.
    """
    try:
        from jax._src.ad_checkpoint import _saved_residuals
    except ImportError as e:  # pragma: no cover - only on a JAX that moved it
        raise RuntimeError(
            f"jmp_lite.memory.residual_bytes needs jax._src.ad_checkpoint._saved_residuals, which jax "
            f"{jax.__version__} does not have; it was written against jax 0.10 (report this as a bug)"
        ) from e
    return _saved_residuals


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """Compiles inside skip JAX's persistent compilation cache (neither load nor store)."""
    from jax._src import compilation_cache as cc  # the cache's once-per-process decision

    flag = jax.config.jax_enable_compilation_cache
    saved = getattr(cc, "_cache_checked", None), getattr(cc, "_cache_used", None)
    jax.config.update("jax_enable_compilation_cache", False)
    if None not in saved:
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", flag)
        if None not in saved:
            cc._cache_checked, cc._cache_used = saved
