"""Swapping a model's linear layers for MarlinLinear and its experts modules for
MarlinExperts, for checkpoints and quantize-on-load."""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from ..experts import MarlinExperts, MarlinExpertsLinear, UnsupportedExperts
from ..layouts import RansQuantizedWeight
from ..linear import MarlinLinear, PermutedInputMarlinLinear, QuantizedModule
from ..model import quantize_model
from .errors import CheckpointError
from .layout import LinearSpec, ModelLayout, layout_of_model


def replace_with_empty_marlin(model: nn.Module, table: Dict[str, dict], device="meta") -> List[str]:
    """Replace the linear layers named in a checkpoint's `modules` table by empty
    MarlinLinear modules, and the experts modules whose stacks it lists by empty
    MarlinExperts (on `device`, normally meta), ready to receive the tensors."""
    layout = layout_of_model(model)
    stacks = {name: entry for name, entry in table.items() if entry.get("layout") == "experts"}
    stack_modules = _replace_experts(model, layout, stacks, device)
    replaced = []
    for ckpt_name, entry in table.items():
        if ckpt_name in stacks:
            continue
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
    experts = sorted({name.rpartition(".")[0] for name in stack_modules})
    _skip_parent_init(model, replaced + experts)
    _layout_state_may_be_absent(model, replaced + stack_modules)
    return replaced + experts


def _replace_experts(model: nn.Module, layout: ModelLayout, stacks: Dict[str, dict], device) -> List[str]:
    """Empty MarlinExperts for the experts modules whose stacks the table lists (all of
    them); returns the names of the stacks (MarlinExpertsLinear modules)."""
    by_module: Dict[str, Dict[str, dict]] = {}
    for ckpt_name, entry in stacks.items():
        name = layout.resolve(ckpt_name, layout.stacks)
        if name is None:
            reason = next((r for m, r in layout.experts_unsupported.items() if ckpt_name.startswith(m + ".")), None)
            raise CheckpointError(f"quantization_config lists expert stack {ckpt_name!r}, which is not an expert "
                                  f"stack of {type(model).__name__}" + (f" ({reason})" if reason else ""))
        spec = layout.stacks[name]
        shape = (entry["num_experts"], entry["in_features"], entry["out_features"])
        if shape != (spec.num_experts, spec.in_features, spec.out_features):
            raise CheckpointError(f"{ckpt_name}: checkpoint has {shape[0]} experts of {shape[1]}x{shape[2]} but the "
                                  f"model expects {spec.num_experts} of {spec.in_features}x{spec.out_features}")
        by_module.setdefault(spec.experts_module, {})[spec.param] = entry
    replaced = []
    for name, entries in by_module.items():
        try:
            module = MarlinExperts(model.get_submodule(name), device=device)
        except UnsupportedExperts as e:
            raise CheckpointError(f"{name}: {e}") from e
        for param, _, _ in module.structure.stacks:
            if param not in entries:
                raise CheckpointError(f"quantization_config lists some stacks of {name} but not {param!r}")
            module.add_module(param, empty_marlin(entries[param], module.structure.has_bias, device=device,
                                                  dtype=module.structure.dtype))
            replaced.append(f"{name}.{param}")
        model.set_submodule(name, module)
    return replaced


def empty_marlin(entry: dict, bias: bool = False, device="meta", dtype=None) -> QuantizedModule:
    """The empty MarlinLinear (or MarlinExpertsLinear) that a `modules` table entry (config.py) describes."""
    if entry.get("layout") == "experts":
        return MarlinExpertsLinear(entry["num_experts"], entry["in_features"], entry["out_features"], bias,
                                   entry["weight_format"], entry["group_size"], device=device, dtype=dtype)
    cls = PermutedInputMarlinLinear if entry.get("act_order") else MarlinLinear
    coded = {}
    if entry.get("layout") == "rans":  # entropy-coded: the stream's length makes the buffers' shapes
        coded = {"layout": RansQuantizedWeight, "chunk_k": entry["chunk_k"], "prob_bits": entry["prob_bits"],
                 "num_words": entry["num_words"]}
    return cls(entry["in_features"], entry["out_features"], bias, entry["weight_format"], entry["group_size"],
               device=device, dtype=dtype, sparsity=entry.get("sparsity"), **coded)


