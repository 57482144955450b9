"""The strict check: mslsim.compile rejects what Apple's Metal compiler rejects (one broken case per
rule, each error naming its .metal line) and keeps accepting valid MSL."""
import os
import re

import pytest
import torch

from torch_marlin.testing import mslsim
from torch_marlin.testing.mslsim import _strict

KDIR = os.path.join(os.path.dirname(__file__), "kernels")
BROKEN = os.path.join(KDIR, "strict_broken.metal")
VALID = os.path.join(KDIR, "strict_valid.metal")
HAVE_CLANG = _strict.find_clang()[0] is not None
needs_clang = pytest.mark.skipif(not HAVE_CLANG, reason="the strict pass needs clang >= 17 (apt-get install clang-19)")


def _expected_lines(case):
    with open(BROKEN) as f:
        return [i for i, ln in enumerate(f, 1) if ln.rstrip().endswith(f"// expect: {case}")]


def _reject(case, pattern):
    lines = _expected_lines(case)
    assert lines, case
    with pytest.raises(mslsim.MSLSimError) as e:
        mslsim.compile(BROKEN, defines={f"CASE_{case.upper()}": 1})
    msg = str(e.value)
    assert "Metal compiler rejects" in msg or "Metal requires" in msg, msg
    assert any(f"strict_broken.metal:{ln}:" in msg for ln in lines), (lines, msg)
    assert re.search(pattern, msg, re.S), msg
    return msg


ADDRESS_SPACE_CASES = {
    "as_call": r"pointer to address space 'device' as a pointer to thread address space",
    "as_call_threadgroup": r"'threadgroup float\[64\]' to 'device float \*'",
    "as_call_constant": r"pointer to address space 'constant' as a pointer to thread address space",
    "as_reference": r"cannot bind reference in address space 'device'",
    "as_assign": r"assigning 'device float \*' to 'float \*' changes address space",
    "as_init": r"'device float \*' with an lvalue of type 'constant float \*'",
    "as_init_reference": r"reference of type 'float' to value of type 'threadgroup float' changes address space",
    "as_return": r"return object of type 'float \*' with an lvalue of type 'device float \*'",
    "as_template": r"call to 'first'.*address space 'device' as a pointer to thread address space",
    "as_member_this": r"object parameter of type 'const Counter' with an expression of type 'device Counter'",
    "as_member_param": r"'float \*' with an lvalue of type 'device float \*'",
    "as_simdgroup_load": r"simdgroup_load.*'const (device|threadgroup) float \*'.* 'float \*'",
}


@needs_clang
@pytest.mark.parametrize("case", sorted(ADDRESS_SPACE_CASES))
def test_address_space_mismatch(case):
    _reject(case, ADDRESS_SPACE_CASES[case])


@pytest.mark.parametrize("case,pattern", [
    ("kernel_pointer_no_as", r"kernel 'no_as'.*'x' has no address space"),
    ("kernel_pointer_thread", r"kernel 'thread_as'.*'y' has the thread address space"),
    ("kernel_reference_no_as", r"kernel 'ref_no_as'.*'n' has no address space"),
])
def test_kernel_parameters_need_an_address_space(case, pattern):
    _reject(case, pattern)


@pytest.mark.parametrize("case,pattern", [
    ("double", r"'double' is not supported"),
    ("goto", r"'goto' is not supported"),
    ("new", r"'new' is not supported"),
    ("delete", r"'delete' is not supported"),
    ("virtual", r"virtual functions are not supported"),
    ("exceptions", r"exceptions are not supported.*'throw'"),
    ("try", r"exceptions are not supported.*'try'"),
    ("thread_local", r"'thread_local' is not supported"),
    ("std", r"standard library \('std::'\)"),
    ("std_header", r"'cmath'.*standard library"),
])
def test_restrictions(case, pattern):
    _reject(case, pattern)


@needs_clang
def test_recursion():
    msg = _reject("recursion", r"recursion is not supported in Metal: factorial calls factorial")
    assert "mutual" not in msg


@needs_clang
def test_mutual_recursion():
    _reject("mutual_recursion", r"mutual recursion is not supported in Metal:.*is_(odd|even) calls is_(even|odd)")


def test_the_unbroken_file_compiles():
    lib = mslsim.compile(BROKEN)
    assert lib.kernels() == ["strict_case"]


