"""Staging B through threadgroup memory (lanes 0-7 + simdgroup barriers) against
dequantizing straight into simdgroup_matrix fragments (thread_elements, what
metal/gemm_fused.metal does), measured on the emulator with a test-only
instrumented kernel (tests/metal/kernels/fused_b_variants.metal)."""

from pathlib import Path

import pytest
import torch

import torch_marlin.ops  # noqa: F401
import mslsim
from torch_marlin.testing.metal import metal_dir

from metal_helpers import make_weight, rel_err

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def lib():
    return mslsim.compile(str(HERE / "kernels" / "fused_b_variants.metal"), include_dirs=(str(metal_dir()),))


def _run(lib, name, m, n, k, seed):
    gen = torch.Generator().manual_seed(3)
    packed, scales, _ = make_weight("fp4", k, n, 32, gen=gen)
    x = torch.randn(m, k, generator=gen)
    y = torch.zeros(m, n)
    counters = torch.zeros(2, dtype=torch.int32)
    stats = lib.launch(name, grid=(-(-n // 64), -(-m // 32), 1), threadgroup=(128, 1, 1),
                       args={0: x, 1: packed, 2: scales, 3: y, 4: counters, 5: m, 6: n, 7: k, 8: 32},
                       schedule="random", seed=seed)
    ref = torch.ops.marlin.gemm(x, packed, scales, None, None, "fp4", 32)
    return y, ref, counters.tolist(), stats


def test_thread_elements_beats_staging(lib):
    m, n, k = 32, 64, 128  # one 32 x 64 tile, 16 packed rows
    results = {}
    for name in ("fused_b_thread_elements", "fused_b_staging"):
        for seed in (0, 1):
            y, ref, counters, stats = _run(lib, name, m, n, k, seed)
            assert rel_err(y, ref) <= 2e-5, name
        results[name] = (counters, stats)
    (te_loads, te_sbar), te = results["fused_b_thread_elements"]
    (st_loads, st_sbar), st = results["fused_b_staging"]
    words = (k // 8) * n  # distinct packed words of the tile
    # thread_elements: each word loaded by the 4 lanes of its fragment row,
    # once per threadgroup; staging: once per m fragment (4 at TM = 32) by one lane.
    assert te_loads == 4 * words and st_loads == 4 * words
    # ... but in load instructions per simdgroup: 1 per fragment vs 4 (one per m fragment)
    assert te_sbar == 0 and st_sbar == 2 * 4 * 2 * (k // 8) * 4  # 2 per (m, n) fragment per K block per simdgroup
    assert te.threadgroup_memory < st.threadgroup_memory
    assert te.barriers == st.barriers  # same threadgroup barriers (x tile)
