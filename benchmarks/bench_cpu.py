"""CPU benchmark of torch.ops.marlin.gemm (a benchmark, not a test).

Compares against dense fp32 and bf16 torch.matmul and torch's own int4 CPU
kernel (aten._weight_int4pack_mm_for_cpu) on the same codes, on LLaMA-7B-like
layer shapes, bf16 activations, group size 128. Every candidate is timed in
the same process, interleaved round by round (so a noisy neighbour slows all
of them alike); the figures are medians. Prints the CPU, its instruction-set
flags and the kernel build that ran, a table, and writes JSON with the same.

    python benchmarks/bench_cpu.py [--quick] [--sparse [--cold-mib 1024]] [--kernels avx2] [--threads 2]
                                   [--clock wall] [--json bench_cpu.json]

--kernels forces a kernel build (= TORCH_MARLIN_CPU_KERNELS), e.g. to check
the AVX2 build on an AVX-512 machine.

With --sparse: the 2:4 sparse layout (torch.ops.marlin.sparse24_gemm) against
the dense layout of the same format on the same shapes, timed alternately in
one process (minimum times, and the median of the per-pair ratios).
--cold-mib N rotates each call over copies of the weights totalling N MiB,
so that with N above the last-level cache they are read from DRAM, as in the
decode of a model larger than the cache.

With --int8: GEMVs with float x against int8 x (torch_marlin.cpu_int8_activations,
docs/CPU.md) of the layouts in --layouts (dense, 2:4), interleaved in one
process, fp32 x; --int-dot forces the int8 dot product (=
TORCH_MARLIN_CPU_INT_DOT, e.g. vpmaddubsw in the avx2 build).

    python benchmarks/bench_cpu.py --int8 --layouts 2:4 --shapes 4096x4096,11008x4096 --rows 1,4 \
        --formats fp4,int4 --threads 1 --clock cpu --kernels avx2
"""

from __future__ import annotations

import argparse
import itertools
import math
import json
import os
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
# The /proc/cpuinfo flags that decide which kernels (ours, torch's, oneDNN's) run.
ISA_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "avx512vbmi", "avx_vnni", "amx_bf16", "amx_int8", "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2"]


