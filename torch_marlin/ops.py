"""torch.ops.marlin.* as typed Python functions: importing this module loads the C++
extension, and each op has one function here, named as the op, with its arguments
and their rules (in the manner of pytorch/extension-cpp's ops.py).

The schemas, kernels and argument checks are C++ (csrc/registration.cpp,
csrc/cpu/, csrc/core/checks.cpp and the layouts' *_checks.cpp, shared by the CPU
op and the Metal planner): a bad argument raises there, naming it. Each
layout's fake kernels and autograd live with the layout (torch_marlin/layouts/).

Shapes: K is the packed (padded) number of input features, N the number of
output features, G = K / group_size groups of K (1 for group_size=-1). Codes,
scales and zeros are laid out as docs/FORMAT.md says; weight_format is one of
formats.WEIGHT_FORMATS and group_size one of formats.GROUP_SIZES.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.marlin.*)

# --- dense layout (torch_marlin/layouts/dense.py) ------------------------------------------


def gemm(x: Tensor, packed: Tensor, scales: Tensor, zeros: Optional[Tensor], bias: Optional[Tensor],
         weight_format: str, group_size: int) -> Tensor:
    """x @ W^T (+ bias) with W^T = B [K, N] the dense packed weight.

    x [..., K] float16, bfloat16 or float32 (the compute dtype); packed int32 [K/8, N];
    scales fp16 [G, N]; zeros fp16 [G, N] for formats with zeros, else None; bias [N] in
    x's dtype or None. Returns [..., N] in x's dtype (fp32 accumulation)."""
    return torch.ops.marlin.gemm(x, packed, scales, zeros, bias, weight_format, group_size)


def dequantize(packed: Tensor, scales: Tensor, zeros: Optional[Tensor], weight_format: str, group_size: int,
               dtype: Optional[torch.dtype] = None) -> Tensor:
    """B = W^T [K, N] of a dense packed weight (arguments as gemm), computed in fp32 and
    rounded once to `dtype` (float16, bfloat16 or float32; default float16)."""
    return torch.ops.marlin.dequantize(packed, scales, zeros, weight_format, group_size, dtype)


# --- 2:4 sparse layout (torch_marlin/layouts/sparse24.py) ----------------------------------


def sparse24_gemm(x: Tensor, values: Tensor, metadata: Tensor, scales: Tensor, zeros: Optional[Tensor],
                  bias: Optional[Tensor], weight_format: str, group_size: int) -> Tensor:
    """x @ W^T (+ bias) with W a 2:4 sparse packed weight: values int32 [K/16, N] (the kept
    codes), metadata int32 [K/32, N] (their positions; every nibble a valid pattern),
    scales / zeros / bias and the result as gemm."""
    return torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, bias, weight_format, group_size)


def sparse24_dequantize(values: Tensor, metadata: Tensor, scales: Tensor, zeros: Optional[Tensor],
                        weight_format: str, group_size: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """B = W^T [K, N] of a 2:4 sparse weight (arguments as sparse24_gemm; pruned weights
    are 0), computed in fp32 and rounded once to `dtype` (default float16)."""
    return torch.ops.marlin.sparse24_dequantize(values, metadata, scales, zeros, weight_format, group_size, dtype)


# --- expert stacks (torch_marlin/layouts/experts.py) -----------------------------------------


def moe_gemm(x: Tensor, expert_ids: Tensor, topk_weights: Optional[Tensor], packed: Tensor, scales: Tensor,
             zeros: Optional[Tensor], bias: Optional[Tensor], weight_format: str, group_size: int) -> Tensor:
    """Routed rows times their experts' weights: for token t and slot j, e = expert_ids[t, j],
    row x[t] (x [T, K]) or x[t, j] (x [T, top_k, K]) @ W_e^T + bias[e].

    expert_ids int32/int64 [T, top_k]; packed int32 [E, K/8, N], scales / zeros fp16
    [E, G, N]; bias [E, N] in x's dtype or None. Returns [T, top_k, N], or with
    topk_weights [T, top_k] (x's dtype) the weighted sum over j, [T, N]."""
    return torch.ops.marlin.moe_gemm(x, expert_ids, topk_weights, packed, scales, zeros, bias, weight_format,
                                     group_size)


def _moe_gemm_grad_x(grad: Tensor, expert_ids: Tensor, packed: Tensor, scales: Tensor, zeros: Optional[Tensor],
                     weight_format: str, group_size: int) -> Tensor:
    """moe_gemm's backward for x: grad [T, top_k, N] row (t, j) times B_e [K, N] transposed,
    e = expert_ids[t, j]; [T, top_k, K] in grad's dtype. Internal (autograd of moe_gemm)."""
    return torch.ops.marlin._moe_gemm_grad_x(grad, expert_ids, packed, scales, zeros, weight_format, group_size)


# --- the built-in quantizers in C++ (torch_marlin/quantize.py is their specification) ------


def _quantize_weight(weight: Tensor, weight_format: str, group_size: int, clip_ratios: Sequence[float],
                     rounds: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize weight [N, K] (CPU, float32, bfloat16 or float16) into the dense layout: for
    each clip ratio the clipped scale and `rounds - 1` least-squares refits, keeping the
    best. Returns (packed, scales, zeros, sums = [squared error, squared norm] float64);
    zeros is empty for formats without zeros. Internal (layouts/dense.py quantize_weight)."""
    return torch.ops.marlin._quantize_weight(weight, weight_format, group_size, list(clip_ratios), rounds)


def _quantize_weight_sparse24(weight: Tensor, weight_format: str, group_size: int, clip_ratios: Sequence[float],
                              rounds: int, scores: Optional[Tensor] = None
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """_quantize_weight into the 2:4 layout, pruned first to the two largest `scores`
    (float32 [N, K]; default |weight|) of every block of 4: (values, metadata, scales,
    zeros, sums). Internal (layouts/sparse24.py quantize_sparse)."""
    return torch.ops.marlin._quantize_weight_sparse24(weight, weight_format, group_size, list(clip_ratios), rounds,
                                                      scores)


# --- what the machine runs ------------------------------------------------------------------


def _cpu_kernels() -> str:
    """JSON: {"selected": the CPU kernel build in use, "builds": {build: "" if this CPU runs
    it, else why not}, "passed_over": {build: why the automatic choice skips it}}."""
    return torch.ops.marlin._cpu_kernels()


def _metal_fit_threadgroup(kernel: str, threadgroup: Sequence[int], min_threads_x: int, max_threads: int,
                           thread_execution_width: int = 32) -> List[int]:
    """The threadgroup the MPS bridge launches `kernel` with on a pipeline allowing at most
    `max_threads` threads (csrc/core/metal_plan.cpp fit_threadgroup); raises if it cannot run."""
    return torch.ops.marlin._metal_fit_threadgroup(kernel, list(threadgroup), min_threads_x, max_threads,
                                                   thread_execution_width)


def _metal_support_problem(macos_major: int, macos_minor: int, apple7_gpu: bool) -> str:
    """Why the Metal kernels cannot run on this macOS version / GPU family; "" if they can."""
    return torch.ops.marlin._metal_support_problem(macos_major, macos_minor, apple7_gpu)


class cpu_int8_activations:
    """Whether the CPU kernels quantize x to int8 for GEMVs (up to 8 rows of x).

    The GEMVs of the dense op, the expert stacks and the 2:4 layout take it.

    x is quantized per block of 32 values to int8 with an fp32 scale (as
    llama.cpp's Q8_0) and multiplied by the 4-bit codes with integer dot
    products, for the value formats whose values are small integers (fp4, int4,
    uint4, affine; nf4 keeps the float path) and group sizes that are multiples
    of 32. Faster decode for a small loss of precision in x (docs/CPU.md has both).
    A process-wide setting, like torch.set_grad_enabled: it applies when
    called, and as a context manager it restores the previous setting on exit::

        torch_marlin.cpu_int8_activations(True)
        with torch_marlin.cpu_int8_activations(False):
            ...
    """

    def __init__(self, enabled: bool):
        if not isinstance(enabled, bool):
            raise TypeError(f"cpu_int8_activations: enabled must be True or False, got {enabled!r}")
        self.previous = torch.ops.marlin._cpu_int8_activations(enabled)

    def __enter__(self) -> "cpu_int8_activations":
        return self

    def __exit__(self, *exc) -> None:
        torch.ops.marlin._cpu_int8_activations(self.previous)

    @staticmethod
    def enabled() -> bool:
        """The setting in force."""
        return torch.ops.marlin._cpu_int8_activations()
