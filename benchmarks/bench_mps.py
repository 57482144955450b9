"""Benchmark of the Metal kernels, and their estimated bounds per Apple chip.

On a Mac with MPS (and torch_marlin built with the MPS bridge): median time,
achieved GB/s and the share of the chip's DRAM bandwidth, and the speed-up of
torch.ops.marlin.gemm against fp16 torch.matmul and torch._weight_int4pack_mm
on MPS, for M in {1, 4, 16, 64, 256} on LLaMA-7B layer shapes, with warm-up
and rotating weight buffers (several copies of the weights, more bytes than
the GPU caches, used round-robin). The chip is read from sysctl and
system_profiler; --peak-gbs overrides its bandwidth.

Everywhere (Linux CI too): per kernel and shape, the device bytes the
dispatch plan's launches request (without cache hits) and their threadgroup
memory, against the ideal traffic (weights, scales/zeros and activations read
once, output written once); with --estimates, the per-kernel accounting of
docs/KERNELS.md (bytes and ALU instructions per weight, counted from the
kernel source) and the bound it gives on each M1-M4 Pro/Max. Nothing is timed
there: the emulator says nothing about GPU speed, and the bounds are estimates.

With --sparse: the 2:4 sparse layout (torch.ops.marlin.sparse24_gemm) against
the dense layout of the same format, the same way (plan traffic everywhere,
median times on a Mac).

With --rans: the entropy-coded layout (torch.ops.marlin.rans_gemm, lossless
codes of the format at --rans-bits bits per weight) against the dense layout:
its plans everywhere, with --estimates the accounting of docs/KERNELS.md
("Entropy-coded layout") and the M = 1 bound per chip class, median times of
both on a Mac (the same codes, coded and packed).

    python3 benchmarks/bench_mps.py [--format fp4] [--group-size 128] [--plan-only] [--estimates] [--sparse]
                                    [--rans [--rans-bits 3.8]]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import time

import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.formats import WEIGHT_FORMATS, has_zeros
from torch_marlin.testing.metal import metal_plan

SHAPES = {  # name: (N, K) of W^T = B [K, N]
    "qkv/o_proj 4096x4096": (4096, 4096),
    "gate/up 11008x4096": (11008, 4096),
    "down 4096x11008": (4096, 11008),
}
M_VALUES = (1, 4, 16, 64, 256)
DTYPE_SIZE = {"f16": 2, "bf16": 2, "f32": 4}

# --- chips: Apple's published GPU core counts and memory bandwidth (GB/s, the
# press releases / tech specs of each chip). Apple publishes no GPU clock
# after M1: M1 Pro/Max from Apple's 5.2 / 10.4 TFLOPS (cores x 128 FP32 lanes
# x 2 flops x clock), M2 from metal-benchmarks (philipturner), M3/M4 assumed.
# Every ALU figure below scales linearly with the clock.
CHIPS = {  # name: (GPU cores, bandwidth GB/s, GPU clock GHz, clock source)
    "M1": (8, 68.25, 1.27, "Apple 2.6 TFLOPS"),
    "M2": (10, 100, 1.398, "Apple 3.6 TFLOPS"),
    "M3": (10, 100, 1.4, "assumed"),
    "M4": (10, 120, 1.4, "assumed"),
    "M1 Pro": (16, 200, 1.27, "Apple 5.2 TFLOPS"),
    "M1 Max": (32, 400, 1.27, "Apple 10.4 TFLOPS"),
    "M2 Pro": (19, 200, 1.398, "metal-benchmarks"),
    "M2 Max": (38, 400, 1.398, "metal-benchmarks"),
    "M3 Pro": (18, 150, 1.4, "assumed"),
    "M3 Max 30c": (30, 300, 1.4, "assumed"),
    "M3 Max 40c": (40, 400, 1.4, "assumed"),
    "M4 Pro": (20, 273, 1.4, "assumed"),
    "M4 Max 32c": (32, 410, 1.4, "assumed"),
    "M4 Max 40c": (40, 546, 1.4, "assumed"),
}
LANES = 128  # FP32 / simple-integer lanes per GPU core (one instruction each per cycle)
COMPLEX_LANES = 32  # shifts, conversions: 4 cycles per instruction (metal-benchmarks)
MMA_EFFICIENCY = 0.8  # simdgroup_matrix fp32 8x8x8: ~20 cycles for 16 FMAs per lane (metal-benchmarks)


def _chip_rates(chip):
    cores, gbs, ghz, _ = CHIPS[chip]
    return gbs * 1e9, cores * LANES * ghz * 1e9, cores * COMPLEX_LANES * ghz * 1e9


# --- per-kernel accounting, counted from the source (docs/KERNELS.md explains
# each term). Costs per weight (one 4-bit code): `simple` = full-rate
# instructions (fp32/fp16 add, mul, fma; and/or; iadd incl. shifts by 1..4),
# `complex` = quarter-rate ones (other shifts, int<->float conversions).
# 16-bit float sources of fp32 instructions are free on Apple GPUs.

def param_bytes(fmt, gs):
    """DRAM bytes of scales (and zeros) per weight."""
    return 0.0 if gs == -1 else 2.0 * (2 if has_zeros(fmt) else 1) / gs


def decode_word(fmt):
    """marlin_raw_pair for p = 0..3 with constant p (metal/marlin_dequant.h): (simple, complex) per word."""
    if fmt == "fp4":
        # per pair, t = w << 8, w << 4, w, w >> 4: a = 0x3C003C00 + ((t & 0x07000700) << 1), then
        # min(a, fma(a, 2, -2)) as half2 (4 fp16 instructions), | (t << 4) & 0x80008000. The shifts
        # fold into w << 9, 12 (p = 0), 5, 8 (p = 1), 1, 4 (p = 2: iadd with shift, full rate) and
        # w >> 3, w (p = 3): 8 and + 4 or + 4 add + 1 iadd + 16 fp16 full rate, 5 quarter-rate shifts
        # (before the subnormal-free decode: 8 and + 4 or + 2 iadd, 5 quarter-rate)
        return 8 + 4 + 4 + 1 + 16, 5
    if fmt == "nf4":
        # marlin_table_pair, per pair: t = w >> 4p (p > 0), t & 15, (t >> 16) & 15, two reads of
        # the 16-value table held in registers (counted as simple instructions): 8 and + 8 reads
        # full rate, 7 quarter-rate shifts
        return 8 + 8, 7
    # per pair: &, | 0x64006400, one half2 fma (2 fp16 instructions); w >> 8 once
    return 4 * 4, 1


def gemv_costs(fmt, gs, m, dtype="f16"):
    """marlin_gemv: (simple, complex, DRAM bytes) per weight for M = m rows."""
    simple, complex_ = decode_word(fmt)
    run = 2 if gs == 16 else 4  # rows summed raw before the group's scale is applied
    flush = (2 if has_zeros(fmt) else 1) / run  # fma (uint4, affine: zero or bias term too) per word and row
    scale_fold = 1.0 / run if fmt == "fp4" else 0.0  # scale * 1/2, per column and run
    xsum = 2.0 if has_zeros(fmt) else 0.0  # 8 adds per row and word, shared by the lane's 4 columns
    per_row = 8 + flush + xsum
    cvt = 2.0 if dtype == "bf16" else 0.0  # 8 bf16 -> fp32 per row and word, shared by 4 columns
    words = simple + scale_fold + m * per_row
    return words / 8, (complex_ + m * cvt) / 8, 0.5 + param_bytes(fmt, gs)


def gemm_costs(kernel, fmt, gs, tm):
    """Fused / tiled GEMM: (simple, complex, MMA lane-FMAs, bytes) per weight and M tile of tm rows."""
    if kernel == "fused":
        # per lane and fragment one pair (2 weights) with a lane-dependent p: fp4 a select of two
        # shifts + 6 + the half2 fma and min (4), ints a select of w >> 8 + 4; fp32 dequant: 2 mul (uint4: 2 sub
        # more; affine: 2 fma instead) (nf4: two ands and two table reads, the shifts w >> 4p and t >> 16)
        simple = ((11 if fmt == "fp4" else 4) + 2 + (2 if fmt == "uint4" else 0)) / 2
        complex_ = (2 if fmt in ("fp4", "nf4") else 1) / 2
    else:
        # one word per thread and stage: constant-p decode, 8 mul (uint4: 8 sub more; affine: 8 fma instead); the 8
        # threadgroup stores are memory instructions, not ALU
        s, c = decode_word(fmt)
        simple, complex_ = (s + 8 + (8 if fmt == "uint4" else 0)) / 8, c / 8
    return simple, complex_, tm / MMA_EFFICIENCY, 0.5 + param_bytes(fmt, gs)


def sparse24_gemv_costs(fmt, gs, m, dtype="f16"):
    """marlin_sparse24_gemv: (simple, complex, DRAM bytes) per weight (per position of the dense [K, N]
    matrix, so comparable with the dense kernels) for M = m rows. Per values word (16 K of a column,
    4 blocks, 8 kept codes): the dense decode of its 4 nibble pairs; per block 2 ands for the position
    fields (the selects compare them with constants: the shifts fold into the constants); the metadata
    half of odd values rows one shift (`>> 16`, every other word); per block and row 2 selects for
    each of the 2 x values (icmpsel: compare and select in one instruction) and 2 fmas (raw sums), for
    uint4 / affine 2 adds more (x at the kept positions, per column: the patterns differ); per run and
    row the group's fma (2 with zeros), fp4 once per run `scale * 2^14`. bf16 x: 16 conversions per
    values row and row of x, shared by the lane's 4 columns."""
    simple, complex_ = decode_word(fmt)
    run = 1 if gs == 16 else 2  # values rows summed raw before the scale
    zeros = has_zeros(fmt)
    per_row = 4 * (4 + 2 + (2 if zeros else 0)) + (2 if zeros else 1) / run
    words = simple + 4 * 2 + (1.0 / run if fmt == "fp4" else 0.0) + m * per_row
    cvt = 4.0 if dtype == "bf16" else 0.0
    nbytes = (4 + 2) / 16 + param_bytes(fmt, gs)  # values word + half a metadata word per 16 K
    return words / 16, (complex_ + 0.5 + m * cvt) / 16, nbytes


