"""The dispatch plan (csrc/core/metal_plan.cpp) shared by the MPS bridge and run_metal."""

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.testing.metal import library, metal_plan, run_metal

from metal_helpers import DTYPES, FORMATS, make_weight


def _meta_weight(fmt, k, n, group_size):
    groups = 1 if group_size == -1 else k // group_size
    packed = torch.empty(k // 8, n, dtype=torch.int32, device="meta")
    scales = torch.empty(groups, n, dtype=torch.float16, device="meta")
    zeros = torch.empty(groups, n, dtype=torch.float16, device="meta") if fmt == "uint4" else None
    return packed, scales, zeros


def _plan(m, n, k, fmt="fp4", dtype=torch.float16, group_size=128, bias=False):
    packed, scales, zeros = _meta_weight(fmt, k, n, group_size)
    x = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, dtype=dtype, device="meta") if bias else None
    return metal_plan("gemm", x, packed, scales, zeros, b, fmt, group_size)


@pytest.mark.parametrize("m,mr", [(1, 1), (2, 4), (4, 4), (5, 8), (8, 8)])
def test_gemv_for_decode(m, mr):
    p = _plan(m, 4096, 4096)
    (l,) = p["launches"]
    assert l["kernel"] == f"marlin_gemv_fp4_f16_m{mr}"
    assert l["grid"] == [4096 // 32, 1, 1] and l["threadgroup"] == [256, 1, 1]
    assert l["threadgroup_memory"] == 8 * mr * 32 * 4
    assert l["constants"] == {"0": False, "1": False}


@pytest.mark.parametrize("m,tm", [(9, 32), (32, 32), (33, 64), (64, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_fused_gemm_tiles(m, tm, dtype):
    p = _plan(m, 11008, 4096, dtype=dtype, bias=True)
    (l,) = p["launches"]
    assert l["kernel"].startswith("marlin_gemm_fused_fp4_") and l["kernel"].endswith(f"_tm{tm}")
    assert l["threadgroup"] == [128, 1, 1]
    assert l["grid"] == [-(-11008 // 64), -(-m // tm), 1]
    assert l["threadgroup_memory"] == 2 * tm * 32 * dtype.itemsize
    assert l["constants"] == {"0": True, "1": False}


@pytest.mark.parametrize("m", [65, 130, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_tiled_gemm_for_large_m(m, dtype):
    p = _plan(m, 4096, 4096, dtype=dtype)
    (l,) = p["launches"]
    assert l["kernel"] == f"marlin_gemm_tiled_fp4_{p['dtype']}"
    assert l["grid"] == [64, -(-m // 64), 1] and l["threadgroup"] == [128, 1, 1]
    assert l["threadgroup_memory"] == 2 * (64 * 32 * dtype.itemsize + 32 * 64 * 4) <= 32768


def test_k_split_for_few_tiles_and_large_k():
    p = _plan(16, 64, 8192)  # one output tile, K = 8192
    assert p["splits"] == 16 and p["partial_floats"] == 16 * 16 * 64
    fused, reduce = p["launches"]
    assert fused["grid"] == [1, 1, 16] and fused["constants"] == {"0": False, "1": True}
    assert reduce["kernel"] == "marlin_reduce_f16"
    split_rows = dict((i, v) for i, _, v in fused["bindings"])[11]
    assert split_rows % 4 == 0 and split_rows * 16 >= 8192 // 8 > split_rows * 15
    # enough tiles, or too little K: no split
    assert _plan(256, 4096, 4096)["splits"] == 1
    pt = _plan(130, 64, 8192)  # tiled GEMM splits K the same way
    assert pt["launches"][0]["kernel"].startswith("marlin_gemm_tiled_") and pt["splits"] == 16
    assert _plan(16, 64, 512)["splits"] == 1
    # bias goes to the reduction when K is split, to the GEMM otherwise
    pb = _plan(16, 64, 8192, bias=True)
    assert pb["launches"][0]["constants"]["0"] is False and pb["launches"][1]["constants"]["0"] is True
    assert _plan(16, 4096, 256, bias=True)["launches"][0]["constants"]["0"] is True


def test_dequantize_plan():
    packed, scales, zeros = _meta_weight("uint4", 4096, 100, 64)
    p = metal_plan("dequantize", packed, scales, zeros, "uint4", 64, dtype=torch.bfloat16)
    (l,) = p["launches"]
    assert l["kernel"] == "marlin_dequant_uint4_bf16"
    assert l["grid"] == [4, 4096 // 8 // 4, 1] and l["threadgroup"] == [32, 4, 1]


def test_every_variant_fits_threadgroup_memory_and_exists():
    kernels = {src: set(library(src).kernels()) for src in ("dequant", "gemv", "gemm_fused", "gemm_tiled")}
    seen = set()
    for fmt in FORMATS:
        for dtype in DTYPES:
            for m in (1, 2, 3, 4, 5, 8, 9, 16, 32, 33, 64, 65, 130, 1000):
                for n, k in ((64, 8192), (4096, 4096), (83, 200)):
                    for l in _plan(m, n, k, fmt, dtype, group_size=-1, bias=True)["launches"]:
                        assert l["threadgroup_memory"] <= 32768 and l["threadgroup_memory"] % 16 == 0
                        assert l["threadgroup"][0] * l["threadgroup"][1] * l["threadgroup"][2] <= 1024
                        assert l["kernel"] in kernels[l["source"]], l["kernel"]
                        seen.add(l["kernel"])
            packed, scales, zeros = _meta_weight(fmt, 256, 64, 32)
            l = metal_plan("dequantize", packed, scales, zeros, fmt, 32, dtype=dtype)["launches"][0]
            assert l["kernel"] in kernels["dequant"]
    # every GEMV / fused / reduce kernel of the libraries is reachable from the planner
    reachable = kernels["gemv"] | kernels["gemm_fused"] | kernels["gemm_tiled"]
    assert reachable <= seen, sorted(reachable - seen)


def _cpu_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e).split("\n")[0]
    return None


@pytest.mark.parametrize("case", ["group_size", "x_k", "zeros_fp4", "bias_dtype", "x_dtype", "no_zeros"])
def test_same_errors_as_cpu(case):
    packed, scales, zeros = make_weight("uint4", 64, 16, 32)
    x = torch.randn(2, 64).half()
    args = dict(x=x, packed=packed, scales=scales, zeros=zeros, bias=None, weight_format="uint4",
                group_size=32)
    if case == "group_size":
        args["group_size"] = 48
    elif case == "x_k":
        args["x"] = torch.randn(2, 63).half()
    elif case == "zeros_fp4":
        args["weight_format"] = "fp4"
    elif case == "bias_dtype":
        args["bias"] = torch.randn(16)
    elif case == "x_dtype":
        args["x"] = torch.randn(2, 64).double()
    elif case == "no_zeros":
        args["zeros"] = None
    cpu = _cpu_error(lambda: torch.ops.marlin.gemm(**args))
    metal = _cpu_error(lambda: run_metal("gemm", **args))
    assert cpu is not None and metal is not None
    assert issubclass(metal[0], cpu[0]) or issubclass(cpu[0], metal[0]), (cpu, metal)
    assert metal[1] == cpu[1]


def test_run_metal_signature_errors():
    packed, scales, _ = make_weight("fp4", 64, 16, 32)
    with pytest.raises(ValueError, match="op_name"):
        run_metal("nope", packed)
    with pytest.raises(TypeError, match="unexpected keyword"):
        run_metal("dequantize", packed, scales, None, "fp4", 32, bogus=1)


def test_huge_m_is_planned_not_rejected():
    # M * K > 2^32 elements: kernels use 64-bit offsets, no shape error the CPU op would not give.
    p = _plan(1 << 20, 4096, 8192)
    (l,) = p["launches"]
    assert l["kernel"].startswith("marlin_gemm_tiled_") and l["grid"] == [64, (1 << 20) // 64, 1]
