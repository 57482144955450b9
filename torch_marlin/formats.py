"""Weight formats of docs/FORMAT.md in plain torch: the reference layout.

Everything here is vectorized torch; the C++ and Metal paths are tested
against these functions, and these against the per-element packer in
tests/reference.py.
"""

from __future__ import annotations

import torch

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

# bitsandbytes' NF4 table (normal-distribution quantiles, QLoRA), as published in float32;
# nf4 stores each rounded to the nearest fp16 (NF4_VALUES), which every backend holds exactly.
NF4_BITSANDBYTES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_VALUES = torch.tensor(NF4_BITSANDBYTES, dtype=torch.float64).half().float()


# --- value formats ---------------------------------------------------------------------
# A value format says what a 4-bit code means: the value of each of the 16 codes
# before the group scale, whether a group also has a second fp16 parameter (`zeros`):
# a zero point, w = (value - zero) * scale, or a bias, w = value * scale + bias (else
# w = value * scale), and how a real x (code_inputs: w / scale, + zero, or
# (w - bias) / scale) rounds to the nearest code. Every Python path (quantize.py,
# gptq.py, sparsegpt.py, the C++ quantizer's wrapper, the reference dequantizer) asks
# the descriptor; the C++ and Metal decodes are specialised per format
# (metal/marlin_common.h).