def sparse24_gemm_costs(fmt, gs, tm):
    """marlin_sparse24_gemm: (simple, complex, MMA lane-FMAs, bytes) per weight and M tile: per lane and
    B^T fragment 2 dense weights from one kept pair: the fused GEMM's lane-dependent pair decode and
    fp32 dequant, 2 ands and 2 lane-dependent shifts for the positions, 2 x 2 compare-selects."""
    simple = ((6 if fmt == "fp4" else 4) + 2 + (2 if fmt == "uint4" else 0) + 2 + 4) / 2
    complex_ = ((2 if fmt in ("fp4", "nf4") else 1) + 2) / 2
    return simple, complex_, tm / MMA_EFFICIENCY, (4 + 2) / 16 + param_bytes(fmt, gs)


def moe_routing_costs(experts, pairs):
    """The routing's counting sort (metal/moe.metal), per (token, expert) pair: (instructions, bytes).
    count: an id load, 32 shuffles + 32 compares + 64 adds/selects for the ranks in a 32-pair step, a
    histogram read, a rank store (+ the histogram update of one lane per expert); offsets: per (chunk,
    expert) 2 reads and a write, over 256-pair chunks; scatter: an id, a rank, an offset read, a store.
    The previous routing scanned all pairs once per expert: E/32 simd steps of a load, a compare and
    a simd_sum per pair (twice)."""
    chunk_share = experts / 256  # (chunk, expert) entries per pair
    instructions = 32 + 32 + 64 + 4 + 3 * chunk_share + 4
    nbytes = 4 + 4 + 4 + 12 * chunk_share + 4 + 4 + 4 + 4
    old_instructions = 2 * 3 * experts / 32 * 32  # per pair: each simdgroup step covers 32 pairs
    return instructions, nbytes, old_instructions


