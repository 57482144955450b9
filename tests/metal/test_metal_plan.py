"""The dispatch plan (csrc/core/metal_plan.cpp) shared by the MPS bridge and run_metal."""

import pytest
import torch

import torch_marlin
import torch_marlin.ops  # noqa: F401
from torch_marlin.testing.metal import library, metal_plan, run_metal

from metal_helpers import has_zeros, DTYPES, FORMATS, make_weight


def _meta_weight(fmt, k, n, group_size):
    groups = 1 if group_size == -1 else k // group_size
    packed = torch.empty(k // 8, n, dtype=torch.int32, device="meta")
    scales = torch.empty(groups, n, dtype=torch.float16, device="meta")
    zeros = torch.empty(groups, n, dtype=torch.float16, device="meta") if has_zeros(fmt) else None
    return packed, scales, zeros


def _plan(m, n, k, fmt="fp4", dtype=torch.float16, group_size=128, bias=False):
    packed, scales, zeros = _meta_weight(fmt, k, n, group_size)
    x = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, dtype=dtype, device="meta") if bias else None
    return metal_plan("gemm", x, packed, scales, zeros, b, fmt, group_size)


def _x_tile_bytes(tm, itemsize):
    return tm * (16 + 16 // itemsize) * itemsize  # [TM][kGemmTileK] padded by 16 bytes per row


@pytest.mark.parametrize("m", range(1, 9))
def test_gemv_for_decode(m):
    # The row count sizing the kernel's register arrays is a template parameter (instantiated for 1, 4
    # and 8 rows: the smallest >= M); rows past M are skipped (work bounded by M, the M buffer).
    p = _plan(m, 4096, 4096)
    (l,) = p["launches"]
    assert l["kernel"] == f"marlin_gemv_fp4_f16_m{1 if m == 1 else 4 if m <= 4 else 8}"
    assert l["grid"] == [4096 // 32, 1, 1] and l["threadgroup"] == [256, 1, 1]
    assert l["threadgroup_memory"] == 8 * m * 32 * 4
    assert l["constants"] == {"0": False, "1": False, "2": True, "3": 128 // 8}
    assert [7, "scalar", m] in l["bindings"]  # M


@pytest.mark.parametrize("group_size,rows", [(16, 2), (32, 4), (64, 8), (128, 16), (256, 32), (-1, 0)])
def test_group_size_is_a_function_constant(group_size, rows):
    # Packed rows per group (0: one group over K) for every kernel reading scales.
    for m in (1, 16, 100):
        assert _plan(m, 256, 512, group_size=group_size)["launches"][0]["constants"]["3"] == rows
    packed, scales, zeros = _meta_weight("fp4", 512, 256, group_size)
    l = metal_plan("dequantize", packed, scales, zeros, "fp4", group_size)["launches"][0]
    assert l["constants"] == {"3": rows}


@pytest.mark.parametrize("n,k,splits", [(1024, 4096, 4), (512, 4096, 4), (2048, 4096, 2), (4096, 4096, 1),
                                        (1024, 512, 1), (64, 16384, 16)])
def test_gemv_k_split_for_small_n(n, k, splits):
    # Fewer than 128 column tiles: K slices of whole 16-row blocks, at least
    # 8 blocks (one per simdgroup) each, summed by marlin_reduce.
    p = _plan(1, n, k, bias=True)
    assert p["splits"] == splits
    gemv = p["launches"][0]
    assert gemv["grid"] == [n // 32, splits, 1]
    split_rows = dict((i, v) for i, _, v in gemv["bindings"])[10]
    assert split_rows % 16 == 0 and split_rows * splits >= k // 8 > split_rows * (splits - 1)
    if splits > 1:
        assert split_rows >= 128
        assert gemv["constants"]["0"] is False and gemv["constants"]["1"] is True
        reduce = p["launches"][1]
        assert reduce["source"] == "reduce" and reduce["kernel"] == "marlin_reduce_f16"
        assert reduce["constants"] == {"0": True} and p["partial_floats"] == splits * n
    else:
        assert len(p["launches"]) == 1 and gemv["constants"]["0"] is True


@pytest.mark.parametrize("m,tm", [(9, 32), (32, 32), (33, 64), (64, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_fused_gemm_tiles(m, tm, dtype):
    p = _plan(m, 11008, 4096, dtype=dtype, bias=True)
    (l,) = p["launches"]
    assert l["kernel"].startswith("marlin_gemm_fused_fp4_") and l["kernel"].endswith(f"_tm{tm}")
    assert l["threadgroup"] == [128, 1, 1]
    assert l["grid"] == [-(-11008 // 64), -(-m // tm), 1]
    assert l["threadgroup_memory"] == 2 * _x_tile_bytes(tm, dtype.itemsize) <= 16384
    assert l["constants"] == {"0": True, "1": False, "2": True, "3": 16}


@pytest.mark.parametrize("m", [65, 130, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_tiled_gemm_for_large_m(m, dtype):
    p = _plan(m, 4096, 4096, dtype=dtype)
    (l,) = p["launches"]
    assert l["kernel"] == f"marlin_gemm_tiled_fp4_{p['dtype']}"
    assert l["grid"] == [64, -(-m // 64), 1] and l["threadgroup"] == [128, 1, 1]
    # x tile [64][16 + pad] of T, fp32 B tile [16][64 + 4]
    assert l["threadgroup_memory"] == _x_tile_bytes(64, dtype.itemsize) + 16 * 68 * 4 <= 16384


def test_k_split_for_few_tiles_and_large_k():
    p = _plan(16, 64, 8192)  # one output tile, K = 8192
    assert p["splits"] == 16 and p["partial_floats"] == 16 * 16 * 64
    fused, reduce = p["launches"]
    assert fused["grid"] == [1, 1, 16] and fused["constants"] == {"0": False, "1": True, "2": True, "3": 16}
    assert reduce["kernel"] == "marlin_reduce_f16" and reduce["source"] == "reduce"
    split_rows = dict((i, v) for i, _, v in fused["bindings"])[10]
    assert split_rows % 2 == 0 and split_rows * 16 >= 8192 // 8 > split_rows * 15
    # enough tiles, or too little K: no split
    assert _plan(256, 4096, 4096)["splits"] == 1
    pt = _plan(130, 64, 8192)  # tiled GEMM splits K the same way
    assert pt["launches"][0]["kernel"].startswith("marlin_gemm_tiled_") and pt["splits"] == 16
    assert _plan(16, 64, 512)["splits"] == 1
    # bias goes to the reduction when K is split, to the GEMM otherwise
    pb = _plan(16, 64, 8192, bias=True)
    assert pb["launches"][0]["constants"]["0"] is False and pb["launches"][1]["constants"]["0"] is True
    assert _plan(16, 4096, 256, bias=True)["launches"][0]["constants"]["0"] is True


def _offset(t, elements):
    """t's shape and strides, starting `elements` into a larger storage."""
    big = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    return big.as_strided(t.shape, t.stride(), elements)


@pytest.mark.parametrize("m", (1, 16, 100))
def test_vector_loads_only_when_aligned(m):
    # marlin_aligned: 16-byte vector loads of packed rows, scales, zeros and x
    # need N % 4 == 0 and every bound buffer offset 16-byte aligned.
    def aligned(n=256, x_off=0, p_off=0, s_off=0, z_off=0):
        packed, scales, zeros = _meta_weight("uint4", 512, n, 64)
        x = torch.empty(m, 512, dtype=torch.float16, device="meta")
        args = (_offset(x, x_off), _offset(packed, p_off), _offset(scales, s_off), _offset(zeros, z_off))
        return metal_plan("gemm", *args, None, "uint4", 64)["launches"][0]["constants"]["2"]

    assert aligned() is True
    assert aligned(x_off=8, p_off=4, s_off=8, z_off=8) is True  # 16 bytes in
    assert aligned(n=258) is False
    assert aligned(x_off=2) is False
    assert aligned(p_off=1) is False
    assert aligned(s_off=4) is False
    assert aligned(z_off=4) is False


def test_dequantize_plan():
    packed, scales, zeros = _meta_weight("uint4", 4096, 100, 64)
    p = metal_plan("dequantize", packed, scales, zeros, "uint4", 64, dtype=torch.bfloat16)
    (l,) = p["launches"]
    assert l["kernel"] == "marlin_dequant_uint4_bf16"
    assert l["grid"] == [4, 4096 // 8 // 4, 1] and l["threadgroup"] == [32, 4, 1]


def test_every_variant_fits_threadgroup_memory_and_exists():
    sources = ("dequant", "gemv", "gemm_fused", "gemm_tiled", "reduce")
    kernels = {src: set(library(src).kernels()) for src in sources}
    seen = set()
    for fmt in FORMATS:
        for dtype in DTYPES:
            for m in (1, 2, 3, 4, 5, 8, 9, 16, 32, 33, 64, 65, 130, 1000):
                for n, k in ((64, 8192), (4096, 4096), (83, 200)):
                    for l in _plan(m, n, k, fmt, dtype, group_size=-1, bias=True)["launches"]:
                        threads = l["threadgroup"][0] * l["threadgroup"][1] * l["threadgroup"][2]
                        assert l["threadgroup_memory"] % 16 == 0 and threads <= 1024
                        # at most 16 KiB per 128 threads: two threadgroups fit a core
                        assert l["threadgroup_memory"] * 128 <= 16384 * threads, l
                        assert l["kernel"] in kernels[l["source"]], l["kernel"]
                        seen.add(l["kernel"])
            packed, scales, zeros = _meta_weight(fmt, 256, 64, 32)
            l = metal_plan("dequantize", packed, scales, zeros, fmt, 32, dtype=dtype)["launches"][0]
            assert l["kernel"] in kernels["dequant"]
    # every GEMV / GEMM / reduce kernel of the libraries is reachable from the planner
    reachable = kernels["gemv"] | kernels["gemm_fused"] | kernels["gemm_tiled"] | kernels["reduce"]
    assert reachable <= seen, sorted(reachable - seen)


def test_function_constants_match_the_shared_list():
    # metal/marlin_common.h lists the function constants once; every library
    # declares exactly those, and every plan sets them by index with their type.
    shared = torch_marlin._C.SHARED_CONSTANTS["FUNCTION_CONSTANTS"]
    for src in ("dequant", "gemv", "gemm_fused", "gemm_tiled", "reduce", "moe"):
        assert library(src).function_constants() == {name: index for name, (index, _) in shared.items()}
    types = {index: typ for index, typ in shared.values()}
    for m in (1, 5, 16, 100):
        for n, k in ((64, 8192), (4096, 4096)):
            for l in _plan(m, n, k, bias=True)["launches"]:
                for index, value in l["constants"].items():
                    assert isinstance(value, bool) == (types[int(index)] == "bool"), (l["kernel"], index)


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


def test_bench_mps_plan_only_and_estimates_run_without_a_mac():
    # benchmarks/bench_mps.py --plan-only --estimates is the Linux half of the
    # benchmark (plan traffic, the estimated bounds of docs/KERNELS.md).
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mps.py"
    r = subprocess.run([sys.executable, str(script), "--plan-only", "--estimates", "--format", "uint4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "gemv_uint4_f16" in r.stdout and "M4 Max 40c" in r.stdout and "simdgroup_load" in r.stdout
