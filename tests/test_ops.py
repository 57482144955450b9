"""torch.ops.marlin.* on CPU against float64 dequantize-then-matmul."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_marlin as tm
from torch_marlin import formats

DTYPES = formats.ACTIVATION_DTYPES
GROUP_SIZES = formats.GROUP_SIZES
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}


def random_weight(k, n, weight_format, group_size):
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 16, (k, n))
    scales = (torch.rand(groups, n) * 0.02 + 0.001).half()
    zeros = (torch.rand(groups, n) * 15).half() if formats.has_zeros(weight_format) else None
    return tm.pack_codes(codes), scales, zeros


def assert_close_to_reference(y, x, b64, bias=None):
    """Per element: one rounding to y's dtype plus fp32 accumulation error."""
    ref = x.double() @ b64
    if bias is not None:
        ref = ref + bias.double()
    magnitude = x.double().abs() @ b64.abs() + (0 if bias is None else bias.double().abs())
    bound = 0.5 * EPS[y.dtype] * ref.abs() + 1e-6 * magnitude + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.all(err <= bound), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_gemm_matches_float64_reference(weight_format, group_size, dtype):
    for m, n, k in [(1, 64, 512), (1, 1100, 256), (2, 7, 256), (3, 200, 512), (8, 33, 256), (13, 130, 512), (16, 64, 256),
                    (17, 72, 256), (33, 64, 768), (130, 65, 256)]:
        if group_size > 0 and k % group_size:
            continue
        packed, scales, zeros = random_weight(k, n, weight_format, group_size)
        b64 = tm.dequantize_reference(packed, scales, zeros, weight_format, group_size, torch.float64)
        x = torch.randn(m, k).to(dtype)
        bias = torch.randn(n).to(dtype) if m % 2 else None
        y = torch.ops.marlin.gemm(x, packed, scales, zeros, bias, weight_format, group_size)
        assert_close_to_reference(y, x, b64, bias)


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_gemm_large_k_and_batch_dims(weight_format):
    k, n = 8192, 48
    packed, scales, zeros = random_weight(k, n, weight_format, 128)
    b64 = tm.dequantize_reference(packed, scales, zeros, weight_format, 128, torch.float64)
    x = torch.randn(2, 3, k)
    y = torch.ops.marlin.gemm(x, packed, scales, zeros, None, weight_format, 128)
    assert y.shape == (2, 3, n)
    assert_close_to_reference(y.view(6, n), x.view(6, k), b64)
    # a non-contiguous x gives the same answer
    xt = torch.randn(k, 5).t()
    assert torch.equal(torch.ops.marlin.gemm(xt, packed, scales, zeros, None, weight_format, 128),
                       torch.ops.marlin.gemm(xt.contiguous(), packed, scales, zeros, None, weight_format, 128))


def test_gemm_empty_batch():
    packed, scales, _ = random_weight(64, 8, "fp4", 32)
    y = torch.ops.marlin.gemm(torch.randn(0, 64), packed, scales, None, None, "fp4", 32)
    assert y.shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_dequantize_is_exact(weight_format, group_size, dtype):
    packed, scales, zeros = random_weight(512, 77, weight_format, group_size)
    got = torch.ops.marlin.dequantize(packed, scales, zeros, weight_format, group_size, dtype)
    expected = tm.dequantize_reference(packed, scales, zeros, weight_format, group_size, dtype)
    assert got.dtype == dtype
    if weight_format == "uint4":
        # q - zero is rounded to fp32 when the zero has many fraction bits: one ulp at most.
        assert torch.all((got.double() - expected.double()).abs() <= EPS[dtype] * expected.double().abs())
    else:
        assert torch.equal(got, expected)  # code value x fp16 scale is exact in fp32
    default = torch.ops.marlin.dequantize(packed, scales, zeros, weight_format, group_size)
    assert default.dtype == torch.float16


def test_every_fp4_code_through_the_op():
    codes = torch.arange(16).repeat(4).view(64, 1).repeat(1, 3)  # every code at every nibble slot
    packed, scales = tm.pack_codes(codes), torch.tensor([[1.0, 2.0, 0.25]]).half()
    got = torch.ops.marlin.dequantize(packed, scales, None, "fp4", -1, torch.float32)
    expected = tm.E2M1_VALUES[codes] * scales.float()
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # -0.0 stays -0.0


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_opcheck(weight_format):
    packed, scales, zeros = random_weight(128, 24, weight_format, 32)
    x = torch.randn(3, 128, requires_grad=True)
    bias = torch.randn(24)
    torch.library.opcheck(torch.ops.marlin.gemm.default, (x, packed, scales, zeros, bias, weight_format, 32))
    torch.library.opcheck(torch.ops.marlin.gemm.default, (x.detach().half(), packed, scales, zeros, None, weight_format, 32))
    torch.library.opcheck(torch.ops.marlin.dequantize.default, (packed, scales, zeros, weight_format, 32),
                          {"dtype": torch.bfloat16})


