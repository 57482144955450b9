"""2:4 pruning: which two of every four weights along K to keep, and the
float nn.Linear weight -> SparseQuantizedWeight path.

Masks are chosen on the real-valued weights before quantizing (never on raw
codes). A weight that is already 2:4 (at most two nonzeros in every aligned
block of 4 along K, e.g. a checkpoint trained sparse and stored dense with
zeros) keeps exactly its pattern, whatever the method. Kept weights are then
quantized per group with the scales fitted to them alone: group g of the
dense K covers kept entries [g * group_size / 2, (g + 1) * group_size / 2).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import formats
from .layouts.base import layout_for_sparsity
from .layouts.sparse24 import BLOCK, SparseQuantizedWeight, compress, padded_in_features
from .quantize import (_ROW_CHUNK_ELEMENTS, check_float_weight, native_search, quantize_groups, quantizer_names,
                       run_native)

# Pruning methods of quantize_model(..., sparsity="2:4", method=...). magnitude
# needs no data; wanda (|w| * ||x||) and sparsegpt need calibration inputs.
PRUNING_METHODS = ("magnitude", "wanda", "sparsegpt")
CALIBRATED_PRUNING = ("wanda", "sparsegpt")  # torch_marlin.sparsegpt


def mask_2to4(scores: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest scores of every aligned block of 4 along the last dim
    (whose size must be a multiple of 4); ties go to the lower index. Bool, same shape."""
    if not isinstance(scores, torch.Tensor) or scores.dim() < 1 or scores.shape[-1] % BLOCK:
        raise ValueError(f"scores must have a last dimension that is a multiple of {BLOCK}, "
                         f"got {formats._describe(scores)}")
    s = scores.reshape(*scores.shape[:-1], -1, BLOCK)
    # rank[i] = how many block entries beat entry i (greater, or equal at a lower index)
    a, b = s.unsqueeze(-1), s.unsqueeze(-2)  # a[..., i, j] = s_i, b[..., i, j] = s_j
    lower = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=s.device).tril(-1)  # j < i
    beats = (b > a) | ((b == a) & lower)
    return (beats.sum(-1) < 2).reshape(scores.shape)


