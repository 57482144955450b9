"""compile(..., flush_subnormals=True) runs kernels as a GPU that flushes subnormals: fp16, bfloat and fp32
subnormal inputs and results of arithmetic are signed zeros; without it they are kept (IEEE)."""
import math

import pytest
import torch

import mslsim

SRC = """#include <metal_stdlib>
using namespace metal;
kernel void probe(device const half* h [[buffer(0)]], device const float* f [[buffer(1)]],
                  device const bfloat* b [[buffer(2)]], device float* out [[buffer(3)]],
                  device half* hout [[buffer(4)]], device bfloat* bout [[buffer(5)]]) {
  out[0] = float(h[0]);       // subnormal half read
  out[1] = -float(h[0]);      // its sign
  out[2] = f[0] * f[3];       // subnormal fp32 input of an operation (f[3] = 1)
  out[3] = f[1] * f[1];       // fp32 result below the smallest normal
  out[4] = float(b[0]);       // subnormal bfloat read
  out[5] = float(h[1]) * 2.0f;  // the smallest normal half stays
  hout[0] = h[1] * h[2];      // half result below the smallest normal
  hout[1] = half(f[2]);       // float -> subnormal half
  hout[2] = half(-f[2]);
  bout[0] = bfloat(f[0] * 4.0f);
}
"""

HALF_SUB = 2.0 ** -15  # 0x0200: fp4 0.5 in the old decode's units
F32_SUB = 2.0 ** -130


def _run(flush):
    lib = mslsim.compile(SRC, flush_subnormals=flush)
    assert lib.flush_subnormals is flush
    h = torch.tensor([HALF_SUB, 2.0 ** -14, 0.5], dtype=torch.float16)
    f = torch.tensor([F32_SUB, 1e-20, 2.0 ** -20, 1.0], dtype=torch.float32)
    b = torch.tensor([F32_SUB], dtype=torch.bfloat16)
    out, hout, bout = torch.zeros(6), torch.zeros(3, dtype=torch.float16), torch.zeros(1, dtype=torch.bfloat16)
    lib.launch("probe", grid=(1,), threadgroup=(1,), args={0: h, 1: f, 2: b, 3: out, 4: hout, 5: bout})
    return out.tolist(), hout.float().tolist(), bout.float().tolist()


def test_ieee_by_default_keeps_subnormals():
    out, hout, bout = _run(False)
    assert out[:3] == [HALF_SUB, -HALF_SUB, F32_SUB]
    assert out[3] == pytest.approx(1e-40, rel=1e-3) and out[4] == F32_SUB and out[5] == 2.0 ** -13
    assert hout == [2.0 ** -15, 2.0 ** -20, -(2.0 ** -20)] and bout == [4 * F32_SUB]


def test_flush_mode_flushes_to_signed_zero():
    out, hout, bout = _run(True)
    assert out[:5] == [0.0, 0.0, 0.0, 0.0, 0.0] and out[5] == 2.0 ** -13
    assert math.copysign(1, out[1]) == -1  # -0.0
    assert hout == [0.0, 0.0, 0.0] and math.copysign(1, hout[2]) == -1
    assert bout == [0.0]


def test_flush_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(mslsim.FLUSH_SUBNORMALS_ENV, "1")
    assert mslsim.flush_subnormals_default() and mslsim.compile(SRC).flush_subnormals
    monkeypatch.setenv(mslsim.FLUSH_SUBNORMALS_ENV, "maybe")
    with pytest.raises(mslsim.MSLSimError, match="TORCH_MARLIN_MSLSIM_FLUSH_SUBNORMALS must be 1 or 0"):
        mslsim.compile(SRC)
    with pytest.raises(mslsim.MSLSimError, match="flush_subnormals must be True, False or None"):
        mslsim.compile(SRC, flush_subnormals=1)


def test_flush_mode_does_not_leak_into_the_caller():
    _run(True)
    assert torch.tensor([F32_SUB]).mul(1.0).item() == F32_SUB  # this thread's FPU is IEEE again
