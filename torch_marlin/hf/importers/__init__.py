"""Detect a checkpoint's quantization from its config and pick the importer."""

from __future__ import annotations

import os
from typing import Optional, Tuple

from ..checkpoint import SourceCheckpoint, read_json
from .awq import AWQSource
from .base import ConvertedLayer, Importer, LayerPlan, UnsupportedQuantization
from .compressed_tensors import CompressedTensorsSource
from .float_source import FloatSource
from .fp4 import MXFP4Source, NVFP4Source
from .gptq import GPTQSource

SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors", "mxfp4", "modelopt (NVFP4)")
# Source-side quantization configs that the converted checkpoint must not carry along.
SOURCE_QUANT_FILES = ("quantize_config.json", "hf_quant_config.json", "quant_config.json")


def source_quantization(source: SourceCheckpoint) -> Tuple[Optional[str], dict]:
    """(method, config) of an already-quantized source, or (None, {}) for float."""
    qc = source.config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise UnsupportedQuantization(f"config.json quantization_config must be an object, got {qc!r}")
    if qc:
        method = qc.get("quant_method")
        if method == "modelopt":
            return "modelopt", qc
        if method is None:
            raise UnsupportedQuantization(f"quantization_config has no 'quant_method': {qc}")
        return str(method).lower(), qc
    autogptq = os.path.join(source.directory, "quantize_config.json")
    if os.path.exists(autogptq):
        qc = read_json(autogptq, "quantize_config.json")
        return str(qc.get("quant_method", "gptq")).lower(), qc
    modelopt = os.path.join(source.directory, "hf_quant_config.json")
    if os.path.exists(modelopt):
        qc = read_json(modelopt, "hf_quant_config.json")
        return "modelopt", dict(qc.get("quantization", qc))
    return None, {}


def make_importer(source: SourceCheckpoint, method: str, config: dict) -> Importer:
    if method == "gptq":
        return GPTQSource(source, config=config)
    if method == "awq":
        return AWQSource(source, config=config)
    if method == "compressed-tensors":
        return CompressedTensorsSource(source, config=config)
    if method == "mxfp4":
        return MXFP4Source(source, config=config)
    if method == "modelopt":
        algo = str(config.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise UnsupportedQuantization(f"modelopt quant_algo={algo!r} is not supported (only NVFP4)")
        return NVFP4Source(source, config=config, flavor="modelopt")
    if method == "torch_marlin":
        raise UnsupportedQuantization("the source is already a torch_marlin checkpoint")
    raise UnsupportedQuantization(f"unknown or unsupported quantization method {method!r}; "
                                  f"supported sources: float, {', '.join(SUPPORTED_METHODS)}")


__all__ = ["AWQSource", "CompressedTensorsSource", "ConvertedLayer", "FloatSource", "GPTQSource", "Importer",
           "LayerPlan", "MXFP4Source", "NVFP4Source", "SOURCE_QUANT_FILES", "SUPPORTED_METHODS",
           "UnsupportedQuantization", "make_importer", "source_quantization"]
