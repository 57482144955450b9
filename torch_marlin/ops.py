"""torch.ops.marlin.*: loads the C++ ops and adds fake kernels and autograd.

Schemas and backend kernels live in C++ (csrc/registration.cpp, csrc/cpu/,
csrc/mps/). Here, in Python as torch.library recommends: the fake (meta)
kernels that let torch.compile trace the ops, and the backward of gemm
with respect to its input (weights are frozen).
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.marlin.*)
from .formats import PACK_FACTOR, check_quantized

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.register_fake("marlin::gemm")
def _gemm_fake(x, packed, scales, zeros, bias, weight_format, group_size):
    k, n, _ = check_quantized(packed, scales, zeros, weight_format, group_size)
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x must be float16, bfloat16 or float32, got {x.dtype}")
    torch._check(x.device == packed.device,
                 lambda: f"x must be on the same device as packed ({packed.device}), got {x.device}")
    torch._check(x.dim() >= 1 and x.shape[-1] == k, lambda: f"x.size(-1) must equal K = {k}, got {list(x.shape)}")
    if bias is not None:
        torch._check(tuple(bias.shape) == (n,), lambda: f"bias must have shape [{n}], got {list(bias.shape)}")
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("marlin::dequantize")
def _dequantize_fake(packed, scales, zeros, weight_format, group_size, dtype=None):
    k, n, _ = check_quantized(packed, scales, zeros, weight_format, group_size)
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
        b = torch.ops.marlin.dequantize(packed, scales, zeros, ctx.weight_format, ctx.group_size, ctx.x_dtype)
        grad_x = grad @ b.t()
    if ctx.has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, None, None, None, grad_bias, None, None


torch.library.register_autograd("marlin::gemm", _gemm_backward, setup_context=_gemm_setup_context)

__all__ = ["PACK_FACTOR"]
