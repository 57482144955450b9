"""Speed of the MSL emulator (a benchmark, not a test): a 256x256x256 fp16
simdgroup_matrix GEMM (tests/mslsim/kernels/gemm.metal, 64 threadgroups of
128 threads) on one core, with threadgroup-memory race detection on (the
default) and off, alternating in one process (median of --repeat launches
each), and compile time cold (with the strict check) and cached. Emulator
speed says nothing about an Apple GPU.

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

from torch_marlin.testing import mslsim

KERNEL = os.path.join(os.path.dirname(__file__), "..", "tests", "mslsim", "kernels", "gemm.metal")


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

        n = 256
        a, b = torch.randn(n, n).half(), torch.randn(n, n).half()
        times, barriers = {True: [], False: []}, 0
        for _ in range(args.repeat):
            for check_races in (True, False):
                c = torch.zeros(n, n).half()
                start = time.perf_counter()
                stats = lib.launch("gemm_f16_nn", grid=(n // 32, n // 32), threadgroup=(128,),
                                   args={0: a, 1: b, 2: c, 3: n, 4: n, 5: n}, workers=1,
                                   check_races=check_races)
                times[check_races].append(time.perf_counter() - start)
                barriers = stats.barriers
        error = float((c.float() - a.float() @ b.float()).abs().max())

    on, off = statistics.median(times[True]), statistics.median(times[False])
    result = {"compile_cold_s": cold, "compile_cached_s": warm, "gemm256_s_one_core": on,
              "gemm256_s_one_core_no_race_check": off, "race_check_ratio": on / off,
              "gemm256_barriers": barriers, "gemm256_max_abs_error": error}
    for key, value in result.items():
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
