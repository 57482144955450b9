"""The C++ quantizer (torch.ops.marlin._quantize_weight) against its specification,
the plain-torch quantizers of torch_marlin/quantize.py (quantize_weight_reference).

Criterion: equality, not closeness. The C++ code performs the reference's float
operations in the reference's order (the reference sums in a fixed pairwise order,
quantize._tree_sum, that the C++ code reproduces), so it must pick the same
candidate in every group: the packed codes and the fp16 scales are compared bit for
bit, the uint4 zero points by value. (A zero point of 0 may come out as +0 or -0:
a group whose minimum is a signed zero gives amin's pick between +0 and -0, which
depends on the reduction order; both are the same zero point.) Each ISA build of
the kernel (AVX-512, AVX2, portable) is compared, as TORCH_MARLIN_CPU_KERNELS picks it.
"""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import torch_marlin as tm
from torch_marlin import formats, quantize
from torch_marlin.layouts.dense import quantize_weight_reference

FORMATS = formats.WEIGHT_FORMATS
BUILDS = ["", "avx2", "generic"]  # "": the best this CPU runs


@contextlib.contextmanager
def kernel_build(name):
    old = os.environ.get("TORCH_MARLIN_CPU_KERNELS")
    os.environ["TORCH_MARLIN_CPU_KERNELS"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCH_MARLIN_CPU_KERNELS"]
        else:
            os.environ["TORCH_MARLIN_CPU_KERNELS"] = old


def assert_same(fast, ref, context):
    assert torch.equal(fast.packed, ref.packed), (context, int((fast.packed != ref.packed).sum()))
    assert torch.equal(fast.scales.view(torch.int16), ref.scales.view(torch.int16)), context
    assert (fast.zeros is None) == (ref.zeros is None), context
    if ref.zeros is not None:
        assert torch.equal(fast.zeros, ref.zeros), context
    assert (fast.in_features, fast.out_features, fast.group_size) == (ref.in_features, ref.out_features,
                                                                      ref.group_size)
    # relative_error: C++ sums the chosen candidates' errors in float64, the reference in float32.
    assert fast.relative_error == pytest.approx(ref.relative_error, rel=1e-5, abs=1e-7), context


def hard_weights(n, k, dtype):
    """Gaussian rows of varied scale plus the cases that exercise every branch."""
    w = torch.randn(n, k) * torch.logspace(-3, 2, n).unsqueeze(1)
    w[0] = 0.0                                  # an all-zero row
    w[1, : k // 2] = 0.0                        # zero groups next to non-zero ones
    w[2] = torch.rand(k)                        # one sign only: uint4 lo = 0
    w[3] = -torch.rand(k)                       # hi = 0
    w[4] = 3.0                                  # constant groups
    w[5] = torch.randn(k) * 1e-7                # scales clamp at 2^-14
    w[6] = torch.randn(k) * 1e6                 # scales clamp at 65504
    w[7] = torch.rand(k)
    w[7, ::5] = -1e-6                           # uint4 zero points in the fp16 subnormals
    w[8, ::7] *= 50                             # outliers: clipping pays off
    w[9, 1::2] = -0.0                           # signed zeros
    if dtype == torch.float16:
        w[6] /= 100                             # stays finite in fp16
    return w.to(dtype)


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("method", ["mse", "absmax"])
def test_equals_reference(weight_format, group_size, method):
    for dtype, (n, k) in [(torch.float32, (19, 256)), (torch.bfloat16, (12, 200)), (torch.float16, (17, 40))]:
        w = hard_weights(n, k, dtype)
        ref = quantize_weight_reference(w, weight_format, group_size, method)
        for build in BUILDS:
            with kernel_build(build):
                fast = tm.quantize_weight(w, weight_format, group_size, method)
            assert_same(fast, ref, (build, dtype, n, k))


@pytest.mark.parametrize("k", [8, 24, 1000, 4104])
def test_whole_row_groups_of_any_length(k):
    # group_size=-1: groups longer than 256 or not a power of two run the masked path.
    w = hard_weights(10, k, torch.float32)
    for weight_format in FORMATS:
        ref = quantize_weight_reference(w, weight_format, -1, "mse")
        for build in BUILDS:
            with kernel_build(build):
                assert_same(tm.quantize_weight(w, weight_format, -1, "mse"), ref, (build, weight_format))


@pytest.mark.parametrize("weight_format", FORMATS)
def test_rounding_ties_and_boundaries(weight_format):
    """Weights that land exactly on every rounding midpoint, and one float either
    side, for the scale the search starts from (absmax / qmax = 1 exactly)."""
    if weight_format == "fp4":  # midpoints between E2M1 magnitudes, and two magnitudes
        points, top = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5]), 6.0
    elif weight_format == "int4":  # scale 7/7: w/s = w, ties at the half-integers
        points, top = torch.arange(-7, 7) + 0.5, 7.0
    else:  # scale 15/15, zero point 7.5: w/s + z is a half-integer for integer w
        points, top = torch.arange(-7, 8).float(), 7.5
    values = torch.cat([points, points.nextafter(torch.tensor(100.0)), points.nextafter(torch.tensor(-100.0))])
    row = torch.zeros(64)
    row[: values.numel()] = values
    row[62], row[63] = -top, top
    w = torch.stack([row, -row, row.flip(0)])
    for method in ("absmax", "mse"):
        ref = quantize_weight_reference(w, weight_format, 64, method)
        for build in BUILDS:
            with kernel_build(build):
                assert_same(tm.quantize_weight(w, weight_format, 64, method), ref, (build, method))


