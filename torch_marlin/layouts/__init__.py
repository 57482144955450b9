"""Weight layouts (docs/ARCHITECTURE.md): how a quantized weight's codes and
metadata are arranged in tensors. One module per layout; each registers
itself with base.register_layout."""

from .base import QuantizedLayout, layout_by_code, layout_for_sparsity, register_layout
from .dense import QuantizedWeight
from .experts import QuantizedExperts
from .rans import RansQuantizedWeight
from .sparse24 import SparseQuantizedWeight

__all__ = ["QuantizedExperts", "QuantizedLayout", "QuantizedWeight", "RansQuantizedWeight", "SparseQuantizedWeight", "layout_by_code",
           "layout_for_sparsity", "register_layout"]
