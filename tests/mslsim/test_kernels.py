"""Functional tests of the MSL CPU emulator with small kernels."""
import os

import pytest
import torch

import mslsim

KDIR = os.path.join(os.path.dirname(__file__), "kernels")


@pytest.fixture(scope="module")
def basic():
    return mslsim.compile(os.path.join(KDIR, "basic.metal"))


@pytest.fixture(scope="module")
def gemm():
    return mslsim.compile(os.path.join(KDIR, "gemm.metal"))


@pytest.fixture(scope="module")
def special():
    return mslsim.compile(os.path.join(KDIR, "special.metal"))


@pytest.mark.parametrize("schedule", ["random", "inorder"])
def test_vector_add(basic, schedule):
    n = 1000
    a, b = torch.randn(n), torch.randn(n)
    c = torch.full((n,), -1.0)
    st = basic.launch("vector_add", grid=(8, 1, 1), threadgroup=(128, 1, 1), args={0: a, 1: b, 2: c, 3: n},
                      schedule=schedule, seed=3)
    assert torch.equal(c, a + b)
    assert st.threadgroups == 8 and st.buffer_bytes[2] == 4 * n


def test_reduce_simd_sum_threadgroup_atomics(basic):
    n = 3000
    x = torch.randn(n)
    total = torch.zeros(1)
    count = torch.zeros(1, dtype=torch.int32)
    st = basic.launch("reduce_sum", grid=(12,), threadgroup=(256,), args={0: x, 1: total, 2: count, 3: n})
    assert count.item() == 12
    torch.testing.assert_close(total, x.sum().reshape(1), rtol=1e-4, atol=1e-4)
    assert st.barriers == 12
    assert st.threadgroup_memory >= 128


def test_prefix_sum(basic):
    tg = 256
    x = torch.randint(-5, 10, (4 * tg,), dtype=torch.int32)
    y = torch.zeros_like(x)
    basic.launch("prefix_sum", grid=(4,), threadgroup=(tg,), args={0: x, 1: y}, threadgroup_memory={0: 32 * 4})
    blocks = x.view(4, tg)
    exp = torch.cumsum(blocks, 1) - blocks
    assert torch.equal(y.view(4, tg), exp.to(torch.int32))


def test_simd_collectives(basic):
    x = torch.randn(32)
    x[::3] = -x[::3].abs()
    out = torch.zeros(10 * 32)
    bits = torch.zeros(4, dtype=torch.int32)
    basic.launch("simd_ops", grid=(1,), threadgroup=(32,), args={0: x, 1: out, 2: bits})
    o = out.view(10, 32)
    lane = torch.arange(32)
    assert torch.equal(o[0], x[(lane * 7) % 32])
    assert torch.equal(o[1], x[lane ^ 5])
    down = torch.where(lane + 3 < 32, x[(lane + 3).clamp(max=31)], x)
    up = torch.where(lane - 3 >= 0, x[(lane - 3).clamp(min=0)], x)
    assert torch.equal(o[2], down), "simd_shuffle_down: edge lanes keep their own value"
    assert torch.equal(o[3], up)
    assert torch.equal(o[4], x[9].expand(32))
    assert torch.equal(o[5], x.max().expand(32))
    assert torch.equal(o[6], x.min().expand(32))
    q = x.view(8, 4)
    qs = q[:, 0] + q[:, 1] + q[:, 2] + q[:, 3]
    torch.testing.assert_close(o[7], qs.repeat_interleave(4))
    torch.testing.assert_close(o[8], torch.cumsum(x, 0))
    half_sum = x[:16].sum()
    torch.testing.assert_close(o[9, :16], half_sum.expand(16))
    assert torch.all(o[9, 16:] == 0)
    ballot = sum(1 << i for i in range(32) if x[i] > 0)
    assert bits[0].item() & 0xFFFFFFFF == ballot
    assert bits[1].item() == 0 and bits[2].item() == 1 and bits[3].item() == 1


