"""Which 2:4 metadata code (a benchmark, not a test): the layout's nibble code
(pos0 | pos1 << 2, 4 bits per block of 4 weights) against two base-6 codes of
2.67 bits per block (one of the 6 valid patterns per block: 6 blocks per
16 bits decoded by arithmetic, or 3 blocks per byte decoded by a 216-entry
table), each decoded inside the same sparse CPU GEMV on the same weights, one thread,
interleaved runs; minimum times (preemption on a shared machine only adds
time) and the median of the per-pair time ratios.

    python benchmarks/sparse_metadata_code.py [--quick] [--repeats 15]

Compiles benchmarks/sparse_metadata_code.cpp (plain C++ against
csrc/cpu/sparse24_kernels_impl.h, AVX2 build) with $CXX (default g++).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
G128_BITS = {"nibble": 2 + 1 + 16 / 128, "base6": 2 + 8 / 12 + 16 / 128}  # fp4/int4 at group 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "sparse_metadata_code")
        cxx = os.environ.get("CXX", "g++")
        subprocess.run([cxx, "-O3", "-std=c++20", "-I", str(ROOT / "csrc"), "-I", str(ROOT / "metal"),
                        str(ROOT / "benchmarks" / "sparse_metadata_code.cpp"), "-o", exe], check=True)
        run = subprocess.run([exe, str(args.repeats), str(int(args.quick))], capture_output=True, text=True)
    if run.returncode:
        sys.exit(run.stderr)
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    print(f"bits per weight at g128 (fp4/int4): nibble {G128_BITS['nibble']:.3f}, base-6 {G128_BITS['base6']:.3f} "
          f"({G128_BITS['base6'] / G128_BITS['nibble']:.3f}x the bytes)")
    print("times: minimum over the runs; ratios: time / nibble time")
    print(f"{'format':6} {'N':>6} {'K':>6} {'M':>2} | {'nibble ms':>9} | {'base-6 arith.':>13} {'ratio':>6} | "
          f"{'base-6 table':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['format']:6} {r['n']:6} {r['k']:6} {r['m']:2} | {r['nibble_ms']:9.3f} | {r['base6_ms']:13.3f} "
              f"{r['base6_ms'] / r['nibble_ms']:6.2f} | {r['base6_table_ms']:12.3f} "
              f"{r['base6_table_ms'] / r['nibble_ms']:6.2f}")


if __name__ == "__main__":
    main()
