"""Loss scales (no-op, static, dynamic) as pure pytrees, and finiteness helpers."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.optim.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "select_tree",
]

_export(__name__, globals(), __all__)
