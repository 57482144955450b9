"""torch_marlin: FP4 (E2M1) and INT4 weight-only quantized matmul for PyTorch."""

from . import ops  # noqa: F401  (loads the extension: torch.ops.marlin.*)
from .ops import cpu_int8_activations
from .formats import E2M1_VALUES, GROUP_SIZES, WEIGHT_FORMATS, dequantize_reference, pack_codes, unpack_codes
from .linear import MarlinLinear, quantized_linear
from .experts import MarlinExperts, MarlinExpertsLinear, quantize_experts
from .layouts import QuantizedExperts, SparseQuantizedWeight
from .model import QuantizationReport, quantize_model
from .quantize import QuantizedWeight, pack_fp4_weights, quantize_weight, register_quantizer
from .hf import MarlinConfig, enable_transformers_integration, from_pretrained

__version__ = "0.1.0"

# Registers with transformers lazily, when its quantizer registry is first imported.
enable_transformers_integration()

__all__ = [
    "E2M1_VALUES", "GROUP_SIZES", "WEIGHT_FORMATS", "MarlinConfig", "MarlinExperts", "MarlinExpertsLinear",
    "MarlinLinear", "QuantizationReport", "QuantizedExperts", "QuantizedWeight", "SparseQuantizedWeight",
    "cpu_int8_activations", "dequantize_reference", "enable_transformers_integration", "from_pretrained",
    "pack_codes", "pack_fp4_weights", "quantize_experts", "quantize_model", "quantize_weight", "quantized_linear",
    "register_quantizer", "unpack_codes",
]
