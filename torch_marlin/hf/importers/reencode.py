"""What the importers of MLX, GGUF and bitsandbytes checkpoints share: a tensor is imported
exactly, within a stated bound, re-quantized, or kept in float (dequantized by the source's
own formula), and the summary counts each with its bits per weight before and after.

A tensor that is not imported as a quantized layer is given to the converter dequantized:
`TensorView` hides the source's quantized tensors of it and shows one float tensor under the
model's name instead, computed when the converter streams it (one tensor at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ...layouts import QuantizedWeight
from ..errors import CheckpointError
from .base import ConvertedLayer, Importer

EXACT, BOUND, REQUANTIZED, FLOAT = "exact", "within bound", "re-quantized", "kept float"
CATEGORIES = (EXACT, BOUND, REQUANTIZED, FLOAT)


@dataclass
class ImportOptions:
    """Choices for the tensors a source stores in a form torch_marlin cannot hold exactly
    (MLX 8-bit layers, GGUF Q5/Q6/Q8/F16/IQ4_NL tensors): keep them in float (default), or
    re-quantize the linear layers among them with this format, group size and quantizer."""

    requantize: bool = False
    weight_format: str = "fp4"
    group_size: int = 128
    quantizer: str = "mse"


class TensorView:
    """A source checkpoint with some tensors replaced by computed float tensors.

    `replace(hidden, key, ...)` drops the source tensors `hidden` from the key list and
    lists `key` (a float tensor of `dtype` and `shape`, made by `loader()`) where the first
    of them was, so the converter still streams in file order."""

    def __init__(self, base) -> None:
        self.base = base
        self.directory = base.directory
        self.config = base.config
        self._virtual: Dict[str, Tuple[torch.dtype, Tuple[int, ...], Callable[[], torch.Tensor]]] = {}
        self._hidden: Dict[str, Optional[str]] = {}  # source key -> the virtual key listed in its place

    def replace(self, hidden: Iterable[str], key: str, dtype: torch.dtype, shape, loader) -> None:
        hidden = list(hidden)
        self._virtual[key] = (dtype, tuple(int(s) for s in shape), loader)
        for i, name in enumerate(hidden):
            self._hidden[name] = key if i == 0 else None

    def keys(self) -> List[str]:
        keys = []
        for key in self.base.keys():
            if key in self._hidden:
                if self._hidden[key] is not None:
                    keys.append(self._hidden[key])
            elif key not in self._virtual:
                keys.append(key)
        return keys

    def __contains__(self, key: str) -> bool:
        return key in self._virtual or (key not in self._hidden and key in self.base)

    def dtype(self, key: str) -> torch.dtype:
        return self._virtual[key][0] if key in self._virtual else self.base.dtype(key)

    def shape(self, key: str) -> Tuple[int, ...]:
        return self._virtual[key][1] if key in self._virtual else self.base.shape(key)

    def nbytes(self, key: str) -> int:
        if key in self._virtual:
            dtype, shape, _ = self._virtual[key]
            return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.base.nbytes(key)

    def load(self, key: str) -> torch.Tensor:
        if key in self._virtual:
            dtype, shape, loader = self._virtual[key]
            tensor = loader()
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise CheckpointError(f"{key}: dequantized to {tensor.dtype} {list(tensor.shape)}, expected "
                                      f"{dtype} {list(shape)}")
            return tensor
        if key in self._hidden:
            raise CheckpointError(f"tensor {key!r} was replaced by its dequantized weight")
        return self.base.load(key)

    def total_bytes(self) -> int:
        return self.base.total_bytes()


@dataclass
class Tally:
    """Per category: tensors, and bits before (as stored by the source) and after."""

    modules: Dict[str, List[str]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    bits: Dict[str, List[float]] = field(default_factory=lambda: {c: [0.0, 0.0, 0.0] for c in CATEGORIES})

    def add(self, category: str, name: str, weights: int, bits_before: float, bits_after: float) -> None:
        self.modules[category].append(name)
        totals = self.bits[category]
        totals[0] += weights
        totals[1] += weights * bits_before
        totals[2] += weights * bits_after

    def lines(self, label: str) -> List[str]:
        parts = []
        for category in CATEGORIES:
            count = len(self.modules[category])
            if count:
                weights, before, after = self.bits[category]
                parts.append(f"{count} {category} ({before / weights:.2f} -> {after / weights:.2f} bits per weight)")
        lines = [f"{label}: " + ("; ".join(parts) if parts else "no quantized tensors")]
        for category in (BOUND, REQUANTIZED, FLOAT):
            names = self.modules[category]
            if names:
                shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
                lines.append(f"  {category}: {shown}")
        return lines


@dataclass
class ReencodingImporter(Importer):
    """Base of the MLX, GGUF and bitsandbytes importers (not registered itself).

    Subclasses fill `self.view` (a TensorView of the source) and `self.plans` in
    `__post_init__`, from headers only, and record every quantized tensor in `self.tally`."""

    layout: object = None  # the ModelLayout of the model
    options: ImportOptions = field(default_factory=ImportOptions)
    tally: Tally = field(default_factory=Tally)

    @classmethod
    def from_config(cls, source, method, config, layout=None, options=None):
        return cls(source, config=config, layout=layout, options=options or ImportOptions())

    def tensor_source(self):
        return self.view

    def is_linear(self, module: str) -> bool:
        return self.layout is not None and self.layout.resolve(module, self.layout.linears) is not None

    def requantized(self, module: str, weight: torch.Tensor, bits_before: float) -> ConvertedLayer:
        """A linear layer the source stores in another form, dequantized to `weight` [N, K]:
        quantized again with the options' format (only called when options.requantize)."""
        o = self.options
        try:
            q = QuantizedWeight.from_float(weight.float(), o.weight_format, o.group_size, o.quantizer)
        except ValueError as e:
            raise CheckpointError(f"{module}: re-quantizing its dequantized weight: {e}") from e
        self.tally.add(REQUANTIZED, module, q.num_weights, bits_before, 8 * q.nbytes / q.num_weights)
        return ConvertedLayer(q)

    def imported(self, module: str, q, bits_before: float, exact: bool = True) -> ConvertedLayer:
        self.tally.add(EXACT if exact else BOUND, module, q.num_weights, bits_before, 8 * q.nbytes / q.num_weights)
        return ConvertedLayer(q)

    def keep_float(self, name: str, hidden, key: str, dtype, shape, loader, bits_before: float) -> None:
        self.view.replace(hidden, key, dtype, shape, loader)
        weights = torch.Size(shape).numel()
        self.tally.add(FLOAT, name, weights, bits_before, 8 * torch.empty((), dtype=dtype).element_size())

    def summary_lines(self) -> List[str]:
        return self.tally.lines(self.LABEL)
