"""Mixed-precision policies: a ``(param, compute, output)`` dtype triple and its casts."""

from jmp_lite._src.base.dtypes import half_dtype, preferred_half_dtype
from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.base.policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    dtype_to_names,
    get_policy,
)

__all__ = [
    "Policy",
    "cast_to_full",
    "cast_to_half",
    "dtype_to_names",
    "get_policy",
    "half_dtype",
    "preferred_half_dtype",
]

_export(__name__, globals(), __all__)
