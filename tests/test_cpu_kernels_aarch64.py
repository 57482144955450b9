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

SOURCES = sorted((ROOT / "csrc" / "cpu").glob("kernel*.cpp")) + [ROOT / "tests" / "cpu_kernels" / "check_kernels.cpp"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory, terminal):
    out = tmp_path_factory.mktemp("aarch64")

    def compile_one(src):
        obj = out / (src.stem + ".o")
        r = subprocess.run([CXX, "-O3", "-std=c++20", "-I", str(ROOT / "csrc"), "-I", str(ROOT / "metal"), "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{src.name}:\n{r.stderr[-4000:]}"
        return obj

    with terminal.step(f"cross-compiling {len(SOURCES)} files of the CPU kernels for aarch64"):
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objects = list(pool.map(compile_one, SOURCES))
        exe = out / "check_kernels"
        r = subprocess.run([CXX, "-static", *map(str, objects), "-o", str(exe)], capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@pytest.mark.parametrize("cpu, builds", [
    ("max", ["neon_bf16", "generic"]),       # Armv8.6+ with BF16 (BFDOT): both builds run, neon_bf16 is chosen
    ("cortex-a72", ["generic"]),             # Armv8.0 NEON only: neon_bf16 must be skipped, not crash
])
def test_aarch64_kernels_match_reference(harness, cpu, builds):
    r = subprocess.run([QEMU, "-cpu", cpu, str(harness), "--expect-selected", builds[0]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for build in builds:
        assert f"PASS {build} " in r.stdout, r.stdout
    if "neon_bf16" not in builds:
        assert "SKIP neon_bf16: this CPU lacks bf16" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("OK")
