"""The strict check: mslsim.compile rejects what Apple's Metal compiler rejects (one broken case per
rule, each error naming its .metal line) and keeps accepting valid MSL."""
import os
import re
import subprocess
import sys

import pytest
import torch

import mslsim
from mslsim import _strict

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
    # a C-style cast compiles in clang's C++ (as an addrspacecast), Metal has no such conversion
    "as_c_cast": r"cast of a device pointer to a thread pointer: Metal does not convert pointers between address",
    "as_c_cast_threadgroup": r"cast of a threadgroup pointer to a device pointer",
    "vla": r"variable length arrays are not supported in Metal",
}


@needs_clang
@pytest.mark.parametrize("case", sorted(ADDRESS_SPACE_CASES))
def test_address_space_mismatch(case):
    _reject(case, ADDRESS_SPACE_CASES[case])


@pytest.mark.parametrize("case,pattern", [
    ("program_scope_device", r"program-scope variable 'g_bias' is not in the constant address space"),
    ("program_scope_constexpr", r"program-scope variable 'kScale' is not in the constant address space"),
    ("program_scope_threadgroup", r"program-scope threadgroup variable 'g_tile'; Metal requires threadgroup "
                                  r"variables to be declared inside a kernel function"),
    ("kernel_return", r"kernel 'returns_value' returns 'float'; Metal requires kernel functions to return void"),
    ("builtin_float", r"kernel 'builtin_float': parameter 'i' has type 'float', which Metal does not allow for "
                      r"\[\[thread_position_in_grid\]\] \(uint, uint2, uint3, ushort, ushort2 or ushort3\)"),
    ("builtin_int", r"parameter 'lane' has type 'int', .*\[\[thread_index_in_simdgroup\]\] \(uint or ushort\)"),
    ("builtin_vector", r"parameter 'tid' has type 'uint2', .*\[\[thread_index_in_threadgroup\]\] "
                       r"\(uint or ushort\)"),
])
def test_program_scope_kernel_and_builtin_rules(case, pattern):
    _reject(case, pattern)


def test_program_scope_threadgroup_variable_is_an_error_not_a_crash():
    # It used to crash the process when the library was loaded (its storage was allocated outside any
    # threadgroup); the emulator cannot run it even with the strict check off. In a subprocess, so a
    # crash fails this test instead of ending the test session.
    code = (f"import mslsim\n"
            f"for strict in (None, False):\n"
            f"    try:\n"
            f"        mslsim.compile({BROKEN!r}, defines={{'CASE_PROGRAM_SCOPE_THREADGROUP': 1}}, strict=strict)\n"
            f"    except mslsim.MSLSimError as e:\n"
            f"        print('MSLSimError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    line = _expected_lines("program_scope_threadgroup")[0]
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("MSLSimError:")]
    assert len(errors) == 2 and all(f"strict_broken.metal:{line}: error: program-scope threadgroup variable"
                                    in e for e in errors), r.stdout


def test_valid_program_scope_casts_and_builtins_are_accepted():
    # the near misses of the rules above, compiled with the whole check and run
    lib = mslsim.compile("""#include <metal_stdlib>
using namespace metal;
constant float kTable[4] = {1.0f, 2.0f, 3.0f, 4.0f};
constant constexpr uint kCount = 4;
static constant constexpr const int kTwo = 2;
constant float4 kBrace{1.0f, 2.0f, 3.0f, 4.0f};
struct Scale;
struct Scale { float s; float apply(float v) const { return s * v; } };
enum class Mode : uint { kAdd = 0, kMul = 1 };
inline float scaled(float v, float s = float(kTwo)) { return v * s; }
kernel void near_misses(device float* y [[buffer(0)]], device uint* raw [[buffer(1)]],
                        ushort lane [[thread_index_in_simdgroup]], const uint tid [[thread_index_in_threadgroup]],
                        uint2 pos [[thread_position_in_grid]], ushort3 tg [[threads_per_threadgroup]]) {
  threadgroup float shared[16];
  float local[kCount];                                          // a constant array size
  for (uint i = 0; i < kCount; ++i) local[i] = kTable[i];
  shared[tid] = local[tid % kCount];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup float4* v4 = (const threadgroup float4*)shared;  // a cast within one address space
  device uchar* bytes = (device uchar*)(raw + tid);                   // likewise in device memory
  bytes[0] = uchar(lane);
  const Scale sc{0.5f};
  y[tid] = sc.apply(scaled(v4[tid / 4][tid % 4])) + kBrace[tid % 4] + float(pos.x) + float(tg.x);
}
""", strict=True if HAVE_CLANG else None)
    y, raw = torch.zeros(16), torch.zeros(16, dtype=torch.int32)
    lib.launch("near_misses", grid=(1,), threadgroup=(16,), args={0: y, 1: raw})
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])
    tid = torch.arange(16)
    torch.testing.assert_close(y, table[tid % 4] + table[tid % 4] + tid.float() + 16)
    assert torch.equal(raw, tid.int())


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
