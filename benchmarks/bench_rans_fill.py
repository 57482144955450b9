"""The entropy-coded layout's CPU tile GEMM split into its parts, per kernel
build: the tile fill (the decode) alone, and fill plus micro-kernels at M rows,
on the kernels' entry points without torch (benchmarks/rans_fill.cpp; one
thread, process CPU time, median of 9; rans_fill's JSON lines carry the
minimum too, and it takes the grid's spread). Used in docs/CPU.md to find
where the rans GEMM's time goes; bench_rans.py times the op against the
dense one.

    python benchmarks/bench_rans_fill.py [--builds avx512_bf16,avx512,avx2] [--rows 32] [--weights fp4,grid,tcq]

Compiles the CPU kernels (csrc/cpu/kernel*.cpp, rans_kernels_*.cpp) with g++
first (a few minutes on 2 cores).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(out: Path) -> Path:
    cpu = ROOT / "csrc" / "cpu"
    sources = sorted(cpu.glob("kernel*.cpp")) + sorted(cpu.glob("rans_kernels_*.cpp")) + [ROOT / "benchmarks" / "rans_fill.cpp"]
    flags = ["-O3", "-std=c++20", "-I", str(ROOT / "csrc"), "-I", str(ROOT / "metal"),
             "-I", str(ROOT / "tests" / "cpu_kernels")]

    def compile_one(src):
        obj = out / (src.stem + ".o")
        r = subprocess.run(["g++", *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{src.name}:\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_one, sources))
    exe = out / "rans_fill"
    subprocess.run(["g++", *map(str, objects), "-o", str(exe)], check=True)
    return exe


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builds", default="avx512_bf16,avx512,avx2")
    p.add_argument("--rows", type=int, nargs="+", default=[32])
    p.add_argument("--weights", default="fp4,grid,tcq")
    p.add_argument("--size", type=int, default=4096, help="N = K")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print("| build | weights | N x K | M | fill ms | fill + micro-kernels ms |")
        print("| --- | --- | --- | ---: | ---: | ---: |")
        for b in args.builds.split(","):
            for w in args.weights.split(","):
                for m in args.rows:
                    r = subprocess.run([str(exe), b, w, str(m), str(args.size)], capture_output=True, text=True)
                    if r.returncode != 0:
                        sys.exit(f"{b} {w} M={m} failed: {r.stdout}{r.stderr}")
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                    if "skipped" in row:
                        print(f"| {b} | skipped: {row['skipped']} | | | | |")
                        continue
                    print(f"| {b} | {w} | {row['n']}x{row['k']} | {m} | {row['fill_ms']:.2f} | {row['gemm_ms']:.2f} |")


if __name__ == "__main__":
    main()
