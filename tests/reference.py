"""Independent per-element references, written from docs/FORMAT.md without
using torch_marlin's packers: plain Python loops over single elements."""

import math
import struct

E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def e2m1_value(code: int) -> float:
    """Decode from the bit fields, not from a table: sign, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    magnitude = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return math.copysign(magnitude, sign)


def fp16_nearest(x: float) -> float:
    """x rounded to the nearest fp16 (ties to even), by struct's half packing."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


# bitsandbytes' NF4 code values (csrc/kernels.cu), which nf4 stores rounded to fp16.
NF4_BITSANDBYTES = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]


def weight_one_by_one(code: int, scale: float, zero, weight_format: str) -> float:
    """One dequantized weight from its code and its group's scale (and zero point), per
    docs/FORMAT.md. Written apart from torch_marlin.formats on purpose: a new format
    fails every reference test until its decode is written here."""
    if weight_format == "fp4":
        return e2m1_value(code) * scale
    if weight_format == "int4":
        return (code - 8) * scale
    if weight_format == "uint4":
        return (code - zero) * scale
    if weight_format == "affine":
        return code * scale + zero  # `zero` is the group's bias
    if weight_format == "nf4":
        return fp16_nearest(NF4_BITSANDBYTES[code]) * scale
    raise AssertionError(f"tests/reference.py has no decode for weight_format={weight_format!r}")


def pack_one_by_one(codes):
    """codes: list of K rows of N ints -> list of K/8 rows of N signed int32 ints."""
    k, n = len(codes), len(codes[0])
    words = [[0] * n for _ in range(k // 8)]
    for row in range(k):
        for col in range(n):
            words[row // 8][col] |= codes[row][col] << (4 * (row % 8))
    return [[w - (1 << 32) if w >= 1 << 31 else w for w in r] for r in words]


def dequantize_one_by_one(words, scales, zeros, weight_format, group_size):
    """Float (Python double) B[k][n] from packed words and per-group scales/zeros."""
    k, n = len(words) * 8, len(words[0])
    rows = k if group_size == -1 else group_size
    out = [[0.0] * n for _ in range(k)]
    for row in range(k):
        for col in range(n):
            code = ((words[row // 8][col] & 0xFFFFFFFF) >> (4 * (row % 8))) & 0xF
            zero = None if zeros is None else zeros[row // rows][col]
            out[row][col] = weight_one_by_one(code, scales[row // rows][col], zero, weight_format)
    return out


# --- 2:4 sparse layout (docs/FORMAT.md, "2:4 sparse layout") ---------------------------

def pack_sparse_one_by_one(codes, keep):
    """codes, keep: K rows of N (ints 0..15, bools with two True per block of 4 along K)
    -> (values: K/16 rows of N int32 ints, metadata: K/32 rows of N int32 ints)."""
    k, n = len(codes), len(codes[0])
    values = [[0] * n for _ in range(k // 16)]
    metadata = [[0] * n for _ in range(k // 32)]
    for col in range(n):
        for block in range(k // 4):
            kept = [p for p in range(4) if keep[4 * block + p][col]]
            assert len(kept) == 2
            for slot, p in enumerate(kept):
                nibble = block % 4 + 4 * slot  # kept weight `slot` of block b: nibble b % 4 + 4 * slot
                values[block // 4][col] |= codes[4 * block + p][col] << (4 * nibble)
            metadata[block // 8][col] |= (kept[0] | kept[1] << 2) << (4 * (block % 8))
    signed = lambda rows: [[w - (1 << 32) if w >= 1 << 31 else w for w in r] for r in rows]
    return signed(values), signed(metadata)


def dequantize_sparse_one_by_one(values, metadata, scales, zeros, weight_format, group_size):
    """Float B[k][n] of a 2:4 weight: the kept codes dequantized as in the dense
    layout (docs/FORMAT.md), every other weight 0.0."""
    k, n = len(values) * 16, len(values[0])
    rows = k if group_size == -1 else group_size
    out = [[0.0] * n for _ in range(k)]
    for col in range(n):
        for block in range(k // 4):
            nibble = ((metadata[block // 8][col] & 0xFFFFFFFF) >> (4 * (block % 8))) & 0xF
            for slot, p in enumerate((nibble & 3, nibble >> 2)):
                row = 4 * block + p
                code = ((values[block // 4][col] & 0xFFFFFFFF) >> (4 * (block % 4 + 4 * slot))) & 0xF
                zero = None if zeros is None else zeros[row // rows][col]
                out[row][col] = weight_one_by_one(code, scales[row // rows][col], zero, weight_format)
    return out


def tcq_levels_one_by_one(symbols, chunk_k):
    """Levels [K][N] of "tcq" symbols [K][N] (lists of ints), one column and one row at a time
    (docs/FORMAT.md, "tcq"): a column's state is 0 at the first row of each chunk; states 0
    and 1 read k = s - 128 as 2k, states 2 and 3 as 2k - sign(k); the next state is
    NEXT[state][k mod 2]."""
    next_state = {0: (0, 2), 1: (2, 0), 2: (1, 3), 3: (3, 1)}
    rows = [list(r) for r in symbols]
    out = [[0] * len(rows[0]) for _ in rows]
    for col in range(len(rows[0])):
        state = 0
        for row, values in enumerate(rows):
            if row % chunk_k == 0:
                state = 0
            k = values[col] - 128
            if state < 2:
                out[row][col] = 2 * k
            else:
                out[row][col] = 2 * k - (1 if k > 0 else -1 if k < 0 else 0)
            state = next_state[state][k % 2]
    return out