def report_accounting(fmt, gs):
    """The per-kernel table of docs/KERNELS.md: instructions and DRAM bytes per weight."""
    print(f"# per-kernel accounting (counted from the source, not measured), format={fmt}, group_size={gs}, "
          "fp16 x; per weight = per position of the dense [K, N] matrix")
    print(f"{'kernel':34} {'simple':>7} {'complex':>8} {'MMA':>6} {'bytes':>7} {'instr/byte':>10}")
    rows = []
    for m in (1, 4, 8):
        rows.append((f"marlin_gemv M={m}", *gemv_costs(fmt, gs, m)[:2], 0.0, gemv_costs(fmt, gs, m)[2]))
    for m in (1, 4, 8):
        sc = sparse24_gemv_costs(fmt, gs, m)
        rows.append((f"marlin_sparse24_gemv M={m}", sc[0], sc[1], 0.0, sc[2]))
    for kernel, tm in (("fused", 32), ("fused", 64), ("tiled", 64)):
        simple, complex_, mma, nbytes = gemm_costs(kernel, fmt, gs, tm)
        rows.append((f"marlin_gemm_{kernel} TM={tm} (per tile)", simple, complex_, mma, nbytes))
    for tm in (32, 64):
        rows.append((f"marlin_sparse24_gemm TM={tm} (per tile)", *sparse24_gemm_costs(fmt, gs, tm)))
    simple, complex_, nbytes = gemv_costs(fmt, gs, 1)
    rows.append(("marlin_moe_gemv (per pair)", simple, complex_, 0.0, nbytes))
    simple, complex_, mma, nbytes = gemm_costs("fused", fmt, gs, 32)
    rows.append(("marlin_moe_gemm (per 32-row tile)", simple, complex_, mma, nbytes))
    for name, simple, complex_, mma, nbytes in rows:
        print(f"{name:34} {simple:7.2f} {complex_:8.3f} {mma:6.1f} {nbytes:7.4f} {(simple + complex_) / nbytes:10.2f}")
    for experts, pairs in ((8, 64), (128, 16384), (256, 16384)):
        instructions, nbytes, old = moe_routing_costs(experts, pairs)
        print(f"# MoE routing E={experts} S={pairs}: ~{instructions:.0f} lane instructions and ~{nbytes:.0f} "
              f"bytes per pair (the single-threadgroup scan it replaces: ~{old:.0f} per pair, on one core)")


def gemv_bound(chip, fmt, gs, m, dtype="f16"):
    """(ALU busy at full DRAM bandwidth, share of the bandwidth reachable, bytes per weight)."""
    bw, simple_rate, complex_rate = _chip_rates(chip)
    simple, complex_, nbytes = gemv_costs(fmt, gs, m, dtype)
    weights_per_s = bw / nbytes
    busy = max(weights_per_s * simple / simple_rate, weights_per_s * complex_ / complex_rate)
    return busy, min(1.0, 1.0 / busy), nbytes


def report_estimates(fmt, gs):
    print(f"# estimated bounds (not measurements), format={fmt}, group_size={gs}, fp16 x unless noted")
    for m, dt in ((1, "f16"), (1, "bf16"), (8, "f16")):
        simple, complex_, nbytes = gemv_costs(fmt, gs, m, dt)
        print(f"# GEMV M={m} {dt}: {nbytes:.4f} DRAM bytes, {simple:.2f} full-rate + {complex_:.3f} quarter-rate "
              "instructions per weight")
    print("# GEMV: ALU busy at the chip's full DRAM bandwidth -> share of the bandwidth reachable")
    print("# (ALU-limited when busy > 100%), and the time of a 4096 x 4096 layer at that rate")
    rows = [(1, "f16"), (1, "bf16"), (4, "f16"), (8, "f16")]
    head = "".join(f"{f'M={m} {dt}':>22}" for m, dt in rows)
    print(f"{'chip':12} {'cores':>5} {'GB/s':>5} {'GHz':>6}{head}")
    for chip, (cores, gbs, ghz, _) in CHIPS.items():
        cells = []
        for m, dt in rows:
            busy, share, nbytes = gemv_bound(chip, fmt, gs, m, dt)
            us = 4096 * 4096 * nbytes / (gbs * 1e9 * share) * 1e6
            cells.append(f"{busy * 100:4.0f}% ->{share * 100:4.0f}% {us:5.1f}us")
        print(f"{chip:12} {cores:5d} {gbs:5g} {ghz:6.3f}" + "".join(f"{c:>22}" for c in cells))
    print("# GEMMs at N = K = 4096: estimated share of FP32 peak spent in MMAs (memory or decode-limited below)")
    print(f"{'chip':12}" + "".join(f"{f'{k} M={m}':>16}" for k, m in (("fused", 16), ("fused", 64), ("tiled", 256),
                                                                       ("tiled", 4096))))
    for chip in CHIPS:
        bw, simple_rate, complex_rate = _chip_rates(chip)
        cells = []
        for kernel, m in (("fused", 16), ("fused", 64), ("tiled", 256), ("tiled", 4096)):
            tm = 32 if kernel == "fused" and m <= 32 else 64
            simple, complex_, mma, nbytes = gemm_costs(kernel, fmt, gs, tm)
            tiles = math.ceil(m / tm)
            weights = 4096 * 4096
            t_mem = weights * nbytes * tiles / bw
            t_alu = max(weights * tiles * (simple + mma) / simple_rate, weights * tiles * complex_ / complex_rate)
            useful = 2.0 * m * weights / (2.0 * simple_rate)  # MMA flops of the real rows at peak
            cells.append(f"{useful / max(t_mem, t_alu) * 100:15.0f}%")
        print(f"{chip:12}" + "".join(cells))


