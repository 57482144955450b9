"""CPU GEMVs with int8 activations (torch_marlin.cpu_int8_activations) against a
float64 reference of exactly what they compute: x quantized to int8 per block of
32 with an fp32 scale (reproduced here in torch), then exact products with the
dequantized weight. tests/test_ops.py reruns these under every kernel build;
tests/cpu_kernels/check_kernels.cpp checks the kernels under qemu for Arm."""

import itertools

import pytest
import torch

import torch_marlin as tm
from torch_marlin import formats
from torch_marlin.layouts import sparse24 as sp

from test_ops import EPS, random_weight
from test_sparse24 import _metadata_with, random_mask, random_sparse

BLOCK = 32
# The formats whose values (times 1 or 2) are small integers; nf4 keeps the float path.
INT8_FORMATS = [f for f in formats.WEIGHT_FORMATS if f != "nf4"]


@pytest.fixture(autouse=True)
def int8_on():
    with tm.cpu_int8_activations(True):
        yield


def quantize_x(x):
    """(xq, dx) per block of 32: dx = max|x| / 127 and xq = round(x / dx), ties to even, in fp32."""
    xf = x.float().reshape(x.shape[0], -1, BLOCK)
    d = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d == 0, torch.zeros_like(xf), torch.round(xf / torch.where(d == 0, 1, d))).clamp(-127, 127)
    return q, d


def int8_reference(x, b64, scales, zeros, group_size):
    """The float64 product of the int8 x with the weight b64 ([K, N], dense or 2:4), and the
    magnitude of the terms the kernel adds."""
    k = x.shape[1]
    q, d = quantize_x(x)
    x64 = (q.double() * d.double()).reshape(x.shape[0], k)
    rows = k if group_size == -1 else group_size
    s64 = scales.double().abs().repeat_interleave(rows, 0)
    z64 = zeros.double().abs().repeat_interleave(rows, 0) if zeros is not None else 0
    return x64 @ b64, x64.abs() @ (b64.abs() + 16 * s64 + z64)


def assert_int8_close(y, x, packed, scales, zeros, weight_format, group_size, bias=None):
    b64 = tm.dequantize_reference(packed, scales, zeros, weight_format, group_size, torch.float64)
    assert_int8_close_to(y, x, b64, scales, zeros, group_size, bias)


def assert_int8_close_to(y, x, b64, scales, zeros, group_size, bias=None):
    ref, magnitude = int8_reference(x, b64, scales, zeros, group_size)
    if bias is not None:
        ref = ref + bias.double()
        magnitude = magnitude + bias.double().abs()
    bound = 0.5 * EPS[y.dtype] * ref.abs() + 1e-6 * magnitude + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.all(err <= bound), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", formats.ACTIVATION_DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_gemv_matches_reference(weight_format, group_size, dtype):
    # (1, 4160, 256): one row wider than kPrefetchNextBlockCols (dense_gemv_q8.h)
    for m, n, k in [(1, 64, 512), (1, 1100, 256), (1, 4160, 256), (2, 7, 256), (3, 200, 512), (4, 130, 256),
                    (5, 33, 256), (8, 96, 768)]:
        if group_size > 0 and k % group_size:
            continue
        packed, scales, zeros = random_weight(k, n, weight_format, group_size)
        x = torch.randn(m, k).to(dtype)
        x[0, 32:64] = 0  # an all-zero block: scale 0
        x[-1, 5] = 100.0  # one block dominated by one value
        bias = torch.randn(n).to(dtype) if m % 2 else None
        y = torch.ops.marlin.gemm(x, packed, scales, zeros, bias, weight_format, group_size)
        assert_int8_close(y, x, packed, scales, zeros, weight_format, group_size, bias)


@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_gemv_large_k_and_batch_dims(weight_format):
    k, n = 8192, 48
    packed, scales, zeros = random_weight(k, n, weight_format, 128)
    x = torch.randn(2, 3, k).bfloat16()
    y = torch.ops.marlin.gemm(x, packed, scales, zeros, None, weight_format, 128)
    assert y.shape == (2, 3, n)
    assert_int8_close(y.view(6, n), x.view(6, k), packed, scales, zeros, weight_format, 128)


