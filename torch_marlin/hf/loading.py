"""torch_marlin.from_pretrained: load a converted checkpoint with MarlinLinear layers."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .checkpoint import read_json
from .config import QUANT_METHOD, validate_quantization_config
from .errors import CheckpointError


def from_pretrained(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
                    dtype: Optional[torch.dtype] = None, model_class=None, fuse_projections: bool = False,
                    **kwargs):
    """Load a torch_marlin checkpoint directory (from `torch-marlin convert` or
    `save_pretrained`) as a transformers model with MarlinLinear layers.

    The model is built on the meta device (no float weights are materialized),
    its quantized layers are swapped for MarlinLinear and the packed tensors
    loaded, then it is moved to `device` ("cpu" or "mps"). `dtype` sets the
    dtype of the layers left in float (default: the checkpoint's).
    `model_class` defaults to the config's architecture (e.g. LlamaForCausalLM);
    fuse_projections=True fuses the quantized q|k|v and gate|up siblings into one
    weight each after loading (torch_marlin.fused_projections: exact, a
    concatenation of the stored codes and scales; the checkpoint stays per layer).
    A checkpoint converted with `torch-marlin convert --fuse-projections` is
    fused on load in any case (here and through transformers' from_pretrained).
    Other keyword arguments go to transformers' from_pretrained.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise CheckpointError(f"path must be a local checkpoint directory, got {path!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if not isinstance(fuse_projections, bool):
        raise TypeError(f"fuse_projections must be a bool, got {fuse_projections!r}")
    device = torch.device(device)
    if device.type not in ("cpu", "mps"):
        raise ValueError(f"device must be 'cpu' or 'mps', got {device}")
    config = read_json(os.path.join(path, "config.json"), "config.json")
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{path} is not a torch_marlin checkpoint (config.json quantization_config "
                              f"quant_method is {None if not isinstance(qc, dict) else qc.get('quant_method')!r}); "
                              f"convert it first with `torch-marlin convert`")
    validate_quantization_config(qc)
    try:
        import transformers
    except ImportError as e:
        raise ImportError("from_pretrained needs transformers: pip install 'torch_marlin[hf]'") from e
    from .integration import register

    register()
    if model_class is None:
        model_class = next((getattr(transformers, a) for a in config.get("architectures") or []
                            if hasattr(transformers, a)), transformers.AutoModel)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = [k for k in info.get("missing_keys", []) if not k.endswith(("position_ids", "inv_freq"))]
    quantized_missing = [k for k in missing if k.endswith((".packed", ".scales", ".zeros", ".input_perm", ".words",
                                                                ".word_offsets", ".states", ".freqs"))]
    if quantized_missing:
        raise CheckpointError(f"{path}: quantized tensors missing from the checkpoint: {quantized_missing[:5]}")
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        raise CheckpointError(f"{path}: tensors whose shape does not match the config: {list(mismatched)[:5]}")
    model.eval()
    if fuse_projections:  # a no-op where the checkpoint's config already fused them
        from ..fused_projections import fuse_projections as fuse

        if fuse(model) and getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.fused_projections = True  # is_serializable: not saved fused
    return model.to(device)
