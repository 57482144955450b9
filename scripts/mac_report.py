"""The first run on a Mac, in one command: build with Xcode's toolchain, compile
every Metal kernel with Apple's compiler, run the MPS tests and the Metal
benchmarks, and write one JSON report to attach to an issue as it is.

    python3 scripts/mac_report.py [--out mac_report.json] [--quick]     (or: make mac-report)
    python3 scripts/mac_report.py --kernels-only   # only compile the kernels (CI: .github/workflows/macos.yml)

Steps (each recorded with its command, exit status, time and output tail; a
failing step does not stop the later ones):
  machine     chip, GPU cores, memory, macOS, Xcode, Metal compiler and SDK, Python, torch
  build       torch_marlin (pip install --no-build-isolation -e .) and mslsim with
              Xcode's clang (xcrun), so the MPS bridge and the embedded metallib are built
  kernels     every metal/*.metal to AIR with `xcrun metal` for the declared macOS floor
              (the command of csrc/mps/embed_metal.py), then one metallib; warnings kept
  tests       tests/metal/test_metal_mps.py (results on the GPU) and test_embed_metal.py
              (the metallib build), every test's outcome (JUnit XML)
  benchmarks  bench_mps (GB/s and % of the chip's DRAM bandwidth per kernel and shape),
              bench_mps --sparse (2:4 against dense), bench_moe --device mps,
              bench_decode --device mps

Anywhere else it refuses with a message: there is no GPU to measure. The parts
that read tool output and assemble the report are tested on Linux
(tests/test_mac_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT_VERSION = 1
NOT_A_MAC = ("scripts/mac_report.py runs on a Mac (Apple silicon, macOS 14 or newer, Xcode installed): it builds "
             "with Xcode's toolchain, compiles the kernels with Apple's Metal compiler and measures them on the GPU. "
             "This machine runs {system}; on Linux the kernels run on the emulator (make test, docs/MSLSIM.md).")


def require_mac(system: str | None = None) -> None:
    system = system or platform.system()
    if system != "Darwin":
        raise SystemExit(NOT_A_MAC.format(system=system))


def run(cmd, timeout=3600, env=None, cwd=ROOT) -> dict:
    """A step's record: command, exit status, seconds, the tail of its output."""
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        status, out, err = r.returncode, r.stdout, r.stderr
    except (OSError, subprocess.SubprocessError) as e:
        status, out, err = None, "", f"{type(e).__name__}: {e}"
    return dict(cmd=[str(c) for c in cmd], returncode=status, seconds=round(time.monotonic() - start, 1),
                stdout=out[-20000:], stderr=err[-20000:])


def _out(cmd) -> str | None:
    r = run(cmd, timeout=120)
    return r["stdout"].strip() if r["returncode"] == 0 else None


def machine() -> dict:
    import torch

    gpu = _out(["system_profiler", "SPDisplaysDataType", "-json"])
    return dict(
        chip=_out(["sysctl", "-n", "machdep.cpu.brand_string"]), model=_out(["sysctl", "-n", "hw.model"]),
        memory_bytes=_out(["sysctl", "-n", "hw.memsize"]), gpu=json.loads(gpu) if gpu else None,
        macos=_out(["sw_vers", "-productVersion"]), macos_build=_out(["sw_vers", "-buildVersion"]),
        xcode=_out(["xcodebuild", "-version"]), metal_compiler=_out(["xcrun", "-sdk", "macosx", "metal", "--version"]),
        sdk=_out(["xcrun", "-sdk", "macosx", "--show-sdk-version"]), python=sys.version, torch=torch.__version__,
        mps_available=bool(torch.backends.mps.is_available()))


def xcode_env() -> dict:
    """The environment of the build: Xcode's clang for C++ and Objective-C++."""
    env = dict(os.environ)
    for var, tool in (("CC", "clang"), ("CXX", "clang++")):
        path = _out(["xcrun", "-f", tool])
        if path:
            env[var] = path
    return env


def build() -> list:
    env = xcode_env()
    pip = [sys.executable, "-m", "pip", "install", "--no-build-isolation"]
    return [run(pip + ["-e", "."], env=env), run(pip + ["-e", "./mslsim"], env=env)]


