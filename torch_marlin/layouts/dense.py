"""The dense layout: `packed` int32 [K/8, N] plus per-group `scales` (and `zeros`).

Everything of the layout on the Python side: the QuantizedWeight class
(packing from codes, the float64 reference dequantization, its op call), and
the fake kernels and autograd of its ops `torch.ops.marlin.gemm` /
`dequantize` (schemas in csrc/registration.cpp, CPU kernels in csrc/cpu/,
Metal planner in csrc/core/metal_plan_dense.cpp). docs/FORMAT.md is the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from .. import formats
from .. import ops
from ..quantize import QuantizedCodes, check_float_weight, native_search, quantize_codes, run_native
from .base import QuantizedLayout, fake_gemm_output, register_layout


@register_layout
@dataclass
class QuantizedWeight(QuantizedLayout):
    """A packed weight and what is needed to interpret it (docs/FORMAT.md)."""

    LAYOUT = "dense"
    LAYOUT_CODE = 1  # the state_dict descriptor's first integer (it was "layout version 1")
    TENSORS = ("packed", "scales", "zeros")

    packed: torch.Tensor  # int32 [K/8, N], K padded
    scales: torch.Tensor  # fp16 [G, N]
    zeros: Optional[torch.Tensor]  # fp16 [G, N] for formats with zeros (uint4), else None
    weight_format: str
    group_size: int
    in_features: int  # unpadded K
    out_features: int  # N
    relative_error: float = float("nan")  # ||W - Wq|| / ||W|| when quantized from floats

    @property
    def padded_in_features(self) -> int:
        return self.packed.shape[0] * formats.PACK_FACTOR

    @classmethod
    def from_codes(cls, codes, scales, zeros, weight_format, group_size,
                   in_features=None, out_features=None) -> "QuantizedWeight":
        """Pack codes [K, N] (0..15) with their scales/zeros [G, N]; validates everything."""
        packed = formats.pack_codes(codes)
        k, n, _ = formats.check_quantized(packed, scales, zeros, weight_format, group_size)
        in_features = k if in_features is None else int(in_features)
        out_features = n if out_features is None else int(out_features)
        if not (0 < in_features <= k and k - in_features < formats.padded_in_features(1, group_size)):
            raise ValueError(f"in_features={in_features} does not fit packed K={k}")
        if out_features != n:
            raise ValueError(f"out_features={out_features} must equal N={n}")
        return cls(packed, scales.contiguous(), None if zeros is None else zeros.contiguous(),
                   weight_format, group_size, in_features, out_features)

    @classmethod
    def empty(cls, in_features, out_features, weight_format, group_size, device=None) -> "QuantizedWeight":
        k = formats.padded_in_features(in_features, group_size)
        groups = formats.num_groups(k, group_size)
        packed = torch.zeros(k // formats.PACK_FACTOR, out_features, dtype=torch.int32, device=device)
        scales = torch.zeros(groups, out_features, dtype=torch.float16, device=device)
        zeros = torch.zeros_like(scales) if formats.has_zeros(weight_format) else None
        return cls(packed, scales, zeros, weight_format, group_size, in_features, out_features)

    @classmethod
    def concat_out(cls, parts) -> "QuantizedWeight":
        """Weights of the same input side stacked along out_features (exact: scales and
        zeros are per output column), e.g. gate and up into gate_up. int4 parts join
        uint4 ones as uint4 with zero 8, the same values."""
        parts = list(parts)
        if len({q.weight_format for q in parts}) > 1 and {q.weight_format for q in parts} == {"int4", "uint4"}:
            parts = [q.as_uint4() for q in parts]
        first = parts[0]
        key = (first.weight_format, first.group_size, first.in_features, first.packed.shape[0])
        for i, q in enumerate(parts):
            other = (q.weight_format, q.group_size, q.in_features, q.packed.shape[0])
            if other != key:
                raise ValueError(f"part {i} has (weight_format, group_size, in_features, K/8) {other}, part 0 has "
                                 f"{key}: only weights of one format, group size and in_features concatenate")
        zeros = None if first.zeros is None else torch.cat([q.zeros for q in parts], 1)
        return cls(torch.cat([q.packed for q in parts], 1), torch.cat([q.scales for q in parts], 1), zeros,
                   first.weight_format, first.group_size, first.in_features, sum(q.out_features for q in parts))

    def as_uint4(self) -> "QuantizedWeight":
        """An int4 weight as uint4 with zero point 8: the same codes and values."""
        if self.weight_format != "int4":
            raise ValueError(f"only int4 converts to uint4 exactly, this is {self.weight_format}")
        return QuantizedWeight(self.packed, self.scales, torch.full_like(self.scales, formats.INT4_OFFSET), "uint4",
                               self.group_size, self.in_features, self.out_features)

    @classmethod
    def from_float(cls, weight, weight_format, group_size, method="mse") -> "QuantizedWeight":
        return quantize_weight(weight, weight_format, group_size, method)

    @classmethod
    def pack(cls, codes: QuantizedCodes) -> "QuantizedWeight":
        q = cls.from_codes(codes.codes, codes.scales, codes.zeros, codes.weight_format, codes.group_size,
                           in_features=codes.in_features, out_features=codes.out_features)
        q.relative_error = codes.relative_error
        return q

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weight W as [N, in_features] (reference path, float64 inside)."""
        b = formats.dequantize_reference(self.packed, self.scales, self.zeros,
                                         self.weight_format, self.group_size, dtype)
        return b[: self.in_features].t()

    def weight(self, dtype=torch.float32) -> torch.Tensor:
        b = ops.dequantize(self.packed, self.scales, self.zeros, self.weight_format, self.group_size, torch.float32)
        return b[: self.in_features].t().to(dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        pad = self.padded_in_features - self.in_features
        if pad:
            x = F.pad(x, (0, pad))
        return ops.gemm(x, self.packed, self.scales, self.zeros, bias, self.weight_format, self.group_size)


# --- quantizing a float weight into the layout ---------------------------------------

def quantize_weight(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                    method: str = "mse") -> QuantizedWeight:
    """Quantize an nn.Linear weight [N, K]; K is zero-padded to what the layout needs.
    "mse" and "absmax" run in C++ (torch.ops.marlin._quantize_weight, straight to the
    packed layout), with the result of quantize_weight_reference bit for bit."""
    check_float_weight(weight, weight_format, group_size, method)
    search = native_search(method)
    if search is None:
        return quantize_weight_reference(weight, weight_format, group_size, method)
    (packed, scales, zeros), error = run_native(ops._quantize_weight, weight, weight_format, group_size, search)
    n, k = weight.shape
    q = QuantizedWeight(packed, scales, zeros if formats.has_zeros(weight_format) else None, weight_format, group_size,
                        in_features=k, out_features=n)
    q.relative_error = error
    return q


def quantize_weight_reference(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                              method: str = "mse") -> QuantizedWeight:
    """quantize_weight in plain torch, through the registered Python quantizer
    (torch_marlin.quantize.quantize_codes): the specification of its C++ path."""
    return QuantizedWeight.pack(quantize_codes(weight, weight_format, group_size, method))


def pack_fp4_weights(weight: torch.Tensor, group_size: int = 128):
    """Quantize a float nn.Linear weight [N, K] to fp4; returns (packed, scales).

    An fp4-only shorthand; `quantize_weight` is the general form.
    """
    q = quantize_weight(weight, "fp4", group_size)
    return q.packed, q.scales


# --- fake kernels and autograd of the dense ops -------------------------------------

@torch.library.register_fake("marlin::gemm")
def _gemm_fake(x, packed, scales, zeros, bias, weight_format, group_size):
    k, n, _ = formats.check_quantized(packed, scales, zeros, weight_format, group_size)
    return fake_gemm_output(x, packed, "packed", k, n, bias)


@torch.library.register_fake("marlin::dequantize")
def _dequantize_fake(packed, scales, zeros, weight_format, group_size, dtype=None):
    k, n, _ = formats.check_quantized(packed, scales, zeros, weight_format, group_size)
    return packed.new_empty((k, n), dtype=dtype or torch.float16)


def _gemm_setup_context(ctx, inputs, output):
    x, packed, scales, zeros, bias, weight_format, group_size = inputs
    ctx.save_for_backward(packed, scales, zeros)
    ctx.weight_format, ctx.group_size, ctx.x_dtype = weight_format, group_size, x.dtype
    ctx.has_bias = bias is not None


def _gemm_backward(ctx, grad):
    packed, scales, zeros = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dy @ B^T with B = W^T dequantized in the activation dtype.
        b = ops.dequantize(packed, scales, zeros, ctx.weight_format, ctx.group_size, ctx.x_dtype)
        grad_x = grad @ b.t()
    if ctx.has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, None, None, None, grad_bias, None, None


torch.library.register_autograd("marlin::gemm", _gemm_backward, setup_context=_gemm_setup_context)
