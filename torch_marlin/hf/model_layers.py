"""Which checkpoint tensors belong to linear layers and expert stacks, found without loading weights.

The model is instantiated on the meta device from its config (no memory,
no weights), and its nn.Linear and transformers Conv1D modules and its
experts modules' 3-D weight stacks (torch_marlin.moe) are listed.
Checkpoint names are matched to module names allowing for the base-model
prefix ("model.", "bert.", "transformer.") being present on one side only.
Checkpoints that store experts as per-expert linear layers
(`experts.{i}.gate_proj`, how transformers saves Mixtral, Qwen-MoE, ...) are
mapped to the stacks through transformers' own conversion mapping of the
model (which parts are concatenated in which order). Without transformers,
or for an architecture it does not know, a name-based fallback is used and
said so; a checkpoint with expert tensors is refused then (names alone
cannot tell how its experts form the stacks the model loads).
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set

import torch
from torch import nn

from ..float_linear import is_conv1d, is_float_linear
from .errors import CheckpointError, import_transformers

# Weights that stay in float in the name-based fallback (embeddings, heads, norms).
_FALLBACK_FLOAT = re.compile(r"(embed|wte|wpe|lm_head|norm|ln_|layernorm|\bln\b|score|classifier)", re.I)
# Tensors of an experts module: per-expert layers (`experts.3.w1.weight`) or stacks (`experts.gate_up_proj`).
_EXPERTS_TENSOR = re.compile(r"(^|\.)experts\.")


@dataclass(frozen=True)
class LinearSpec:
    kind: str  # "linear" (weight [out, in]) or "conv1d" (transformers Conv1D, weight [in, out])
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class StackSpec:
    """One 3-D weight stack of an experts module (docs/FORMAT.md, expert-stack layout)."""

    experts_module: str  # model name of the experts module
    param: str  # its parameter, e.g. "gate_up_proj"
    num_experts: int
    in_features: int
    out_features: int
    bias: bool  # `<param>_bias` [E, out]
    transposed: bool  # stored [E, in, out] (the class's is_transposed), else [E, out, in]


@dataclass(frozen=True)
class ExpertPart:
    """A per-expert linear layer of a checkpoint that is one slice of a stack: expert
    `expert`, concatenated along out_features at `position` of `positions`."""

    stack: str  # model name of the stack
    expert: int
    position: int
    positions: int


@dataclass
class ModelLayout:
    linears: Dict[str, LinearSpec] = field(default_factory=dict)  # keyed by model module name
    stacks: Dict[str, StackSpec] = field(default_factory=dict)  # "<experts module>.<param>" -> spec
    experts_unsupported: Dict[str, str] = field(default_factory=dict)  # experts modules left in float: why
    transforms: list = field(default_factory=list)  # transformers' weight conversions of the model
    output_embeddings: Set[str] = field(default_factory=set)  # lm_head-like modules
    tied: Set[str] = field(default_factory=set)  # modules whose weight is shared with another
    prefix: str = ""  # base_model_prefix of the architecture
    exact: bool = True  # False when the name-based fallback was used
    architecture: str = ""

    def resolve(self, name: str, candidates: Iterable[str]) -> Optional[str]:
        """Model module name for a checkpoint module name (prefix-tolerant)."""
        pool = candidates if isinstance(candidates, (set, dict)) else set(candidates)
        if name in pool:
            return name
        if self.prefix:
            if f"{self.prefix}.{name}" in pool:
                return f"{self.prefix}.{name}"
            if name.startswith(self.prefix + ".") and name[len(self.prefix) + 1:] in pool:
                return name[len(self.prefix) + 1:]
        return None


def build_meta_model(directory: str):
    """The transformers model of `directory`, on the meta device (no weights)."""
    import transformers

    with contextlib.redirect_stdout(io.StringIO()):
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    if hasattr(config, "quantization_config"):  # describe the float architecture, not a quantizer's
        delattr(config, "quantization_config")
    architectures = getattr(config, "architectures", None) or []
    model_class = None
    for arch in architectures:
        model_class = getattr(transformers, arch, None)
        if model_class is not None:
            break
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_class is not None:
            return model_class._from_config(config)
        return transformers.AutoModel.from_config(config)


def describe_model(directory: str, tensor_shapes: Dict[str, tuple]) -> ModelLayout:
    """Linear layers of the model in `directory`; `tensor_shapes` are the checkpoint's."""
    try:
        model = build_meta_model(directory)
    except Exception as e:  # noqa: BLE001  (ImportError, unknown architecture, bad config)
        experts = next((key for key in tensor_shapes if _EXPERTS_TENSOR.search(key)), None)
        if experts is not None:  # names cannot tell how the experts form the stacks the model loads
            purpose = f"converting a mixture-of-experts model ({directory} holds {experts})"
            import_transformers(purpose)
            raise CheckpointError(f"{purpose} needs its model class, but it could not be built from its config "
                                  f"({type(e).__name__}: {e})") from e
        warnings.warn(f"could not build the model from its config ({type(e).__name__}: {e}); "
                      f"falling back to name-based detection of linear layers", stacklevel=3)
        return _fallback_layout(tensor_shapes)
    return layout_of_model(model)