def test_strict_false_skips_the_check():
    lib = mslsim.compile(BROKEN, defines={"CASE_DOUBLE": 1}, strict=False)
    assert "strict_case" in lib.kernels()


def test_valid_msl_compiles_and_runs():
    lib = mslsim.compile(VALID, strict=True if HAVE_CLANG else None)
    n = 64
    inp = torch.randn(n)
    pairs = torch.randn(n, 2)
    counter = torch.zeros(1, dtype=torch.int32)
    half_bits = torch.tensor([0.5, 0.75], dtype=torch.float16).view(torch.int16).tolist()
    params = torch.tensor([7, torch.tensor(2.0).view(torch.int32).item(),
                           (half_bits[0] & 0xFFFF) | (half_bits[1] << 16)], dtype=torch.int32)
    out = torch.zeros(n + 1)
    lib.launch("valid_mix", grid=(1,), threadgroup=(n,),
               args={0: out, 1: pairs, 2: params, 3: counter, 4: inp}, constants={"add_one": True})
    tid = torch.arange(n)
    local = torch.tensor([2.0, 5.0, 3.0, 4.0])
    offsets = torch.tensor([0.5, 1.5, 2.5, 3.5])
    exp = (inp[tid ^ 1] + inp + local[0] + local.sum() + inp + inp + 2.0 + 2 * pairs.sum(1) + 7 + 0.375
           + offsets[tid % 4] + 0.75 + 10 + 1)
    torch.testing.assert_close(out[:n], exp)
    assert out[n].item() == n and counter.item() == n

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    c = torch.zeros(8, 8)
    lib.launch("valid_matrix", grid=(1,), threadgroup=(32,), args={0: a, 1: b, 2: c})
    torch.testing.assert_close(c, a @ b)

    x = torch.randn(16)
    y = x.clone()
    lib.launch("valid_deduced_space", grid=(1,), threadgroup=(16,), args={0: y})
    assert torch.equal(y, 2 * x)


def test_existing_kernels_pass_the_strict_check():
    for f in ("basic", "gemm", "special", "expressions", "mlx_style", "broken", "races"):
        mslsim.compile(os.path.join(KDIR, f + ".metal"), strict=True if HAVE_CLANG else None)


def test_metal_defines():
    lib = mslsim.compile("""#include <metal_stdlib>
using namespace metal;
#if defined(__METAL__) && defined(__METAL_VERSION__)
kernel void shared_header_ok(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = 1.0f; }
#endif
""")
    assert lib.kernels() == ["shared_header_ok"]


def test_missing_clang_warns_outside_ci_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_MARLIN_MSLSIM_CLANG", str(tmp_path / "no-such-clang"))
    monkeypatch.setenv("TORCH_MARLIN_MSLSIM_CACHE", str(tmp_path))
    monkeypatch.setattr(mslsim, "_warned", set())
    src = """#include <metal_stdlib>
using namespace metal;
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = 2.0f; }
"""
    monkeypatch.delenv("CI", raising=False)
    with pytest.warns(mslsim.MSLSimWarning, match="no-such-clang"):
        lib = mslsim.compile(src)
    assert lib.kernels() == ["k"]
    mslsim._lib_cache.clear()
    mslsim._strict_done.clear()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(mslsim.MSLSimError, match="needs clang.*required under CI"):
        mslsim.compile(src)
    with pytest.raises(mslsim.MSLSimError, match="needs clang"):
        mslsim.compile(src, strict=True)
    # the checks that need no clang still run
    monkeypatch.delenv("CI")
    with pytest.raises(mslsim.MSLSimError, match="'double' is not supported"):
        mslsim.compile(src.replace("2.0f", "double(2)"))


@needs_clang
def test_strict_result_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_MARLIN_MSLSIM_CACHE", str(tmp_path))
    mslsim.compile(VALID)
    marks = [p for p in os.listdir(tmp_path) if p.startswith("s-") and p.endswith(".ok")]
    assert len(marks) == 1
    mslsim._lib_cache.clear()
    mslsim._strict_done.clear()
    calls = []
    monkeypatch.setattr(_strict, "start", lambda *a: calls.append(a))
    mslsim.compile(VALID)
    assert calls == []
