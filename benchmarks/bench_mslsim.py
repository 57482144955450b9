"""Speed of the MSL emulator (a benchmark, not a test): a 256x256x256 fp16
simdgroup_matrix GEMM (tests/mslsim/kernels/gemm.metal, 64 threadgroups of
128 threads; threadgroup memory in its inner loop) and a device-memory loop
(256 threadgroups of 256 threads, 64 read-modify-writes of a writable buffer
per thread) on one core, with race detection on (the default) and off,
alternating in one process (median of --repeat launches each, process CPU
time), and the GEMM's compile time cold (with the strict check) and cached.
Emulator speed says nothing about an Apple GPU.

    python benchmarks/bench_mslsim.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import mslsim

KERNEL = os.path.join(os.path.dirname(__file__), "..", "tests", "mslsim", "kernels", "gemm.metal")
DEVICE_LOOP = """#include <metal_stdlib>
using namespace metal;
kernel void device_loop(const device float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  for (uint i = 0; i < 64; ++i) y[gid] = y[gid] * 0.5f + x[(gid + i * 977) % 65536];
}
"""


def cpu_seconds(launch) -> float:
    start = time.process_time()
    launch()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--repeat", type=int, default=5, help="launches per setting (default 5)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCH_MARLIN_MSLSIM_CACHE"] = cache
        start = time.perf_counter()
        mslsim.compile(KERNEL)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        lib = mslsim.compile(KERNEL)
        warm = time.perf_counter() - start

        device_lib = mslsim.compile(DEVICE_LOOP)

        n = 256
        a, b = torch.randn(n, n).half(), torch.randn(n, n).half()
        x = torch.randn(1 << 16)
        times = {(kernel, check): [] for kernel in ("gemm", "device") for check in (True, False)}
        for _ in range(args.repeat):
            for check_races in (True, False):
                c = torch.zeros(n, n).half()
                times["gemm", check_races].append(cpu_seconds(lambda: lib.launch(
                    "gemm_f16_nn", grid=(n // 32, n // 32), threadgroup=(128,),
                    args={0: a, 1: b, 2: c, 3: n, 4: n, 5: n}, workers=1, check_races=check_races)))
                y = torch.zeros_like(x)
                times["device", check_races].append(cpu_seconds(lambda: device_lib.launch(
                    "device_loop", grid=(x.numel() // 256,), threadgroup=(256,), args={0: x, 1: y}, workers=1,
                    check_races=check_races)))
        error = float((c.float() - a.float() @ b.float()).abs().max())

    med = {key: statistics.median(t) for key, t in times.items()}
    result = {"compile_cold_s": cold, "compile_cached_s": warm, "gemm256_cpu_s": med["gemm", True],
              "gemm256_cpu_s_no_race_check": med["gemm", False],
              "gemm256_race_check_ratio": med["gemm", True] / med["gemm", False],
              "device_loop_cpu_s": med["device", True], "device_loop_cpu_s_no_race_check": med["device", False],
              "device_loop_race_check_ratio": med["device", True] / med["device", False],
              "gemm256_max_abs_error": error}
    for key, value in result.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
