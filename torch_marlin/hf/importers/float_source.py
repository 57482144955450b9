"""A float checkpoint: quantize the weights of its linear layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ...layouts import QuantizedWeight, layout_for_sparsity
from ...linear import linear_weight
from ...model import matches_any
from ...sparsity import is_2to4
from ..layout import ModelLayout, float_linear_modules
from ..errors import CheckpointError
from .base import ConvertedLayer, Importer, LayerPlan


@dataclass
class FloatSource(Importer):
    layout: ModelLayout = None
    weight_format: str = "fp4"
    group_size: int = 128
    quantizer: str = "mse"
    exclude: Sequence[str] = ()
    quantize_lm_head: bool = False
    sparsity: Optional[str] = None  # "2:4": magnitude pruning (a weight already 2:4 keeps its pattern)
    skipped: List[str] = field(default_factory=list)  # linear layers left in float, with reason
    already_sparse: List[str] = field(default_factory=list)  # with sparsity: weights that were already 2:4

    def plan(self) -> Dict[str, LayerPlan]:
        plans = {}
        for module, model_name in float_linear_modules(self.layout, self.source.keys()).items():
            key = f"{module}.weight"
            spec = self.layout.linears[model_name]
            if not self.source.dtype(key).is_floating_point or len(self.source.shape(key)) != 2:
                raise CheckpointError(f"{key}: expected a 2-D float weight for a linear layer, got "
                                      f"{self.source.dtype(key)} {list(self.source.shape(key))}")
            expected = ((spec.out_features, spec.in_features) if spec.kind == "linear"
                        else (spec.in_features, spec.out_features))
            if tuple(self.source.shape(key)) != expected:
                raise CheckpointError(f"{key} has shape {list(self.source.shape(key))} but the config "
                                      f"describes {list(expected)}")
            if model_name in self.layout.tied or module in self.layout.tied:
                self.skipped.append(module)  # shared with an embedding: must stay float
            elif model_name in self.layout.output_embeddings and not self.quantize_lm_head:
                self.skipped.append(module)
            elif matches_any(module, self.exclude) or matches_any(model_name, self.exclude):
                self.skipped.append(module)
            else:
                bias = f"{module}.bias"
                plans[module] = LayerPlan([key], bias if bias in self.source else None)
        return plans

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        weight = self.source.load(plan.keys[0])
        model_name = self.layout.resolve(module, self.layout.linears)
        weight = linear_weight(weight, self.layout.linears[model_name].kind == "conv1d")
        layout = layout_for_sparsity(self.sparsity) or QuantizedWeight
        if self.sparsity is not None and is_2to4(weight):
            self.already_sparse.append(module)
        try:  # the quantizer finds NaN and Inf while it reads the weight
            q = layout.from_float(weight, self.weight_format, self.group_size, self.quantizer)
        except ValueError as e:
            raise CheckpointError(f"{plan.keys[0]}: {e}") from e
        return ConvertedLayer(q)

    def layers_in_float(self, linears, converted):
        return sorted(self.skipped)

    def description(self) -> dict:
        described = {"method": "float", "quantizer": self.quantizer}
        if self.sparsity is not None:
            described.update(sparsity=self.sparsity, pruning="magnitude", already_sparse=len(self.already_sparse))
        return described
