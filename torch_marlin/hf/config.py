"""The `quantization_config` entry of a torch_marlin checkpoint's config.json.

    {"quant_method": "torch_marlin", "format_version": 1,
     "weight_format": "fp4", "group_size": 128,          # most common, for display
     "modules": {"model.layers.0.self_attn.q_proj":      # every quantized layer
                 {"weight_format": "fp4", "group_size": 128,
                  "in_features": 64, "out_features": 64, "act_order": true?,
                  "sparsity": "2:4"?},                    # 2:4 sparse layout (docs/FORMAT.md)
                 "model.layers.0.mlp.experts.gate_up_proj":  # every quantized expert stack
                 {"layout": "experts", "num_experts": 128, "weight_format": "fp4", ...}},
     "modules_to_not_convert": ["lm_head", ...],         # linear layers left in float
     "source": {"method": "float" | "gptq" | ..., ...}}

Per-module entries make loading exact (mixed formats from imports, act-order
permutations) without guessing from tensor shapes.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List

from .. import formats, rans
from ..layouts import RansQuantizedWeight, layout_for_sparsity
from .errors import CheckpointError

QUANT_METHOD = "torch_marlin"
FORMAT_VERSION = 1
LAYOUTS = ("dense", "experts", "rans")  # a module entry's "layout" (absent: dense)
# rans (entropy-coded) entries also carry the stream's shape: "chunk_k", "prob_bits", "num_words"


def build_quantization_config(importer, modules: Dict[str, dict], layers_in_float: List[str]) -> dict:
    common = Counter((m["weight_format"], m["group_size"]) for m in modules.values()).most_common(1)
    weight_format, group_size = common[0][0] if common else ("fp4", 128)
    config = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "weight_format": weight_format,
        "group_size": group_size,
        "modules": dict(sorted(modules.items())),
        "modules_to_not_convert": sorted(layers_in_float),
        "source": importer.description(),
    }
    sparsity = Counter(m.get("sparsity") for m in modules.values()).most_common(1)
    if sparsity and sparsity[0][0] is not None:
        config["sparsity"] = sparsity[0][0]  # for display, like weight_format
    return config


def validate_quantization_config(qc: dict) -> Dict[str, dict]:
    """Check a checkpoint's quantization_config; returns its per-module table."""
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"not a torch_marlin quantization_config: {qc!r}")
    version = qc.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"torch_marlin checkpoint format_version {version} is not supported "
                              f"(this version reads {FORMAT_VERSION})")
    if not isinstance(qc.get("fuse_projections", False), bool):
        raise CheckpointError(f"quantization_config.fuse_projections must be true or false, got "
                              f"{qc['fuse_projections']!r}")
    modules = qc.get("modules")
    if not isinstance(modules, dict):
        raise CheckpointError("torch_marlin quantization_config has no 'modules' table")
    for name, entry in modules.items():
        try:
            layout = entry.get("layout", "dense")
            if layout not in LAYOUTS:
                raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
            if layout == "rans":
                RansQuantizedWeight.check_arguments(entry["weight_format"], entry["group_size"])
                if isinstance(entry["num_words"], bool) or not isinstance(entry["num_words"], int) \
                        or entry["num_words"] < 0:
                    raise ValueError(f"num_words must be an int >= 0, got {entry['num_words']!r}")
                rans.check_chunk_k(entry["chunk_k"])
                rans.check_prob_bits(entry["prob_bits"])
            else:
                formats.check_weight_format(entry["weight_format"])
                formats.check_group_size(entry["group_size"])
            layout_for_sparsity(entry.get("sparsity"))
            for key in ("in_features", "out_features") + (("num_experts",) if layout == "experts" else ()):
                if isinstance(entry[key], bool) or not isinstance(entry[key], int) or entry[key] <= 0:
                    raise ValueError(f"{key} must be a positive int, got {entry[key]!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"quantization_config.modules[{name!r}] is invalid: {e}") from e
    return modules
