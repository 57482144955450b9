"""The entropy-coded layout's CPU tile GEMM split into its parts, per kernel
build: the tile fill (the decode) alone, and fill plus micro-kernels at M rows,
on the kernels' entry points without torch (benchmarks/rans_fill.cpp; one
thread, process CPU time, median of 9; rans_fill's JSON lines carry the
minimum too, and it takes the grid's spread). Used in docs/CPU.md to find
where the rans GEMM's time goes; bench_rans.py times the op against the
dense one.

    python benchmarks/bench_rans_fill.py [--builds avx512_bf16,avx512,avx2] [--rows 32] [--weights fp4,grid,tcq]
    python benchmarks/bench_rans_fill.py --against REV [--rows 32] [--weights ...]

Compiles the CPU kernels (csrc/cpu/kernel*.cpp, rans_kernels_*.cpp) with g++
first (a few minutes on 2 cores). --against REV times this tree's avx2 kernels
against those of git revision REV, both linked into one binary (REV's under
another namespace) and alternated pass by pass, so that the baseline runs in
the same process: the ratio column is the median of the alternated pairs'.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import core_probe

ROOT = Path(__file__).resolve().parent.parent


def baseline_source(rev: str, out: Path) -> Path:
    """REV's csrc/ under out/, its avx2 build renamed avx2_base (rans_fill.cpp's name for it)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "csrc"], capture_output=True, check=True).stdout
    out.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    build_file = out / "csrc" / "cpu" / "kernels_avx2.cpp"
    text = build_file.read_text()
    if "#define MARLIN_KERNEL_NS avx2\n" not in text:
        sys.exit(f"{rev}: kernels_avx2.cpp does not name its build avx2 as expected")
    build_file.write_text(text.replace("#define MARLIN_KERNEL_NS avx2\n", "#define MARLIN_KERNEL_NS avx2_base\n"))
    return out / "csrc"


def build(out: Path, against: str | None = None) -> Path:
    cpu = ROOT / "csrc" / "cpu"
    sources = sorted(cpu.glob("kernel*.cpp")) + sorted(cpu.glob("rans_kernels_*.cpp")) + [ROOT / "benchmarks" / "rans_fill.cpp"]
    common = ["-O3", "-std=c++20", "-I", str(ROOT / "metal"), "-I", str(ROOT / "tests" / "cpu_kernels")]
    jobs = [(src, out / (src.stem + ".o"), ROOT / "csrc") for src in sources]
    if against:
        base = baseline_source(against, out / "base")
        jobs.append((base / "cpu" / "rans_kernels_avx2.cpp", out / "rans_kernels_avx2_base.o", base))

    def compile_one(job):
        src, obj, include = job
        r = subprocess.run(["g++", *common, "-I", str(include), "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{src.name}:\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_one, jobs))
    exe = out / "rans_fill"
    subprocess.run(["g++", *map(str, objects), "-o", str(exe)], check=True)
    return exe


def own_core(pairs):
    """'(median ratio, pairs)' of the [ratio, probe] pairs that had the core to themselves."""
    own = core_probe.own_core([r for r, _ in pairs], [p for _, p in pairs])
    return f"({statistics.median(own):.3f}, {len(own)})" if own else "(-, 0)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builds", default="avx512_bf16,avx512,avx2")
    p.add_argument("--rows", type=int, nargs="+", default=[32])
    p.add_argument("--weights", default="fp4,grid,tcq")
    p.add_argument("--size", type=int, default=4096, help="N = K")
    p.add_argument("--spread", default=None, help="the grid's: a number, gauss (bench_rans.py's grid) or t6 (Student's t)")
    p.add_argument("--against", metavar="REV", help="this tree's avx2 kernels against REV's, in one process")
    args = p.parse_args()
    extra = [args.spread] if args.spread else []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp), args.against)

        def run(build_name, w, m):
            """rans_fill's JSON line for one case."""
            r = subprocess.run([str(exe), build_name, w, str(m), str(args.size), *extra], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{build_name} {w} M={m} failed: {r.stdout}{r.stderr}")
            return json.loads(r.stdout.strip().splitlines()[-1])

        if args.against:
            print(f"avx2 against {args.against} in the same process, 1 thread, process CPU time, median of 15 alternated passes")
            print("(own core: the pairs whose core was not shared by another thread, benchmarks/core_probe.py)")
            print("| weights | M | fill ms | base fill ms | fill / base (own core, pairs) | fill + micro-kernels ms | base "
                  "| ratio (own core, pairs) |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for w in args.weights.split(","):
                for m in args.rows:
                    row = run("avx2-vs-base", w, m)
                    if "skipped" in row:
                        sys.exit(f"skipped: {row['skipped']}")
                    fill_own, gemm_own = own_core(row["fill_pairs"]), own_core(row["gemm_pairs"])
                    print(f"| {w} | {m} | {row['fill_ms']:.2f} | {row['base_fill_ms']:.2f} | {row['fill_ratio']:.3f} "
                          f"{fill_own} | {row['gemm_ms']:.2f} | {row['base_gemm_ms']:.2f} | {row['gemm_ratio']:.3f} "
                          f"{gemm_own} |")
            return
        print("| build | weights | N x K | M | fill ms | fill + micro-kernels ms |")
        print("| --- | --- | --- | ---: | ---: | ---: |")
        for b in args.builds.split(","):
            for w in args.weights.split(","):
                for m in args.rows:
                    row = run(b, w, m)
                    if "skipped" in row:
                        print(f"| {b} | skipped: {row['skipped']} | | | | |")
                        continue
                    print(f"| {b} | {w} | {row['n']}x{row['k']} | {m} | {row['fill_ms']:.2f} | {row['gemm_ms']:.2f} |")

if __name__ == "__main__":
    main()