def test_threads_and_layout_do_not_change_the_result():
    w = torch.randn(300, 512)
    q = tm.quantize_weight(w, "uint4", 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tm.quantize_weight(w, "uint4", 64)
    finally:
        torch.set_num_threads(threads)
    assert_same(one, q, "threads")
    assert one.relative_error == q.relative_error  # the float64 sum is in row order, not thread order
    # A transposed (non-contiguous) view, float64 (converted) and the same weight in bf16 as float32.
    assert_same(tm.quantize_weight(w.t().contiguous().t(), "uint4", 64), q, "strided")
    assert_same(tm.quantize_weight(w.double(), "uint4", 64), q, "float64")
    b = w.bfloat16()
    assert_same(tm.quantize_weight(b, "fp4", 64), tm.quantize_weight(b.float(), "fp4", 64), "bf16")


def test_registered_quantizers_still_run_in_python():
    calls = []

    def mine(groups, weight_format, group_size):
        calls.append(groups.shape)
        return quantize._QUANTIZERS["mse"](groups, weight_format, group_size)

    tm.register_quantizer("mine", mine)
    try:
        w = torch.randn(8, 64)
        assert_same(tm.quantize_weight(w, "int4", 32, "mine"), tm.quantize_weight(w, "int4", 32, "mse"), "mine")
        assert calls == [(8, 2, 32)]
    finally:
        del quantize._QUANTIZERS["mine"]


_CROSS = (shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64"))
_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not all(_CROSS), reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_portable_build_on_aarch64(tmp_path):
    """What ARM CPUs run (Apple Silicon, Graviton): the portable build compiled for
    aarch64, run under qemu, against the reference."""
    exe = tmp_path / "quantize_portable"
    subprocess.run([_CROSS[0], "-O2", "-std=c++20", "-static", f"-I{_ROOT / 'csrc'}", f"-I{_ROOT / 'metal'}",
                    str(_ROOT / "tests" / "native" / "quantize_portable.cpp"),
                    str(_ROOT / "csrc" / "cpu" / "quantize_generic.cpp"), "-o", str(exe)],
                   check=True, timeout=900)
    ratios, rounds = quantize._search_space(True)
    for weight_format, group_size, k in [("fp4", 128, 200), ("uint4", 32, 96), ("int4", 16, 64), ("uint4", -1, 300),
                                        ("nf4", 64, 128), ("affine", 32, 96)]:
        w = hard_weights(11, k, torch.float32)
        ref = quantize_weight_reference(w, weight_format, group_size, "mse")
        kp = ref.padded_in_features
        length = formats.effective_group_size(kp, group_size)
        (tmp_path / "w.bin").write_bytes(w.numpy().tobytes())
        code = formats.WEIGHT_FORMATS.index(weight_format)  # the format's number, metal/marlin_common.h
        subprocess.run([_CROSS[1], str(exe), str(tmp_path / "w.bin"), str(tmp_path / "out.bin"), "11", str(k),
                        str(kp), str(length), str(code), str(rounds), *("%.9g" % r for r in ratios)],
                       check=True, timeout=300)
        out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.uint8)
        packed_bytes, group_bytes = kp // 8 * 11 * 4, kp // length * 11 * 2
        packed = out[:packed_bytes].view(torch.int32).view(kp // 8, 11)
        scales = out[packed_bytes:packed_bytes + group_bytes].view(torch.float16).view(-1, 11)
        assert torch.equal(packed, ref.packed), weight_format
        assert torch.equal(scales.view(torch.int16), ref.scales.view(torch.int16)), weight_format
        if formats.has_zeros(weight_format):
            assert torch.equal(out[packed_bytes + group_bytes:].view(torch.float16).view(-1, 11), ref.zeros)


def _op(w, weight_format="fp4", group_size=32, ratios=(1.0,), rounds=1):
    return torch.ops.marlin._quantize_weight(w, weight_format, group_size, list(ratios), rounds)


def _op24(w, weight_format="fp4", group_size=32, scores=None):
    return torch.ops.marlin._quantize_weight_sparse24(w, weight_format, group_size, [1.0], 1, scores)


def test_op_schema():
    torch.library.opcheck(torch.ops.marlin._quantize_weight.default, (torch.randn(4, 64), "uint4", 32, [1.0, 0.9], 2),
                          test_utils="test_schema")
    torch.library.opcheck(torch.ops.marlin._quantize_weight_sparse24.default,
                          (torch.randn(4, 64), "uint4", 32, [1.0, 0.9], 2, torch.rand(4, 64)), test_utils="test_schema")


@pytest.mark.parametrize("call, message", [
    (lambda: _op(torch.randn(4, 64), "fp8"), "weight_format"),
    (lambda: _op(torch.randn(4, 64), group_size=48), "group_size"),
    (lambda: _op(torch.randn(4, 64, 2)), "2-D"),
    (lambda: _op(torch.zeros(0, 64)), "empty"),
    (lambda: _op(torch.ones(4, 64, dtype=torch.int32)), "float32, bfloat16 or float16"),
    (lambda: _op(torch.randn(4, 64), ratios=()), "clip_ratios must not be empty"),
    (lambda: _op(torch.randn(4, 64), ratios=(1.5,)), r"clip_ratios must lie in \(0, 1\]"),
    (lambda: _op(torch.randn(4, 64), ratios=(float("nan"),)), "clip_ratios"),
    (lambda: _op(torch.randn(4, 64), rounds=0), "rounds"),
    (lambda: _op(torch.randn(4, 64), ratios=[0.5] * 300, rounds=2), "at most 512"),
    (lambda: _op(torch.randn(40, 64).index_fill_(1, torch.tensor([9]), float("inf"))), r"NaN or Inf \(row 0\)"),
    (lambda: tm.quantize_weight(torch.randn(40, 64).bfloat16().index_fill_(0, torch.tensor([33]), float("nan"))),
     r"NaN or Inf \(row 33\)"),
    (lambda: _op24(torch.randn(4, 64), group_size=8), "group_size"),
    (lambda: _op24(torch.randn(4, 64), "int8"), "weight_format"),
    (lambda: _op24(torch.randn(4, 64), scores=torch.rand(4, 60)),
     r"scores must be a float32 CPU tensor of the weight's shape \[4, 64\]"),
    (lambda: _op24(torch.randn(4, 64), scores=torch.rand(4, 64).double()), "scores must be a float32"),
    (lambda: _op24(torch.randn(4, 64), scores=torch.rand(4, 64).index_fill_(1, torch.tensor([3]), float("nan"))),
     "scores contain NaN or Inf"),
    (lambda: _op24(torch.randn(40, 64).index_fill_(0, torch.tensor([17]), float("-inf"))), r"NaN or Inf \(row 17\)"),
])
def test_op_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
