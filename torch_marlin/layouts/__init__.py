"""Weight layouts (docs/ARCHITECTURE.md): how a quantized weight's codes and
metadata are arranged in tensors. One module per layout; each registers
itself with base.register_layout."""

from .base import QuantizedLayout, layout_by_code, register_layout
from .dense import QuantizedWeight
from .experts import QuantizedExperts

__all__ = ["QuantizedExperts", "QuantizedLayout", "QuantizedWeight", "layout_by_code", "register_layout"]