def is_2to4(weight: torch.Tensor) -> bool:
    """At most two nonzeros in every aligned block of 4 along K of weight [N, K]
    (K zero-padded to a multiple of 4)."""
    k = weight.shape[-1]
    # Blocks of 16M weights, 1.5 bytes of temporaries each (the whole weight in int64
    # took 10): a 1B model's 262M-weight tied head needed 2.6 GiB.
    rows = max(1, (1 << 24) // max(1, k))
    for r0 in range(0, weight.shape[0], rows):
        nonzero = weight[r0:r0 + rows] != 0
        if k % BLOCK:
            nonzero = torch.nn.functional.pad(nonzero, (0, -k % BLOCK))
        if (nonzero.view(nonzero.shape[0], -1, BLOCK).sum(-1, dtype=torch.uint8) > 2).any():
            return False
    return True


def split_method(method: str, sparsity: Optional[str]) -> Tuple[Optional[str], str]:
    """quantize_model's `method` as (pruning method or None, quantizer). Without
    sparsity it is the quantizer; with sparsity="2:4" a pruning method
    ("magnitude", "wanda", "sparsegpt": the last two need calibration data,
    torch_marlin.sparsegpt) or a quantizer name (magnitude pruning)."""
    layout_for_sparsity(sparsity)  # validates the string
    if sparsity is None:
        if method in CALIBRATED_PRUNING:
            raise ValueError(f"method={method!r} prunes to 2:4: it needs sparsity='2:4'")
        if method not in dense_methods():
            raise ValueError(f"method must be one of {dense_methods()}, or with sparsity='2:4' one of "
                             f"{sparse_methods()}; got {method!r}")
        return None, method
    if method in quantizer_names():
        return "magnitude", method
    if method not in PRUNING_METHODS:
        raise ValueError(f"method must be one of {sparse_methods()} with sparsity={sparsity!r}, got {method!r}")
    return method, "mse"


def dense_methods() -> Tuple[str, ...]:
    """The `method`s of quantize_model / MarlinLinear.from_linear without sparsity."""
    return quantizer_names() + ("gptq",)


def sparse_methods() -> Tuple[str, ...]:
    """The `method`s of quantize_model / MarlinLinear.from_linear with sparsity="2:4"."""
    return PRUNING_METHODS + quantizer_names()


def quantize_sparse(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                    method: str = "mse", scores: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> SparseQuantizedWeight:
    """Prune an nn.Linear weight [N, K] to 2:4 and quantize the kept weights.

    The kept pair of each block is `mask` [N, K] if given (exactly two True per
    full block of 4 along K, at most two in a last partial one), else the two
    largest `scores` [N, K] (default |weight|: magnitude pruning). A weight
    that is already 2:4 keeps its nonzeros whatever the scores. `method` is
    the quantizer of the kept weights (torch_marlin.quantize); "mse" and "absmax"
    prune and quantize in C++ (torch.ops.marlin._quantize_weight_sparse24), with
    the result of quantize_sparse_reference bit for bit."""
    return _quantize_sparse(weight, weight_format, group_size, method, scores, mask, native=True)


def quantize_sparse_reference(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                              method: str = "mse", scores: Optional[torch.Tensor] = None,
                              mask: Optional[torch.Tensor] = None) -> SparseQuantizedWeight:
    """quantize_sparse in plain torch, through the registered Python quantizer: the
    specification of its C++ path, and the path of every other quantizer."""
    return _quantize_sparse(weight, weight_format, group_size, method, scores, mask, native=False)


def _quantize_sparse(weight, weight_format: str, group_size: int, method: str, scores, mask,
                     native: bool) -> SparseQuantizedWeight:
    check_float_weight(weight, weight_format, group_size, method)
    n, k = weight.shape
    for name, t in (("scores", scores), ("mask", mask)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (n, k)):
            raise ValueError(f"{name} must have the weight's shape {[n, k]}, got {formats._describe(t)}")
    if mask is not None:
        scores = _mask_scores(mask)
    elif scores is not None and is_2to4(weight):
        # Keep the pattern it has: the two largest |w| of a block are its nonzeros (and
        # then zeros, lower index first), so magnitude pruning keeps exactly that.
        scores = None
    search = native_search(method) if native else None
    if search is not None:
        if scores is not None:
            scores = scores.detach().to("cpu", torch.float32)
        (values, metadata, sc, z), error = run_native(torch.ops.marlin._quantize_weight_sparse24, weight,
                                                      weight_format, group_size, search, scores)
        q = SparseQuantizedWeight(values, metadata, sc, z if formats.has_zeros(weight_format) else None,
                                  weight_format, group_size, in_features=k, out_features=n)
        q.relative_error = error
        return q
    kp = padded_in_features(k, group_size)
    kept_group = formats.effective_group_size(kp, group_size) // 2
    codes = torch.empty(n, kp // 2, dtype=torch.uint8)
    positions = torch.empty(n, kp // 2, dtype=torch.uint8)
    scales = torch.empty(n, kp // 2 // kept_group, dtype=torch.float16)
    zeros = torch.empty_like(scales) if formats.has_zeros(weight_format) else None
    err2 = norm2 = 0.0
    rows = max(1, _ROW_CHUNK_ELEMENTS // kp)
    for r0 in range(0, n, rows):
        block = weight.detach()[r0:r0 + rows].to(device="cpu", dtype=torch.float32).contiguous()
        if not torch.isfinite(block).all():
            raise ValueError("weight contains NaN or Inf")
        block = torch.nn.functional.pad(block, (0, kp - k))
        if scores is None:
            s = block.abs()
        else:  # padding scores below every real one: padded weights are pruned first
            s = torch.nn.functional.pad(scores[r0:r0 + rows].detach().to("cpu", torch.float32), (0, kp - k),
                                        value=-1.0)
            if not torch.isfinite(s).all():
                raise ValueError("scores contain NaN or Inf")
        keep = mask_2to4(s)
        kept, pos = compress(block.t(), keep.t(), "weight")
        c, sc, z, e = quantize_groups(kept.t().contiguous().view(block.shape[0], -1, kept_group),
                                      weight_format, method)
        codes[r0:r0 + rows] = c.view(block.shape[0], -1)
        positions[r0:r0 + rows] = pos.t()
        scales[r0:r0 + rows] = sc
        if zeros is not None:
            zeros[r0:r0 + rows] = z
        err2 += e + float((block[~keep] ** 2).sum())
        norm2 += float((block ** 2).sum())
    q = SparseQuantizedWeight.from_kept(codes.t(), positions.t(), scales.t(), None if zeros is None else zeros.t(),
                                        weight_format, group_size, in_features=k, out_features=n)
    q.relative_error = (err2 / norm2) ** 0.5 if norm2 > 0 else 0.0
    return q


def _mask_scores(mask: torch.Tensor) -> torch.Tensor:
    """Scores that make mask_2to4 reproduce a given 2:4 mask [N, K]; a last partial
    block of K is completed with padding positions (scores between pruned and kept)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    n, k = mask.shape
    counts = torch.nn.functional.pad(mask, (0, -k % BLOCK)).view(n, -1, BLOCK).sum(-1)
    full = k // BLOCK
    bad = (counts[:, :full] != 2).nonzero()
    if len(bad):
        row, block = bad[0].tolist()
        raise ValueError(f"mask must keep exactly 2 of every 4 weights along K; row {row}, columns "
                         f"{BLOCK * block}..{BLOCK * block + 3} keep {int(counts[row, block])}")
    if k % BLOCK and (counts[:, full] > 2).any():
        raise ValueError(f"mask keeps more than 2 of the last {k % BLOCK} columns (a partial block of 4)")
    # kept 1 > padding -1 (quantize_sparse's pad value) > pruned -2
    return torch.where(mask, 1.0, -2.0)
