"""Hugging Face interop: checkpoint conversion/import, loading, transformers integration.

Importing this package does not import transformers; the pieces that need it
import it when called.
"""

from __future__ import annotations

from .loading import from_pretrained


def register_transformers_integration() -> bool:
    """Register torch_marlin with transformers' quantizer registry if transformers
    is installed; returns whether it is registered. Safe to call repeatedly."""
    from .integration import register

    return register()


def enable_transformers_integration() -> None:
    """Cheap hook for `import torch_marlin`: registers with transformers when (and if)
    transformers' quantizer registry gets imported."""
    from .integration import enable_transformers_integration as _enable

    _enable()


def MarlinConfig(**kwargs):  # noqa: N802  (reads like the class it returns)
    """transformers quantization config for quantize-on-load:
    `AutoModel.from_pretrained(float_dir, quantization_config=MarlinConfig(weight_format="fp4"))`."""
    from .integration import marlin_config

    return marlin_config(**kwargs)


__all__ = ["MarlinConfig", "enable_transformers_integration", "from_pretrained",
           "register_transformers_integration"]
