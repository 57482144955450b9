"""Whether this process has its CPU core to itself right now.

On a shared VM another tenant's thread can run on the other hardware thread of
our core for seconds at a time: the clock stays, but the vector units are shared,
and code bound by their throughput (the dense micro-kernels, the rans tile fill)
slows by up to 2x while code bound by latency does not. Timings taken in such
phases give other ratios than on a core of one's own (docs/CPU.md, "Whose core").

The probe (core_probe.c) times 8 independent vpaddd chains against 1 dependent
one of the same count: the vector adds per cycle this core gives us now, about
3.5 on Zen 3 on a core of its own and about 2 when shared; the clock cancels out.
Benchmarks call it around each round and label the round by it (classify).
x86-64 with AVX2 and a C compiler only: load() returns None elsewhere.
"""

import ctypes
import os
import platform
import shutil
import subprocess
import tempfile


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


def load():
    """The probe as a function of no arguments, or None (not x86-64 with AVX2, or no C compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or not _has_avx2() or not cc:
        return None
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core_probe.c")
    lib = os.path.join(tempfile.mkdtemp(prefix="core_probe_"), "core_probe.so")
    if subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", lib], capture_output=True).returncode:
        return None
    fn = ctypes.CDLL(lib).core_probe
    fn.restype = ctypes.c_double
    return fn


# The probe on a core of one's own: about 3.5 on Zen 3 to 5 (4 vector ALUs), about 2.9 on
# Intel cores with 3; shared, about half. A run whose best probe stays below this never had its
# core to itself (or runs on a narrower core): then no round is labelled own.
OWN_CORE_FLOOR = 2.7


def classify(values):
    """'own' / 'shared' / '' per probe value, against the highest in the run: at least 0.85 of it
    (and at least OWN_CORE_FLOOR) is a core of our own, at most 0.7 of it or below 2 a shared one,
    the rest unlabelled."""
    top = max(values) if values else 0.0
    return ["own" if v >= max(0.85 * top, OWN_CORE_FLOOR) else "shared" if v <= 0.7 * top or v < 2 else ""
            for v in values]


def own_core(figures, probes):
    """The figures (one per round or pair) whose probe classify labels a core of our own."""
    return [f for f, c in zip(figures, classify(probes)) if c == "own"]