# --- threadgroup-memory bank model: 32 banks of 4 bytes (Apple documents no
# banking; this is the usual GPU layout). An access of one simdgroup costs as
# many cycles as the most distinct 4-byte words falling into one bank (lanes
# reading the same word share it); "optimum" is its size / 128 bytes.

def _lane(lane):
    """Row and first column of a lane in an 8x8 simdgroup_matrix fragment (metal/marlin_tile.h)."""
    return (lane // 4 & 4) + (lane // 2) % 4, (lane // 4 & 2) * 2 + (lane % 2) * 2


def _cycles(accesses):
    words = {w for start, size in accesses for w in range(start // 4, (start + size + 3) // 4)}
    banks = {}
    for w in words:
        banks[w % 32] = banks.get(w % 32, 0) + 1
    return max(banks.values()), max(1, math.ceil(len(words) / 32))


def report_banks():
    import torch_marlin

    t = torch_marlin._C.SHARED_CONSTANTS["METAL_TILES"]
    tk, tn, pad = t["GEMM_TILE_K"], t["GEMM_TILE_N"], t["TILE_PAD_BYTES"]
    print("# threadgroup tile accesses per simdgroup instruction: cycles in the bank model (optimum)")
    for size, name in ((2, "f16/bf16"), (4, "f32")):
        sx = tk + pad // size
        # fused GEMM: x^T fragment, two scalar reads per lane of rows col, col + 1 (K permuted)
        fused = max(_cycles([(((c + e) * sx + (r >> 1) + 4 * (r & 1)) * size, size)
                             for r, c in map(_lane, range(32))])[0] for e in (0, 1))
        # tiled GEMM: x fragment, one 2-element read per lane
        tiled = _cycles([((r * sx + c) * size, 2 * size) for r, c in map(_lane, range(32))])
        # x-tile loader: one 4-element store per thread, 4 chunks per row
        load = _cycles([((i // (tk // 4) * sx + 4 * (i % (tk // 4))) * size, 4 * size) for i in range(32)])
        print(f"  x tile {name:8} row stride {sx * size:3d} B: fused x^T read {fused} (1), tiled x read "
              f"{tiled[0]} ({tiled[1]}), loader store {load[0]} ({load[1]})")
    tk2 = 32  # kSparseGemmTileK (metal/marlin_common.h)
    for size, name in ((2, "f16/bf16"), (4, "f32")):
        # 2:4 GEMM: x^T fragment, two scalar reads per lane of rows fc + e at column fr, the columns
        # XOR-swizzled by 8 ((row / 2) % 4) (metal/sparse24_gemm.h marlin_sparse24_x_index)
        def read(swizzle):
            return max(_cycles([(((c + e) * tk2 + (r ^ (8 * (((c + e) >> 1) & 3) if swizzle else 0))) * size, size)
                                for r, c in map(_lane, range(32))])[0] for e in (0, 1))
        print(f"  2:4 GEMM x tile {name:8} [TM][{tk2}]: x^T read {read(False)} unswizzled, {read(True)} swizzled (1)")
    for stride in (tn, tn + pad // 4):
        b = _cycles([((r * stride + c) * 4, 4) for r in range(8) for c in range(8)])
        print(f"  tiled B tile, row stride {stride * 4} B: 8x8 fp32 simdgroup_load {b[0]} ({b[1]})"
              + ("  <- unpadded, for comparison" if stride == tn else ""))


def ideal_bytes(m, n, k, groups, fmt, t, sparse=False):
    codes = k // 16 * n * 4 + k // 32 * n * 4 if sparse else k // 8 * n * 4  # 2:4: values + metadata
    weights = codes + groups * n * 2 * (2 if has_zeros(fmt) else 1)
    return weights + m * k * t + m * n * t


def plan_bytes(plan, fmt):
    """Device bytes requested by the plan's launches, counting every threadgroup's loads."""
    m, n, k, t = plan["M"], plan["N"], plan["K"], DTYPE_SIZE[plan["dtype"]]
    groups = k // plan["group_rows"]
    params = groups * n * 2 * (2 if has_zeros(fmt) else 1)  # scales (+ zeros), fp16
    sz = 2 if has_zeros(fmt) else 1  # fp16 params per (group, column)
    sparse_codes = k // 16 * n * 4 + k // 32 * n * 4  # 2:4 values + metadata
    out = m * n * (4 if plan["splits"] > 1 else t)  # fp32 partial tiles with a K split
    total = 0
    for l in plan["launches"]:
        gx, gy, gz = l["grid"]
        name = l["kernel"]
        if name.startswith("marlin_gemv_"):
            # weights and their group params once per lane run; every threadgroup reads x of its slice
            total += k // 8 * n * 4 + params + gx * m * k * t + out
        elif name.startswith(("marlin_gemm_fused_", "marlin_gemm_tiled_")):
            # per M tile: all weights of the N range and their params, x rows of the tile per N tile
            total += gy * (k // 8 * n * 4 + params) + gx * m * k * t + out
        elif name.startswith("marlin_reduce_"):
            total += plan["splits"] * m * n * 4 + m * n * t
        elif name.startswith("marlin_dequant_"):
            total += k // 8 * n * 4 + params + k * n * t
        elif name.startswith("marlin_sparse24_gemv_"):
            # values and metadata once (a lane's run of 2 values rows has one metadata word); params
            # once per run, the 4 runs of a simdgroup step (128 K) sharing one address at g >= 128:
            # once per group, or per 128 K for larger groups; every threadgroup reads all of x
            total += sparse_codes + max(groups, k // 128) * n * 2 * sz + gx * m * k * t + out
        elif name.startswith("marlin_sparse24_gemm_"):
            total += gy * (sparse_codes + k // 16 * n * 2 * sz) + gx * m * k * t + out
        elif name.startswith("marlin_sparse24_dequant_"):
            total += sparse_codes + k // 16 * n * 2 * sz + k * n * t
    return total, ideal_bytes(m, n, k, groups, fmt, t, plan_is_sparse(plan))


def plan_is_sparse(plan):
    return any(l["kernel"].startswith("marlin_sparse24_") for l in plan["launches"])


def sparse_meta_inputs(m, n, k, fmt, gs, dtype, device="meta"):
    x, _, scales, zeros = meta_inputs(m, n, k, fmt, gs, dtype, device)
    values = torch.empty(k // 16, n, dtype=torch.int32, device=device)
    metadata = torch.empty(k // 32, n, dtype=torch.int32, device=device)
    return x, values, metadata, scales, zeros


def report_sparse_plans(fmt, gs, dtype=torch.float16):
    """Requested device bytes of the 2:4 plans against the dense plans of the same problem."""
    print(f"# 2:4 sparse vs dense plan traffic, format={fmt}, group_size={gs}, dtype={dtype}")
    print(f"{'shape':24} {'M':>5} {'sparse kernels':40} {'MB dense':>9} {'MB 2:4':>9} {'req. x':>7} "
          f"{'ideal x':>7}")
    for name, (n, k) in SHAPES.items():
        for m in M_VALUES:
            dense = metal_plan("gemm", *meta_inputs(m, n, k, fmt, gs, dtype), None, fmt, gs)
            x, values, metadata, scales, zeros = sparse_meta_inputs(m, n, k, fmt, gs, dtype)
            sparse = metal_plan("sparse24_gemm", x, values, metadata, scales, zeros, None, fmt, gs)
            (dreq, dideal), (sreq, sideal) = plan_bytes(dense, fmt), plan_bytes(sparse, fmt)
            kernels = "+".join(l["kernel"].replace("marlin_", "") for l in sparse["launches"])
            print(f"{name:24} {m:5d} {kernels:40} {dreq / 1e6:9.2f} {sreq / 1e6:9.2f} {dreq / sreq:7.2f} "
                  f"{dideal / sideal:7.2f}")


def meta_inputs(m, n, k, fmt, gs, dtype, device="meta"):
    groups = 1 if gs == -1 else k // gs
    packed = torch.empty(k // 8, n, dtype=torch.int32, device=device)
    scales = torch.empty(groups, n, dtype=torch.float16, device=device)
    zeros = torch.empty(groups, n, dtype=torch.float16, device=device) if has_zeros(fmt) else None
    x = torch.empty(m, k, dtype=dtype, device=device)
    return x, packed, scales, zeros


def report_plans(fmt, gs, dtype=torch.float16):
    print(f"# dispatch plan traffic, format={fmt}, group_size={gs}, dtype={dtype}")
    print(f"{'shape':24} {'M':>5} {'kernels':40} {'grid':>12} {'tg mem':>7} {'MB req':>9} {'MB ideal':>9} {'ratio':>6}")
    for name, (n, k) in SHAPES.items():
        for m in M_VALUES:
            x, packed, scales, zeros = meta_inputs(m, n, k, fmt, gs, dtype)
            plan = metal_plan("gemm", x, packed, scales, zeros, None, fmt, gs)
            req, ideal = plan_bytes(plan, fmt)
            kernels = "+".join(l["kernel"].replace("marlin_", "") for l in plan["launches"])
            grid = "x".join(map(str, plan["launches"][0]["grid"]))
            tg = max(l["threadgroup_memory"] for l in plan["launches"])
            print(f"{name:24} {m:5d} {kernels:40} {grid:>12} {tg:7d} {req / 1e6:9.2f} {ideal / 1e6:9.2f} {req / ideal:6.2f}")


FUSED_GROUPS = {  # model: {group: (K, [N of each member])}
    "Llama-2-7B": {"q|k|v": (4096, [4096, 4096, 4096]), "gate|up": (4096, [11008, 11008])},
    "Llama-3.2-1B": {"q|k|v": (2048, [2048, 512, 512]), "gate|up": (2048, [8192, 8192])},
    "Qwen3-MoE attn": {"q|k|v": (2048, [4096, 512, 512])},
}


def report_fused_plans(fmt, gs, dtype=torch.float16, m=1):
    """Fused projections (torch_marlin.fused_projections) on Metal at decode: launches, threadgroups and
    requested bytes of the separate layers' plans against the one plan of the concatenated weight."""
    print(f"# fused projections at M={m}, format={fmt}, group_size={gs}: separate layers -> one fused weight")
    print(f"{'model':16} {'group':8} {'launches':>10} {'threadgroups':>14} {'MB requested':>16}")
    for model, groups in FUSED_GROUPS.items():
        for group, (k, widths) in groups.items():
            cells = []
            for ns in (widths, [sum(widths)]):
                plans = [metal_plan("gemm", *meta_inputs(m, n, k, fmt, gs, dtype), None, fmt, gs) for n in ns]
                launches = sum(len(p["launches"]) for p in plans)
                groups_ = sum(math.prod(l["grid"]) for p in plans for l in p["launches"] if "gemv" in l["kernel"])
                mb = sum(plan_bytes(p, fmt)[0] for p in plans) / 1e6
                cells.append((launches, groups_, mb))
            (l0, t0, b0), (l1, t1, b1) = cells
            print(f"{model:16} {group:8} {l0:4d} -> {l1:<3d} {t0:6d} -> {t1:<6d} {b0:7.2f} -> {b1:<7.2f}")


def detect_chip():
    """(name, DRAM GB/s) of this Mac's chip from CHIPS, or (name, None)."""
    if platform.system() != "Darwin":
        return None, None
    try:
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        gpu = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True, text=True,
                             timeout=60).stdout
        cores = next((int(l.split(":")[1]) for l in gpu.splitlines() if "Total Number of Cores" in l), None)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, None
    base = brand.replace("Apple ", "")
    for name, (c, gbs, _, _) in CHIPS.items():
        if name.split(" ")[:2] == base.split(" ")[:2] and (name.count(" ") == 1 or c == cores):
            return f"{base} ({cores}-core GPU)", gbs
    return f"{base} ({cores}-core GPU)", None


def _median_ms(fn, n_iter=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.mps.synchronize()
    times = []
    for _ in range(n_iter):
        t0 = time.perf_counter()
        fn()
        torch.mps.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _int4pack_fn(x, n, k, gs, copies):
    """torch._weight_int4pack_mm on MPS, or None when this torch does not offer it."""
    try:
        ws = []
        for _ in range(copies):
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="mps")
            try:
                packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 2)
            except Exception:  # noqa: BLE001 - older signature: int32 [N, K]
                packed = torch._convert_weight_to_int4pack(q, 2)
            sz = torch.rand(k // gs, n, 2, dtype=x.dtype, device="mps")
            ws.append((packed, sz))
        torch._weight_int4pack_mm(x, ws[0][0], gs, ws[0][1])
    except Exception as e:  # noqa: BLE001
        print(f"  (torch._weight_int4pack_mm unavailable: {type(e).__name__}: {str(e).splitlines()[0]})")
        return None
    it = [0]

    def run():
        p, s = ws[it[0] % copies]
        it[0] += 1
        return torch._weight_int4pack_mm(x, p, gs, s)

    return run


def bench_device(fmt, gs, peak_gbs, cache_bytes=256 << 20):
    dev = "mps"
    chip, chip_gbs = detect_chip()
    peak = peak_gbs or chip_gbs
    print(f"# MPS timings on {chip or 'unknown chip'}, DRAM peak "
          f"{f'{peak} GB/s' if peak else 'unknown (pass --peak-gbs)'}, format={fmt}, group_size={gs}, "
          f"fp16 activations (median ms; GB/s = ideal bytes / time)")
    print(f"{'shape':24} {'M':>5} {'marlin':>8} {'GB/s':>7} {'%peak':>6} {'fp16 mm':>8} {'x':>6} {'int4pack':>9} {'x':>6}")
    for name, (n, k) in SHAPES.items():
        weight_bytes = k // 8 * n * 4
        copies = max(2, min(32, math.ceil(cache_bytes / weight_bytes)))
        groups = k // gs if gs != -1 else 1
        ws = []
        for _ in range(copies):
            packed = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
            scales = torch.rand(groups, n, dtype=torch.float16, device=dev)
            zeros = torch.rand(groups, n, dtype=torch.float16, device=dev) * 15 if has_zeros(fmt) else None
            ws.append((packed, scales, zeros))
        dense = [torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(max(2, copies // 4))]
        for m in M_VALUES:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            it = [0]

            def marlin():
                p, s, z = ws[it[0] % copies]
                it[0] += 1
                return torch.ops.marlin.gemm(x, p, s, z, None, fmt, gs)

            jt = [0]

            def fp16():
                w = dense[jt[0] % len(dense)]
                jt[0] += 1
                return x @ w.t()

            t_m = _median_ms(marlin)
            t_f = _median_ms(fp16)
            i4 = _int4pack_fn(x, n, k, gs, copies) if gs != -1 else None
            t_i = _median_ms(i4) if i4 else float("nan")
            gbs = ideal_bytes(m, n, k, groups, fmt, 2) / t_m / 1e6
            share = f"{gbs / peak * 100:5.0f}%" if peak else "    ?"
            print(f"{name:24} {m:5d} {t_m:8.3f} {gbs:7.1f} {share:>6} {t_f:8.3f} {t_f / t_m:6.2f} "
                  f"{t_i:9.3f} {t_i / t_m:6.2f}")


def bench_sparse_device(fmt, gs, cache_bytes=256 << 20):
    """Median ms of sparse24_gemm against gemm of the same format on MPS (rotating weight copies)."""
    dev = "mps"
    print(f"# MPS timings, 2:4 sparse vs dense, format={fmt}, group_size={gs}, fp16 activations (median ms)")
    print(f"{'shape':24} {'M':>5} {'dense':>8} {'2:4':>8} {'x':>6}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(32, math.ceil(cache_bytes / (k // 8 * n * 4))))
        groups = k // gs if gs != -1 else 1
        dense_w, sparse_w = [], []
        for _ in range(copies):
            scales = torch.rand(groups, n, dtype=torch.float16, device=dev)
            zeros = torch.rand(groups, n, dtype=torch.float16, device=dev) * 15 if has_zeros(fmt) else None
            dense_w.append((torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev), scales,
                            zeros))
            # metadata of valid patterns only: every nibble (0, 1) = 0x4
            sparse_w.append((torch.randint(-2**31, 2**31 - 1, (k // 16, n), dtype=torch.int32, device=dev),
                             torch.full((k // 32, n), 0x44444444, dtype=torch.int32, device=dev), scales, zeros))
        for m in M_VALUES:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            it = [0, 0]

            def dense():
                p, s, z = dense_w[it[0] % copies]
                it[0] += 1
                return torch.ops.marlin.gemm(x, p, s, z, None, fmt, gs)

            def sparse():
                v, md, s, z = sparse_w[it[1] % copies]
                it[1] += 1
                return torch.ops.marlin.sparse24_gemm(x, v, md, s, z, None, fmt, gs)

            t_d, t_s = _median_ms(dense), _median_ms(sparse)
            print(f"{name:24} {m:5d} {t_d:8.3f} {t_s:8.3f} {t_d / t_s:6.2f}")


# --- entropy-coded layout (metal/rans_*.h): counted per decoded weight from the
# source (docs/KERNELS.md, "Entropy-coded layout", lists each instruction).
# RansChunk::next per lane and step (prob_bits <= 12): full rate: slot and, the
# uniform bucket-shift test, 2 threadgroup addresses, 2 adds (+ slot - cum),
# need compare, ptr + rank, the refill (compare, word address, select, the two
# 16-bit halves, bad flag), ptr += total; quarter rate: x >> prob_bits and the
# 32-bit multiply; 2 simd collectives (prefix sum, sum). The 16-bit entry
# fields and the half raw value are free instruction sources.
RANS_NEXT = (14, 2, 2)  # (simple, complex, simd collectives)
# "tcq": RansTcq::value per lane and step: compare + select of the entry's two
# levels, xor and and of the next state bit, the move of the other bit (full
# rate; 3 if the compiler fuses compare-select and renames the move away).
RANS_TCQ_STATE = 5


def rans_gemv_costs(fmt, gs, m, bits, dtype="f16", tcq=False):
    """rans_gemv: (simple, complex, simd, DRAM bytes) per weight for M = m rows at `bits` coded bits per
    weight. Per step besides the decode: x pointer and loop (3), tcq's trellis state; per row an fma, the x
    address (rows > 1), the sum of x (formats with zeros), a bf16 conversion; per group the scale
    (negligible)."""
    simple, complex_, simd = RANS_NEXT
    per_row = 1 + (1 if has_zeros(fmt) else 0)
    simple += 3 + (RANS_TCQ_STATE if tcq else 0) + m * per_row + (m - 1)
    complex_ += m if dtype == "bf16" else 0
    return simple, complex_, simd, bits / 8 + param_bytes(fmt, gs)


def rans_gemm_costs(fmt, gs, bits, tm=32, tcq=False):
    """rans_gemm: (simple, complex, simd, MMA lane-FMAs, bytes) per weight and M tile: the decode (+ loop 3,
    tcq's trellis state, the raw half's Bt address 1), the fp32 dequant of the fragment (uint4: sub + mul),
    the MMAs."""
    simple, complex_, simd = RANS_NEXT
    simple += 3 + (RANS_TCQ_STATE if tcq else 0) + 1 + (2 if fmt == "uint4" else 1)
    return simple, complex_, simd, tm / MMA_EFFICIENCY, bits / 8 + param_bytes(fmt, gs)


def rans_weights_per_s(chip, simple, complex_, simd, nbytes, simd_cycles=1):
    """Weights per second at the chip's bandwidth or ALU limit (simd collectives as `simd_cycles`
    quarter-rate instructions each)."""
    bw, simple_rate, complex_rate = _chip_rates(chip)
    return min(bw / nbytes, simple_rate / simple, complex_rate / (complex_ + simd * simd_cycles))


def report_rans_estimates(fmt, gs, bits):
    print(f"# entropy-coded layout: estimated bounds (not measurements), lossless {fmt} codes at {bits} bits per "
          f"weight, group_size={gs}, fp16 x")
    for m in (1, 8):
        s, c, q, nbytes = rans_gemv_costs(fmt, gs, m, bits)
        print(f"# rans_gemv M={m}: {nbytes:.4f} DRAM bytes, {s} full-rate + {c} quarter-rate instructions + {q} simd "
              "collectives per weight")
    s, c, q, mma, nbytes = rans_gemm_costs(fmt, gs, bits)
    print(f"# rans_gemm per 32-row tile: {nbytes:.4f} bytes, {s} + {c} + {q} collectives per weight, "
          f"+ {mma:.0f} MMA lane-fma cycles")
    s, c, q, _ = rans_gemv_costs(fmt, gs, 1, bits, tcq=True)
    print(f"# tcq (grid symbols, one step per column): rans_gemv M=1 {s} + {c} + {q} collectives, rans_gemm per "
          f"32-row tile {rans_gemm_costs(fmt, gs, bits, tcq=True)[0]} full-rate per weight")
    print("# M = 1, 4096 x 4096: dense marlin_gemv against rans_gemv, lossless or grid and tcq (collectives at 1 / 4 "
          "quarter-rate cycles)")
    print(f"{'chip':12} {'cores':>5} {'GB/s':>6} {'GHz':>6} {'dense us':>9} {'rans us':>13} {'rans / dense':>13} "
          f"{'tcq us':>13} {'tcq / dense':>13}")
    weights = 4096 * 4096
    for chip, (cores, gbs, ghz, _) in CHIPS.items():
        busy, share, dense_bytes = gemv_bound(chip, fmt, gs, 1)
        t_dense = weights * dense_bytes / (gbs * 1e9 * share) * 1e6
        line = f"{chip:12} {cores:5d} {gbs:6.1f} {ghz:6.3f} {t_dense:9.1f}"
        for tcq in (False, True):
            costs = rans_gemv_costs(fmt, gs, 1, bits, tcq=tcq)
            t = [weights / rans_weights_per_s(chip, *costs, simd_cycles=k) * 1e6 for k in (1, 4)]
            line += f" {t[0]:6.1f}-{t[1]:<6.1f} {t[0] / t_dense:6.1f}-{t[1] / t_dense:.1f}x"
        print(line)


def rans_meta_inputs(m, n, k, fmt, gs, dtype, bits, chunk_k=1024, device="meta"):
    """Meta tensors of a rans_gemm call (words sized for `bits` per weight)."""
    x, _, scales, zeros = meta_inputs(m, n, k, fmt, gs, dtype, device)
    chunks = -(-n // 32) * -(-k // chunk_k)
    e = lambda *shape, dt: torch.empty(*shape, dtype=dt, device=device)  # noqa: E731
    return (x, e(int(k * n * bits / 16), dt=torch.int16), e(chunks + 1, dt=torch.int32),
            e(chunks, 32, dt=torch.int32), e(16, dt=torch.int16), scales, zeros, None, fmt, k, chunk_k, 12, gs)


def report_rans_plans(fmt, gs, bits, dtype=torch.float16):
    print(f"# entropy-coded layout plans, lossless {fmt} codes, group_size={gs}, {bits} bits per weight, {dtype}")
    print(f"{'shape':24} {'M':>5} {'kernels':30} {'grid':>12} {'tg mem':>7} {'splits':>6}")
    for name, (n, k) in SHAPES.items():
        for m in M_VALUES:
            plan = metal_plan("rans_gemm", *rans_meta_inputs(m, n, k, fmt, gs, dtype, bits))
            kernels = "+".join(l["kernel"] for l in plan["launches"])
            grid = "x".join(map(str, plan["launches"][0]["grid"]))
            tg = max(l["threadgroup_memory"] for l in plan["launches"])
            print(f"{name:24} {m:5d} {kernels:30} {grid:>12} {tg:7d} {plan['splits']:6d}")


def bench_rans_device(fmt, gs, cache_bytes=256 << 20):
    """Median ms of rans_gemm against gemm on MPS for the same codes (peaked, like trained weights'
    codes), coded losslessly and packed; rotating copies of both."""
    from torch_marlin import rans
    from torch_marlin.formats import pack_codes

    dev = "mps"
    print(f"# MPS timings, entropy-coded (lossless) vs dense, format={fmt}, group_size={gs}, fp16 x (median ms)")
    print(f"{'shape':24} {'M':>5} {'bits/w':>7} {'dense':>8} {'rans':>8} {'rans/dense':>11}")
    for name, (n, k) in SHAPES.items():
        probs = torch.softmax(-0.35 * (torch.arange(16.0) - 7.5).abs(), 0)
        codes = torch.multinomial(probs, k * n, replacement=True).view(k, n)
        stream = rans.encode_codes(codes, fmt, rans.DEFAULT_CHUNK_K, rans.DEFAULT_PROB_BITS, gs)
        groups = k // gs if gs != -1 else 1
        scales = torch.rand(groups, n, dtype=torch.float16, device=dev)
        zeros = torch.rand(groups, n, dtype=torch.float16, device=dev) * 15 if has_zeros(fmt) else None
        copies = max(2, min(32, math.ceil(cache_bytes / (k // 8 * n * 4))))
        packed = [pack_codes(codes).to(dev) for _ in range(copies)]
        coded = [[t.to(dev) for t in stream.tensors().values()] for _ in range(copies)]
        bits = stream.nbytes * 8 / (k * n)
        for m in M_VALUES:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            it = [0, 0]

            def dense():
                it[0] += 1
                return torch.ops.marlin.gemm(x, packed[it[0] % copies], scales, zeros, None, fmt, gs)

            def coded_gemm():
                it[1] += 1
                w, o, st, f = coded[it[1] % copies]
                return torch.ops.marlin.rans_gemm(x, w, o, st, f, scales, zeros, None, fmt, k, rans.DEFAULT_CHUNK_K,
                                                  rans.DEFAULT_PROB_BITS, gs)

            t_d, t_r = _median_ms(dense), _median_ms(coded_gemm)
            print(f"{name:24} {m:5d} {bits:7.3f} {t_d:8.3f} {t_r:8.3f} {t_r / t_d:11.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp4", choices=WEIGHT_FORMATS)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--plan-only", action="store_true", help="only the plan traffic report (and --estimates)")
    ap.add_argument("--estimates", action="store_true", help="the per-chip bounds of docs/KERNELS.md")
    ap.add_argument("--peak-gbs", type=float, help="the chip's DRAM bandwidth, when it is not detected")
    ap.add_argument("--sparse", action="store_true", help="2:4 sparse against dense of the same format")
    ap.add_argument("--rans", action="store_true", help="entropy-coded (lossless) against dense of the same format")
    ap.add_argument("--rans-bits", type=float, default=3.8, help="--rans: coded bits per weight of the estimates")
    ap.add_argument("--fused", action="store_true", help="fused projections against the separate layers")
    args = ap.parse_args()
    if args.rans:
        report_rans_plans(args.format, args.group_size, args.rans_bits)
        if args.estimates:
            report_rans_estimates(args.format, args.group_size, args.rans_bits)
        return
    (report_sparse_plans if args.sparse else report_plans)(args.format, args.group_size)
    if args.fused:
        report_fused_plans(args.format, args.group_size)
    if args.estimates:
        report_accounting(args.format, args.group_size)
        report_estimates(args.format, args.group_size)
        report_banks()
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if mps and not args.plan_only:
        if not torch._C._dispatch_has_kernel_for_dispatch_key("marlin::gemm", "MPS"):
            print("torch_marlin was built without the MPS bridge: no device timings")
            return
        if args.rans:
            bench_rans_device(args.format, args.group_size)
        elif args.sparse:
            bench_sparse_device(args.format, args.group_size)
        else:
            bench_device(args.format, args.group_size, args.peak_gbs)
    elif not mps:
        print("(no MPS device: device timings skipped)")


if __name__ == "__main__":
    main()
