"""Fused projections: quantized linear layers that read the same input (q|k|v,
gate|up) concatenated along N into one wider quantized weight, so a decode
step runs one matmul for the group instead of one per layer (a wider weight
keeps more GPU cores busy; on the CPU one pass over x).

Exact: scales and zeros are per output column, so the fused weight holds the
members' own codes and scales side by side (QuantizedWeight.concat_out), and
each member's output is its columns of the fused output. The parent module's
forward is left alone: each member is replaced by a ProjectionSlice that asks
the group's FusedProjection for its columns; the first member called on an
input computes the fused matmul, the others take their columns of it when
called with the same tensor (as attention and gated MLPs do), and any other
call computes it again (correct, only slower).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .layouts.dense import QuantizedWeight
from .linear import MarlinLinear

# Sibling linears that read the same input, and the name of their fused module (vLLM's names).
PROJECTION_GROUPS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


def _version(x: torch.Tensor) -> Optional[int]:
    """The in-place version counter of x (None for inference tensors, which have none)."""
    return None if x.is_inference() else x._version


class FusedProjection(nn.Module):
    """One MarlinLinear (`linear`) whose output columns are the outputs of `members`, widths `widths`."""

    def __init__(self, linear: MarlinLinear, members: Sequence[str], widths: Sequence[int]) -> None:
        super().__init__()
        if sum(widths) != linear.out_features or len(members) != len(widths):
            raise ValueError(f"widths {list(widths)} of members {list(members)} must sum to the fused "
                             f"out_features {linear.out_features}")
        self.linear = linear
        self.members, self.widths = tuple(members), tuple(widths)
        self._clear()

    def _clear(self) -> None:
        self._input, self._input_version, self._outputs, self._served = None, None, None, set()

    def output_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for input x: its columns of the fused output."""
        fresh = (self._outputs is not None and self._input is x and self._input_version == _version(x)
                 and index not in self._served)
        if not fresh:
            outputs = self.linear(x).split(self.widths, dim=-1)
            self._clear()
            self._input, self._input_version = x, _version(x)
            self._outputs = [part.contiguous() for part in outputs]
        out = self._outputs[index]
        self._served.add(index)
        if len(self._served) == len(self.widths):  # every member served: hold nothing between steps
            self._clear()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output: the members' outputs concatenated along the last dimension."""
        return self.linear(x)

    def extra_repr(self) -> str:
        return "members=" + "|".join(f"{m}[{w}]" for m, w in zip(self.members, self.widths))


class ProjectionSlice(nn.Module):
    """Stands in for member `index` of a FusedProjection (which its parent module holds): its columns of
    the fused output. Holds no tensors; the fused weight is saved once, under the FusedProjection."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent already owns it
        self.index = index
        self.in_features, self.out_features = fused.linear.in_features, fused.widths[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output_of(self.index, x)

    def extra_repr(self) -> str:
        return f"columns of {self.fused.members[self.index]} in the fused projection"


def _fusable(modules: List[nn.Module]) -> bool:
    """Plain dense MarlinLinear layers of one input size, format and group size, all with or all without bias."""
    if not all(type(m) is MarlinLinear and m.layout is QuantizedWeight for m in modules):
        return False
    q = [m.quantized_weight() for m in modules]
    same = len({(w.in_features, w.weight_format, w.group_size) for w in q}) == 1
    biases = {m.bias is None for m in modules}
    return same and len(biases) == 1 and len({m.bias.dtype for m in modules if m.bias is not None}) <= 1


def fuse_projections(model: nn.Module) -> List[str]:
    """Fuse, in place, every group of sibling MarlinLinear layers that read the same input
    (PROJECTION_GROUPS: q_proj|k_proj|v_proj into qkv_proj, gate_proj|up_proj into gate_up_proj) into
    one FusedProjection; each member becomes a ProjectionSlice of it. Results are identical to the
    separate layers (the same codes and scales). Groups whose members are not all plain dense
    MarlinLinear layers with one input size, format and group size, and bias on all or none, stay
    as they are. Returns the qualified names of the fused modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    fused_names = []
    for parent_name, parent in list(model.named_modules()):
        for members, fused_name in PROJECTION_GROUPS:
            modules = [getattr(parent, name, None) for name in members]
            if any(m is None for m in modules) or hasattr(parent, fused_name) or not _fusable(modules):
                continue
            weight = QuantizedWeight.concat_out([m.quantized_weight() for m in modules])
            bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
            linear = MarlinLinear.from_quantized(weight, bias)
            fused = FusedProjection(linear, members, [m.out_features for m in modules])
            parent.add_module(fused_name, fused)
            for index, name in enumerate(members):
                setattr(parent, name, ProjectionSlice(fused, index))
            fused_names.append(f"{parent_name}.{fused_name}" if parent_name else fused_name)
    return fused_names
