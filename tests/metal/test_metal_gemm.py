"""GEMV / fused GEMM / tiled GEMM / K-split kernels on the emulator against the CPU op.

Every case runs the exact launches of the dispatch plan (run_metal) under two
random emulator schedules (seeds 0 and 1). Tolerance: max |metal - cpu| /
max |cpu| <= GEMM_TOL[dtype] (metal_helpers.py).
"""

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.testing.metal import run_metal_with_stats

from metal_helpers import DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, K_FOR_GROUP, SEEDS, make_weight, rel_err

M_VALUES = (1, 3, 8, 16, 33, 64, 130)
N_TAIL = 83  # not a multiple of 4, 32 or 64


def _expected_family(m):
    return "marlin_gemv_" if m <= 8 else "marlin_gemm_fused_" if m <= 64 else "marlin_gemm_tiled_"


def _check(fmt, dtype, m, n, k, group_size, seed_base, bias=True, x_shape=None, splits=None):
    gen = torch.Generator().manual_seed(seed_base)
    packed, scales, zeros = make_weight(fmt, k, n, group_size, gen=gen)
    x = torch.randn(*(x_shape or (m,)), k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    ref = torch.ops.marlin.gemm(x, packed, scales, zeros, b, fmt, group_size)
    for seed in SEEDS:
        out, plan, stats = run_metal_with_stats("gemm", x, packed, scales, zeros, b, fmt, group_size,
                                                seed=seed)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert plan["launches"][0]["kernel"].startswith(_expected_family(plan["M"]))
        if splits is not None:
            assert (plan["splits"] > 1) == splits, plan
        for launch, st in zip(plan["launches"], stats):
            assert st.threadgroup_memory == launch["threadgroup_memory"] <= 32768
        err = rel_err(out, ref)
        assert err <= GEMM_TOL[dtype], (fmt, dtype, m, n, k, group_size, seed, err, plan["launches"][0]["kernel"])
    return plan


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_every_group_size(fmt, dtype, m):
    for i, group_size in enumerate(GROUP_SIZES):
        _check(fmt, dtype, m, N_TAIL, K_FOR_GROUP[group_size], group_size,
               seed_base=100 * m + i, bias=(i % 2 == 0))


@pytest.mark.parametrize("m", (1, 5, 16, 64, 130))  # gemv, gemv, fused, fused, tiled
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_k_parallel(fmt, dtype, m):
    # Few output tiles (N = 40), large K: the GEMMs split K into 4 slices
    # (M > 8). K = 2056 (group_size -1) is 257 packed rows: slices of 68 rows,
    # the last one ending in a partial 32-deep stage.
    for i, group_size in enumerate(GROUP_SIZES):
        k = 2056 if group_size == -1 else 2048
        plan = _check(fmt, dtype, m, 40, k, group_size, seed_base=7 * m + i, bias=(i % 2 == 1),
                      splits=m > 8)
        if m > 8:
            assert plan["splits"] == 4
            assert plan["launches"][-1]["kernel"] == f"marlin_reduce_{plan['dtype']}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_batched_x_and_wide_n(fmt):
    # x [2, 3, K] -> [2, 3, N]; N spanning several threadgroups, with a tail.
    _check(fmt, torch.float16, 6, 200, 128, 32, seed_base=5, x_shape=(2, 3))
    _check(fmt, torch.float16, 24, 200, 128, 32, seed_base=6, x_shape=(4, 6))


def test_gemm_empty_m():
    packed, scales, _ = make_weight("fp4", 64, 16, 32)
    x = torch.randn(0, 64).half()
    out, plan, stats = run_metal_with_stats("gemm", x, packed, scales, None, None, "fp4", 32)
    assert out.shape == (0, 16) and plan["launches"] == [] and stats == []


@pytest.mark.parametrize("m,n,k", [(1, 1024, 4096), (7, 520, 2048), (24, 1000, 1024), (100, 300, 512)])
def test_gemm_larger_shapes(m, n, k):
    # many threadgroups and long K loops (one format / dtype each, the rest is covered above)
    fmt, dtype = ("fp4", torch.float16) if m % 2 else ("uint4", torch.bfloat16)
    _check(fmt, dtype, m, n, k, 128, seed_base=m + n)


@pytest.mark.parametrize("m", (1, 8, 16, 64, 80))  # gemv m1, gemv m8, fused tm32, fused tm64, tiled
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_through_gemm(fmt, m):
    # One-hot rows of x pick single rows of B: y[i] = B[i % K] exactly (fp32),
    # with every code in every nibble position and column.
    k, n = 16, 48
    codes = (torch.arange(k).view(-1, 1) + torch.arange(n).view(1, -1)) % 16
    packed, scales, zeros = make_weight(fmt, k, n, 16, codes=codes)
    x = torch.nn.functional.one_hot(torch.arange(m) % k, k).float()
    ref = torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, 16)
    dense = torch.ops.marlin.dequantize(packed, scales, zeros, fmt, 16, torch.float32)
    for seed in SEEDS:
        out, plan, _ = run_metal_with_stats("gemm", x, packed, scales, zeros, None, fmt, 16, seed=seed)
        assert plan["launches"][0]["kernel"].startswith(_expected_family(m))
        assert torch.equal(out, ref) and torch.equal(out, dense[torch.arange(m) % k])
