"""Swapping a model's linear layers for MarlinLinear, for checkpoints and quantize-on-load."""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from ..linear import MarlinLinear, PermutedInputMarlinLinear
from ..model import quantize_model
from .errors import CheckpointError
from .layout import LinearSpec, layout_of_model


def replace_with_empty_marlin(model: nn.Module, table: Dict[str, dict], device="meta") -> List[str]:
    """Replace the linear layers named in a checkpoint's `modules` table by empty
    MarlinLinear modules (on `device`, normally meta) ready to receive the tensors."""
    layout = layout_of_model(model)
    replaced = []
    for ckpt_name, entry in table.items():
        name = layout.resolve(ckpt_name, layout.linears)
        if name is None:
            raise CheckpointError(f"quantization_config lists {ckpt_name!r}, which is not a linear layer of "
                                  f"{type(model).__name__}")
        spec: LinearSpec = layout.linears[name]
        if (spec.in_features, spec.out_features) != (entry["in_features"], entry["out_features"]):
            raise CheckpointError(f"{ckpt_name}: checkpoint has {entry['in_features']}x{entry['out_features']} "
                                  f"but the model expects {spec.in_features}x{spec.out_features}")
        old = model.get_submodule(name)
        dtype = old.weight.dtype if old.weight.is_floating_point() else None
        model.set_submodule(name, empty_marlin(entry, spec.bias, device=device, dtype=dtype))
        replaced.append(name)
    _skip_parent_init(model, replaced)
    _layout_state_may_be_absent(model, replaced)
    return replaced


def empty_marlin(entry: dict, bias: bool = False, device="meta", dtype=None) -> MarlinLinear:
    """The empty MarlinLinear that a `modules` table entry (config.py) describes."""
    cls = PermutedInputMarlinLinear if entry.get("act_order") else MarlinLinear
    return cls(entry["in_features"], entry["out_features"], bias, entry["weight_format"], entry["group_size"],
               device=device, dtype=dtype, sparsity=entry.get("sparsity"))


def layout_state(entry: dict) -> torch.Tensor:
    """The `_extra_state` (layout guard) of the MarlinLinear a `modules` entry describes: the
    converter writes it next to the layer's tensors, so that loading the tensors into a module
    built with another format or group size fails as it does for a state_dict."""
    return empty_marlin(entry).get_extra_state()


def _layout_state_may_be_absent(model: nn.Module, replaced: List[str]) -> None:
    """The modules were built from the config's table, which is authoritative; checkpoints
    converted before `_extra_state` was written lack it. Tell transformers that its absence is
    expected, so its load report does not list it as "MISSING, newly initialized". When present
    it is loaded through MarlinLinear.set_extra_state, which raises on a layout mismatch."""
    if not replaced:
        return
    pattern = "^(?:" + "|".join(re.escape(name) for name in replaced) + r")\._extra_state$"
    model._keys_to_ignore_on_load_missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()) | {
        pattern}


def _skip_parent_init(model: nn.Module, replaced: List[str]) -> None:
    """transformers re-initializes modules after loading; some _init_weights reach into a
    child's `.weight` (GPT-2 does `c_proj.weight`), which MarlinLinear does not have. A parent
    holding no tensors of its own has nothing else to initialize, so mark it done."""
    for name in replaced:
        parent = model.get_submodule(name.rpartition(".")[0])  # "" is the model itself
        own = list(parent.parameters(recurse=False)) + [b for b in parent.buffers(recurse=False) if b is not None]
        if not own and parent is not model:
            parent._is_hf_initialized = True


def quantize_linear_modules(model: nn.Module, weight_format: str, group_size: int, quantizer: str = "mse",
                            skip: Iterable[str] = ()) -> Dict[str, dict]:
    """Quantize loaded linear layers in place (quantize-on-load) with quantize_model;
    returns the `modules` table for the config."""
    report = quantize_model(model, weight_format, group_size, exclude=list(skip), method=quantizer)
    table = {}
    for name in report.replaced:
        q = model.get_submodule(name)
        table[name] = {"weight_format": weight_format, "group_size": group_size,
                       "in_features": q.in_features, "out_features": q.out_features}
    return table


def check_loaded(model: nn.Module) -> None:
    """Every MarlinLinear buffer must have received checkpoint data."""
    for name, module in model.named_modules():
        if isinstance(module, MarlinLinear):
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.device.type == "meta":
                    raise CheckpointError(f"{name}.{buffer_name} is missing from the checkpoint")


def default_skips(model: nn.Module, extra: Optional[Iterable[str]] = None) -> List[str]:
    """Layers that stay float when quantizing on load: output embeddings and tied weights."""
    layout = layout_of_model(model)
    return sorted(set(layout.output_embeddings) | set(layout.tied) | set(extra or []))
