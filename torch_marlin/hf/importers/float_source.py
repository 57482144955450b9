"""A float checkpoint: quantize the weights of its linear layers and expert stacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

from ...moe import linear_stack, quantize_experts
from ...layouts import QuantizedWeight, layout_for_sparsity
from ...float_linear import linear_weight
from ...model import matches_any, unmatched_patterns
from ...sparsity import is_2to4
from ..model_layers import ModelLayout, expert_parts, float_linear_modules
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
    skipped: List[str] = field(default_factory=list)  # linear layers / stacks left in float, with reason
    already_sparse: List[str] = field(default_factory=list)  # with sparsity: weights that were already 2:4
    expert_layers: Set[str] = field(default_factory=set)  # per-expert linear layers (parts of a stack)
    _exclude_tested: Set[str] = field(default_factory=set, init=False, repr=False)  # names matched against exclude

    def plan(self) -> Dict[str, LayerPlan]:
        plans = {}
        for module, model_name in float_linear_modules(self.layout, self.source.keys()).items():
            key = f"{module}.weight"
            spec = self.layout.linears[model_name]
            expected = ((spec.out_features, spec.in_features) if spec.kind == "linear"
                        else (spec.in_features, spec.out_features))
            self._require_float(key, expected)
            excluded = self._excluded(module, model_name)
            if model_name in self.layout.tied or module in self.layout.tied:
                self.skipped.append(module)  # shared with an embedding: must stay float
            elif model_name in self.layout.output_embeddings and not self.quantize_lm_head:
                self.skipped.append(module)
            elif excluded:
                self.skipped.append(module)
            else:
                plans[module] = self._plan(module, key, f"{module}.bias")
        # Expert stacks: 3-D tensors in the model's own layout (gpt-oss), or per-expert
        # linear layers that transformers merges into stacks (how it saves Mixtral, Qwen-MoE, ...).
        members = []  # (checkpoint module or stack key, weight key, model stack name, bias key)
        for key in self.source.keys():
            stack = self.layout.resolve(key, self.layout.stacks)
            if stack is not None:
                spec = self.layout.stacks[stack]
                shape = ((spec.num_experts, spec.in_features, spec.out_features) if spec.transposed
                         else (spec.num_experts, spec.out_features, spec.in_features))
                self._require_float(key, shape)
                members.append((key, key, stack, f"{key}_bias"))
        candidates = [k[: -len(".weight")] for k in self.source.keys() if k.endswith(".weight")]
        for module, part in expert_parts(self.layout, candidates).items():
            spec = self.layout.stacks[part.stack]
            if len(self.source.shape(f"{module}.weight")) != 2:
                raise CheckpointError(f"{module}.weight: expected a 2-D float weight of an expert, got "
                                      f"{list(self.source.shape(f'{module}.weight'))}")
            self._require_float(f"{module}.weight", tuple(self.source.shape(f"{module}.weight")))
            if self.source.shape(f"{module}.weight")[1] != spec.in_features:
                raise CheckpointError(f"{module}.weight has shape {list(self.source.shape(f'{module}.weight'))}, "
                                      f"but {part.stack} takes in_features={spec.in_features}")
            members.append((module, f"{module}.weight", part.stack, f"{module}.bias"))
            self.expert_layers.add(module)
        # Loading replaces an experts module with all its stacks quantized: an --exclude
        # pattern matching any of its stacks or layers keeps the whole module in float.
        excluded = {self.layout.stacks[stack].experts_module for module, _, stack, _ in members
                    if self._excluded(module, stack, self.layout.stacks[stack].experts_module)}
        for module, key, stack, bias in members:
            if self.layout.stacks[stack].experts_module not in excluded:
                plans[module] = self._plan(module, key, bias)
            elif stack not in self.skipped:
                self.skipped.append(stack)
        for pattern in unmatched_patterns(self.exclude, self._exclude_tested):
            self.note(f"exclude pattern {pattern!r} matches no linear layer or experts module")
        return plans

    def _excluded(self, *names: str) -> bool:
        self._exclude_tested.update(names)
        return any(matches_any(name, self.exclude) for name in names)

    def _plan(self, module: str, key: str, bias: str) -> LayerPlan:
        return LayerPlan([key], bias if bias in self.source else None)

    def _require_float(self, key: str, shape) -> None:
        if not self.source.dtype(key).is_floating_point or tuple(self.source.shape(key)) != tuple(shape):
            raise CheckpointError(f"{key}: expected a float weight of shape {list(shape)} (from the config), got "
                                  f"{self.source.dtype(key)} {list(self.source.shape(key))}")

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        weight = self.source.load(plan.keys[0])
        stack = self.layout.resolve(module, self.layout.stacks)
        model_name = self.layout.resolve(module, self.layout.linears)  # None for an expert's part
        try:  # the quantizer finds NaN and Inf while it reads the weight
            if stack is not None:
                weight = linear_stack(weight, self.layout.stacks[stack].transposed)
                return ConvertedLayer(quantize_experts(weight, self.weight_format, self.group_size, self.quantizer))
            conv1d = model_name is not None and self.layout.linears[model_name].kind == "conv1d"
            weight = linear_weight(weight, conv1d)
            # The expert-stack layout is dense: an expert's layer is quantized dense under sparsity too.
            sparsity = None if module in self.expert_layers else self.sparsity
            layout = layout_for_sparsity(sparsity) or QuantizedWeight
            if sparsity is not None and is_2to4(weight):
                self.already_sparse.append(module)
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
