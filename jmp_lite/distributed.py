"""Multi-device training: gradient all-reduce in a chosen dtype, and fully sharded data parallelism
(``fsdp``) with 16-bit parameter gathers and float32 gradient reduce-scatters."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.parallel.distributed import reduce_gradients
from jmp_lite._src.parallel.fsdp import FsdpLayout, fsdp, fsdp_layout, shard_params

__all__ = [
    "FsdpLayout",
    "fsdp",
    "fsdp_layout",
    "reduce_gradients",
    "shard_params",
]

_export(__name__, globals(), __all__)