def compile_kernels(work: Path) -> dict:
    sys.path.insert(0, str(ROOT / "csrc" / "mps"))
    import embed_metal

    files, airs = [], []
    for src in sorted((ROOT / "metal").glob("*.metal")):
        air = work / (src.stem + ".air")
        r = run(embed_metal.metal_compile_command(src, air), env=embed_metal.toolchain_env())
        files.append(dict(source=src.name, ok=r["returncode"] == 0, seconds=r["seconds"],
                          diagnostics=r["stderr"]))
        if r["returncode"] == 0:
            airs.append(air)
    link = run(embed_metal.metallib_link_command(airs, work / "marlin.metallib"), env=embed_metal.toolchain_env())
    return dict(macos_floor=embed_metal.MACOS_FLOOR, metal_std=embed_metal.METAL_STD, files=files,
                metallib=dict(ok=link["returncode"] == 0 and len(airs) == len(files), diagnostics=link["stderr"]))


def parse_junit(xml_text: str) -> list:
    """Every test of a pytest --junitxml file: name, outcome (passed, failed, error, skipped), seconds, message."""
    results = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or node.text or "")[:2000]
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        results.append(dict(name=name, outcome=outcome, seconds=float(case.get("time") or 0), message=message))
    return results


def run_tests(work: Path) -> dict:
    junit = work / "tests.xml"
    r = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
             "tests/metal/test_metal_mps.py", "tests/metal/test_embed_metal.py"], timeout=7200)
    results = parse_junit(junit.read_text()) if junit.exists() else []
    return dict(step=r, results=results)


# bench_mps's device table: shape (24 columns), M, marlin ms, GB/s, %peak, fp16 mm ms, x, int4pack ms, x
_MPS_ROW = re.compile(r"^(?P<shape>.{24}) +(?P<m>\d+) +(?P<ms>[\d.]+) +(?P<gbs>[\d.]+) +\S+ +(?P<fp16>[\d.na]+) +\S+ "
                      r"+(?P<int4>[\d.na]+) +\S+$")
# bench_mps --sparse: shape, M, dense ms, 2:4 ms, dense / 2:4
_SPARSE_ROW = re.compile(r"^(?P<shape>.{24}) +(?P<m>\d+) +(?P<dense>[\d.]+) +(?P<sparse>[\d.]+) +[\d.]+$")


def _shape_nk(shape: str):
    n, k = re.search(r"(\d+)x(\d+)", shape).groups()
    return int(n), int(k)