def cpu_description() -> dict:
    """CPU model and the relevant ISA flags (Linux /proc/cpuinfo; elsewhere what platform knows)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in (platform.processor(), platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    return dict(model=model, machine=platform.machine(), isa_flags=[f for f in ISA_FLAGS if f in flags],
                logical_cpus=os.cpu_count())


# wall: elapsed time. cpu: this process's CPU time, which leaves out the time
# the process waits for a core; with --threads 1 on a machine shared with other
# jobs it is the steadier measure (with more threads it also counts threads
# spinning at barriers).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_medians(fns: dict, repeats: int, min_time: float = 0.3, clock=time.perf_counter) -> dict:
    """Median seconds of each function, timed round-robin (one call of each per round)."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    deadline = time.perf_counter() + min_time * len(fns)
    rounds = 0
    while rounds < repeats or (time.perf_counter() < deadline and rounds < 20 * repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


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


def machine_header() -> dict:
    """Print the CPU, its ISA flags and the kernel build; the JSON records the same."""
    cpu = cpu_description()
    kernels = json.loads(torch.ops.marlin._cpu_kernels())
    if kernels["selected"] is None:
        raise SystemExit(kernels["error"])
    print(f"# {cpu['model']} ({cpu['machine']}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"# ISA flags: {' '.join(cpu['isa_flags']) or '-'}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; torch_marlin kernels: {kernels['selected']}"
          + "".join(f" ({b} passed over: {why})" for b, why in kernels.get("passed_over", {}).items()))
    return dict(cpu=cpu, kernels=kernels["selected"], torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                threads=torch.get_num_threads(), torch=torch.__version__)


def sparse_main(args, shapes, rows) -> None:
    machine = machine_header()
    print(f"# 2:4 sparse vs dense, group {GROUP_SIZE}, bf16 x, dense and 2:4 timed alternately (wall clock)"
          + (f"; weights rotated over copies of >= {args.cold_mib} MiB (from DRAM)" if args.cold_mib else
             "; the same weights every call (cache-resident where they fit)"))
    header = (f"{'format':6} {'N':>6} {'K':>6} {'M':>4} | {'dense ms':>9} {'2:4 ms':>9} | "
              f"{'x (min)':>7} {'x (median)':>10}")
    print(header)
    print("-" * len(header))
    results = []
    for n, k in shapes:
        for fmt in args.formats.split(","):
            _, packed, scales, zeros = make_weights(n, k, fmt)
            values, metadata = sparse_weights(n, k, fmt)
            # --cold-mib: each call takes the next of enough copies of the weights that
            # one round reads that many MiB, so they come from DRAM, not the cache.
            copies = max(1, math.ceil(args.cold_mib * 2**20 / (packed.nbytes + values.nbytes + metadata.nbytes)))
            dense_w = [(packed.clone(), scales.clone()) for _ in range(copies)]
            sparse_w = [(values.clone(), metadata.clone(), scales.clone()) for _ in range(copies)]
            turn = itertools.count()
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                reps = args.repeats * (3 if m <= 8 else 1)

                def dense():
                    p, s = dense_w[next(turn) % copies]
                    return torch.ops.marlin.gemm(x, p, s, zeros, None, fmt, GROUP_SIZE)

                def sparse():
                    v, md, s = sparse_w[next(turn) % copies]
                    return torch.ops.marlin.sparse24_gemm(x, v, md, s, zeros, None, fmt, GROUP_SIZE)

                td, ts, ratio = paired_seconds(dense, sparse, reps)
                row = dict(format=fmt, n=n, k=k, m=m, dense_ms=td * 1e3, sparse_ms=ts * 1e3, speedup_min=td / ts,
                           speedup_median=ratio)
                results.append(row)
                print(f"{fmt:6} {n:6} {k:6} {m:4} | {td * 1e3:9.3f} {ts * 1e3:9.3f} | {td / ts:7.2f} {ratio:10.2f}",
                      flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(machine, cold_mib=args.cold_mib, sparse=results), f, indent=1)
    print(f"wrote {args.json}")


def int8_main(args, shapes, rows) -> None:
    import torch_marlin

    machine = machine_header()
    int_dot = json.loads(torch.ops.marlin._cpu_kernels())["int_dot"]
    print(f"# float x against int8 x (int8 dot: {int_dot}): median ms ({args.clock} clock), interleaved in one "
          f"process; fp32 x, group size {GROUP_SIZE}; load average {os.getloadavg()[0]:.1f}")
    header = f"{'layout':6} {'format':6} {'N':>6} {'K':>6} {'M':>4} | {'float x ms':>10} {'int8 x ms':>9} | {'speedup':>7}"
    print(header)
    print("-" * len(header))
    results = []
    for n, k in shapes:
        for fmt in args.formats.split(","):
            _, packed, scales, zeros = make_weights(n, k, fmt)
            values, metadata = sparse_weights(n, k, fmt)
            ops = {"dense": lambda x: torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, GROUP_SIZE),
                   "2:4": lambda x: torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, fmt,
                                                                   GROUP_SIZE)}
            for layout in args.layouts.split(","):
                for m in rows:
                    x = torch.randn(m, k)

                    def run(int8, op=ops[layout], x=x):
                        with torch_marlin.cpu_int8_activations(int8):
                            return op(x)

                    t = interleaved_medians({"float": lambda: run(False), "int8": lambda: run(True)}, args.repeats,
                                            clock=CLOCKS[args.clock])
                    row = dict(layout=layout, format=fmt, n=n, k=k, m=m, float_ms=t["float"] * 1e3,
                               int8_ms=t["int8"] * 1e3, speedup=t["float"] / t["int8"])
                    results.append(row)
                    print(f"{layout:6} {fmt:6} {n:6} {k:6} {m:4} | {row['float_ms']:10.3f} {row['int8_ms']:9.3f} | "
                          f"{row['speedup']:7.2f}", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(machine, clock=args.clock, group_size=GROUP_SIZE, int_dot=int_dot, int8=results), f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, fewer repeats")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--formats", default="fp4,int4,uint4")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--kernels", help="force a kernel build (TORCH_MARLIN_CPU_KERNELS)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1 gives steadier ratios on a machine shared with other jobs)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or process CPU time (steadier with --threads 1 on a shared machine)")
    parser.add_argument("--json", default="bench_cpu.json")
    parser.add_argument("--sparse", action="store_true", help="2:4 sparse against dense of the same format")
    parser.add_argument("--cold-mib", type=int, default=0,
                        help="with --sparse: rotate over copies of the weights totalling this many MiB "
                             "(above the last-level cache: weights from DRAM, as in a large model's decode)")
    parser.add_argument("--shapes", help="NxK,... (out x in features) instead of the LLaMA-7B-like three")
    parser.add_argument("--int8", action="store_true", help="GEMVs with float x against int8 x")
    parser.add_argument("--layouts", default="dense,2:4", help="with --int8: dense and/or 2:4")
    parser.add_argument("--int-dot", help="with --int8: force the int8 dot product (TORCH_MARLIN_CPU_INT_DOT)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels:
        os.environ["TORCH_MARLIN_CPU_KERNELS"] = args.kernels  # read at the first gemm call
    if args.int_dot:
        os.environ["TORCH_MARLIN_CPU_INT_DOT"] = args.int_dot
    shapes = [tuple(map(int, x.split("x"))) for x in args.shapes.split(",")] if args.shapes else SHAPES
    shapes = shapes[:1] if args.quick else shapes
    repeats = 5 if args.quick else args.repeats
    rows = [int(r) for r in args.rows.split(",")]
    if args.sparse:
        return sparse_main(args, shapes, rows)
    if args.int8:
        return int8_main(args, shapes, rows)

    machine = machine_header()
    print(f"# median ms ({args.clock} clock), candidates interleaved in one process; bf16 x, group size 128")
    header = (f"{'format':6} {'N':>6} {'K':>6} {'M':>4} | {'marlin ms':>9} | {'int4 ms':>8} {'bf16 ms':>8} "
              f"{'fp32 ms':>8} | {'x int4':>6} {'x bf16':>6}")
    print(header)
    print("-" * len(header))
    results = []
    for n, k in shapes:
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.to(torch.bfloat16)
        for fmt in args.formats.split(","):
            codes, packed, scales, zeros = make_weights(n, k, fmt)
            int4_packed, int4_sz = torch_int4(codes, scales)
            for m in rows:
                x32 = torch.randn(m, k)
                x16 = x32.to(torch.bfloat16)
                t = interleaved_medians({
                    "marlin": lambda: torch.ops.marlin.gemm(x16, packed, scales, zeros, None, fmt, GROUP_SIZE),
                    "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, int4_packed, GROUP_SIZE, int4_sz),
                    "bf16": lambda: x16 @ w16.t(),
                    "fp32": lambda: x32 @ w32.t(),
                }, repeats, clock=CLOCKS[args.clock])
                row = dict(format=fmt, n=n, k=k, m=m, marlin_ms=t["marlin"] * 1e3, int4_ms=t["int4"] * 1e3,
                           bf16_ms=t["bf16"] * 1e3, fp32_ms=t["fp32"] * 1e3,
                           speedup_vs_int4=t["int4"] / t["marlin"], speedup_vs_bf16=t["bf16"] / t["marlin"])
                results.append(row)
                print(f"{fmt:6} {n:6} {k:6} {m:4} | {row['marlin_ms']:9.3f} | {row['int4_ms']:8.3f} "
                      f"{row['bf16_ms']:8.3f} {row['fp32_ms']:8.3f} | {row['speedup_vs_int4']:6.2f} "
                      f"{row['speedup_vs_bf16']:6.2f}")
    with open(args.json, "w") as f:
        json.dump(dict(machine, clock=args.clock, group_size=GROUP_SIZE, results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