def _args(**over):
    packed, scales, zeros = random_weight(64, 8, "uint4", 32)
    args = dict(x=torch.randn(2, 64), packed=packed, scales=scales, zeros=zeros, bias=None,
                weight_format="uint4", group_size=32)
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "x must be float16, bfloat16 or float32"),
    (dict(x=torch.randn(2, 63)), r"x.size\(-1\) must equal K = 8 \* packed.size\(0\) = 64"),
    (dict(x=torch.randn(2, 64).half(), bias=torch.randn(8)), "bias must have x's dtype"),
    (dict(bias=torch.randn(9)), r"bias must have shape \[N\] = \[8\]"),
    (dict(weight_format="nf3"), "weight_format must be one of"),
    (dict(group_size=48), "group_size must be one of"),
    (dict(group_size=128), "must be a multiple of group_size = 128"),
    (dict(packed=torch.zeros(8, 8, dtype=torch.int64)), "packed must be int32"),
    (dict(packed=torch.zeros(8, 16, dtype=torch.int32)[:, ::2]), "packed must be contiguous"),
    (dict(scales=torch.ones(2, 8)), "scales must be float16"),
    (dict(scales=torch.ones(4, 8).half()), r"scales must have shape \[K/group_size, N\] = \[2, 8\]"),
    (dict(zeros=None), "zeros is required for weight_format='uint4'"),
    (dict(zeros=torch.ones(2, 7).half()), r"zeros must have shape"),
    (dict(weight_format="fp4"), "zeros must be None for weight_format='fp4'"),
    (dict(x=torch.randn(2, 64, device="meta")), "x must be on the same device as packed"),
])
def test_gemm_bad_input(over, message):
    a = _args(**over)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        torch.ops.marlin.gemm(a["x"], a["packed"], a["scales"], a["zeros"], a["bias"], a["weight_format"], a["group_size"])


@pytest.mark.parametrize("over", [
    dict(weight_format="nf3"), dict(group_size=48), dict(group_size=128),
    dict(packed=torch.zeros(8, 8, dtype=torch.int64)), dict(scales=torch.ones(2, 8)),
    dict(scales=torch.ones(4, 8).half()), dict(zeros=None), dict(zeros=torch.ones(2, 7).half()),
    dict(weight_format="fp4"),
])
def test_fake_kernel_names_the_argument_the_op_names(over):
    """C++ does not run while tracing (fake tensors) or on the meta device: there the fake
    kernel's checks (formats.check_quantized) must refuse what the op refuses, naming the
    same argument."""
    a = _args(**over)
    names = []
    for device in ("cpu", "meta"):
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in
                (a["x"], a["packed"], a["scales"], a["zeros"], a["bias"], a["weight_format"], a["group_size"])]
        with pytest.raises((RuntimeError, ValueError, TypeError)) as error:
            torch.ops.marlin.gemm(*args)
        names.append(str(error.value).split()[0])
    assert names[0] == names[1], names


def test_dequantize_bad_dtype():
    a = _args()
    with pytest.raises(RuntimeError, match="dtype must be float16, bfloat16 or float32"):
        torch.ops.marlin.dequantize(a["packed"], a["scales"], a["zeros"], "uint4", 32, torch.int32)


def cpu_kernels():
    """{"selected": build, "error": ..., "builds": {build: "" if this CPU runs it, else why not},
    "passed_over": {build: why the automatic choice skips it though this CPU runs it}}."""
    return json.loads(torch.ops.marlin._cpu_kernels())


def test_selected_kernel_build_is_reported():
    info = cpu_kernels()
    forced = os.environ.get("TORCH_MARLIN_CPU_KERNELS")
    runs = [b for b, why in info["builds"].items() if not why]
    assert info["selected"] == (forced or next(b for b in runs if b not in info["passed_over"]))
    assert info["builds"]["generic"] == ""  # runs everywhere
    assert set(info["passed_over"]) <= set(runs) - {"generic"}
    if "avx512_bf16" in runs and "avx512" in runs:  # the one preference: by vendor (docs/CPU.md)
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
        assert ("avx512_bf16" in info["passed_over"]) == intel


# The reference tests of the dense and the 2:4 ops and of int8 activations, rerun under each build.
REFERENCE_FILES = [__file__, str(Path(__file__).with_name("test_sparse24.py")),
                   str(Path(__file__).with_name("test_int8_activations.py"))]
REFERENCE_TESTS = ["test_gemm_matches_float64_reference", "test_gemm_large_k_and_batch_dims", "test_dequantize_is_exact",
                   "test_every_fp4_code_through_the_op", "test_selected_kernel_build_is_reported",
                   "test_gemv_one_row_wide_ranges", "test_every_nibble_is_checked",
                   "test_gemm_large_k_batch_dims_and_empty", "test_int8_gemv_matches_reference",
                   "test_int8_gemv_large_k_and_batch_dims", "test_int8_sparse24_gemv_matches_reference",
                   "test_int8_sparse24_large_k_and_batch_dims", "test_int8_sums_at_their_largest"]


