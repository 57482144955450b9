"""The aarch64 (NEON) builds of the CPU kernels, run under qemu-aarch64.

This machine cannot run Arm code and the torch extension is not built for Arm
here, so tests/cpu_kernels/check_kernels.cpp (the kernel entry points against
a float64 reference, no torch) is cross-compiled with the same sources and
flags as setup.py's CPU kernels and run under user-mode qemu. Arm speed is not
measured anywhere.
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
MISSING = "aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)"

# CI (.ci/run installs them) must run this check; elsewhere it is optional.
if (CXX is None or QEMU is None) and os.environ.get("CI"):
    raise RuntimeError(f"CI requires {MISSING}")
pytestmark = pytest.mark.skipif(CXX is None or QEMU is None, reason=f"needs {MISSING}")

KERNELS = sorted((ROOT / "csrc" / "cpu").glob("kernel*.cpp"))
# The entropy-coded layout's kernels have their own harness (check_rans_kernels.cpp).
RANS_KERNELS = sorted((ROOT / "csrc" / "cpu").glob("rans_kernels_*.cpp"))
HARNESSES = {"check_kernels": [], "check_rans_kernels": RANS_KERNELS}


@pytest.fixture(scope="module")
def harness(tmp_path_factory, terminal):
    out = tmp_path_factory.mktemp("aarch64")

    def compile_one(src):
        obj = out / (src.stem + ".o")
        r = subprocess.run([CXX, "-O3", "-std=c++20", "-I", str(ROOT / "csrc"), "-I", str(ROOT / "metal"), "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=1800)  # (a hang guard: rans_kernels_neon_bf16.cpp
        # took 10-12 min on a 2-core Zen 3 with another compile beside it)
        assert r.returncode == 0, f"{src.name}:\n{r.stderr[-4000:]}"
        return obj

    mains = [ROOT / "tests" / "cpu_kernels" / f"{name}.cpp" for name in HARNESSES]
    sources = KERNELS + RANS_KERNELS + mains
    with terminal.step(f"cross-compiling {len(sources)} files of the CPU kernels for aarch64"):
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objects = dict(zip(sources, pool.map(compile_one, sources)))
        exes = {}
        for name, extra in HARNESSES.items():
            exes[name] = out / name
            parts = [objects[src] for src in KERNELS + extra + [ROOT / "tests" / "cpu_kernels" / f"{name}.cpp"]]
            r = subprocess.run([CXX, "-static", *map(str, parts), "-o", str(exes[name])], capture_output=True,
                               text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-4000:]
    return exes


@pytest.mark.parametrize("cpu, builds", [
    ("max", ["neon_bf16", "generic"]),       # Armv8.6+ with BF16 (BFDOT): both builds run, neon_bf16 is chosen
    ("cortex-a72", ["generic"]),             # Armv8.0 NEON only: neon_bf16 must be skipped, not crash
])
def test_aarch64_kernels_match_reference(harness, cpu, builds):
    r = subprocess.run([QEMU, "-cpu", cpu, str(harness["check_kernels"]), "--expect-selected", builds[0]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for build in builds:
        assert f"PASS {build} " in r.stdout, r.stdout
    if "neon_bf16" not in builds:
        assert "SKIP neon_bf16: this CPU lacks bf16" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("cpu, builds", [("max", ["neon_bf16", "generic"]), ("cortex-a72", ["generic"])])
def test_aarch64_rans_kernels_match_reference(harness, cpu, builds):
    """The entropy-coded layout's kernels: decode exact, gemv / gemm_tile against float64,
    corrupted streams reported, never a read past the words (a guard page)."""
    r = subprocess.run([QEMU, "-cpu", cpu, str(harness["check_rans_kernels"])], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for build in builds:
        assert f"PASS {build} " in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("OK")
