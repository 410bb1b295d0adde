"""Half-precision copies of trained weights for inference (``export_params``)."""

from jmp_lite._src.base.export import export_params
from jmp_lite._src.base.exports import export as _export

__all__ = ["export_params"]

_export(__name__, globals(), __all__)