def gemm_kernels(m: int, n: int, k: int, fmt: str, gs: int, sparse: bool = False) -> str:
    """The kernels the planner launches for this call (as bench_mps's plan table names them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    import bench_mps
    from torch_marlin.testing.metal import metal_plan

    if sparse:
        x, values, metadata, scales, zeros = bench_mps.sparse_meta_inputs(m, n, k, fmt, gs, torch.float16)
        plan = metal_plan("sparse24_gemm", x, values, metadata, scales, zeros, None, fmt, gs)
    else:
        x, packed, scales, zeros = bench_mps.meta_inputs(m, n, k, fmt, gs, torch.float16)
        plan = metal_plan("gemm", x, packed, scales, zeros, None, fmt, gs)
    return "+".join(launch["kernel"] for launch in plan["launches"])


def parse_bench_mps(text: str, fmt: str, gs: int, peak_gbs: float | None) -> list:
    """Rows of bench_mps's device table with the kernels behind them and the share of the chip's bandwidth."""
    rows = []
    for line in text.splitlines():
        match = _MPS_ROW.match(line)
        if not match:
            continue
        shape, m = match["shape"].strip(), int(match["m"])
        n, k = _shape_nk(shape)
        gbs = float(match["gbs"])
        rows.append(dict(shape=shape, n=n, k=k, m=m, kernels=gemm_kernels(m, n, k, fmt, gs), ms=float(match["ms"]),
                         gb_per_s=gbs, percent_of_peak=round(100 * gbs / peak_gbs, 1) if peak_gbs else None,
                         fp16_matmul_ms=float(match["fp16"]), int4pack_ms=float(match["int4"])))
    return rows


def parse_bench_sparse(text: str, fmt: str, gs: int) -> list:
    rows = []
    for line in text.splitlines():
        match = _SPARSE_ROW.match(line)
        if match:
            shape, m = match["shape"].strip(), int(match["m"])
            n, k = _shape_nk(shape)
            rows.append(dict(shape=shape, n=n, k=k, m=m, kernels=gemm_kernels(m, n, k, fmt, gs, sparse=True),
                             dense_ms=float(match["dense"]), sparse24_ms=float(match["sparse"])))
    return rows


def run_benchmarks(work: Path, fmt: str, gs: int, quick: bool) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_mps

    chip, peak = bench_mps.detect_chip()
    py = sys.executable
    common = ["--format", fmt, "--group-size", str(gs)]
    mps = run([py, "benchmarks/bench_mps.py", *common], timeout=7200)
    sparse = run([py, "benchmarks/bench_mps.py", "--sparse", *common], timeout=7200)
    moe_json, decode_json = work / "bench_moe.json", work / "bench_decode.json"
    moe = run([py, "benchmarks/bench_moe.py", "--device", "mps", *common, "--json", str(moe_json)], timeout=7200)
    decode = run([py, "benchmarks/bench_decode.py", "--device", "mps", "--no-rss", "--json", str(decode_json),
                  *(["--quick"] if quick else []),
                  "--variants", "float32,bfloat16,marlin-fp4,marlin-int4,marlin-uint4,marlin-fp4-2:4"], timeout=7200)
    return dict(chip=chip, peak_gb_per_s=peak, format=fmt, group_size=gs,
                bench_mps=dict(step=mps, rows=parse_bench_mps(mps["stdout"], fmt, gs, peak)),
                bench_mps_sparse=dict(step=sparse, rows=parse_bench_sparse(sparse["stdout"], fmt, gs)),
                bench_moe=dict(step=moe, results=_load(moe_json)),
                bench_decode=dict(step=decode, results=_load(decode_json)))


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def assemble(machine_info: dict, build_steps: list, kernels: dict, tests: dict, benchmarks: dict) -> dict:
    """The report, with a summary first: what to look at when reading it."""
    outcomes = {}
    for t in tests["results"]:
        outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
    rows = benchmarks["bench_mps"]["rows"]
    shares = [r["percent_of_peak"] for r in rows if r["percent_of_peak"] is not None]
    summary = dict(
        build_ok=all(s["returncode"] == 0 for s in build_steps),
        kernels_compiled=sum(f["ok"] for f in kernels["files"]), kernels_total=len(kernels["files"]),
        kernels_with_diagnostics=[f["source"] for f in kernels["files"] if f["diagnostics"].strip()],
        metallib_ok=kernels["metallib"]["ok"], tests=outcomes,
        failed_tests=[t["name"] for t in tests["results"] if t["outcome"] in ("failed", "error")],
        gemv_m1_percent_of_peak=[r["percent_of_peak"] for r in rows if r["m"] == 1],
        best_percent_of_peak=max(shares) if shares else None)
    return dict(report_version=REPORT_VERSION, summary=summary, machine=machine_info, build=build_steps,
                kernels=kernels, tests=tests, benchmarks=benchmarks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="mac_report.json")
    ap.add_argument("--format", default="fp4")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="bench_decode --quick (2 layers, 1 round)")
    ap.add_argument("--kernels-only", action="store_true",
                    help="compile every kernel with xcrun metal, print the diagnostics, exit 1 if one fails")
    args = ap.parse_args(argv)
    require_mac()
    if args.kernels_only:
        with tempfile.TemporaryDirectory(prefix="mac_report_") as tmp:
            kernels = compile_kernels(Path(tmp))
        for f in kernels["files"]:
            print(f"{f['source']}: {'ok' if f['ok'] else 'FAILED'} ({f['seconds']} s)\n{f['diagnostics']}".rstrip())
        print(f"metallib: {'ok' if kernels['metallib']['ok'] else 'FAILED'}\n{kernels['metallib']['diagnostics']}".rstrip())
        return 0 if kernels["metallib"]["ok"] else 1
    with tempfile.TemporaryDirectory(prefix="mac_report_") as tmp:
        work = Path(tmp)
        print("machine ...", flush=True)
        info = machine()
        print("build with Xcode's toolchain ...", flush=True)
        build_steps = build()
        print("compile every kernel with xcrun metal ...", flush=True)
        kernels = compile_kernels(work)
        print("MPS tests ...", flush=True)
        tests = run_tests(work)
        print("benchmarks ...", flush=True)
        benchmarks = run_benchmarks(work, args.format, args.group_size, args.quick)
    report = assemble(info, build_steps, kernels, tests, benchmarks)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {args.out}: attach it to the issue as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
