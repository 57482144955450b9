"""Calibrated 2:4 pruning: SparseGPT and Wanda, each with 4-bit quantization.

Both take a layer's input Hessian H = E[x x^T] [K, K] from the sequential
calibration engine of torch_marlin.calibration (the GPTQ machinery): layers
are pruned and quantized in forward order, each on the inputs it receives
with every earlier layer already pruned and quantized.

- SparseGPT (Frantar & Alistarh, 2023) prunes and quantizes jointly, column by
  column, moving each column's error (pruning or rounding) onto the columns
  not yet processed through the Cholesky factor U of H^-1, like GPTQ
  (torch_marlin.gptq). The kept pair of each block of 4 columns is chosen
  when the block is reached, by the OBS saliency w^2 / U[c, c]^2 of the
  already-updated weights. A group's scales are searched when its first
  column is reached, on the weights the saliency would keep at that moment,
  weighted by each column's cost 1 / U[c, c]^2 (GPTQ's group search); the
  blocks' final choice can differ from that prediction.
- Wanda (Sun et al., 2023) keeps the two largest |w| * ||x_c|| of each block
  (||x_c||^2 = H[c, c] up to the number of rows), then quantizes the kept
  weights as magnitude pruning does (torch_marlin.sparsity).

A weight that is already 2:4 keeps its pattern with either method (SparseGPT
then only quantizes, with the error feedback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import formats
from .calibration import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, output_error
from .gptq import (_block_columns, _codes_of, _inverse_cholesky, _quantize_column, _weighted_search, check_hessian,
                   check_options)
from .layout_registry import layout_for_sparsity
from .quantize import CalibratedMethod, QuantizedCodes, register_calibrated_method
from .sparsity import compress, is_2to4, mask_2to4, padded_in_features

_INNER = 32  # columns per inner block of rank-1 updates (a multiple of 4, divides or is divided by a group)


@dataclass
class SparseGPTResult:
    qweight: object  # the 2:4 layout (SparseQuantizedWeight); None when weight_format is None
    pruned: torch.Tensor  # the weight as computed [N, K] float32 (pruned, quantized unless weight_format is None)
    relative_output_error: float  # sqrt(tr(E H E^T) / tr(W H W^T)) on the given H
    damp: float
    input_perm: Optional[torch.Tensor] = None  # K is never permuted


def sparsegpt(weight: torch.Tensor, hessian: torch.Tensor, weight_format: Optional[str] = "fp4",
              group_size: int = 128, damp: float = DEFAULT_DAMP,
              block_size: int = DEFAULT_BLOCK_SIZE) -> SparseGPTResult:
    """Prune weight [N, K] to 2:4 and quantize the kept weights, minimizing
    tr((W - Q) H (W - Q)^T); weight_format=None prunes only (float result)."""
    check_options(weight_format or "fp4", group_size, False, damp, block_size, 0)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D floating-point tensor [N, K], got {formats._describe(weight)}")
    n, k = weight.shape
    h = check_hessian(hessian, k)
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf")
    kp = padded_in_features(k, group_size)
    gs = formats.effective_group_size(kp, group_size)
    fixed = None
    if is_2to4(w):  # keep the pattern it has (padding columns are pruned after the real ones)
        nonzero = torch.nn.functional.pad((w != 0).float(), (0, kp - k), value=-1.0)
        fixed = mask_2to4(nonzero)
    w = torch.nn.functional.pad(w, (0, kp - k))
    h = torch.nn.functional.pad(h, (0, kp - k, 0, kp - k))
    u, used_damp, _ = _inverse_cholesky(h, damp)
    original = w.float()
    W, U = w.float(), u.float()
    del u
    diag = torch.diagonal(U).clone()
    cost = diag.pow(-2)
    cost[k:] = 0  # padding meets zero inputs
    mask = torch.zeros(n, kp, dtype=torch.bool)
    values = torch.zeros(n, kp)  # code values before the scale (q for uint4) at kept positions
    deq = torch.zeros(n, kp)
    quantize = weight_format is not None
    groups = kp // gs
    scales = torch.empty(n, groups, dtype=torch.float16)
    zeros = torch.empty_like(scales) if quantize and formats.has_zeros(weight_format) else None
    s = z = None
    # Lazy updates as GPTQ: rank-1 inside inner blocks of 32 columns, products between inner
    # blocks and between outer blocks (whole groups, so a group's search sees every update).
    block = _block_columns(block_size, gs, kp) if quantize else -(-block_size // _INNER) * _INNER
    for i1 in range(0, kp, block):
        i2 = min(i1 + block, kp)
        err = torch.empty(n, i2 - i1)
        for j1 in range(i1, i2, _INNER):
            j2 = min(j1 + _INNER, i2)
            w1, u1 = W[:, j1:j2], U[j1:j2, j1:j2]  # w1 is a view: updated in place
            for i in range(j2 - j1):
                col = j1 + i
                if quantize and col % gs == 0:
                    s, z = _group_scales(W[:, col:col + gs], diag[col:col + gs], cost[col:col + gs],
                                         None if fixed is None else fixed[:, col:col + gs], weight_format)
                    scales[:, col // gs] = s
                    if zeros is not None:
                        zeros[:, col // gs] = z
                    s = s.float()
                    z = None if z is None else z.float()
                if col % 4 == 0:
                    cols = slice(col, col + 4)
                    mask[:, cols] = fixed[:, cols] if fixed is not None else \
                        mask_2to4(W[:, cols] ** 2 / diag[cols] ** 2)
                keep = mask[:, col]
                if quantize:
                    v, d = _quantize_column(w1[:, i], s, z, weight_format)
                    values[:, col] = torch.where(keep, v, 0.0)
                    d = torch.where(keep, d, 0.0)
                else:
                    d = torch.where(keep, w1[:, i], 0.0)
                deq[:, col] = d
                e = (w1[:, i] - d) / u1[i, i]
                w1[:, i:].addr_(e, u1[i, i:], alpha=-1)
                err[:, col - i1] = e
            if j2 < i2:
                W[:, j2:i2].addmm_(err[:, j1 - i1:j2 - i1], U[j1:j2, j2:i2], alpha=-1)
        if i2 < kp:
            W[:, i2:].addmm_(err, U[i1:i2, i2:], alpha=-1)
    rel_out = output_error(original[:, :k], deq[:, :k], h[:k, :k].float())
    qweight = None
    if quantize:
        kept, positions = compress(values.t(), mask.t(), "values")
        norm = float(original.norm())
        codes = QuantizedCodes("sparse24", _codes_of(kept, weight_format), scales.t(),
                               None if zeros is None else zeros.t(), weight_format, group_size, k, n,
                               float((original - deq).norm()) / norm if norm > 0 else 0.0, positions=positions)
        qweight = codes.pack()
    return SparseGPTResult(qweight, deq[:, :k], rel_out, used_damp)


def _group_scales(segment, diag, cost, fixed, weight_format):
    """Scales (and zeros) of one group [N, gs] on the weights the saliency keeps now."""
    n, gs = segment.shape
    keep = fixed if fixed is not None else mask_2to4(segment ** 2 / diag ** 2)
    kept = segment[keep].view(n, gs // 2)
    kept_cost = cost.expand(n, -1)[keep].view(n, gs // 2)
    return _weighted_search(kept, kept_cost, weight_format)


def wanda_scores(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """|w| * ||x_c||: H[c, c] is the mean of x_c^2, proportional to ||x_c||^2."""
    h = check_hessian(hessian, weight.shape[1])
    return weight.detach().abs().float().cpu() * torch.diagonal(h).clamp_min(0).sqrt().float()


def wanda(weight: torch.Tensor, hessian: torch.Tensor, weight_format: Optional[str] = "fp4",
          group_size: int = 128, quantizer: str = "mse") -> SparseGPTResult:
    """Wanda 2:4 mask, then the kept weights quantized with `quantizer`; weight_format=None prunes only."""
    scores = wanda_scores(weight, hessian)
    h = check_hessian(hessian, weight.shape[1])
    if weight_format is None:
        w = weight.detach().float().cpu()
        keep = mask_2to4(torch.nn.functional.pad(scores, (0, -w.shape[1] % 4), value=-1.0))[:, :w.shape[1]]
        pruned = w if is_2to4(w) else w * keep
        return SparseGPTResult(None, pruned, output_error(w, pruned, h.float()), 0.0)
    # The kept weights are quantized by the 2:4 layout (in C++ for "mse" and "absmax").
    q = layout_for_sparsity("2:4").from_float(weight, weight_format, group_size, quantizer, scores=scores)
    return SparseGPTResult(q, q.dequantize(), output_error(weight, q.dequantize(), h.float()), 0.0)


def _check_options(weight_format: str, group_size: int, damp: float = DEFAULT_DAMP,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    check_options(weight_format, group_size, False, damp, block_size, 0)


def _wanda_layer(weight, hessian, weight_format: str, group_size: int, damp: float = DEFAULT_DAMP,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> SparseGPTResult:
    """wanda with the options of the calibrated methods (it uses neither)."""
    return wanda(weight, hessian, weight_format, group_size)


register_calibrated_method("wanda", CalibratedMethod("Wanda", "magnitude 2:4", "2:4", _check_options, _wanda_layer))
register_calibrated_method("sparsegpt", CalibratedMethod("SparseGPT", "magnitude 2:4", "2:4", _check_options,
                                                         sparsegpt))
