"""The 2:4 sparse Metal kernels (GEMV, fragment-decoding GEMM with K split,
dequantize) on the emulator through the real dispatch plan, against the CPU op;
the planner's choices and errors. Two random emulator schedules per case,
race detection and the strict compile check on (the emulator's defaults)."""

import itertools

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.layouts import sparse24 as sp
from torch_marlin.testing.metal import metal_plan, run_metal_with_stats

from metal_helpers import has_zeros, DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, SEEDS, rel_err

N_TAIL = 83  # not a multiple of 4, 32 or 64
# K per group size: multiples of 32 and of the group, not always of the 64-deep GEMM tile.
K_FOR_GROUP = {16: 224, 32: 96, 64: 192, 128: 384, 256: 512, -1: 160}


def make_sparse(fmt, k, n, group_size, gen):
    groups = 1 if group_size == -1 else k // group_size
    kept = torch.randint(0, 16, (k // 2, n), generator=gen)
    patterns = torch.tensor(sp.PATTERNS)[torch.randint(0, 6, (k // 4, n), generator=gen)]
    values, metadata = sp.pack_kept(kept, patterns.permute(0, 2, 1).reshape(k // 2, n))
    scales = (torch.rand(groups, n, generator=gen) * 0.5 + 0.01).half()
    zeros = (torch.rand(groups, n, generator=gen) * 15).half() if has_zeros(fmt) else None
    return values, metadata, scales, zeros


def _family(m):
    return "marlin_sparse24_gemv_" if m <= 8 else "marlin_sparse24_gemm_"


def _check(fmt, dtype, m, n, k, group_size, seed_base, bias=True, x_shape=None, splits=None):
    gen = torch.Generator().manual_seed(seed_base)
    values, metadata, scales, zeros = make_sparse(fmt, k, n, group_size, gen)
    x = torch.randn(*(x_shape or (m,)), k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = (x, values, metadata, scales, zeros, b, fmt, group_size)
    ref = torch.ops.marlin.sparse24_gemm(*args)
    for seed in SEEDS:
        out, plan, stats = run_metal_with_stats("sparse24_gemm", *args, seed=seed)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert plan["launches"][0]["kernel"].startswith(_family(plan["M"]))
        if splits is not None:
            assert (plan["splits"] > 1) == splits, plan
        for launch, st in zip(plan["launches"], stats):
            assert st.threadgroup_memory == launch["threadgroup_memory"] <= 32768
        err = rel_err(out, ref)
        assert err <= GEMM_TOL[dtype], (fmt, dtype, m, n, k, group_size, seed, err, plan["launches"][0]["kernel"])
    return plan


@pytest.mark.parametrize("m", (1, 3, 8, 16, 33, 64, 130))  # gemv m1/m4/m8, gemm tm32/tm64 (and M > 64)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_gemm_shapes(fmt, dtype, m):
    # Two group sizes per case, rotating with M: every group size for every format and dtype.
    i = (1, 3, 8, 16, 33, 64, 130).index(m)
    for j, group_size in enumerate(GROUP_SIZES[(2 * i) % 6:(2 * i) % 6 + 2]):
        _check(fmt, dtype, m, N_TAIL, K_FOR_GROUP[group_size], group_size, seed_base=100 * m + j, bias=j == 0)


@pytest.mark.parametrize("m", (16, 130))
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_gemm_k_parallel(fmt, m):
    # N = 40: few output tiles, so K = 2048 is split in 4 slices, summed by marlin_reduce.
    for i, group_size in enumerate((16, 128, -1)):
        plan = _check(fmt, torch.float16, m, 40, 2048, group_size, seed_base=7 * m + i, bias=i != 1, splits=True)
        assert plan["splits"] == 4 and plan["launches"][-1]["kernel"] == "marlin_reduce_f16"


def test_sparse_gemm_batched_x_wide_n_and_empty():
    _check("fp4", torch.float16, 6, 200, 128, 32, seed_base=5, x_shape=(2, 3))
    _check("int4", torch.bfloat16, 24, 200, 128, 32, seed_base=6, x_shape=(4, 6))
    _check("uint4", torch.float32, 1, 1024, 2048, 128, seed_base=8)  # many threadgroups, long K
    gen = torch.Generator().manual_seed(0)
    values, metadata, scales, _ = make_sparse("fp4", 64, 16, 32, gen)
    out, plan, stats = run_metal_with_stats("sparse24_gemm", torch.randn(0, 64).half(), values, metadata, scales,
                                            None, None, "fp4", 32)
    assert out.shape == (0, 16) and plan["launches"] == [] and stats == []


@pytest.mark.parametrize("m", (1, 8, 16, 80))  # gemv m1, gemv m8, gemm tm32, gemm tm64
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_pattern_and_code_through_gemm(fmt, m):
    """One-hot rows of x pick single rows of B: y[i] = B[i % K] exactly, with every
    pattern at every block position and every code in every slot."""
    k, n = 64, 48
    patterns = torch.tensor(sp.PATTERNS)[(torch.arange(k // 4).view(-1, 1) + torch.arange(n)) % 6]
    positions = patterns.permute(0, 2, 1).reshape(k // 2, n)
    kept = (torch.arange(k // 2).view(-1, 1) + torch.arange(n) // 6) % 16
    values, metadata = sp.pack_kept(kept, positions)
    gen = torch.Generator().manual_seed(m)
    scales = (torch.rand(k // 16, n, generator=gen) + 0.5).half()
    zeros = (torch.rand(k // 16, n, generator=gen) * 15).half() if has_zeros(fmt) else None
    x = torch.nn.functional.one_hot(torch.arange(m) % k, k).float()
    dense = torch.ops.marlin.sparse24_dequantize(values, metadata, scales, zeros, fmt, 16, torch.float32)
    for seed in SEEDS:
        out, plan, _ = run_metal_with_stats("sparse24_gemm", x, values, metadata, scales, zeros, None, fmt, 16,
                                            seed=seed)
        assert plan["launches"][0]["kernel"].startswith(_family(m))
        assert torch.equal(out, dense[torch.arange(m) % k])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_dequantize(fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    for group_size in GROUP_SIZES:
        values, metadata, scales, zeros = make_sparse(fmt, K_FOR_GROUP[group_size], N_TAIL, group_size, gen)
        args = (values, metadata, scales, zeros, fmt, group_size, dtype)
        out, plan, _ = run_metal_with_stats("sparse24_dequantize", *args, seed=group_size % 2)
        ref = torch.ops.marlin.sparse24_dequantize(*args)
        assert plan["launches"][0]["kernel"] == f"marlin_sparse24_dequant_{fmt}_{plan['dtype']}"
        if fmt == "uint4":  # (q - zero) * scale in fp32 on both sides: one ulp at most
            assert rel_err(out, ref) <= 2.0 ** -10
        else:
            assert torch.equal(out, ref) and torch.equal(torch.signbit(out), torch.signbit(ref))


@pytest.mark.parametrize("m", (1, 3, 16))
def test_invalid_metadata_gives_a_defined_result_only_where_it_reaches(m):
    """The kernels do not validate metadata in their hot loops (MarlinLinear checks it at load, the CPU
    op raises): an invalid pattern gives the same finite numbers under every schedule in its own column
    only (positions are 2-bit: nothing is read outside the block), every other output is unaffected."""
    gen = torch.Generator().manual_seed(11)
    values, metadata, scales, _ = make_sparse("fp4", 128, 40, 32, gen)
    bad = metadata.clone()
    bad[1, 7] = (int(bad[1, 7]) & ~0xF0) | (0x5 << 4)  # word [1, 7] nibble 1: positions (1, 1)
    bad[0, 9] = (int(bad[0, 9]) & ~0xF) | 0xB  # word [0, 9] nibble 0: positions (3, 2)
    x = torch.randn(m, 128, generator=gen).half()
    good = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, None, None, "fp4", 32)
    outs = [run_metal_with_stats("sparse24_gemm", x, values, bad, scales, None, None, "fp4", 32, seed=seed)[0]
            for seed in SEEDS]
    assert all(torch.equal(o, outs[0]) for o in outs) and torch.isfinite(outs[0]).all()
    others = (torch.arange(40) != 7) & (torch.arange(40) != 9)
    assert rel_err(outs[0][:, others], good[:, others]) <= GEMM_TOL[torch.float16]
    deq = run_metal_with_stats("sparse24_dequantize", values, bad, scales, None, "fp4", 32, torch.float32)[0]
    ref = torch.ops.marlin.sparse24_dequantize(values, metadata, scales, None, "fp4", 32, torch.float32)
    assert torch.isfinite(deq).all() and torch.equal(deq[:, others], ref[:, others])
    with pytest.raises(ValueError, match=r"metadata has an invalid 2:4 pattern: word \[0, 9\] nibble 0"):
        torch.ops.marlin.sparse24_gemm(x, values, bad, scales, None, None, "fp4", 32)
    with pytest.raises(ValueError, match=r"invalid 2:4 pattern"):
        sp.check_metadata(bad)


@pytest.mark.parametrize("fmt, m, n, k, gs, splits", [("fp4", 1, 40, 2048, 16, 2), ("uint4", 5, 64, 4096, 128, 4),
                                                       ("int4", 3, 64, 3072, -1, 3)])
def test_gemv_k_split_for_narrow_n(fmt, m, n, k, gs, splits):
    """Few column blocks: the 2:4 GEMV splits K in whole 128-K blocks (marlin_reduce sums the slices),
    with vector loads where N % 4 == 0 and the tensors are aligned."""
    plan = _check(fmt, torch.float16, m, n, k, gs, seed_base=7 + m, splits=True)
    gemv = plan["launches"][0]
    assert plan["splits"] == splits and gemv["grid"] == [-(-n // 32), splits, 1]
    assert gemv["constants"][str(2)] == (n % 4 == 0)  # marlin_aligned
    assert plan["launches"][1]["kernel"].startswith("marlin_reduce_")


def test_gemv_runs_on_fewer_simdgroups():
    """A pipeline allowing fewer threads (register pressure): the GEMV splits K over what it gets."""
    gen = torch.Generator().manual_seed(2)
    values, metadata, scales, zeros = make_sparse("uint4", 512, 70, 64, gen)
    x = torch.randn(5, 512, generator=gen).half()
    ref = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, "uint4", 64)
    out, plan, stats = run_metal_with_stats("sparse24_gemm", x, values, metadata, scales, zeros, None, "uint4", 64,
                                            max_threads_per_threadgroup=64)
    assert plan["launches"][0]["min_threads_x"] == 32 and stats[0].threads_per_threadgroup == 64
    assert rel_err(out, ref) <= GEMM_TOL[torch.float16]


# --- the planner ----------------------------------------------------------------------

def _meta(m, n, k, fmt, gs, dtype=torch.float16):
    groups = 1 if gs == -1 else k // gs
    e = lambda *s, dt: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    zeros = e(groups, n, dt=torch.float16) if has_zeros(fmt) else None
    return (e(m, k, dt=dtype), e(k // 16, n, dt=torch.int32), e(k // 32, n, dt=torch.int32),
            e(groups, n, dt=torch.float16), zeros, None, fmt, gs)


@pytest.mark.parametrize("m, kernel, tm", [(1, "gemv", 1), (4, "gemv", 4), (5, "gemv", 8), (8, "gemv", 8),
                                           (9, "gemm", 32), (32, "gemm", 32), (33, "gemm", 64), (4096, "gemm", 64)])
def test_plan_kernel_choice(m, kernel, tm):
    for fmt, dtype in itertools.product(FORMATS, DTYPES):
        plan = metal_plan("sparse24_gemm", *_meta(m, 4096, 4096, fmt, 128, dtype))
        launch = plan["launches"][0]
        suffix = f"_m{tm}" if kernel == "gemv" else f"_tm{tm}"
        assert launch["kernel"] == f"marlin_sparse24_{kernel}_{fmt}_{plan['dtype']}{suffix}"
        assert launch["source"] == f"sparse24_{kernel}"
        assert (plan["splits"] > 1) == (kernel == "gemm" and m <= 64)  # 64 tiles of N = 4096: K split
        assert launch["threadgroup_memory"] <= 32768 and launch["threadgroup_memory"] % 16 == 0


def test_plan_errors_are_the_cpu_ops():
    args = list(_meta(4, 64, 96, "fp4", 32))
    args[2] = torch.empty(2, 64, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"metadata must have shape \[K/32, N\] = \[3, 64\]"):
        metal_plan("sparse24_gemm", *args)
    with pytest.raises(RuntimeError, match=r"x.size\(-1\) must equal K = 16 \* values.size\(0\) = 96"):
        metal_plan("sparse24_gemm", torch.empty(2, 64, dtype=torch.float16, device="meta"), *_meta(1, 64, 96, "fp4", 32)[1:])
    with pytest.raises(RuntimeError, match="dtype must be float16, bfloat16 or float32"):
        metal_plan("sparse24_dequantize", *_meta(1, 64, 96, "fp4", 32)[1:5], "fp4", 32, torch.int32)
