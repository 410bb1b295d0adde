"""Attention that keeps no T x T matrix: a blockwise kernel with its own backward pass, and the dispatch."""

from jmp_lite._src.base.exports import export as _export
from jmp_lite._src.kernels.attention_kernels import choose_implementation, dot_product_attention

__all__ = [
    "choose_implementation",
    "dot_product_attention",
]

_export(__name__, globals(), __all__)