def test_vectors_swizzles_packed(basic):
    n = 16
    a = torch.randn(n, 4)
    out = torch.zeros(n, 3, 4)
    ph = torch.zeros(n, 3, dtype=torch.float16)
    u = torch.zeros(n, dtype=torch.int32)
    basic.launch("vectors", grid=(1,), threadgroup=(n,), args={0: a, 1: out, 2: ph, 3: u})
    x, y, z, w = a.unbind(1)
    r0 = torch.stack([w * 2 + x, z * 2 + y, y * 2 + 1, x * 2 + w], 1)
    r0[:, [0, 1]] = r0[:, [1, 0]].clone()
    r0[:, 2] += 0.5
    r0[:, 3] = z - w
    torch.testing.assert_close(out[:, 0], r0)
    torch.testing.assert_close(out[:, 1], torch.where(a > 0, a, torch.zeros_like(a)))
    torch.testing.assert_close(out[:, 2], torch.cat([a[:, :3].clamp(-0.5, 0.5),
                                                     torch.maximum(x.abs(), y)[:, None]], 1))
    assert torch.equal(ph, (a[:, :3].half() * 2))
    hz = a[:, 2:4].half().contiguous().view(torch.int32).view(-1)
    assert torch.equal(u, x.contiguous().view(torch.int32) ^ hz)


