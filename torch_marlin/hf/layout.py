"""Which checkpoint tensors belong to linear layers, found without loading weights.

The model is instantiated on the meta device from its config (no memory,
no weights), and its nn.Linear and transformers Conv1D modules are listed.
Checkpoint names are matched to module names allowing for the base-model
prefix ("model.", "bert.", "transformer.") being present on one side only.
Without transformers, or for an architecture it does not know, a name-based
fallback is used and said so.
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

from ..linear import is_conv1d, is_float_linear

# Weights that stay in float in the name-based fallback (embeddings, heads, norms).
_FALLBACK_FLOAT = re.compile(r"(embed|wte|wpe|lm_head|norm|ln_|layernorm|\bln\b|score|classifier)", re.I)


@dataclass(frozen=True)
class LinearSpec:
    kind: str  # "linear" (weight [out, in]) or "conv1d" (transformers Conv1D, weight [in, out])
    in_features: int
    out_features: int
    bias: bool


@dataclass
class ModelLayout:
    linears: Dict[str, LinearSpec] = field(default_factory=dict)  # keyed by model module name
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
        warnings.warn(f"could not build the model from its config ({type(e).__name__}: {e}); "
                      f"falling back to name-based detection of linear layers", stacklevel=3)
        return _fallback_layout(tensor_shapes)
    return layout_of_model(model)


def layout_of_model(model: nn.Module) -> ModelLayout:
    layout = ModelLayout(prefix=getattr(model, "base_model_prefix", "") or "",
                         architecture=type(model).__name__)
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
