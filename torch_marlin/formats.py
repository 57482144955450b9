"""Weight formats of docs/FORMAT.md in plain torch: the reference layout.

Everything here is vectorized torch; the C++ and Metal paths are tested
against these functions, and these against the per-element packer in
tests/reference.py.
"""

from __future__ import annotations

import torch

# The position of a format in WEIGHT_FORMATS is its number in state_dicts and
# checkpoints (MarlinLinear's _extra_state) and in the C++/Metal enum
# (metal/marlin_common.h): never reorder, only append.
WEIGHT_FORMATS = ("fp4", "uint4", "int4")
FORMATS_WITH_ZEROS = ("uint4",)  # asymmetric: a zero point per group besides the scale
# 16 is the NVFP4 block size; the others are the usual GPTQ/AWQ/MLX groups.
GROUP_SIZES = (16, 32, 64, 128, 256, -1)
PACK_FACTOR = 8  # 4-bit codes per int32 word, along K
INT4_OFFSET = 8  # int4 is stored offset-binary: q - 8 is the signed value
FP16_MAX = 65504.0  # scales and zeros are stored in fp16
# Activation dtypes of the ops (x, bias, the result): the compute dtype is x's.
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble j at bits 4j..4j+3


def check_weight_format(weight_format: str, name: str = "weight_format") -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {weight_format!r}")


def has_zeros(weight_format: str) -> bool:
    """Whether the format stores zero points (`zeros`) next to the scales."""
    check_weight_format(weight_format)
    return weight_format in FORMATS_WITH_ZEROS


def check_group_size(group_size: int, name: str = "group_size") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{name} must be one of {GROUP_SIZES}, got {group_size!r}")


def num_groups(k: int, group_size: int) -> int:
    check_group_size(group_size)
    if group_size == -1:
        return 1
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    return k // group_size


def effective_group_size(k: int, group_size: int) -> int:
    """Rows of K per group; -1 means one group over all of K."""
    return k if group_size == -1 else group_size


def padded_in_features(in_features: int, group_size: int) -> int:
    """Smallest K >= in_features that the packed layout accepts."""
    multiple = PACK_FACTOR if group_size == -1 else max(PACK_FACTOR, group_size)
    return -(-in_features // multiple) * multiple


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [K, N] (integers 0..15) into int32 words [K/8, N]."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D tensor [K, N], got {_describe(codes)}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must have an integer dtype, got {codes.dtype}")
    k, n = codes.shape
    if k % PACK_FACTOR:
        raise ValueError(f"codes.shape[0] (K={k}) must be a multiple of {PACK_FACTOR}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must lie in 0..15")
    packed = torch.empty(k // PACK_FACTOR, n, dtype=torch.int32, device=codes.device)
    shifts = _SHIFTS.to(codes.device).view(1, -1, 1)
    # int64 arithmetic on row blocks: exact, and temporary memory stays bounded.
    rows = max(1, (1 << 21) // max(1, n * PACK_FACTOR))
    for r0 in range(0, k // PACK_FACTOR, rows):
        block = codes[r0 * PACK_FACTOR:(r0 + rows) * PACK_FACTOR].to(torch.int64)
        words = (block.view(-1, PACK_FACTOR, n) << shifts).sum(1)
        # Words above 2^31 wrap to negative int32: the bit pattern is what counts.
        packed[r0:r0 + rows] = words - ((words >> 31) << 32)
    return packed


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_codes: int32 [K/8, N] -> uint8 codes [K, N]."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be a 2-D int32 tensor [K/8, N], got {_describe(packed)}")
    rows, n = packed.shape
    nibbles = (packed.to(torch.int64).unsqueeze(1) >> _SHIFTS.to(packed.device).view(1, -1, 1)) & 0xF
    return nibbles.reshape(rows * PACK_FACTOR, n).to(torch.uint8)


def code_values(codes: torch.Tensor, weight_format: str) -> torch.Tensor:
    """Real value of each code before the scale (float32); uint4 returns q."""
    check_weight_format(weight_format)
    if weight_format == "fp4":
        return E2M1_VALUES.to(codes.device)[codes.long()]
    values = codes.to(torch.float32)
    return values - INT4_OFFSET if weight_format == "int4" else values


def check_quantized(packed, scales, zeros, weight_format: str, group_size: int) -> tuple:
    """Validate a packed weight; returns (K, N, groups). Mirrors csrc/core/checks.cpp."""
    check_weight_format(weight_format)
    check_group_size(group_size)
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be a 2-D int32 tensor [K/8, N], got {_describe(packed)}")
    k, n = packed.shape[0] * PACK_FACTOR, packed.shape[1]
    groups = num_groups(k, group_size)
    _check_group_tensor(scales, "scales", groups, n, packed.device)
    if has_zeros(weight_format):
        if zeros is None:
            raise ValueError(f"zeros is required for weight_format={weight_format!r}")
        _check_group_tensor(zeros, "zeros", groups, n, packed.device)
    elif zeros is not None:
        raise ValueError(f"zeros must be None for weight_format={weight_format!r}")
    return k, n, groups


def dequantize_reference(packed, scales, zeros, weight_format: str, group_size: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """B = W^T [K, N] computed in float64, rounded once to `dtype`."""
    k, n, groups = check_quantized(packed, scales, zeros, weight_format, group_size)
    rows = effective_group_size(k, group_size)
    values = code_values(unpack_codes(packed), weight_format).to(torch.float64)
    scale_rows = scales.to(torch.float64).repeat_interleave(rows, dim=0)
    if has_zeros(weight_format):
        values = values - zeros.to(torch.float64).repeat_interleave(rows, dim=0)
    return (values * scale_rows).to(dtype)


def _check_group_tensor(t, name: str, groups: int, n: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float16:
        raise TypeError(f"{name} must be float16, got {t.dtype}")
    if tuple(t.shape) != (groups, n):
        raise ValueError(f"{name} must have shape [K/group_size, N] = [{groups}, {n}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as packed ({device}), got {t.device}")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {list(t.shape)}"
    return type(t).__name__
