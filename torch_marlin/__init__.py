"""torch_marlin: 4-bit (FP4 E2M1, INT4, UINT4, NF4, affine) and entropy-coded
weight-only quantized matmul for PyTorch."""

from . import ops  # noqa: F401  (loads the extension: torch.ops.marlin.*)
from .ops import cpu_int8_activations
from .formats import E2M1_VALUES, GROUP_SIZES, WEIGHT_FORMATS, dequantize_reference, pack_codes, unpack_codes
from . import gptq, sparsegpt  # noqa: F401  (register the calibrated methods "gptq", "sparsegpt", "wanda")
from .linear import MarlinLinear, quantized_linear
from .moe import MarlinExperts, MarlinExpertsLinear, quantize_experts
from .layouts import QuantizedExperts, QuantizedWeight, RansQuantizedWeight, SparseQuantizedWeight
from .layouts.dense import pack_fp4_weights, quantize_weight
from .model import QuantizationReport, quantize_model
from .fused_projections import fuse_projections
from .cpu_decoder import CpuDecoder
from .quantize import register_quantizer
from .hf import MarlinConfig, enable_transformers_integration, from_pretrained

__version__ = "0.1.0"

# Registers with transformers lazily, when its quantizer registry is first imported.
enable_transformers_integration()

__all__ = [
    "CpuDecoder", "E2M1_VALUES", "GROUP_SIZES", "WEIGHT_FORMATS", "MarlinConfig", "MarlinExperts",
    "MarlinExpertsLinear", "MarlinLinear", "QuantizationReport", "QuantizedExperts", "QuantizedWeight",
    "RansQuantizedWeight", "SparseQuantizedWeight", "cpu_int8_activations", "dequantize_reference",
    "enable_transformers_integration", "from_pretrained", "fuse_projections", "pack_codes", "pack_fp4_weights",
    "quantize_experts", "quantize_model", "quantize_weight", "quantized_linear", "register_quantizer", "unpack_codes",
]
