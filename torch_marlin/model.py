"""quantize_model: swap a model's linear layers for MarlinLinear in place."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Union

from torch import nn

from .linear import MarlinLinear, is_float_linear
from .sparsity import split_method

Patterns = Union[str, Iterable[str], None]


@dataclass
class QuantizationReport:
    replaced: List[str] = field(default_factory=list)  # qualified names now MarlinLinear
    skipped: List[str] = field(default_factory=list)  # linear layers left in float (excluded)
    bytes_before: int = 0  # float weight + bias bytes of the replaced layers
    bytes_after: int = 0  # packed + scales (+ zeros) + bias bytes of the same layers
    relative_errors: Dict[str, float] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        mib = 1 / 2 ** 20
        return (f"quantized {len(self.replaced)} linear layers ({len(self.skipped)} left in float): "
                f"{self.bytes_before * mib:.2f} MiB -> {self.bytes_after * mib:.2f} MiB")


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """Glob match on a qualified module name; a plain pattern also matches as a suffix
    of dotted names ("lm_head" matches "model.lm_head", "q_proj" every q_proj)."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return True
    return False


def _patterns(value: Patterns, name: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    patterns = list(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{name} must be a glob pattern or a list of them, got {value!r}")
    return patterns


def _nbytes(module: nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + [b for b in module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_model(model: nn.Module, weight_format: str = "fp4", group_size: int = 128,
                   include: Patterns = None, exclude: Patterns = None,
                   method: str = "mse", sparsity: Optional[str] = None) -> QuantizationReport:
    """Replace every linear layer (nn.Linear, and transformers' Conv1D) whose
    qualified name matches `include` (glob patterns, a plain name also matching
    as a suffix; default all) and none of `exclude` with a MarlinLinear.
    Returns a QuantizationReport (what was replaced, memory before/after).

    sparsity="2:4" prunes every such layer to 2:4 first (SparseQuantizedWeight);
    `method` then names the pruning method (torch_marlin.sparsity): "magnitude"
    (or a quantizer name, "mse"/"absmax": magnitude pruning with that quantizer)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    pruning, quantizer = split_method(method, sparsity)
    include_p, exclude_p = _patterns(include, "include"), _patterns(exclude, "exclude") or []
    report = QuantizationReport()
    targets = []
    for name, module in model.named_modules():
        if not is_float_linear(module):
            continue
        selected = include_p is None or matches_any(name, include_p)
        if not selected or matches_any(name, exclude_p):
            report.skipped.append(name)
        else:
            targets.append(name)
    for name in targets:
        linear = model.get_submodule(name)
        try:
            quantized = MarlinLinear.from_linear(linear, weight_format, group_size, quantizer, sparsity=sparsity)
        except ValueError as e:  # name the layer
            raise ValueError(f"{name}: {e}") from e
        report.bytes_before += _nbytes(linear)
        report.bytes_after += _nbytes(quantized)
        report.relative_errors[name] = quantized.quantization_error
        model.set_submodule(name, quantized)
        report.replaced.append(name)
    return report
