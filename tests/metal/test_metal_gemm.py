"""GEMV / fused GEMM / tiled GEMM / K-split kernels on the emulator against the CPU op.

Every case runs the exact launches of the dispatch plan (run_metal) under two
random emulator schedules (seeds 0 and 1). Tolerance: max |metal - cpu| /
max |cpu| <= GEMM_TOL[dtype] (metal_helpers.py).
"""

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.formats import pack_codes
from torch_marlin.testing import run_metal
from torch_marlin.testing.metal import run_metal_with_stats

from metal_helpers import (DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, K_FOR_GROUP, SEEDS, make_weight, record_error,
                           rel_err)

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
        first = plan["launches"][0]
        assert first["kernel"].startswith(_expected_family(plan["M"]))
        # the kernels' specializations: group size, vector loads, and the GEMV's row count (its kernel's
        # template parameter: the smallest of 1, 4, 8 that holds M)
        assert first["constants"]["3"] == (0 if group_size == -1 else group_size // 8)
        assert first["constants"]["2"] == (n % 4 == 0)
        if plan["M"] <= 8:
            assert first["kernel"].endswith(f"_m{min(r for r in (1, 4, 8) if r >= plan['M'])}")
        if splits is not None:
            assert (plan["splits"] > 1) == splits, plan
        for launch, st in zip(plan["launches"], stats):
            assert st.threadgroup_memory == launch["threadgroup_memory"] <= 32768
        err = rel_err(out, ref)
        record_error(first["kernel"], dtype, err)
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
    # Few output tiles (N = 40), large K: every kernel splits K (the GEMMs in
    # 4 slices of whole 16-deep stages, the GEMV in 2 slices of whole 16-row
    # blocks). K = 2056 (group_size -1) is 257 packed rows: the last slice ends
    # in a partial stage / block. N = 40 takes the vector loads.
    for i, group_size in enumerate(GROUP_SIZES):
        k = 2056 if group_size == -1 else 2048
        plan = _check(fmt, dtype, m, 40, k, group_size, seed_base=7 * m + i, bias=(i % 2 == 1), splits=True)
        assert plan["splits"] == (2 if m <= 8 else 4)
        assert plan["launches"][-1]["kernel"] == f"marlin_reduce_{plan['dtype']}"


@pytest.mark.parametrize("m", range(2, 9))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_every_row_count(fmt, m):
    # The GEMV is specialized for the exact M (no M = 2 running 4 rows): every
    # M of the GEMV, every group size, N with a tail (scalar loads) and without.
    dtype = DTYPES[(m + FORMATS.index(fmt)) % len(DTYPES)]
    for i, group_size in enumerate(GROUP_SIZES):
        for n in (N_TAIL, 64):
            _check(fmt, dtype, m, n, K_FOR_GROUP[group_size], group_size, seed_base=31 * m + i + n,
                   bias=(i % 2 == 0))


def test_gemv_with_fewer_simdgroups_k_split_and_tails():
    # The GEMV on a pipeline allowing fewer threads (the bridge's rule,
    # max_threads_per_threadgroup; test_metal_bridge_rules.py covers the rule
    # itself) also with a K split, one group over K, and scalar loads (N = 83).
    for threads, (fmt, dtype, m, n, k, gs) in zip((32, 64, 96, 160), (
            ("fp4", torch.float16, 1, 83, 384, 32), ("uint4", torch.float32, 5, 64, 2048, -1),
            ("int4", torch.bfloat16, 8, 40, 2048, 16), ("uint4", torch.float16, 2, 83, 2056, -1))):
        gen = torch.Generator().manual_seed(threads)
        packed, scales, zeros = make_weight(fmt, k, n, gs, gen=gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        ref = torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, gs)
        out, plan, stats = run_metal_with_stats("gemm", x, packed, scales, zeros, None, fmt, gs,
                                                max_threads_per_threadgroup=threads)
        assert stats[0].threads_per_threadgroup == threads and (plan["splits"] > 1) == (k >= 2048)
        assert rel_err(out, ref) <= GEMM_TOL[dtype]


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


@pytest.mark.parametrize("group_size", (16, 128, -1))
@pytest.mark.parametrize("m", (1, 4, 16, 100))  # gemv, gemv, fused, tiled
def test_uint4_zero_point_error_is_bounded(m, group_size):
    # uint4 applies the zero point once per group: scale * (sum q x - zero * sum x)
    # (the GEMV) instead of sum (q - zero) * scale * x. Worst case for that: x >= 0
    # and zeros at the codes' mean, so the two sums nearly cancel. Against the
    # exact float64 result the error stays within the classic fp32 summation bound
    # (K + 64) * 2^-24 * scale * sum (|q| + |zero|) |x|, plus half an ulp of the
    # output dtype, and is never worse than the CPU op's own (2x margin + 1 ulp).
    gen = torch.Generator().manual_seed(m * 7 + group_size)
    k, n = 4096, 64
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 16, (k, n), generator=gen)
    packed = pack_codes(codes)
    scales = (torch.rand(groups, n, generator=gen) * 0.5 + 0.01).half()
    zeros = (7.5 + torch.rand(groups, n, generator=gen) * 0.25).half()

    def per_row(t):
        return t.double().repeat_interleave(k // groups, 0)

    w = (codes.double() - per_row(zeros)) * per_row(scales)
    terms = (codes.double() + per_row(zeros)) * per_row(scales)
    for dtype in DTYPES:
        x = torch.randn(m, k, generator=gen).abs().to(dtype)
        exact = x.double() @ w
        out = run_metal("gemm", x, packed, scales, zeros, None, "uint4", group_size).double()
        cpu = torch.ops.marlin.gemm(x, packed, scales, zeros, None, "uint4", group_size).double()
        half_ulp = torch.finfo(dtype).eps / 2 * exact.abs()
        bound = (k + 64) * 2.0 ** -24 * (x.double() @ terms) + half_ulp
        assert ((out - exact).abs() <= bound).all()
        ulp = torch.finfo(dtype).eps * exact.abs().max()
        assert (out - exact).abs().max() <= 2 * (cpu - exact).abs().max() + ulp
