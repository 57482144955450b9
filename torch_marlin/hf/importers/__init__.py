"""Importers of quantized checkpoints, and how a source's quantization is recognized.

Every module of this package is imported here, and every Importer subclass in
them that declares QUANT_METHODS registers itself (importers/base.py): adding
a source format is one new file.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import List, Optional, Tuple

from ..checkpoint import SourceCheckpoint, read_json
from ..errors import UnsupportedQuantization
from .base import REGISTERED, ConvertedLayer, Importer, LayerPlan
from .float_source import FloatSource

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def supported_sources() -> List[str]:
    """How the registered importers are named (for --help and errors)."""
    return [cls.LABEL or cls.QUANT_METHODS[0] for cls in REGISTERED]


def source_side_files() -> Tuple[str, ...]:
    """Source-side quantization configs that a converted checkpoint must not carry along."""
    return tuple(name for cls in REGISTERED for name in cls.SIDE_FILES)


def source_quantization(source: SourceCheckpoint) -> Tuple[Optional[str], dict]:
    """(method, config) of an already-quantized source, or (None, {}) for float."""
    for cls in REGISTERED:
        detected = cls.detect(source.config)
        if detected is not None:
            return str(detected["quant_method"]), detected
    qc = source.config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise UnsupportedQuantization(f"config.json quantization_config must be an object, got {qc!r}")
    if qc:
        method = qc.get("quant_method")
        if method is None:
            raise UnsupportedQuantization(f"quantization_config has no 'quant_method': {qc}")
        return str(method).lower(), qc
    for cls in REGISTERED:
        for name in cls.SIDE_FILES:
            path = os.path.join(source.directory, name)
            if os.path.exists(path):
                config = cls.config_from_side_file(name, read_json(path, name))
                return str(config.get("quant_method", cls.QUANT_METHODS[0])).lower(), config
    return None, {}


def make_importer(source: SourceCheckpoint, method: str, config: dict, layout=None, options=None) -> Importer:
    """The registered importer for `method` (a quant_method value)."""
    for cls in REGISTERED:
        if method in cls.QUANT_METHODS:
            return cls.from_config(source, method, config, layout=layout, options=options)
    if method == "torch_marlin":
        raise UnsupportedQuantization("the source is already a torch_marlin checkpoint")
    raise UnsupportedQuantization(f"unknown or unsupported quantization method {method!r}; "
                                  f"supported sources: float, {', '.join(supported_sources())}")


__all__ = ["ConvertedLayer", "FloatSource", "Importer", "LayerPlan", "UnsupportedQuantization", "make_importer",
           "source_quantization", "source_side_files", "supported_sources"]
