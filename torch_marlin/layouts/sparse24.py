"""The 2:4 structured-sparse layout: in every aligned group of 4 weights along
K two are kept (4-bit codes in `values`) and their positions are stored in
`metadata`; scales (and zeros) per group exactly as in the dense layout.

    values    int32 [K/16, N]  nibbles b and b + 4 of word [r, n] (b = 0..3): codes of the
                               first and second kept weight of block 4r + b (K rows 16r + 4b .. + 3)
    metadata  int32 [K/32, N]  nibble j of word [r, n]: pos0 | pos1 << 2 of block
                               8r + j (K rows 32r + 4j .. + 3), 0 <= pos0 < pos1 <= 3
    scales    fp16  [G, N]     (and zeros for uint4), G = K / group_size as dense

A block's kept pair is the nibble pair (b, b + 4) that one shift and mask
moves into the two halves of a word (the Metal kernels' marlin_raw_pair).
Both are the dense packing (formats.pack_codes) of a smaller matrix:
metadata of the block nibbles [K/4, N], values of the kept codes [K/2, N]
with each group of 8 reordered from K order (block 0 first, block 0 second,
block 1 first, ...) to nibble order (VALUE_ORDER).
docs/FORMAT.md is the spec; this module is its plain-torch reference (the
packers here are checked against the per-element ones in tests/reference.py),
the SparseQuantizedWeight class, and the fake kernels and autograd of the
layout's ops `torch.ops.marlin.sparse24_gemm` / `sparse24_dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.nn import functional as F

from .. import formats
from .. import ops
from ..quantize import QuantizedCodes, check_float_weight, native_search, run_native
from ..sparsity import BLOCK, METADATA_ROWS, compress, padded_in_features, pruning_scores, sparse_codes
from .base import QuantizedLayout, fake_gemm_output, register_layout

VALUE_ROWS = 16  # K rows per values word (8 kept codes)
# The 6 valid (pos0, pos1) patterns and their metadata nibbles pos0 | pos1 << 2.
PATTERNS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
VALID_NIBBLES = tuple(p0 | p1 << 2 for p0, p1 in PATTERNS)  # 4, 8, 12, 9, 13, 14
FILL_METADATA = 0x44444444  # every block (0, 1): the metadata of an all-zero weight
# Nibble j of a values word holds kept code VALUE_ORDER[j] of its 8 in K order (2 * block + i).
VALUE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# --- packing (the reference; tests/reference.py has per-element versions) -------------

def _check_codes(t, name: str, rows_multiple: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [K/2, N], got {formats._describe(t)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.shape[0] % rows_multiple:
        raise ValueError(f"{name}.shape[0] must be a multiple of {rows_multiple} (K a multiple of "
                         f"{METADATA_ROWS}), got {list(t.shape)}")


def pack_kept(kept_codes: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack the kept codes [K/2, N] (0..15, two per block in K order) and their
    positions [K/2, N] (0..3 inside the block, increasing) into (values, metadata)."""
    _check_codes(kept_codes, "kept_codes", METADATA_ROWS // 2)
    _check_codes(positions, "positions", METADATA_ROWS // 2)
    if positions.shape != kept_codes.shape:
        raise ValueError(f"positions must have the shape of kept_codes {list(kept_codes.shape)}, "
                         f"got {list(positions.shape)}")
    if positions.numel() and (positions.min() < 0 or positions.max() > 3):
        bad = ((positions < 0) | (positions > 3)).nonzero()[0].tolist()
        raise ValueError(f"positions must lie in 0..3 (a position inside a block of 4), got "
                         f"{int(positions[bad[0], bad[1]])} at {bad}")
    half_k, n = kept_codes.shape
    values = torch.empty(half_k // 8, n, dtype=torch.int32, device=kept_codes.device)
    metadata = torch.empty(half_k // 16, n, dtype=torch.int32, device=kept_codes.device)
    order = torch.tensor(VALUE_ORDER, device=kept_codes.device)
    # Blocks of whole metadata words (16 kept rows): the whole weight at once took
    # ~10 bytes of temporaries per weight.
    rows = max(1, (1 << 20) // max(1, 16 * n)) * 16
    for r0 in range(0, half_k, rows):
        pairs = positions[r0:r0 + rows].to(torch.uint8).reshape(-1, 2, n)
        unordered = pairs[:, 1] <= pairs[:, 0]
        if unordered.any():
            block, col = unordered.nonzero()[0].tolist()
            p0, p1 = int(pairs[block, 0, col]), int(pairs[block, 1, col])
            block += r0 // 2
            what = "two equal positions" if p0 == p1 else "positions out of order"
            raise ValueError(f"positions of block {block} (K rows {4 * block}..{4 * block + 3}), column {col} "
                             f"are ({p0}, {p1}): {what}; each block keeps two different positions, "
                             f"increasing")
        metadata[r0 // 16:(r0 + rows) // 16] = formats.pack_codes(pairs[:, 0] | pairs[:, 1] << 2)
        words = kept_codes[r0:r0 + rows].reshape(-1, 8, n).index_select(1, order)
        values[r0 // 8:(r0 + rows) // 8] = formats.pack_codes(words.view(-1, n))
    return values, metadata


def pack_sparse(codes: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack dense codes [K, N] under a 2:4 mask [K, N] (exactly two True per aligned
    block of 4 along K) into (values, metadata); pruned codes are ignored."""
    kept, positions = compress(codes, mask)
    return pack_kept(kept, positions)


def unpack_kept(values: torch.Tensor, metadata: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_kept: (kept codes [K/2, N] uint8, positions [K/2, N] uint8).
    Raises ValueError naming the first invalid metadata nibble."""
    check_metadata(metadata)
    nibbles = formats.unpack_codes(metadata)  # [K/4, N]
    positions = torch.stack([nibbles & 3, nibbles >> 2], 1).view(-1, nibbles.shape[1])
    inverse = torch.argsort(torch.tensor(VALUE_ORDER, device=values.device))
    nibble_order = formats.unpack_codes(values)
    kept = nibble_order.view(-1, 8, values.shape[1]).index_select(1, inverse).view(nibble_order.shape)
    return kept, positions


def dense_mask(metadata: torch.Tensor) -> torch.Tensor:
    """The bool mask [K, N] of kept weights that `metadata` describes."""
    nibbles = formats.unpack_codes(metadata).long()  # [K/4, N]
    p = torch.arange(BLOCK, device=metadata.device).view(1, BLOCK, 1)
    keep = (p == (nibbles & 3).unsqueeze(1)) | (p == (nibbles >> 2).unsqueeze(1))
    return keep.view(-1, metadata.shape[1])


def check_metadata(metadata) -> None:
    """Every nibble of `metadata` one of the 6 valid patterns (mirrors the CPU op's check)."""
    if not isinstance(metadata, torch.Tensor) or metadata.dim() != 2 or metadata.dtype != torch.int32:
        raise ValueError(f"metadata must be a 2-D int32 tensor [K/32, N], got {formats._describe(metadata)}")
    if metadata.device.type == "meta" or metadata.numel() == 0:
        return
    nibbles = formats.unpack_codes(metadata)
    bad = (nibbles & 3) >= (nibbles >> 2)
    if bad.any():
        block, col = bad.nonzero()[0].tolist()
        raise ValueError(invalid_metadata_message(block, col, int(nibbles[block, col])))


def invalid_metadata_message(block: int, col: int, nibble: int) -> str:
    """Same text as the CPU op's error (csrc/core/sparse24_checks.cpp)."""
    return (f"metadata has an invalid 2:4 pattern: word [{block // 8}, {col}] nibble {block % 8} "
            f"(K rows {4 * block}..{4 * block + 3}) is {nibble} = positions ({nibble & 3}, {nibble >> 2}); "
            f"a block keeps two different positions pos0 < pos1 in 0..3 (nibble pos0 | pos1 << 2, "
            f"one of {sorted(VALID_NIBBLES)})")


def check_sparse_quantized(values, metadata, scales, zeros, weight_format: str, group_size: int) -> tuple:
    """Validate the shapes of a 2:4 weight; returns (K, N, groups). Mirrors csrc/core/sparse24_checks.cpp
    (metadata contents are checked by check_metadata)."""
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.dtype != torch.int32:
        raise ValueError(f"values must be a 2-D int32 tensor [K/16, N], got {formats._describe(values)}")
    k, n = values.shape[0] * VALUE_ROWS, values.shape[1]
    if k % METADATA_ROWS:
        raise ValueError(f"K = 16 * values.size(0) = {k} must be a multiple of {METADATA_ROWS}")
    if not isinstance(metadata, torch.Tensor) or metadata.dim() != 2 or metadata.dtype != torch.int32:
        raise ValueError(f"metadata must be a 2-D int32 tensor [K/32, N], got {formats._describe(metadata)}")
    if tuple(metadata.shape) != (k // METADATA_ROWS, n):
        raise ValueError(f"metadata must have shape [K/32, N] = [{k // METADATA_ROWS}, {n}] for values of shape "
                         f"{list(values.shape)}, got {list(metadata.shape)}")
    if metadata.device != values.device:
        raise ValueError(f"metadata must be on the same device as values ({values.device}), got {metadata.device}")
    groups = formats.num_groups(k, group_size)
    formats._check_group_tensor(scales, "scales", groups, n, values.device)
    if formats.has_zeros(weight_format):
        if zeros is None:
            raise ValueError(f"zeros is required for weight_format={weight_format!r}")
        formats._check_group_tensor(zeros, "zeros", groups, n, values.device)
    elif zeros is not None:
        raise ValueError(f"zeros must be None for weight_format={weight_format!r}")
    return k, n, groups


def dequantize_sparse_reference(values, metadata, scales, zeros, weight_format: str, group_size: int,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """B = W^T [K, N] computed in float64 and rounded once to `dtype`; pruned weights are 0."""
    k, n, _ = check_sparse_quantized(values, metadata, scales, zeros, weight_format, group_size)
    kept, positions = unpack_kept(values, metadata)
    rows = formats.effective_group_size(k, group_size)
    v = formats.code_values(kept, weight_format).to(torch.float64)
    dense_rows = torch.arange(0, k, BLOCK, device=values.device).repeat_interleave(2).view(-1, 1) + positions.long()
    group = dense_rows // rows
    per_kept = lambda t: None if t is None else t.to(torch.float64).gather(0, group)
    v = formats.value_format(weight_format).weights(v, per_kept(scales), per_kept(zeros))
    out = torch.zeros(k, n, dtype=torch.float64, device=values.device)
    return out.scatter_(0, dense_rows, v).to(dtype)


# --- the layout ----------------------------------------------------------------------

@register_layout
@dataclass
class SparseQuantizedWeight(QuantizedLayout):
    """A 2:4 sparse packed weight (docs/FORMAT.md, "2:4 sparse layout")."""

    LAYOUT = "sparse24"
    LAYOUT_CODE = 3  # persisted in state_dicts: never reuse
    SPARSITY = "2:4"
    TENSORS = ("values", "metadata", "scales", "zeros")

    values: torch.Tensor  # int32 [K/16, N], K padded
    metadata: torch.Tensor  # int32 [K/32, N]
    scales: torch.Tensor  # fp16 [G, N]
    zeros: Optional[torch.Tensor]  # fp16 [G, N] (uint4) or None
    weight_format: str
    group_size: int
    in_features: int  # unpadded K
    out_features: int  # N
    relative_error: float = float("nan")  # ||W - Wq|| / ||W|| (pruning included) when made from floats

    @property
    def padded_in_features(self) -> int:
        return self.values.shape[0] * VALUE_ROWS

    @classmethod
    def from_kept(cls, kept_codes, positions, scales, zeros, weight_format, group_size,
                  in_features=None, out_features=None) -> "SparseQuantizedWeight":
        """Pack kept codes and positions [K/2, N] with their scales/zeros [G, N]; validates everything."""
        values, metadata = pack_kept(kept_codes, positions)
        k, n, _ = check_sparse_quantized(values, metadata, scales, zeros, weight_format, group_size)
        in_features = k if in_features is None else int(in_features)
        out_features = n if out_features is None else int(out_features)
        if not (0 < in_features <= k and padded_in_features(in_features, group_size) == k):
            raise ValueError(f"in_features={in_features} does not fit packed K={k}")
        if out_features != n:
            raise ValueError(f"out_features={out_features} must equal N={n}")
        return cls(values, metadata, scales.contiguous(), None if zeros is None else zeros.contiguous(),
                   weight_format, group_size, in_features, out_features)

    @classmethod
    def empty(cls, in_features, out_features, weight_format, group_size, device=None) -> "SparseQuantizedWeight":
        k = padded_in_features(in_features, group_size)
        groups = formats.num_groups(k, group_size)
        values = torch.zeros(k // VALUE_ROWS, out_features, dtype=torch.int32, device=device)
        metadata = torch.full((k // METADATA_ROWS, out_features), FILL_METADATA, dtype=torch.int32, device=device)
        scales = torch.zeros(groups, out_features, dtype=torch.float16, device=device)
        zeros = torch.zeros_like(scales) if formats.has_zeros(weight_format) else None
        return cls(values, metadata, scales, zeros, weight_format, group_size, in_features, out_features)

    @classmethod
    def from_float(cls, weight, weight_format, group_size, method="mse", scores=None) -> "SparseQuantizedWeight":
        """2:4 pruning by `scores` (default magnitude; a weight that is already 2:4 keeps its
        pattern), then the kept weights quantized with `method` (quantize_sparse)."""
        return quantize_sparse(weight, weight_format, group_size, method=method, scores=scores)

    @classmethod
    def pack(cls, codes: QuantizedCodes) -> "SparseQuantizedWeight":
        q = cls.from_kept(codes.codes, codes.positions, codes.scales, codes.zeros, codes.weight_format,
                          codes.group_size, in_features=codes.in_features, out_features=codes.out_features)
        q.relative_error = codes.relative_error
        return q

    def check_contents(self) -> None:
        check_metadata(self.metadata)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        b = dequantize_sparse_reference(self.values, self.metadata, self.scales, self.zeros,
                                        self.weight_format, self.group_size, dtype)
        return b[: self.in_features].t()

    def mask(self) -> torch.Tensor:
        """Bool [out_features, in_features]: which weights are kept."""
        return dense_mask(self.metadata)[: self.in_features].t()

    def weight(self, dtype=torch.float32) -> torch.Tensor:
        b = ops.sparse24_dequantize(self.values, self.metadata, self.scales, self.zeros,
                                    self.weight_format, self.group_size, torch.float32)
        return b[: self.in_features].t().to(dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        pad = self.padded_in_features - self.in_features
        if pad:
            x = F.pad(x, (0, pad))
        return ops.sparse24_gemm(x, self.values, self.metadata, self.scales, self.zeros, bias,
                                 self.weight_format, self.group_size)


# --- pruning and quantizing a float weight into the layout ----------------------------

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
    """quantize_sparse in plain torch, through the registered Python quantizer
    (torch_marlin.sparsity.sparse_codes): the specification of its C++ path, and the
    path of every other quantizer."""
    return _quantize_sparse(weight, weight_format, group_size, method, scores, mask, native=False)


def _quantize_sparse(weight, weight_format: str, group_size: int, method: str, scores, mask,
                     native: bool) -> SparseQuantizedWeight:
    check_float_weight(weight, weight_format, group_size, method)
    scores = pruning_scores(weight, scores, mask)
    search = native_search(method) if native else None
    if search is None:
        return SparseQuantizedWeight.pack(sparse_codes(weight, weight_format, group_size, method, scores))
    if scores is not None:
        scores = scores.detach().to("cpu", torch.float32)
    (values, metadata, sc, z), error = run_native(ops._quantize_weight_sparse24, weight,
                                                  weight_format, group_size, search, scores)
    n, k = weight.shape
    q = SparseQuantizedWeight(values, metadata, sc, z if formats.has_zeros(weight_format) else None,
                              weight_format, group_size, in_features=k, out_features=n)
    q.relative_error = error
    return q


# --- fake kernels and autograd of the 2:4 ops -----------------------------------------

@torch.library.register_fake("marlin::sparse24_gemm")
def _gemm_fake(x, values, metadata, scales, zeros, bias, weight_format, group_size):
    k, n, _ = check_sparse_quantized(values, metadata, scales, zeros, weight_format, group_size)
    return fake_gemm_output(x, values, "values", k, n, bias)


@torch.library.register_fake("marlin::sparse24_dequantize")
def _dequantize_fake(values, metadata, scales, zeros, weight_format, group_size, dtype=None):
    k, n, _ = check_sparse_quantized(values, metadata, scales, zeros, weight_format, group_size)
    return values.new_empty((k, n), dtype=dtype or torch.float16)


def _gemm_setup_context(ctx, inputs, output):
    x, values, metadata, scales, zeros, bias, weight_format, group_size = inputs
    ctx.save_for_backward(values, metadata, scales, zeros)
    ctx.weight_format, ctx.group_size, ctx.x_dtype = weight_format, group_size, x.dtype
    ctx.has_bias = bias is not None


def _gemm_backward(ctx, grad):
    values, metadata, scales, zeros = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        b = ops.sparse24_dequantize(values, metadata, scales, zeros, ctx.weight_format, ctx.group_size, ctx.x_dtype)
        grad_x = grad @ b.t()
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, None, None, None, None, grad_bias, None, None


torch.library.register_autograd("marlin::sparse24_gemm", _gemm_backward, setup_context=_gemm_setup_context)