class ValueFormat:
    """A format given by its table of 16 code values; rounding to the nearest value by
    table search (ties to the smaller value). Formats with a faster exact rule override
    `nearest_values` / `round_codes` / `codes_of` and must agree with the table search
    off ties (tests/test_formats.py)."""

    def __init__(self, name: str, values, zeros: bool = False, bias: bool = False):
        self.name = name
        self.values = torch.as_tensor(values, dtype=torch.float32)  # indexed by code
        if self.values.shape != (16,):
            raise ValueError(f"a value format has 16 code values, got {list(self.values.shape)}")
        self.zeros = zeros or bias  # a second tensor per group (`zeros`) besides the scale
        self.bias = bias  # it is a bias added after the scale, not a zero point subtracted before
        self._order = torch.sort(self.values, stable=True).indices
        ordered = self.values[self._order]
        self._midpoints = (ordered[1:] + ordered[:-1]) / 2

    @property
    def number(self) -> int:
        """Persisted in state_dicts and checkpoints, and the C++/Metal enum value."""
        return WEIGHT_FORMATS.index(self.name)

    @property
    def max_value(self) -> float:
        """The largest code value: a symmetric group's absmax maps to it."""
        return float(self.values.max())

    @property
    def value_range(self) -> float:
        """Largest minus smallest code value: an asymmetric group's range maps onto it."""
        return float(self.values.max() - self.values.min())

    def weights(self, values: torch.Tensor, scales: torch.Tensor, zeros) -> torch.Tensor:
        """Dequantized weights from code values (q for formats with zeros) and their group's
        scales (and zeros), all broadcastable and of one float dtype."""
        if self.bias:
            return values * scales + zeros
        if self.zeros:
            return (values - zeros) * scales
        return values * scales

    def code_inputs(self, w: torch.Tensor, scales: torch.Tensor, zeros) -> torch.Tensor:
        """The x whose nearest code (round_codes) is weight w's, for given scales (and zeros)."""
        if self.bias:
            return (w - zeros) / scales
        if self.zeros:
            return w / scales + zeros
        return w / scales

    def code_values(self, codes: torch.Tensor) -> torch.Tensor:
        """Value of each code before the scale (float32); formats with zeros give q."""
        return self.values.to(codes.device)[codes.long()]

    def round_codes(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest code of each x = w / scale (+ zero); uint8 of the same shape."""
        index = torch.bucketize(x, self._midpoints.to(device=x.device, dtype=x.dtype))
        return self._order.to(x.device)[index].to(torch.uint8)

    def nearest_values(self, x: torch.Tensor) -> torch.Tensor:
        """code_values(round_codes(x)) in x's dtype: a new tensor."""
        return self.code_values(self.round_codes(x)).to(x.dtype)

    def codes_of(self, values: torch.Tensor) -> torch.Tensor:
        """uint8 codes of exact code values (q for formats with zeros)."""
        return self.round_codes(values)


class _E2M1(ValueFormat):
    """FP4 E2M1: sign bit 3, magnitude rounded by arithmetic (ties down)."""

    def __init__(self, name: str):
        super().__init__(name, E2M1_VALUES)
        magnitudes = E2M1_VALUES[:8]
        self._magnitude_midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2

    def round_codes(self, x):
        magnitude = torch.bucketize(x.abs(), self._magnitude_midpoints.to(x.device))
        return (magnitude | ((x < 0) & (magnitude > 0)).to(magnitude.dtype) << 3).to(torch.uint8)

    def nearest_values(self, x):
        return round_e2m1_magnitude(x.abs().float()).to(x.dtype).copysign_(x)

    def codes_of(self, values):
        # E2M1 magnitude m = mantissa * 2^exponent (frexp): 0, 0.5 -> codes 0, 1; from 1 up,
        # 2 * exponent, plus 1 when the mantissa is 0.75 (1.5, 3, 6).
        magnitude = values.abs()
        mantissa, exponent = torch.frexp(magnitude)
        code = torch.where(magnitude < 1, magnitude * 2, 2 * exponent + (mantissa == 0.75)).to(torch.uint8)
        return code | ((values < 0).to(torch.uint8) << 3)


class _Integer(ValueFormat):
    """Code q has the value q - offset; rounding is torch.round (ties to even) and a clamp."""

    def __init__(self, name: str, offset: int, zeros: bool = False, bias: bool = False):
        super().__init__(name, torch.arange(16) - offset, zeros, bias)
        self.offset = offset

    def round_codes(self, x):
        return (torch.round(x).clamp(-self.offset, 15 - self.offset) + self.offset).to(torch.uint8)

    def nearest_values(self, x):
        return torch.round(x).clamp_(-self.offset, 15 - self.offset)

    def codes_of(self, values):
        return (values + self.offset).to(torch.uint8)


def round_e2m1_magnitude(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude of y >= 0 with ties down, as the fp4 round_codes rounds, by
    arithmetic (~20x faster than bucketize plus a table): one mantissa bit means a
    step of half the power of two below y, and 0.5 below 1 (the subnormal)."""
    step = (y.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_(min=1.0).mul_(0.5)
    return torch.div(y, step).sub_(0.5).ceil_().mul_(step).clamp_(max=6.0)


# In persisted order: the position of a format is its number in state_dicts and
# checkpoints (MarlinLinear's _extra_state) and in the C++/Metal enum
# (metal/marlin_common.h): never reorder, only append.
VALUE_FORMATS = {f.name: f for f in (
    _E2M1("fp4"),
    _Integer("uint4", 0, zeros=True),
    _Integer("int4", INT4_OFFSET),
    ValueFormat("nf4", NF4_VALUES),
    _Integer("affine", 0, bias=True),
)}
WEIGHT_FORMATS = tuple(VALUE_FORMATS)
FORMATS_WITH_ZEROS = tuple(name for name, f in VALUE_FORMATS.items() if f.zeros)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble j at bits 4j..4j+3


def check_weight_format(weight_format: str, name: str = "weight_format") -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {weight_format!r}")


def value_format(weight_format: str) -> ValueFormat:
    """The descriptor of a format name; a ValueError naming the allowed names otherwise."""
    check_weight_format(weight_format)
    return VALUE_FORMATS[weight_format]


def has_zeros(weight_format: str) -> bool:
    """Whether the format stores `zeros` next to the scales (zero points, or biases)."""
    return value_format(weight_format).zeros


def check_group_size(group_size: int, name: str = "group_size") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{name} must be one of {GROUP_SIZES}, got {group_size!r}")


def num_groups(k: int, group_size: int) -> int:
    check_group_size(group_size)
    if group_size == -1:
        return 1
    if k % group_size:
        raise ValueError(f"K = {k} must be a multiple of group_size = {group_size}")  # the C++ check's words
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
    """Real value of each code before the scale (float32); formats with zeros return q."""
    return value_format(weight_format).code_values(codes)


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
    per_row = lambda t: None if t is None else t.to(torch.float64).repeat_interleave(rows, dim=0)
    return value_format(weight_format).weights(values, per_row(scales), per_row(zeros)).to(dtype)


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
