"""The expert-stack layout: E weights of the same shape, one per expert of a
mixture-of-experts layer, each packed like the dense layout.

`packed` int32 [E, K/8, N], `scales` fp16 [E, K/g, N] (and `zeros` for uint4):
expert e's slices are exactly a dense QuantizedWeight (docs/FORMAT.md). Its op
`torch.ops.marlin.moe_gemm` multiplies routed rows: for T tokens that chose
top_k experts each, row (t, j) times the matrix of expert `expert_ids[t, j]`
(+ that expert's bias), optionally summed over j weighted by `topk_weights`.
This file holds the QuantizedExperts class (packing, the float64 reference
dequantization, its op call) and the op's fake kernel and autograd (schema in
csrc/registration.cpp, CPU kernel in csrc/cpu/experts_ops.cpp, Metal planner in
csrc/core/metal_plan_experts.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch.nn import functional as F

from .. import formats
from .. import ops
from .base import QuantizedLayout, register_layout
from .dense import QuantizedWeight

EXPERT_ID_DTYPES = (torch.int32, torch.int64)


def check_experts(packed, scales, zeros, weight_format: str, group_size: int) -> tuple:
    """Validate an expert stack; returns (E, K, N, groups). Mirrors csrc/core/checks.cpp (stacked)."""
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    if not isinstance(packed, torch.Tensor) or packed.dim() != 3 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be a 3-D int32 tensor [E, K/8, N], got {formats._describe(packed)}")
    e, k, n = packed.shape[0], packed.shape[1] * formats.PACK_FACTOR, packed.shape[2]
    if e == 0 or k == 0 or n == 0:
        raise ValueError(f"packed must not be empty, got shape {list(packed.shape)}")
    groups = formats.num_groups(k, group_size)
    expected = (e, groups, n)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float16:
            raise TypeError(f"{name} must be float16, got {t.dtype}")
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape [E, K/group_size, N] = {list(expected)}, got {list(t.shape)}")
        if t.device != packed.device:
            raise ValueError(f"{name} must be on the same device as packed ({packed.device}), got {t.device}")
    if formats.has_zeros(weight_format) and zeros is None:
        raise ValueError(f"zeros is required for weight_format={weight_format!r}")
    if not formats.has_zeros(weight_format) and zeros is not None:
        raise ValueError(f"zeros must be None for weight_format={weight_format!r}")
    return e, k, n, groups


@register_layout
@dataclass
class QuantizedExperts(QuantizedLayout):
    """E quantized weights [N, K] stacked along a leading expert dimension (docs/FORMAT.md)."""

    LAYOUT = "experts"
    LAYOUT_CODE = 2  # state_dict descriptor: [2, format, group_size, in_features, num_experts]
    TENSORS = ("packed", "scales", "zeros")

    packed: torch.Tensor  # int32 [E, K/8, N], K padded
    scales: torch.Tensor  # fp16 [E, G, N]
    zeros: Optional[torch.Tensor]  # fp16 [E, G, N] for formats with zeros (uint4), else None
    weight_format: str
    group_size: int
    in_features: int  # unpadded K
    out_features: int  # N
    relative_error: float = float("nan")  # ||W - Wq|| / ||W|| over the stack, when quantized from floats

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def num_weights(self) -> int:
        return self.num_experts * self.in_features * self.out_features

    @property
    def padded_in_features(self) -> int:
        return self.packed.shape[1] * formats.PACK_FACTOR

    @classmethod
    def empty(cls, in_features, out_features, weight_format, group_size, device=None,
              num_experts: int = 1) -> "QuantizedExperts":
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        one = QuantizedWeight.empty(in_features, out_features, weight_format, group_size, device="meta")
        stack = {name: torch.zeros(num_experts, *t.shape, dtype=t.dtype, device=device)
                 for name, t in one.tensors().items()}
        return cls(stack["packed"], stack["scales"], stack.get("zeros"), weight_format, group_size,
                   in_features, out_features)

    @classmethod
    def from_codes(cls, codes, scales, zeros, weight_format, group_size,
                   in_features=None, out_features=None) -> "QuantizedExperts":
        """Pack codes [E, K, N] (0..15) with their scales/zeros [E, G, N]; validates everything."""
        if not isinstance(codes, torch.Tensor) or codes.dim() != 3 or codes.shape[0] == 0:
            raise ValueError(f"codes must be a 3-D tensor [E, K, N] with E >= 1, got {formats._describe(codes)}")
        for name, t in (("scales", scales), ("zeros", zeros)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != codes.shape[0]):
                raise ValueError(f"{name} must be [E, G, N] with E = {codes.shape[0]}, got {formats._describe(t)}")
        return cls.stack([QuantizedWeight.from_codes(codes[e], scales[e], None if zeros is None else zeros[e],
                                                     weight_format, group_size, in_features, out_features)
                          for e in range(codes.shape[0])])

    @classmethod
    def stack(cls, experts: Sequence[QuantizedWeight]) -> "QuantizedExperts":
        """Stack per-expert dense weights of one shape, format and group size (exact)."""
        experts = list(experts)
        if not experts or not all(isinstance(q, QuantizedWeight) for q in experts):
            raise TypeError("experts must be a non-empty sequence of QuantizedWeight")
        first = experts[0]
        key = (first.weight_format, first.group_size, first.in_features, first.out_features, first.packed.shape)
        for i, q in enumerate(experts):
            other = (q.weight_format, q.group_size, q.in_features, q.out_features, q.packed.shape)
            if other != key:
                raise ValueError(f"expert {i} has (weight_format, group_size, in_features, out_features, packed "
                                 f"shape) {other}, expert 0 has {key}: a stack needs one shape and format")
        zeros = None if first.zeros is None else torch.stack([q.zeros for q in experts])
        return cls(torch.stack([q.packed for q in experts]), torch.stack([q.scales for q in experts]), zeros,
                   first.weight_format, first.group_size, first.in_features, first.out_features)

    def expert(self, e: int) -> QuantizedWeight:
        """Expert e's weight as a dense QuantizedWeight (views of this stack's tensors)."""
        return QuantizedWeight(self.packed[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                               self.weight_format, self.group_size, self.in_features, self.out_features)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weights W as [E, N, in_features] (reference path, float64 inside)."""
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.num_experts)])

    def weight(self, dtype=torch.float32) -> torch.Tensor:
        """W [E, N, in_features] through the dense dequantize op, one expert at a time."""
        return torch.stack([self.expert(e).weight(dtype) for e in range(self.num_experts)])

    def linear(self, x, bias):
        raise TypeError("an expert stack multiplies routed rows: use routed_linear(x, expert_ids, topk_weights, bias)")

    def routed_linear(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in_features] (or [T, top_k, in_features]) times the weights of experts
        expert_ids [T, top_k] (+ bias [E, N]); [T, top_k, N], or [T, N] summed with topk_weights."""
        pad = self.padded_in_features - self.in_features
        if pad:
            x = F.pad(x, (0, pad))
        return ops.moe_gemm(x, expert_ids, topk_weights, self.packed, self.scales, self.zeros, bias,
                            self.weight_format, self.group_size)

    def descriptor_extra(self) -> List[int]:
        return [self.num_experts]

    @classmethod
    def describe_extra(cls, text: str, extra: List[int]) -> str:
        return text + (f", num_experts={extra[0]}" if extra else "")


# --- fake kernel and autograd of moe_gemm ----------------------------------------------

def _moe_shapes(x, expert_ids, topk_weights, packed, scales, zeros, bias, weight_format, group_size):
    """(T, top_k, N, weighted) after the checks of csrc/core/experts_checks.cpp."""
    e, k, n, _ = check_experts(packed, scales, zeros, weight_format, group_size)
    torch._check(x.dtype in formats.ACTIVATION_DTYPES, lambda: f"x must be float16, bfloat16 or float32, got {x.dtype}")
    torch._check(expert_ids.dtype in EXPERT_ID_DTYPES, lambda: f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    torch._check(expert_ids.dim() == 2, lambda: f"expert_ids must have shape [T, top_k], got {list(expert_ids.shape)}")
    for name, t in (("x", x), ("expert_ids", expert_ids), ("topk_weights", topk_weights), ("bias", bias)):
        if t is not None:
            torch._check(t.device == packed.device,
                         lambda: f"{name} must be on the same device as packed ({packed.device}), got {t.device}")
    tokens, top_k = expert_ids.shape
    torch._check(top_k > 0, lambda: f"expert_ids must select at least one expert per token, got {list(expert_ids.shape)}")
    torch._check(x.dim() in (2, 3) and x.shape[0] == tokens and (x.dim() == 2 or x.shape[1] == top_k),
                 lambda: f"x must be [T, K] or [T, top_k, K] with [T, top_k] = {list(expert_ids.shape)} from "
                         f"expert_ids, got shape {list(x.shape)}")
    torch._check(x.shape[-1] == k, lambda: f"x.size(-1) must equal K = {k}, got {list(x.shape)}")
    if topk_weights is not None:
        torch._check(topk_weights.dtype in formats.ACTIVATION_DTYPES,
                     lambda: f"topk_weights must be float16, bfloat16 or float32, got {topk_weights.dtype}")
        torch._check(topk_weights.shape == expert_ids.shape,
                     lambda: f"topk_weights must have expert_ids' shape {list(expert_ids.shape)}, got "
                             f"{list(topk_weights.shape)}")
    if bias is not None:
        torch._check(tuple(bias.shape) == (e, n), lambda: f"bias must have shape [E, N] = [{e}, {n}], got {list(bias.shape)}")
        torch._check(bias.dtype == x.dtype, lambda: f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
    return tokens, top_k, n, topk_weights is not None


@torch.library.register_fake("marlin::moe_gemm")
def _moe_gemm_fake(x, expert_ids, topk_weights, packed, scales, zeros, bias, weight_format, group_size):
    tokens, top_k, n, weighted = _moe_shapes(x, expert_ids, topk_weights, packed, scales, zeros, bias,
                                             weight_format, group_size)
    return x.new_empty((tokens, n) if weighted else (tokens, top_k, n))


@torch.library.impl("marlin::_moe_gemm_grad_x", "CompositeExplicitAutograd")
def _moe_gemm_grad_x(grad, expert_ids, packed, scales, zeros, weight_format, group_size):
    """grad [T, top_k, N] -> [T, top_k, K]: row (t, j) times B_e^T, e = expert_ids[t, j], per expert present."""
    tokens, top_k, n = grad.shape
    flat = grad.reshape(tokens * top_k, n)
    out = torch.zeros(tokens * top_k, packed.shape[1] * formats.PACK_FACTOR, dtype=grad.dtype, device=grad.device)
    ids = expert_ids.reshape(-1).long()
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(1)
        b = ops.dequantize(packed[e], scales[e], None if zeros is None else zeros[e], weight_format,
                           group_size, grad.dtype)  # [K, N]
        out.index_copy_(0, rows, flat.index_select(0, rows) @ b.t())
    return out.view(tokens, top_k, -1)


@torch.library.register_fake("marlin::_moe_gemm_grad_x")
def _moe_gemm_grad_x_fake(grad, expert_ids, packed, scales, zeros, weight_format, group_size):
    return grad.new_empty((*grad.shape[:2], packed.shape[1] * formats.PACK_FACTOR))


def _moe_setup_context(ctx, inputs, output):
    x, expert_ids, topk_weights, packed, scales, zeros, bias, weight_format, group_size = inputs
    ctx.save_for_backward(x, expert_ids, topk_weights, packed, scales, zeros, bias)
    ctx.weight_format, ctx.group_size = weight_format, group_size


def _moe_backward(ctx, grad):
    """Gradients for x, topk_weights and bias (the quantized weights are frozen).

    With y[t, j] = x_tj @ B_e + b_e (e = expert_ids[t, j]): the gradient of y[t, j] is
    grad[t, j], or grad[t] * w[t, j] when weighted; that of x_tj is it times B_e^T
    (summed over j when x [T, K] is shared); that of w[t, j] is <grad[t], y[t, j]>.
    """
    x, expert_ids, topk_weights, packed, scales, zeros, bias = ctx.saved_tensors
    weighted = topk_weights is not None
    grad32 = grad.float()
    grad_pairs = grad32.unsqueeze(1) * topk_weights.float().unsqueeze(-1) if weighted else grad32  # [T, top_k, N]
    grad_x = grad_w = grad_bias = None
    if ctx.needs_input_grad[0]:
        gx = ops._moe_gemm_grad_x(grad_pairs, expert_ids, packed, scales, zeros, ctx.weight_format, ctx.group_size)
        grad_x = (gx.sum(1) if x.dim() == 2 else gx).to(x.dtype)
    if weighted and ctx.needs_input_grad[2]:
        y = ops.moe_gemm(x, expert_ids, None, packed, scales, zeros, bias, ctx.weight_format, ctx.group_size)
        grad_w = (grad32.unsqueeze(1) * y.float()).sum(-1).to(topk_weights.dtype)
    if bias is not None and ctx.needs_input_grad[6]:
        flat = grad_pairs.reshape(-1, grad_pairs.shape[-1])
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        grad_bias = grad_bias.index_add_(0, expert_ids.reshape(-1).long(), flat).to(bias.dtype)
    return grad_x, None, grad_w, None, None, None, grad_bias, None, None


torch.library.register_autograd("marlin::moe_gemm", _moe_backward, setup_context=_moe_setup_context)