@pytest.mark.parametrize("build", list(cpu_kernels()["builds"]))
def test_kernel_build_matches_reference(build, rerun_under_build):
    """Each build this CPU runs (avx512_bf16, avx512, avx2, generic on x86), forced by
    environment variable, dense and 2:4 ops, int8 activations; the aarch64 builds run under qemu in
    test_cpu_kernels_aarch64.py."""
    rerun_under_build(build, "test_ops.py, test_sparse24.py, test_int8_activations.py reference tests",
                      [*REFERENCE_FILES, "-k", " or ".join(REFERENCE_TESTS)])


INT8_FILE = str(Path(__file__).with_name("test_int8_activations.py"))
INT8_TESTS = [t for t in REFERENCE_TESTS if t.startswith("test_int8")]


def _int_dot_cases():
    """(build, int_dot) for each int8 dot product a build has besides the one it chooses here."""
    info = cpu_kernels()
    cases = []
    for build, dots in info["int_dots"].items():
        runs = [d for d, why in dots.items() if not why]
        cases += [(build, d) for d in dots if not runs or d != runs[0]]
    return cases


@pytest.mark.parametrize("build, int_dot", _int_dot_cases())
def test_int_dot_matches_reference(build, int_dot, child_pytest):
    """A build's other int8 dot products (the avx2 build's vpmaddubsw where the CPU has
    vpdpbusd), forced by TORCH_MARLIN_CPU_INT_DOT, under the int8 reference tests."""
    info = cpu_kernels()
    why = info["builds"][build] or info["int_dots"][build][int_dot]
    if why:
        pytest.skip(f"{build} {int_dot}: {why}")
    env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS=build, TORCH_MARLIN_CPU_INT_DOT=int_dot)
    label = f"test_int8_activations.py reference tests under the {build} build with {int_dot}"
    returncode, output = child_pytest(label, [INT8_FILE, "-k", " or ".join(INT8_TESTS)], env, timeout=900)
    assert returncode == 0, output[-6000:]
    assert " passed" in output and " failed" not in output


def _unrunnable_int_dots():
    """(build, int_dot) of the builds this CPU runs: int8 dot products it lacks (the avx2 build's avx_vnni)."""
    info = cpu_kernels()
    return [(b, d) for b, dots in info["int_dots"].items() if not info["builds"][b] for d, why in dots.items() if why]


@pytest.mark.parametrize("build, int_dot, message", [
    (cpu_kernels()["selected"], "no-such-dot",
     "TORCH_MARLIN_CPU_INT_DOT='no-such-dot' is not an int8 dot product of the {build} build; expected one of {dots}"),
    *[(b, d, "TORCH_MARLIN_CPU_INT_DOT='{int_dot}' cannot run here (this CPU lacks") for b, d in _unrunnable_int_dots()[:1]],
])
def test_forcing_an_int_dot_that_does_not_run_is_an_error(build, int_dot, message):
    """Reported by _cpu_kernels, and raised by the first int8 GEMV (the float path does not need it)."""
    message = message.format(build=build, int_dot=int_dot, dots=", ".join(cpu_kernels()["int_dots"][build]))
    code = ("import json, torch, torch_marlin as tm\n"
            "print(json.loads(torch.ops.marlin._cpu_kernels())['error'])\n"
            "p = tm.pack_codes(torch.randint(0, 16, (64, 8)))\n"
            "args = (p, torch.ones(1, 8).half(), None, None, 'fp4', -1)\n"
            "torch.ops.marlin.gemm(torch.randn(2, 64), *args)\n"
            "with tm.cpu_int8_activations(True):\n"
            "    try:\n"
            "        torch.ops.marlin.gemm(torch.randn(2, 64), *args)\n"
            "    except RuntimeError as e:\n"
            "        print(str(e).splitlines()[0])\n")
    env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS=build, TORCH_MARLIN_CPU_INT_DOT=int_dot)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(message) == 2, result.stdout


@pytest.mark.parametrize("build, message", [
    ("no-such-build", "TORCH_MARLIN_CPU_KERNELS='no-such-build' is not a kernel build; expected one of avx512_bf16, "),
    # a build this machine cannot run (there is always one: the other architecture's)
    (next(b for b, why in cpu_kernels()["builds"].items() if why), "cannot run here"),
])
def test_forcing_a_build_this_cpu_cannot_run_is_an_error(build, message):
    code = ("import torch, torch_marlin as tm\n"
            "p = tm.pack_codes(torch.randint(0, 16, (64, 8)))\n"
            "try:\n"
            "    torch.ops.marlin.gemm(torch.randn(2, 64), p, torch.ones(1, 8).half(), None, None, 'fp4', -1)\n"
            "except RuntimeError as e:\n"
            "    print(str(e).splitlines()[0])\n")
    env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS=build)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert message in result.stdout, result.stdout
