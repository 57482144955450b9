"""Quantizer speed on one weight matrix: the C++ path of quantize_weight against the
plain-torch reference (quantize_weight_reference), same process, same input.

Reports the median wall time and the process CPU time per call (CPU time is
steadier than wall time on shared cores) for each format, and checks that both
paths give the same packed weight.

    python benchmarks/bench_quantize.py [--shape 4096 4096] [--group-size 128] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

import torch_marlin as tm
from torch_marlin.layouts.dense import quantize_weight_reference


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fn, repeat: int):
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), cpu_seconds()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(cpu_seconds() - cpu)
    return {"wall_median": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
            "cpu_median": statistics.median(cpus)}, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("N", "K"))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--method", default="mse", choices=["mse", "absmax"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reference-repeat", type=int, default=1, help="the reference is ~100x slower")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    weight = torch.randn(*args.shape, generator=torch.Generator().manual_seed(0)).to(getattr(torch, args.dtype))
    print(f"{args.shape[0]}x{args.shape[1]} {args.dtype} g{args.group_size} {args.method}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    rows = {}
    for fmt in tm.WEIGHT_FORMATS:
        native, q = measure(lambda: tm.quantize_weight(weight, fmt, args.group_size, args.method), args.repeat)
        reference, r = measure(lambda: quantize_weight_reference(weight, fmt, args.group_size, args.method),
                               args.reference_repeat)
        same = torch.equal(q.packed, r.packed) and torch.equal(q.scales, r.scales)
        rows[fmt] = {"native": native, "reference": reference, "identical": same,
                     "relative_error": q.relative_error,
                     "speedup_wall": reference["wall_median"] / native["wall_median"],
                     "speedup_cpu": reference["cpu_median"] / native["cpu_median"]}
        print(f"{fmt:6s} C++ {native['wall_median']:7.3f} s wall ({native['cpu_median']:.3f} s CPU)   "
              f"reference {reference['wall_median']:7.2f} s wall ({reference['cpu_median']:.2f} s CPU)   "
              f"x{rows[fmt]['speedup_wall']:.0f} wall, x{rows[fmt]['speedup_cpu']:.0f} CPU   "
              f"identical: {same}   rel. error {q.relative_error:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": torch.get_num_threads(), "results": rows}, f, indent=2)
    return 0 if all(row["identical"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
