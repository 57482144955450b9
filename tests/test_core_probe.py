"""benchmarks/core_probe.py: the probe that labels benchmark rounds by whether the process had its
CPU core to itself (bench_rans.py, bench_rans_fill.py --against). Its labels, and that it loads
and measures where it can (x86-64 with AVX2 and a C compiler) and says None elsewhere."""
import platform
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import core_probe  # noqa: E402


def test_classify_against_the_best_probe_of_the_run():
    assert core_probe.classify([3.5, 3.0, 2.9, 2.4, 1.8]) == ["own", "own", "", "shared", "shared"]
    assert core_probe.classify([]) == []
    # a run that never had its core to itself: its best rounds are not taken for own ones
    assert core_probe.classify([2.3, 1.9]) == ["", "shared"]


def test_own_core_keeps_the_figures_of_own_rounds():
    assert core_probe.own_core([1.1, 1.2, 1.3, 1.4, 1.5], [3.5, 3.0, 2.9, 2.4, 1.8]) == [1.1, 1.2]
    # no probe (benchmarks pass 0.0 per round): no round is a core of our own
    assert core_probe.own_core([1.1, 1.2], [0.0, 0.0]) == []


def test_probe_loads_and_measures_adds_per_cycle():
    probe = core_probe.load()
    if platform.machine() not in ("x86_64", "AMD64") or not core_probe._has_avx2():
        assert probe is None
        return
    if probe is None:
        pytest.skip("no C compiler")
    values = [probe() for _ in range(3)]
    # 8 independent vector adds against 1 dependent chain: between 1 (no overlap at all) and the
    # 4 vector ALUs of the widest x86 cores, with room for timer noise
    assert all(0.8 < v < 6 for v in values), values
