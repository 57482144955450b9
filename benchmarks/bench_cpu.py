"""CPU benchmark of torch.ops.marlin.gemm (a benchmark, not a test).

Compares against dense fp32 and bf16 torch.matmul and torch's own int4 CPU
kernel (aten._weight_int4pack_mm_for_cpu), on LLaMA-7B-like layer shapes,
and measures a large-copy memory bandwidth in the same run. Prints a table
and writes JSON.

With --sparse: the 2:4 sparse layout (torch.ops.marlin.sparse24_gemm) against
the dense layout of the same format on the same shapes, timed alternately in
one process (minimum times, and the median of the per-pair ratios).

    python benchmarks/bench_cpu.py [--quick] [--sparse] [--threads T] [--json bench_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import torch_marlin  # noqa: F401  (registers torch.ops.marlin)
from torch_marlin.formats import pack_codes
from torch_marlin.layouts.sparse24 import PATTERNS, pack_kept

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N = out_features, K = in_features)
ROWS = [1, 8, 32, 128]
GROUP_SIZE = 128


def median_seconds(fn, repeats: int, min_time: float = 0.2) -> float:
    fn()  # warm-up
    times = []
    deadline = time.perf_counter() + min_time
    while len(times) < repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) >= 10 * repeats:
            break
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 1 << 28) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), 5)
    return 2 * nbytes / seconds / 1e9  # read + write


def make_weights(n: int, k: int, fmt: str):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // GROUP_SIZE, n, generator=g) * 0.01 + 0.001).half()
    zeros = torch.full_like(scales, 8.0) if fmt == "uint4" else None
    return codes, pack_codes(codes), scales, zeros


def torch_int4(codes: torch.Tensor, scales: torch.Tensor):
    """torch's int4 CPU kernel on the same codes: w = (q - 8) * scale."""
    w_int = codes.t().contiguous()  # [N, K] in 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w_int, 2)
    s = scales.to(torch.bfloat16)
    scale_zeros = torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()  # zero: w = (q - 8) * s
    return packed, scale_zeros


def sparse_weights(n: int, k: int, fmt: str):
    """Random 2:4 weights (uniform patterns) with the dense weights' scales/zeros shapes."""
    g = torch.Generator().manual_seed(1)
    kept = torch.randint(0, 16, (k // 2, n), generator=g, dtype=torch.int32)
    pattern = torch.tensor(PATTERNS)[torch.randint(0, 6, (k // 4, n), generator=g)]  # [K/4, N, 2]
    return pack_kept(kept, pattern.permute(0, 2, 1).reshape(k // 2, n))


def paired_seconds(dense, sparse, repeats: int):
    """Alternate the two; (min dense, min sparse, median of dense/sparse per pair)."""
    dense(), sparse()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((dense, a), (sparse, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(a), min(b), statistics.median(x / y for x, y in zip(a, b))


def sparse_main(args, shapes) -> None:
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; 2:4 sparse vs dense, group {GROUP_SIZE}, bf16 x")
    header = (f"{'format':6} {'N':>6} {'K':>6} {'M':>4} | {'dense ms':>9} {'2:4 ms':>9} | "
              f"{'x (min)':>7} {'x (median)':>10}")
    print(header)
    print("-" * len(header))
    results = []
    for n, k in shapes:
        for fmt in args.formats.split(","):
            _, packed, scales, zeros = make_weights(n, k, fmt)
            values, metadata = sparse_weights(n, k, fmt)
            for m in ROWS:
                x = torch.randn(m, k).to(torch.bfloat16)
                reps = args.repeats * (3 if m <= 8 else 1)
                td, ts, ratio = paired_seconds(
                    lambda: torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, GROUP_SIZE),
                    lambda: torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, fmt, GROUP_SIZE),
                    reps)
                row = dict(format=fmt, n=n, k=k, m=m, dense_ms=td * 1e3, sparse_ms=ts * 1e3, speedup_min=td / ts,
                           speedup_median=ratio)
                results.append(row)
                print(f"{fmt:6} {n:6} {k:6} {m:4} | {td * 1e3:9.3f} {ts * 1e3:9.3f} | {td / ts:7.2f} {ratio:10.2f}",
                      flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(threads=torch.get_num_threads(), torch=torch.__version__, sparse=results), f, indent=1)
    print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, fewer repeats")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--formats", default="fp4,int4,uint4")
    parser.add_argument("--json", default="bench_cpu.json")
    parser.add_argument("--sparse", action="store_true", help="2:4 sparse against dense of the same format")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    if args.sparse:
        return sparse_main(args, shapes)

    bandwidth = copy_bandwidth_gbs()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, copy bandwidth {bandwidth:.1f} GB/s")
    header = f"{'format':6} {'N':>6} {'K':>6} {'M':>4} | {'marlin ms':>9} {'GB/s':>6} | {'int4 ms':>8} {'bf16 ms':>8} {'fp32 ms':>8} | {'x int4':>6} {'x bf16':>6}"
    print(header)
    print("-" * len(header))
    results = []
    for n, k in shapes:
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.to(torch.bfloat16)
        for fmt in args.formats.split(","):
            codes, packed, scales, zeros = make_weights(n, k, fmt)
            int4_packed, int4_sz = torch_int4(codes, scales)
            weight_bytes = packed.numel() * 4 + scales.numel() * 2 * (2 if zeros is not None else 1)
            for m in ROWS:
                x32 = torch.randn(m, k)
                x16 = x32.to(torch.bfloat16)
                t_marlin = median_seconds(lambda: torch.ops.marlin.gemm(x16, packed, scales, zeros, None, fmt, GROUP_SIZE), repeats)
                t_int4 = median_seconds(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, int4_packed, GROUP_SIZE, int4_sz), repeats)
                t_bf16 = median_seconds(lambda: x16 @ w16.t(), repeats)
                t_fp32 = median_seconds(lambda: x32 @ w32.t(), repeats)
                gbs = (weight_bytes + m * k * 2 + m * n * 2) / t_marlin / 1e9
                row = dict(format=fmt, n=n, k=k, m=m, marlin_ms=t_marlin * 1e3, int4_ms=t_int4 * 1e3,
                           bf16_ms=t_bf16 * 1e3, fp32_ms=t_fp32 * 1e3, marlin_gbs=gbs,
                           speedup_vs_int4=t_int4 / t_marlin, speedup_vs_bf16=t_bf16 / t_marlin)
                results.append(row)
                print(f"{fmt:6} {n:6} {k:6} {m:4} | {row['marlin_ms']:9.3f} {gbs:6.1f} | {row['int4_ms']:8.3f} "
                      f"{row['bf16_ms']:8.3f} {row['fp32_ms']:8.3f} | {row['speedup_vs_int4']:6.2f} {row['speedup_vs_bf16']:6.2f}")
    with open(args.json, "w") as f:
        json.dump(dict(copy_bandwidth_gbs=bandwidth, threads=torch.get_num_threads(),
                       torch=torch.__version__, results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