def layout_of_model(model: nn.Module) -> ModelLayout:
    from ..moe import find_experts_modules

    layout = ModelLayout(prefix=getattr(model, "base_model_prefix", "") or "",
                         architecture=type(model).__name__)
    experts, layout.experts_unsupported = find_experts_modules(model)
    for name, structure in experts.items():
        for param, in_features, out_features in structure.stacks:
            layout.stacks[f"{name}.{param}"] = StackSpec(name, param, structure.num_experts, in_features,
                                                         out_features, structure.has_bias, structure.is_transposed)
    if layout.stacks:
        layout.transforms = _weight_transforms(model)
    for name, module in model.named_modules():
        if is_conv1d(module):
            layout.linears[name] = LinearSpec("conv1d", module.nx, module.nf, module.bias is not None)
        elif is_float_linear(module):
            layout.linears[name] = LinearSpec("linear", module.in_features, module.out_features,
                                              module.bias is not None)
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is not None:
        layout.output_embeddings = {n for n, m in model.named_modules() if m is output}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in dict(tied).items():
        layout.tied.update({target.rpartition(".")[0], source.rpartition(".")[0]})
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        layout.tied.update(layout.output_embeddings)
    return layout


def _fallback_layout(tensor_shapes: Dict[str, tuple]) -> ModelLayout:
    layout = ModelLayout(exact=False)
    for key, shape in tensor_shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            module = key[: -len(".weight")]
            if _FALLBACK_FLOAT.search(module):
                continue
            out_features, in_features = shape
            layout.linears[module] = LinearSpec("linear", in_features, out_features,
                                                f"{module}.bias" in tensor_shapes)
    return layout


def float_linear_modules(layout: ModelLayout, keys: List[str]) -> Dict[str, str]:
    """{checkpoint module name: model module name} for linear layers stored as float weights."""
    result = {}
    for key in keys:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            model_name = layout.resolve(module, layout.linears)
            if model_name is not None:
                result[module] = model_name
    return result


def _weight_transforms(model: nn.Module) -> list:
    """transformers' checkpoint conversions of the model (renamings, stack merges)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return list(get_model_conversion_mapping(model))
    except Exception:  # noqa: BLE001  (an older transformers, a model without mappings)
        return []


def expert_parts(layout: ModelLayout, modules: Iterable[str]) -> Dict[str, ExpertPart]:
    """{checkpoint module: ExpertPart} for the per-expert linear layers among `modules`
    that transformers' conversion mapping merges into one of the model's stacks. Only
    merges this converter can reproduce exactly are used: stacking the experts
    (MergeModulelist(dim=0)) and concatenating parts along out_features (Concatenate(dim=1))
    of a stack stored [E, out, in]."""
    if not layout.stacks or not layout.transforms:
        return {}
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings

    renamings = [t for t in layout.transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in layout.transforms if isinstance(t, WeightConverter)]
    parts = {}
    for module in modules:
        key = apply_renamings(f"{module}.weight", renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(key)
            if pattern is None:
                continue
            stack = layout.resolve(target, layout.stacks)
            expert = _expert_index(pattern, key)
            if stack is not None and expert is not None and _mergeable(converter, layout.stacks[stack]):
                parts[module] = ExpertPart(stack, expert, converter.source_patterns.index(pattern),
                                           len(converter.source_patterns))
            break
    return parts


def _expert_index(pattern: str, key: str) -> Optional[int]:
    """The number a source pattern's `*` stands for in `key`."""
    regex = re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    return int(match.group(1)) if match and match.groups() else None


def _mergeable(converter, spec: StackSpec) -> bool:
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if spec.transposed or not ops or ops[0] != ("MergeModulelist", 0):
        return False
    return ops[1:] == [] if len(converter.source_patterns) == 1 else ops[1:] == [("Concatenate", 1)]
