"""The aarch64 (NEON) builds of the CPU kernels, run under qemu-aarch64.

This machine cannot run Arm code and the torch extension is not built for Arm
here, so tests/cpu_kernels/check_kernels.cpp (the kernel entry points against
a float64 reference, no torch) is cross-compiled with the same sources and
flags as setup.py's CPU kernels and run under user-mode qemu. Arm speed is not
measured anywhere.
"""

import atexit
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
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


_build = None  # the harnesses' build once started: a Future of {harness name: executable}
_running = []   # its compiler processes (killed if the session ends first)


def _compile_and_link(out: Path):
    """{harness name: executable}: every source cross-compiled, two at a time, then linked."""
    mains = [ROOT / "tests" / "cpu_kernels" / f"{name}.cpp" for name in HARNESSES]
    # The longest first: rans_kernels_neon_bf16.cpp (about 7 min of CPU on a Zen 3).
    pending = sorted(RANS_KERNELS, key=lambda src: "neon" not in src.stem) + KERNELS + mains
    objects, started = {}, {}
    try:
        while pending or _running:
            while pending and len(_running) < (os.cpu_count() or 2):
                src = pending.pop(0)
                objects[src] = out / (src.stem + ".o")
                # nice 19: beside the tests before this file, the compile takes only a core they leave idle.
                with open(out / (src.stem + ".log"), "w") as log:
                    _running.append(subprocess.Popen(
                        ["nice", "-n", "19", CXX, "-O3", "-std=c++20", "-I", str(ROOT / "csrc"), "-I",
                         str(ROOT / "metal"), "-c", str(src), "-o", str(objects[src])], stderr=log))
                started[_running[-1]] = (src, time.monotonic())
            time.sleep(0.2)
            for proc in [p for p in _running if p.poll() is not None]:
                _running.remove(proc)
                src, _ = started[proc]
                assert proc.returncode == 0, f"{src.name}:\n{(out / (src.stem + '.log')).read_text()[-4000:]}"
            for proc in _running:  # a hang guard (in the background a compile may wait long for a core)
                src, since = started[proc]
                assert time.monotonic() - since < 3600, f"{src.name}: no object after an hour"
    finally:
        for proc in _running:
            proc.kill()
    exes = {}
    for name, extra in HARNESSES.items():
        exes[name] = out / name
        parts = [objects[src] for src in KERNELS + extra + [ROOT / "tests" / "cpu_kernels" / f"{name}.cpp"]]
        r = subprocess.run([CXX, "-static", *map(str, parts), "-o", str(exes[name])], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
    return exes


def _stop(out: Path):  # at exit
    for proc in _running:
        proc.kill()
    shutil.rmtree(out, ignore_errors=True)


def start_background_build():
    """Starts the cross-compile in a thread of its own: tests/conftest.py calls this once the
    session has collected this file's tests, so that it runs beside the tests before this file
    (in the foreground it took 886 s of a 46-minute CI on a 2-core Zen 3)."""
    global _build
    if _build is not None or CXX is None or QEMU is None:
        return
    out = Path(tempfile.mkdtemp(prefix="torch-marlin-aarch64-"))
    atexit.register(_stop, out)
    _build = Future()

    def run():
        try:
            _build.set_result(_compile_and_link(out))
        except BaseException as e:  # the fixture raises it
            _build.set_exception(e)

    threading.Thread(target=run, daemon=True).start()


@pytest.fixture(scope="module")
def harness(terminal):
    start_background_build()  # (already started, unless this file runs on its own)
    with terminal.step("waiting for the aarch64 cross-compile of the CPU kernels (started with the session)"):
        return _build.result()


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
