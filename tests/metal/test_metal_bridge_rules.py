"""What the MPS bridge decides from the Mac and its pipelines, in C++
(csrc/core/metal_plan.cpp) so it is tested here: which Macs are supported,
how a launch is sized when a pipeline allows fewer threads than planned, the
32-lane simdgroup check; and the GEMV run with fewer simdgroups on the
emulator through the same rule."""

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.testing import mslsim
from torch_marlin.testing.metal import launch_threadgroup, metal_dir, metal_plan, run_metal

from metal_helpers import GEMM_TOL, make_weight, rel_err

fit = torch.ops.marlin._metal_fit_threadgroup
problem = torch.ops.marlin._metal_support_problem


def test_supported_macs():
    assert problem(14, 0, True) == "" and problem(15, 4, True) == "" and problem(26, 0, True) == ""
    old = problem(13, 6, True)
    assert "macOS 14.0 or newer" in old and "macOS 13.6" in old and "bfloat" in old
    assert "Apple-silicon GPU" in problem(14, 5, False)


def _launches(m, n=96, k=256, fmt="fp4", op="gemm"):
    packed, scales, zeros = make_weight(fmt, k, n, 64)
    if op == "dequantize":
        return metal_plan("dequantize", packed, scales, zeros, fmt, 64)["launches"]
    x = torch.randn(m, k, dtype=torch.float16)
    return metal_plan("gemm", x, packed, scales, zeros, None, fmt, 64)["launches"]


def test_plans_say_which_kernels_may_shrink():
    (gemv,) = _launches(1)
    assert gemv["threadgroup"] == [256, 1, 1] and gemv["min_threads_x"] == 32
    (fused,) = _launches(16)
    tiled, reduce = _launches(130, n=64, k=8192)
    (dequant,) = _launches(0, op="dequantize")
    for launch in (fused, tiled, dequant):  # 128-thread GEMMs, dequantize
        assert launch["min_threads_x"] == 0, launch["kernel"]
    assert reduce["threadgroup"] == [256, 1, 1] and reduce["min_threads_x"] == 32  # loops over its outputs


def test_fit_threadgroup():
    assert fit("k", [256, 1, 1], 32, 1024) == [256, 1, 1]  # fits: as planned
    assert fit("k", [256, 1, 1], 32, 256) == [256, 1, 1]
    assert fit("k", [256, 1, 1], 32, 255) == [224, 1, 1]  # whole simdgroups
    assert fit("k", [256, 1, 1], 32, 100) == [96, 1, 1]
    assert fit("k", [256, 1, 1], 32, 32) == [32, 1, 1]
    with pytest.raises(RuntimeError, match=r"kernel k needs 32 threads per threadgroup, but this GPU's pipeline "
                                           r"allows only 31 \(maxTotalThreadsPerThreadgroup\)"):
        fit("k", [256, 1, 1], 32, 31)
    with pytest.raises(RuntimeError, match="kernel marlin_gemm_fused_fp4_f16_tm32 needs 128 threads per threadgroup, "
                                           "but this GPU's pipeline allows only 96"):
        fit("marlin_gemm_fused_fp4_f16_tm32", [128, 1, 1], 0, 96)
    with pytest.raises(RuntimeError, match="needs 128 threads"):
        fit("marlin_dequant_fp4_f16", [32, 4, 1], 0, 64)
    assert fit("k", [32, 4, 1], 0, 128) == [32, 4, 1]


def test_simd_width_must_be_32():
    assert fit("k", [128, 1, 1], 0, 1024, 32) == [128, 1, 1]
    with pytest.raises(RuntimeError, match="kernel k is written for 32-lane simdgroups, but this GPU runs 64 threads "
                                           "per SIMD group"):
        fit("k", [128, 1, 1], 0, 1024, 64)


def test_emulator_uses_the_bridge_rule():
    (gemv,) = _launches(3)
    assert launch_threadgroup(gemv) == [256, 1, 1]
    assert launch_threadgroup(gemv, 200) == [192, 1, 1]
    (fused,) = _launches(16)
    with pytest.raises(RuntimeError, match="needs 128 threads"):
        run_metal("gemm", torch.randn(16, 256, dtype=torch.float16), *make_weight("fp4", 256, 96, 64), None,
                  "fp4", 64, max_threads_per_threadgroup=64)


@pytest.mark.parametrize("m,max_threads,fmt", [(1, 32, "fp4"), (3, 96, "uint4"), (8, 64, "int4"), (8, 160, "fp4")])
def test_gemv_with_fewer_simdgroups_matches_cpu(m, max_threads, fmt):
    # Fewer simdgroups than planned split K among themselves, and the epilogue
    # (MR rows x 32 columns) loops over the threads it has.
    n, k, group = 72, 512, 64  # a partial last column block; 64 packed rows for 1-5 simdgroups
    packed, scales, zeros = make_weight(fmt, k, n, group, gen=torch.Generator().manual_seed(m))
    x = torch.randn(m, k, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.float16)
    want = torch.ops.marlin.gemm(x, packed, scales, zeros, bias, fmt, group)
    got = run_metal("gemm", x, packed, scales, zeros, bias, fmt, group, max_threads_per_threadgroup=max_threads,
                    seed=m)
    assert rel_err(got, want) <= GEMM_TOL[torch.float16]


def test_bfloat_kernels_only_from_metal_3_1():
    # Metal < 3.1 has no bfloat: the instantiations are guarded, so such a
    # compiler builds the other kernels instead of failing (the bridge itself
    # always compiles for 3.1, on the macOS floor it checks first).
    names = mslsim.compile(str(metal_dir() / "dequant.metal"), include_dirs=(str(metal_dir()),),
                           defines={"__METAL_VERSION__": 300}).kernels()
    assert names and not any("bf16" in n for n in names)
    assert {f"marlin_dequant_{f}_{d}" for f in ("fp4", "int4", "uint4") for d in ("f16", "f32")} <= set(names)
