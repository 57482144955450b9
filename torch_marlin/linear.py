"""MarlinLinear: an nn.Linear drop-in whose weight is stored in 4 bits."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from . import formats, ops  # noqa: F401  (ops registers torch.ops.marlin)
from .quantize import QuantizedWeight, quantize_weight

# Buffers stored in fp16 whatever the module's dtype (docs/FORMAT.md).
_FP16_BUFFERS = ("scales", "zeros")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 family): a linear layer that stores its weight as [in, out]."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def is_float_linear(module: nn.Module) -> bool:
    """A float linear layer MarlinLinear can replace: nn.Linear or Conv1D, exactly
    (subclasses may carry behaviour that replacing them would drop)."""
    return type(module) is nn.Linear or is_conv1d(module)


def linear_weight(weight: torch.Tensor, conv1d: bool = False) -> torch.Tensor:
    """A linear layer's stored weight as the nn.Linear convention W [out, in]."""
    return weight.t() if conv1d else weight


class MarlinLinear(nn.Module):
    """y = x @ W^T + b with W stored as packed 4-bit codes plus group scales.

    Input dtype (float16, bfloat16 or float32) selects the compute dtype.
    Weights are frozen buffers; gradients flow to the input (and to the bias
    if it requires grad), so adapters such as LoRA train on top.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight_format: str = "fp4", group_size: int = 128,
                 device=None, dtype=None) -> None:
        super().__init__()
        formats.check_weight_format(weight_format)
        formats.check_group_size(group_size)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_format, self.group_size = weight_format, group_size
        k = formats.padded_in_features(in_features, group_size)
        groups = formats.num_groups(k, group_size)
        self.register_buffer("packed", torch.zeros(k // formats.PACK_FACTOR, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        zeros = torch.zeros(groups, out_features, dtype=torch.float16, device=device) if weight_format == "uint4" else None
        self.register_buffer("zeros", zeros)
        b = torch.zeros(out_features, dtype=dtype or torch.get_default_dtype(), device=device) if bias else None
        self.register_buffer("bias", b)

    @property
    def padded_in_features(self) -> int:
        return self.packed.shape[0] * formats.PACK_FACTOR

    @classmethod
    def from_quantized(cls, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> "MarlinLinear":
        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
        if bias is not None and tuple(bias.shape) != (qweight.out_features,):
            raise ValueError(f"bias must have shape [{qweight.out_features}], got {list(bias.shape)}")
        module = cls(qweight.in_features, qweight.out_features, bias is not None,
                     qweight.weight_format, qweight.group_size, device=qweight.packed.device,
                     dtype=None if bias is None else bias.dtype)
        module.packed.copy_(qweight.packed)
        module.scales.copy_(qweight.scales)
        if qweight.zeros is not None:
            module.zeros.copy_(qweight.zeros)
        if bias is not None:
            module.bias.copy_(bias.detach())
        return module

    @classmethod
    def from_linear(cls, linear: nn.Module, weight_format: str = "fp4", group_size: int = 128,
                    method: str = "mse") -> "MarlinLinear":
        """Quantize an nn.Linear (or transformers Conv1D) on any device; the result
        stays on that device. This is the one path every float linear weight takes
        (quantize_model, quantize-on-load)."""
        if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if linear.weight.device.type == "meta":
            raise ValueError("linear.weight is on the meta device (not loaded); cannot quantize it")
        weight = linear_weight(linear.weight.detach(), is_conv1d(linear))
        qweight = quantize_weight(weight, weight_format, group_size, method)
        bias = None if linear.bias is None else linear.bias.detach().cpu()
        module = cls.from_quantized(qweight, bias)
        module.quantization_error = qweight.relative_error
        return module.to(linear.weight.device)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.packed, self.scales, self.zeros, self.weight_format,
                               self.group_size, self.in_features, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight W [out_features, in_features] as a dense tensor (computed in fp32)."""
        b = torch.ops.marlin.dequantize(self.packed, self.scales, self.zeros, self.weight_format,
                                        self.group_size, torch.float32)
        return b[: self.in_features].t().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.quantized_weight(), self.bias)

    def _apply(self, fn, recurse=True):
        # .half()/.to(dtype) must not touch fp16 scales/zeros: apply fn to an
        # int16 view (device moves still happen, dtype casts skip integers).
        for name in _FP16_BUFFERS:
            if self._buffers.get(name) is not None:
                self._buffers[name] = self._buffers[name].view(torch.int16)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name in _FP16_BUFFERS:
                if self._buffers.get(name) is not None:
                    self._buffers[name] = self._buffers[name].view(torch.float16)

    # state_dict carries the layout next to the tensors, because fp4 and int4
    # weights of the same shape are otherwise indistinguishable: loading one
    # into the other must fail, not compute garbage.
    _LAYOUT_VERSION = 1

    def get_extra_state(self) -> torch.Tensor:
        """[version, index in WEIGHT_FORMATS, group_size, in_features] (int64, docs/FORMAT.md)."""
        return torch.tensor([self._LAYOUT_VERSION, formats.WEIGHT_FORMATS.index(self.weight_format),
                             self.group_size, self.in_features], dtype=torch.int64)

    def set_extra_state(self, state) -> None:
        if not (isinstance(state, torch.Tensor) and state.dim() == 1 and state.numel() == 4
                and not state.dtype.is_floating_point):
            raise ValueError(f"MarlinLinear state_dict '_extra_state' must be 4 integers "
                             f"[version, format, group_size, in_features], got {state!r}")
        version, fmt, group_size, in_features = (int(v) for v in state.tolist())
        if version != self._LAYOUT_VERSION or not 0 <= fmt < len(formats.WEIGHT_FORMATS):
            raise ValueError(f"MarlinLinear state_dict has layout version {version} / format index {fmt}; "
                             f"this torch_marlin reads version {self._LAYOUT_VERSION}")
        saved = (formats.WEIGHT_FORMATS[fmt], group_size, in_features)
        mine = (self.weight_format, self.group_size, self.in_features)
        if saved != mine:
            raise ValueError(
                "state_dict was saved from MarlinLinear(weight_format={!r}, group_size={}, in_features={}); "
                "this module has weight_format={!r}, group_size={}, in_features={}: build it with the "
                "saved values".format(*saved, *mine))

    def extra_repr(self) -> str:
        bits = self.quantized_weight().nbytes * 8 / (self.in_features * self.out_features)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight_format={self.weight_format}, "
                f"group_size={self.group_size}, bits_per_weight={bits:.2f}")


class PermutedInputMarlinLinear(MarlinLinear):
    """MarlinLinear whose K rows were reordered (GPTQ / compressed-tensors act-order):
    groups are contiguous after the permutation, so the input is permuted the same way."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight_format: str = "fp4",
                 group_size: int = 128, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, weight_format, group_size, device=device, dtype=dtype)
        self.register_buffer("input_perm", torch.arange(in_features, dtype=torch.int32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.input_perm.to(torch.long)))


def quantized_linear(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Functional form: x [..., in_features] -> [..., out_features] in x's dtype."""
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != qweight.in_features:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [..., in_features={qweight.in_features}], got {shape}")
    pad = qweight.padded_in_features - qweight.in_features
    if pad:
        x = F.pad(x, (0, pad))
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return torch.ops.marlin.gemm(x, qweight.packed, qweight.scales, qweight.zeros, bias,
                                 qweight.weight_format, qweight.group_size)