@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_sums_at_their_largest(weight_format):
    """Every code alike (each of the 16 in turn) and x of one sign, so each int8 x is +-127:
    the largest sums of code bytes times x a block adds (vpmaddubsw sums them in int16,
    cpu_vec.h int16_rows), dense and 2:4, one row and two, full vectors and a tail."""
    k, n = 256, 40
    g = torch.Generator().manual_seed(5)
    for code in range(16):
        codes = torch.full((k, n), code)
        scales = (torch.rand(k // 32, n, generator=g) * 0.02 + 0.001).half()
        zeros = (torch.rand(k // 32, n, generator=g) * 15).half() if formats.has_zeros(weight_format) else None
        packed = tm.pack_codes(codes)
        values, metadata = sp.pack_sparse(codes, random_mask(k, n, g))
        sparse64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, 32, torch.float64)
        for x in (torch.ones(1, k), -torch.ones(1, k), torch.stack([torch.ones(k), -torch.ones(k)])):
            y = torch.ops.marlin.gemm(x, packed, scales, zeros, None, weight_format, 32)
            assert_int8_close(y, x, packed, scales, zeros, weight_format, 32)
            y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format, 32)
            assert_int8_close_to(y, x, sparse64, scales, zeros, 32)


@pytest.mark.parametrize("weight_format, group_size, m", [
    ("nf4", 128, 1),    # nf4's values are not small integers
    ("int4", 16, 1),    # groups shorter than a block of x
    ("fp4", 128, 9),    # more rows than a GEMV: the tiled GEMM
])
def test_float_path_where_int8_does_not_apply(weight_format, group_size, m):
    packed, scales, zeros = random_weight(256, 70, weight_format, group_size)
    x = torch.randn(m, 256)
    y = torch.ops.marlin.gemm(x, packed, scales, zeros, None, weight_format, group_size)
    with tm.cpu_int8_activations(False):
        assert torch.equal(y, torch.ops.marlin.gemm(x, packed, scales, zeros, None, weight_format, group_size))


def test_setting_is_scoped_and_checked():
    assert tm.cpu_int8_activations.enabled()
    with tm.cpu_int8_activations(False):
        assert not tm.cpu_int8_activations.enabled()
    assert tm.cpu_int8_activations.enabled()
    with pytest.raises(TypeError, match="enabled must be True or False, got 1"):
        tm.cpu_int8_activations(1)
    assert tm.cpu_int8_activations.enabled()


def test_int8_changes_the_result():
    """The setting reaches the kernels: the same GEMV differs by x's rounding."""
    packed, scales, zeros = random_weight(256, 64, "int4", 32)
    x = torch.randn(1, 256)
    y8 = torch.ops.marlin.gemm(x, packed, scales, zeros, None, "int4", 32)
    with tm.cpu_int8_activations(False):
        y32 = torch.ops.marlin.gemm(x, packed, scales, zeros, None, "int4", 32)
    assert not torch.equal(y8, y32)
    assert torch.allclose(y8, y32, rtol=0.05, atol=0.05 * y32.abs().max().item())


@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_expert_stacks(weight_format):
    """moe_gemm's GEMV items (experts with up to 8 rows) take int8 x too: each expert's
    rows give the dense op's int8 result on that expert's weight, bit for bit."""
    from test_experts import random_stack

    experts, k, n = 4, 256, 80
    q = random_stack(experts, k, n, weight_format, 64)
    x = torch.randn(6, k)
    ids = torch.tensor([[0, 2], [2, 1], [0, 2], [3, 0], [2, 2], [1, 3]])
    y = torch.ops.marlin.moe_gemm(x, ids, None, q.packed, q.scales, q.zeros, None, weight_format, 64)
    for e in range(experts):
        rows = (ids == e).nonzero()
        zeros = None if q.zeros is None else q.zeros[e]
        dense = torch.ops.marlin.gemm(x[rows[:, 0]], q.packed[e], q.scales[e], zeros, None, weight_format, 64)
        assert torch.equal(y[rows[:, 0], rows[:, 1]], dense), e


# --- the 2:4 layout ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", formats.ACTIVATION_DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_sparse24_gemv_matches_reference(weight_format, group_size, dtype):
    """The 2:4 GEMV on int8 x: row blocks, column tails, one row over wide ranges, both metadata halves."""
    g = torch.Generator().manual_seed(3)
    # (1, 4160, 256): one row wider than kPrefetchNextBlockCols (dense_gemv_q8.h)
    for m, n, k in [(1, 64, 512), (1, 1100, 256), (1, 4160, 256), (2, 7, 256), (3, 200, 512), (4, 130, 256), (5, 33, 256),
                    (8, 96, 768)]:
        if group_size > 0 and k % group_size:
            continue
        values, metadata, scales, zeros = random_sparse(k, n, weight_format, group_size, g)
        b64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, group_size, torch.float64)
        x = torch.randn(m, k, generator=g).to(dtype)
        x[0, 32:64] = 0  # an all-zero block: scale 0
        x[-1, 5] = 100.0  # one block dominated by one value
        bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
        y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, bias, weight_format, group_size)
        assert_int8_close_to(y, x, b64, scales, zeros, group_size, bias)


@pytest.mark.parametrize("weight_format", INT8_FORMATS)
def test_int8_sparse24_large_k_and_batch_dims(weight_format):
    k, n = 8192, 48
    values, metadata, scales, zeros = random_sparse(k, n, weight_format, 128)
    b64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, 128, torch.float64)
    x = torch.randn(2, 3, k).bfloat16()
    y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format, 128)
    assert y.shape == (2, 3, n)
    assert_int8_close_to(y.view(6, n), x.view(6, k), b64, scales, zeros, 128)


@pytest.mark.parametrize("weight_format, group_size, m", [("nf4", 128, 1), ("int4", 16, 1), ("fp4", 128, 9)])
def test_sparse24_float_path_where_int8_does_not_apply(weight_format, group_size, m):
    values, metadata, scales, zeros = random_sparse(256, 70, weight_format, group_size)
    x = torch.randn(m, 256)
    y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format, group_size)
    with tm.cpu_int8_activations(False):
        assert torch.equal(y, torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format,
                                                             group_size))


def test_int8_sparse24_changes_the_result():
    """The setting reaches the 2:4 kernels: the same GEMV differs by x's rounding."""
    values, metadata, scales, zeros = random_sparse(256, 64, "int4", 32)
    x = torch.randn(1, 256)
    y8 = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, "int4", 32)
    with tm.cpu_int8_activations(False):
        y32 = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, "int4", 32)
    assert not torch.equal(y8, y32)
    assert torch.allclose(y8, y32, rtol=0.05, atol=0.05 * y32.abs().max().item())


def test_int8_sparse24_checks_every_nibble():
    """An invalid metadata pattern is an error naming it on the int8 path too: all 8 nibbles, both
    halves, the first column and a column of the tail."""
    for j, (row, col) in itertools.product(range(8), [(0, 0), (2, 7)]):
        values, metadata, scales = _metadata_with(3, (row, col, j))
        for m in (1, 4):
            with pytest.raises(ValueError, match=rf"word \[{row}, {col}\] nibble {j} \(K rows"):
                torch.ops.marlin.sparse24_gemm(torch.randn(m, 96), values, metadata, scales, None, None, "fp4", 32)