def layout_state(entry: dict) -> torch.Tensor:
    """The `_extra_state` (layout guard) of the module a `modules` entry describes: the
    converter writes it next to the layer's tensors, so that loading the tensors into a module
    built with another format, group size or number of experts fails as it does for a state_dict."""
    return empty_marlin(entry).get_extra_state()


def _layout_state_may_be_absent(model: nn.Module, replaced: List[str]) -> None:
    """The modules were built from the config's table, which is authoritative; checkpoints
    converted before `_extra_state` was written lack it. Tell transformers that its absence is
    expected, so its load report does not list it as "MISSING, newly initialized". When present
    it is loaded through QuantizedModule.set_extra_state, which raises on a layout mismatch."""
    if not replaced:
        return
    pattern = "^(?:" + "|".join(re.escape(name) for name in replaced) + r")\._extra_state$"
    model._keys_to_ignore_on_load_missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()) | {
        pattern}


def keep_stacks_on_save(model: nn.Module) -> None:
    """save_pretrained reverses the checkpoint conversions that loading used (it would split
    `experts.gate_up_proj` back into `experts.{i}.gate_proj`/`up_proj` tensors); quantized
    stacks are saved as they are, so drop the conversions that would reach their tensors."""
    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:
        return
    keys = [f"{name}.{param}.packed" for name, module in model.named_modules() if isinstance(module, MarlinExperts)
            for param in module.stacks()]
    if not keys:
        return
    from transformers.core_model_loading import WeightConverter

    def reaches_stack(conversion) -> bool:
        if not isinstance(conversion, WeightConverter):
            return False
        reverse = conversion.reverse_transform()
        return any(reverse.rename_source_key(key)[1] is not None for key in keys)

    model._weight_conversions = [c for c in conversions if not reaches_stack(c)]


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
    return modules_table(model, report)


def modules_table(model: nn.Module, report) -> Dict[str, dict]:
    """The `modules` table (config.py) of the linear layers and expert stacks that
    quantize_model replaced, as its QuantizationReport `report` lists them."""
    table = {}
    for name in report.replaced:
        layer = model.get_submodule(name)
        table[name] = _table_entry(layer)
        if getattr(layer, "input_perm", None) is not None:
            table[name]["act_order"] = True
        if layer.quantized_weight().SPARSITY is not None:
            table[name]["sparsity"] = layer.quantized_weight().SPARSITY
        if isinstance(layer.quantized_weight(), RansQuantizedWeight):
            table[name].update(layout="rans", **layer.quantized_weight().shape_options())
    for name in report.experts_replaced:
        for param, stack in model.get_submodule(name).stacks().items():
            table[f"{name}.{param}"] = {"layout": "experts", "num_experts": stack.num_experts, **_table_entry(stack)}
    return table


def _table_entry(module: QuantizedModule) -> dict:
    return {"weight_format": module.weight_format, "group_size": module.group_size,
            "in_features": module.in_features, "out_features": module.out_features}


def check_loaded(model: nn.Module) -> None:
    """Every MarlinLinear buffer must have received checkpoint data."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedModule):
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.device.type == "meta":
                    raise CheckpointError(f"{name}.{buffer_name} is missing from the checkpoint")


def default_skips(model: nn.Module, extra: Optional[Iterable[str]] = None) -> List[str]:
    """Linear layers that stay float when quantizing on load: output embeddings and tied weights
    (not the embeddings they are tied to: a name that is no linear layer is a pattern that
    matches nothing to quantize_model), and `extra` (the user's patterns)."""
    layout = layout_of_model(model)
    tied_linears = set(layout.tied) & set(layout.linears)
    return sorted(set(layout.output_embeddings) | tied_linears | set(extra or []))
