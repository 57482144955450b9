"""MLX-style kernels: 4-bit affine quantized GEMV and a BlockMMA-like GEMM."""
import os

import pytest
import torch

import mslsim

KDIR = os.path.join(os.path.dirname(__file__), "kernels")


@pytest.fixture(scope="module")
def lib():
    return mslsim.compile(os.path.join(KDIR, "mlx_style.metal"))


def _pack4(q):
    q = q.to(torch.uint8)
    b = q[:, 0::2] | (q[:, 1::2] << 4)
    return b.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype,gs", [(torch.float16, 32), (torch.float16, 64), (torch.float32, 32),
                                      (torch.bfloat16, 64)])
def test_qmv_4bit(lib, dtype, gs):
    torch.manual_seed(0)
    N, K = 48, 512
    q = torch.randint(0, 16, (N, K))
    scales = (torch.rand(N, K // gs) * 0.1 + 0.01).to(dtype)
    biases = (torch.randn(N, K // gs) * 0.1).to(dtype)
    x = torch.randn(K).to(dtype)
    y = torch.zeros(N, dtype=dtype)
    name = {torch.float16: "half", torch.float32: "float", torch.bfloat16: "bfloat16_t"}[dtype]
    lib.launch(f"qmv_{name}_gs_{gs}", grid=(N // 8,), threadgroup=(64,),
               args={0: _pack4(q), 1: scales, 2: biases, 3: x, 4: y, 5: K, 6: N})
    w = scales.double().repeat_interleave(gs, 1) * q.double() + biases.double().repeat_interleave(gs, 1)
    ref = w @ x.double()
    tol = {torch.float16: 2e-2, torch.float32: 1e-4, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_gemm_masked(lib, dtype):
    torch.manual_seed(0)
    M, N, K = 50, 70, 48
    A = torch.randn(M, K).to(dtype)
    B = torch.randn(K, N).to(dtype)
    C = torch.full((M, N), 7.0).to(dtype)
    name = "block_gemm_half" if dtype == torch.float16 else "block_gemm_float"
    lda = 16 + 4
    st = lib.launch(name, grid=((N + 31) // 32, (M + 31) // 32), threadgroup=(128,),
                    args={0: A, 1: B, 2: C, 3: torch.tensor([M, N, K, 0], dtype=torch.int32)},
                    threadgroup_memory={0: 32 * lda * A.element_size()})
    ref = (A.float() @ B.float())
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(C.float(), ref, rtol=tol, atol=tol)
    assert st.threadgroup_memory >= 32 * lda * A.element_size() + 16 * (32 + 4) * A.element_size()
