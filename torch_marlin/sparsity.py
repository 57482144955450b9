"""2:4 pruning: which two of every four weights along K to keep, and the kept
weights of a float nn.Linear weight quantized to codes (the 2:4 layout,
torch_marlin/layouts/sparse24.py, packs them: quantize_sparse).

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
from .layout_registry import layout_for_sparsity
from .quantize import (_ROW_CHUNK_ELEMENTS, QuantizedCodes, calibrated_method, calibrated_method_names,
                       quantize_groups, quantizer_names, relative_error)

BLOCK = 4  # weights per 2:4 block along K
# K rows per metadata word of the 2:4 layout (8 blocks): K is padded to whole words, so the
# pruning quantizers produce codes for that K.
METADATA_ROWS = 32


def padded_in_features(in_features: int, group_size: int) -> int:
    """Smallest K >= in_features that the 2:4 layout accepts: whole metadata words and groups."""
    formats.check_group_size(group_size)
    multiple = METADATA_ROWS if group_size == -1 else max(METADATA_ROWS, group_size)
    return -(-in_features // multiple) * multiple


def compress(t: torch.Tensor, mask: torch.Tensor, name: str = "codes") -> Tuple[torch.Tensor, torch.Tensor]:
    """The kept entries of t [K, N] under a 2:4 mask [K, N] along K, as ([K/2, N], positions [K/2, N])."""
    check_mask(mask, "mask", dim=0)
    if not isinstance(t, torch.Tensor) or t.shape != mask.shape:
        raise ValueError(f"{name} must have the mask's shape {list(mask.shape)}, got {formats._describe(t)}")
    k, n = t.shape
    blocks = mask.view(k // BLOCK, BLOCK, n)
    first = blocks.to(torch.uint8).argmax(1)  # first kept position of each block
    last = BLOCK - 1 - blocks.flip(1).to(torch.uint8).argmax(1)
    positions = torch.stack([first, last], 1).view(k // 2, n)
    base = torch.arange(0, k, BLOCK, device=t.device).repeat_interleave(2).view(-1, 1)
    return t.gather(0, base + positions), positions.to(torch.uint8)


def check_mask(mask, name: str = "mask", dim: int = 0) -> None:
    """A 2:4 mask: bool, exactly two True in every aligned block of 4 along `dim`."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a 2-D bool tensor, got {formats._describe(mask)}")
    if mask.shape[dim] % BLOCK:
        raise ValueError(f"{name}.shape[{dim}] must be a multiple of {BLOCK}, got {list(mask.shape)}")
    counts = mask.movedim(dim, -1).reshape(-1, BLOCK).sum(-1)
    if (counts != 2).any():
        i = int((counts != 2).nonzero()[0])
        raise ValueError(f"{name} must keep exactly 2 of every 4 weights along K; block {i} keeps {int(counts[i])}")


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
    sparsity it is the quantizer (or "gptq"); with sparsity="2:4" a pruning method
    ("magnitude", or a calibrated one: "wanda", "sparsegpt", torch_marlin.sparsegpt)
    or a quantizer name (magnitude pruning)."""
    layout_for_sparsity(sparsity)  # validates the string
    if sparsity is None:
        calibrated = calibrated_method(method)
        if calibrated is not None and calibrated.sparsity is not None:
            raise ValueError(f"method={method!r} prunes to {calibrated.sparsity}: it needs "
                             f"sparsity={calibrated.sparsity!r}")
        if method not in dense_methods():
            raise ValueError(f"method must be one of {dense_methods()}, or with sparsity='2:4' one of "
                             f"{sparse_methods()}; got {method!r}")
        return None, method
    if method in quantizer_names():
        return "magnitude", method
    if method not in sparse_methods(sparsity):
        raise ValueError(f"method must be one of {sparse_methods(sparsity)} with sparsity={sparsity!r}, "
                         f"got {method!r}")
    return method, "mse"


def dense_methods() -> Tuple[str, ...]:
    """The `method`s of quantize_model / MarlinLinear.from_linear without sparsity."""
    return quantizer_names() + calibrated_method_names(None)


def sparse_methods(sparsity: str = "2:4") -> Tuple[str, ...]:
    """The `method`s of quantize_model / MarlinLinear.from_linear with sparsity="2:4": magnitude
    pruning (named, or by the name of its quantizer) and the calibrated pruning methods."""
    return ("magnitude",) + calibrated_method_names(sparsity) + quantizer_names()


def pruning_scores(weight: torch.Tensor, scores: Optional[torch.Tensor],
                   mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The scores [N, K] that pick the kept pair of each block of weight [N, K]: from `mask`
    (exactly two True per full block of 4 along K) if given, else `scores`; None for
    magnitude (|w|), and for a weight that is already 2:4 (its nonzeros are kept)."""
    n, k = weight.shape
    for name, t in (("scores", scores), ("mask", mask)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (n, k)):
            raise ValueError(f"{name} must have the weight's shape {[n, k]}, got {formats._describe(t)}")
    if mask is not None:
        return _mask_scores(mask)
    if scores is not None and is_2to4(weight):
        # Keep the pattern it has: the two largest |w| of a block are its nonzeros (and
        # then zeros, lower index first), so magnitude pruning keeps exactly that.
        return None
    return scores


def sparse_codes(weight: torch.Tensor, weight_format: str, group_size: int, method: str,
                 scores: Optional[torch.Tensor] = None) -> QuantizedCodes:
    """Prune weight [N, K] to the two largest `scores` (default |weight|) of every block of 4
    along K and quantize the kept weights per group with the registered Python quantizer
    `method` (scales fitted to them alone: group g of the dense K covers kept entries
    [g * group_size / 2, (g + 1) * group_size / 2)); K padded as the 2:4 layout needs.
    Arguments as pruning_scores returns them (check_float_weight first)."""
    n, k = weight.shape
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
    return QuantizedCodes("sparse24", codes.t(), scales.t(), None if zeros is None else zeros.t(), weight_format,
                          group_size, k, n, relative_error(err2, norm2), positions=positions.t())


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