def test_builtins_3d(basic):
    grid, tg = (2, 3, 2), (8, 4, 2)
    tpg = [g * t for g, t in zip(grid, tg)]
    total = tpg[0] * tpg[1] * tpg[2]
    out = torch.zeros(total, 16, dtype=torch.int32)
    basic.launch("builtins", grid=grid, threadgroup=tg, args={0: out})
    o = out.view(tpg[2], tpg[1], tpg[0], 16)
    zz, yy, xx = torch.meshgrid(torch.arange(tpg[2]), torch.arange(tpg[1]), torch.arange(tpg[0]), indexing="ij")
    assert torch.equal(o[..., 0], xx.int()) and torch.equal(o[..., 1], yy.int()) and torch.equal(o[..., 2], zz.int())
    assert torch.equal(o[..., 3], (xx % 8).int()) and torch.equal(o[..., 6], (xx // 8).int())
    assert torch.equal(o[..., 8], (zz // 2).int())
    tiitg = (xx % 8) + 8 * (yy % 4) + 32 * (zz % 2)
    assert torch.equal(o[..., 11], tiitg.int())
    assert torch.equal(o[..., 12], (tiitg % 32).int()) and torch.equal(o[..., 13], (tiitg // 32).int())
    assert torch.all(o[..., 9] == 64) and torch.all(o[..., 10] == 12)
    assert torch.all(o[..., 14] == 32) and torch.all(o[..., 15] == 2)


@pytest.mark.parametrize("name,dtype,tb", [("gemm_f16_nn", torch.float16, False), ("gemm_f16_nt", torch.float16, True),
                                           ("gemm_f32_nn", torch.float32, False),
                                           ("gemm_bf16_nt", torch.bfloat16, True)])
def test_simdgroup_gemm(gemm, name, dtype, tb):
    M, N, K = 64, 96, 48
    torch.manual_seed(0)
    A = torch.randn(M, K).to(dtype)
    Bm = torch.randn(K, N).to(dtype)
    B = Bm.t().contiguous() if tb else Bm
    C = torch.zeros(M, N, dtype=dtype)
    gemm.launch(name, grid=(N // 32, M // 32), threadgroup=(128,), args={0: A, 1: B, 2: C, 3: M, 4: N, 5: K})
    ref = (A.float() @ Bm.float()).to(dtype)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(C.float(), ref.float(), rtol=tol, atol=tol)


def test_gemm_256(gemm):
    """The 256^3 case of benchmarks/bench_mslsim.py (which times it), checked for correctness."""
    M = N = K = 256
    A = torch.randn(M, K).half()
    B = torch.randn(K, N).half()
    C = torch.zeros(M, N).half()
    st = gemm.launch("gemm_f16_nn", grid=(N // 32, M // 32), threadgroup=(128,),
                     args={0: A, 1: B, 2: C, 3: M, 4: N, 5: K}, workers=1)
    torch.testing.assert_close(C.float(), (A.float() @ B.float()), rtol=2e-2, atol=5e-2)
    assert st.barriers == 64 * 2 * (K // 16)


def test_thread_elements_layout(gemm):
    out = torch.zeros(64)
    lanes = torch.zeros(64)
    gemm.launch("fragment_layout", grid=(1,), threadgroup=(32,), args={0: out, 1: lanes})
    exp = torch.zeros(8, 8)
    for l in range(32):
        r = ((l // 4) & 4) + (l // 2) % 4
        c = ((l // 4) & 2) * 2 + (l % 2) * 2
        exp[r, c], exp[r, c + 1] = 2 * l, 2 * l + 1
    assert torch.equal(out.view(8, 8), exp)
    # transposed load: lane l gets exp.T[r, c], exp.T[r, c+1]
    back = torch.zeros(32, 2)
    for l in range(32):
        r = ((l // 4) & 4) + (l // 2) % 4
        c = ((l // 4) & 2) * 2 + (l % 2) * 2
        back[l] = exp.t()[r, c:c + 2]
    assert torch.equal(lanes.view(32, 2), back)


def test_mma_aliasing_destination(gemm):
    a = torch.randn(8, 8).half()
    b = torch.randn(8, 8).half()
    out = torch.zeros(8, 8).half()
    gemm.launch("mma_alias", grid=(1,), threadgroup=(32,), args={0: a, 1: b, 2: out})
    step = (a.float() @ b.float() + b.float()).half()
    torch.testing.assert_close(out, (2 * step.float()).half(), rtol=0, atol=0)


def test_function_constants(special):
    n = 64
    x = torch.randn(n)
    bias = torch.randn(n)
    y = torch.zeros(n)
    special.launch("affine", grid=(1,), threadgroup=(n,), args={0: x, 1: y})
    assert torch.equal(y, x)
    special.launch("affine", grid=(1,), threadgroup=(n,), args={0: x, 1: y, 2: bias}, constants={0: True})
    assert torch.equal(y, x + bias)
    special.launch("affine", grid=(1,), threadgroup=(n,), args={0: x, 1: y, 2: bias},
                   constants={"has_bias": True, "scale_shift": 2})
    assert torch.equal(y, x * 4 + bias)
    with pytest.raises(mslsim.MSLSimError, match="buffer\\(2\\)"):
        special.launch("affine", grid=(1,), threadgroup=(n,), args={0: x, 1: y}, constants={0: True})
    with pytest.raises(mslsim.MSLSimError, match="unknown function constant"):
        special.launch("affine", grid=(1,), threadgroup=(n,), args={0: x, 1: y}, constants={"nope": 1})


def test_template_host_name(special):
    ks = special.kernels()
    for k in ("scale_half_3", "scale_float_5", "fp16_ops_half", "fp16_ops_bfloat", "affine"):
        assert k in ks
    x = torch.randn(32).half()
    y = torch.zeros(32).half()
    special.launch("scale_half_3", grid=(1,), threadgroup=(32,), args={0: x, 1: y})
    assert torch.equal(y, x * 3)
    special.launch("scale_half_7", grid=(1,), threadgroup=(32,), args={0: x, 1: y})
    assert torch.equal(y, x * 7)
    xf = torch.randn(32)
    yf = torch.zeros(32)
    special.launch("scale_float_5", grid=(1,), threadgroup=(32,), args={0: xf, 1: yf})
    assert torch.equal(yf, xf * 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_bfloat_rounding(special, dtype):
    torch.manual_seed(1)
    n = 256
    a = (torch.randn(n) * 3).to(dtype)
    b = (torch.randn(n) * 3).to(dtype)
    out = torch.zeros(n, 4, dtype=dtype)
    acc = torch.zeros(1, dtype=dtype)
    name = "fp16_ops_half" if dtype == torch.float16 else "fp16_ops_bfloat"
    special.launch(name, grid=(1,), threadgroup=(n,), args={0: a, 1: b, 2: out, 3: acc, 4: n})
    # torch's CPU half / bfloat ops round to the format after every operation too
    assert torch.equal(out[:, 0], a * b + a)
    assert torch.equal(out[:, 1], (a - b) / (a + b))
    assert torch.equal(out[:, 2], (a + b) * b)
    assert torch.equal(out[:, 3], (a.float() * b.float() + a.float()).to(dtype))
    s = torch.zeros((), dtype=dtype)
    for v in a:
        s = s + v
    assert torch.equal(acc[0], s)
    # and the rounding is real: float accumulation differs
    assert not torch.equal(out[:, 0], out[:, 3])


def test_kernels_list_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_MARLIN_MSLSIM_CACHE", str(tmp_path))
    src = """
#include <metal_stdlib>
using namespace metal;
kernel void k1(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = 0.5h * 3; }
"""
    lib = mslsim.compile(src)
    assert lib.kernels() == ["k1"]
    so = [p for p in os.listdir(tmp_path) if p.startswith("k-") and p.endswith(".so")]
    assert len(so) == 1
    mtime = os.path.getmtime(tmp_path / so[0])
    mslsim._lib_cache.clear()
    lib2 = mslsim.compile(src)  # a cache hit: the library is not rebuilt
    assert os.path.getmtime(tmp_path / so[0]) == mtime
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".so")]) == 1
    y = torch.zeros(4)
    lib2.launch("k1", grid=(1,), threadgroup=(4,), args={0: y})
    assert torch.all(y == 1.5)


def test_expression_coverage():
    """Vector / swizzle / half / bfloat / math expressions compile and run."""
    lib = mslsim.compile(os.path.join(KDIR, "expressions.metal"))
    o = torch.rand(32, 4) + 0.5
    w = torch.randint(0, 2**31 - 1, (32,), dtype=torch.int32)
    ho = torch.zeros(32, 4, dtype=torch.float16)
    lib.launch("exprs", grid=(1,), threadgroup=(32,), args={0: o, 1: w, 2: ho})
    assert torch.isfinite(o).all()
    # h = as_type<half2>((w & 0x000F000F) | 0x64006400) - 1024 holds the nibbles of both halves;
    # h4 = half4(h, as_type<half2>(w)); ho = h4 * 2 + 1, then ho.yz swapped
    lo16 = (w & 0xFFFF).to(torch.int16).view(torch.float16)
    hi16 = ((w >> 16) & 0xFFFF).to(torch.int16).view(torch.float16)
    nib_hi = ((w >> 16) & 0xF).to(torch.float16)
    torch.testing.assert_close(ho[:, 3], hi16 * 2 + 1, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ho[:, 1], lo16 * 2 + 1, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ho[:, 2], nib_hi * 2 + 1)


def test_results_independent_of_schedule_and_workers(gemm):
    M, N, K = 64, 64, 32
    A = torch.randn(M, K).half()
    B = torch.randn(K, N).half()
    outs = []
    for schedule, seed, workers in [("inorder", 0, 1), ("random", 1, 2), ("random", 5, 1)]:
        C = torch.zeros(M, N).half()
        gemm.launch("gemm_f16_nn", grid=(2, 2), threadgroup=(128,), args={0: A, 1: B, 2: C, 3: M, 4: N, 5: K},
                    schedule=schedule, seed=seed, workers=workers)
        outs.append(C)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_fault_handler_survives_faulthandler_reinstall():
    import faulthandler
    lib = mslsim.compile(os.path.join(KDIR, "broken.metal"))
    was = faulthandler.is_enabled()
    faulthandler.enable()
    try:
        y = torch.zeros(100)
        with pytest.raises(mslsim.MSLSimError, match="out-of-bounds write"):
            lib.launch("oob_write", grid=(2,), threadgroup=(64,), args={0: y, 1: 100})
    finally:
        if not was:
            faulthandler.disable()


def test_set_bytes_scalars_and_structs(special):
    import ctypes

    class Params(ctypes.Structure):
        _fields_ = [("n", ctypes.c_int32), ("scale", ctypes.c_float), ("shift", ctypes.c_uint16 * 2)]

    half_bits = torch.tensor([0.5, 0.25], dtype=torch.float16).view(torch.int16).tolist()
    p = Params(20, 2.0, (ctypes.c_uint16 * 2)(*[b & 0xFFFF for b in half_bits]))
    y = torch.full((32,), -1.0)
    special.launch("with_struct", grid=(1,), threadgroup=(32,),
                   args={0: y, 1: p, 2: torch.tensor([3.0, 1.0]), 3: 1.5, 4: 0.125, 5: 7})
    exp = torch.arange(32, dtype=torch.float32) * 2 + 0.75 + 2 + 1.5 + 0.125 + 7
    assert torch.equal(y[:20], exp[:20]) and torch.all(y[20:] == -1)
    with pytest.raises(mslsim.MSLSimError, match=r"buffer\(1\).*cannot pack"):
        special.launch("with_struct", grid=(1,), threadgroup=(32,),
                       args={0: y, 1: 3, 2: torch.tensor([3.0, 1.0]), 3: 1.5, 4: 0.125, 5: 7})
    with pytest.raises(mslsim.MSLSimError, match=r"does not fit"):
        special.launch("with_struct", grid=(1,), threadgroup=(32,),
                       args={0: y, 1: p, 2: torch.tensor([3.0, 1.0]), 3: 1.5, 4: 0.125, 5: 70000})


def test_max_total_threads_per_threadgroup(special):
    y = torch.zeros(128)
    special.launch("limited", grid=(2,), threadgroup=(64,), args={0: y})
    assert torch.all(y == 1)
    with pytest.raises(mslsim.MSLSimError, match=r"max_total_threads_per_threadgroup\(64\)"):
        special.launch("limited", grid=(1,), threadgroup=(128,), args={0: y})


def test_device_reference_parameters(basic):
    counter = torch.zeros(1, dtype=torch.int32)
    acc = torch.zeros(2, dtype=torch.int32)
    basic.launch("device_refs", grid=(1,), threadgroup=(48,), args={0: counter, 1: acc})
    assert counter.item() == 48
    assert acc[:1].view(torch.float32).item() == 2.5 and acc[1].item() == 48
    with pytest.raises(mslsim.MSLSimError, match="writable device reference"):
        basic.launch("device_refs", grid=(1,), threadgroup=(48,), args={0: 0, 1: acc})


@pytest.mark.parametrize("metal_version,has_bfloat", [(None, 1), (310, 1), (320, 1), (300, 0), (240, 0)])
def test_have_bfloat_as_apple_defines_it(metal_version, has_bfloat):
    # Apple's compiler defines __HAVE_BFLOAT__ from MSL 3.1 (-std=metal3.1) on.
    src = """
#include <metal_stdlib>
using namespace metal;
kernel void probe(device uint* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
#if defined(__HAVE_BFLOAT__)
  y[0] = __METAL_VERSION__;
#else
  y[0] = 1;
#endif
}
"""
    defines = {} if metal_version is None else {"__METAL_VERSION__": metal_version}
    y = torch.zeros(1, dtype=torch.int32)
    mslsim.compile(src, defines=defines).launch("probe", grid=(1,), threadgroup=(1,), args={0: y})
    assert y.item() == ((metal_version or 310) if has_bfloat else 1)


def test_metal_version_must_be_an_int():
    with pytest.raises(mslsim.MSLSimError, match=r"defines\['__METAL_VERSION__'\] must be an int such as 310"):
        mslsim.compile("kernel void k() {}", defines={"__METAL_VERSION__": "3.1"})


def test_include_dirs_and_defines(tmp_path):
    (tmp_path / "scale.h").write_text("#pragma once\n#define SCALE(x) ((x) * FACTOR)\n")
    src = """
#include <metal_stdlib>
#include "scale.h"
using namespace metal;
kernel void scaled(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
#if USE_SCALE
  y[i] = SCALE(y[i]);
#endif
}
"""
    y = torch.ones(8)
    lib = mslsim.compile(src, include_dirs=(tmp_path,), defines={"FACTOR": 3, "USE_SCALE": True})
    lib.launch("scaled", grid=(1,), threadgroup=(8,), args={0: y})
    assert torch.all(y == 3)
    lib = mslsim.compile(src, include_dirs=(tmp_path,), defines={"FACTOR": 3, "USE_SCALE": 0})
    lib.launch("scaled", grid=(1,), threadgroup=(8,), args={0: y})
    assert torch.all(y == 3)
    with pytest.raises(mslsim.MSLSimError, match="scale.h"):
        mslsim.compile(src, defines={"FACTOR": 3})
    with pytest.raises(mslsim.MSLSimError, match="not found"):
        mslsim.compile("does/not/exist.metal")
