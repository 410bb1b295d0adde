"""The collectives of a lowered program, with the dtype and bytes each moves: the evidence of what a
sharded step puts on the wire, read from the program JAX hands the compiler (``jit(...).lower(...)``).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Collective", "lowered_collectives"]

# StableHLO's collective ops, as the lowered text spells them (op names of StableHLO, not JAX primitives)
_OP = re.compile(r'"?stablehlo\.(all_gather|reduce_scatter|all_reduce|all_to_all|collective_permute)"?\(')
_SIGNATURE = re.compile(r":\s*\((tensor<[^>]*>)[^)]*\)\s*->\s*\(?(tensor<[^>]*>)")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-zA-Z][a-zA-Z0-9]*)>")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8E4M3FN": 1, "f8E5M2": 1, "i1": 1, "i8": 1, "i32": 4}


class Collective(NamedTuple):
    """One collective: ``op`` (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ...), the
    ``dtype`` and ``shape`` of its operand (one device's), and ``bytes``, the size of the larger of
    its operand and result (what one device sends or receives)."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
    match = _TENSOR.fullmatch(text)
    if match is None:
        return (), text
    dims = tuple(int(d) for d in match.group(1).split("x") if d)
    return dims, match.group(2)


def lowered_collectives(lowered: Any) -> list[Collective]:
    """The collectives of ``lowered`` (a ``jax.jit(f).lower(...)`` result or its ``as_text()``), in
    program order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jmp_lite._src.tools.collectives import lowered_collectives
        >>> mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
        >>> lowered = jax.jit(f).lower(jnp.ones(4, jnp.bfloat16))
        >>> [(c.op, c.dtype, c.bytes) for c in lowered_collectives(lowered)]
        [('all_reduce', 'bf16', 8)]
    """
    text = lowered if isinstance(lowered, str) else lowered.as_text()
    found = []
    for match in _OP.finditer(text):
        signature = _SIGNATURE.search(text, match.end())
        if signature is None:
            continue
        (shape, dtype), (out_shape, _) = _tensor(signature.group(1)), _tensor(signature.group(2))
        size = _ITEMSIZE.get(dtype, 4)
        moved = max(int(np.prod(shape, dtype=np.int64)), int(np.prod(out_shape, dtype=np.int64))) * size
        found.append(Collective(match.group(1), dtype, shape, moved))
    return found
