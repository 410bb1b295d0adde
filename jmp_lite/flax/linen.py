"""Flax Linen: run an unmodified model under a ``Policy`` (``apply_policy``)."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.flax.linen import DEFAULT_FLOAT32_MODULES, PolicyApplied, apply_policy

__all__ = [
    "DEFAULT_FLOAT32_MODULES",
    "PolicyApplied",
    "apply_policy",
]

_export(__name__, globals(), __all__)
