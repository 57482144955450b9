"""The 2:4 sparse layout: packing against the per-element reference, the
torch.ops.marlin.sparse24_* ops on CPU against float64 dequantize-then-matmul,
opcheck, torch.compile, autograd, bad input."""

import itertools

import pytest
import torch

from torch_marlin import formats
from torch_marlin.layouts import sparse24 as sp

from reference import dequantize_sparse_one_by_one, pack_sparse_one_by_one
from test_ops import EPS, assert_close_to_reference

DTYPES = formats.ACTIVATION_DTYPES


def random_mask(k, n, generator=None):
    """[K, N] bool, a uniformly random one of the 6 patterns in every block."""
    patterns = torch.tensor(sp.PATTERNS)[torch.randint(0, 6, (k // 4, n), generator=generator)]  # [K/4, N, 2]
    mask = torch.zeros(k // 4, 4, n, dtype=torch.bool)
    mask.scatter_(1, patterns.permute(0, 2, 1), True)
    return mask.view(k, n)


def random_sparse(k, n, weight_format, group_size, generator=None):
    codes = torch.randint(0, 16, (k, n), generator=generator)
    mask = random_mask(k, n, generator)
    groups = 1 if group_size == -1 else k // group_size
    scales = (torch.rand(groups, n, generator=generator) * 0.02 + 0.001).half()
    zeros = (torch.rand(groups, n, generator=generator) * 15).half() if formats.has_zeros(weight_format) else None
    values, metadata = sp.pack_sparse(codes, mask)
    return values, metadata, scales, zeros


# --- format ---------------------------------------------------------------------------

def test_pack_matches_per_element_reference():
    g = torch.Generator().manual_seed(0)
    codes, mask = torch.randint(0, 16, (96, 7), generator=g), random_mask(96, 7, g)
    values, metadata = sp.pack_sparse(codes, mask)
    ref_values, ref_metadata = pack_sparse_one_by_one(codes.tolist(), mask.tolist())
    assert values.dtype == metadata.dtype == torch.int32
    assert values.tolist() == ref_values and metadata.tolist() == ref_metadata
    kept, positions = sp.unpack_kept(values, metadata)
    assert torch.equal(sp.dense_mask(metadata), mask)
    assert torch.equal(sp.pack_kept(kept, positions)[0], values)
    assert torch.equal(kept.long(), codes.t()[mask.t()].view(7, 48).t())


def test_pack_by_row_blocks_equals_pack_by_column_slices():
    """pack_kept packs blocks of kept rows (16 at a time for 2^16 columns); columns are
    independent, so narrow slices (packed in one block) give the same words. An invalid
    pair in a later block is named by its place in the whole weight."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    kept, positions = sp.compress(torch.randint(0, 16, (96, n), generator=g, dtype=torch.uint8), random_mask(96, n, g))
    values, metadata = sp.pack_kept(kept, positions)
    for c0 in range(0, n, 8192):
        v, m = sp.pack_kept(kept[:, c0:c0 + 8192], positions[:, c0:c0 + 8192])
        assert torch.equal(values[:, c0:c0 + 8192], v) and torch.equal(metadata[:, c0:c0 + 8192], m)
    positions[2 * 21 + 1, 5] = positions[2 * 21, 5]
    with pytest.raises(ValueError, match=r"positions of block 21 \(K rows 84..87\), column 5 .* two equal positions"):
        sp.pack_kept(kept, positions)


def test_every_pattern_and_every_code_in_every_slot():
    """Block b of column c has pattern (b + c) % 6: every pattern at each of the 8
    nibbles of a metadata word; kept entry 8w + s (slot s of values word w) has code
    (w + s) % 16: every code in each of the 8 slots of a values word."""
    k, n = 256, 6
    patterns = torch.tensor(sp.PATTERNS)[(torch.arange(k // 4).view(-1, 1) + torch.arange(n)) % 6]  # [K/4, N, 2]
    positions = patterns.permute(0, 2, 1).reshape(k // 2, n)
    t = torch.arange(k // 2)
    kept = ((t // 8 + t % 8) % 16).view(-1, 1).repeat(1, n)
    values, metadata = sp.pack_kept(kept, positions)
    mask = sp.dense_mask(metadata)
    base = torch.arange(0, k, 4).repeat_interleave(2).view(-1, 1)
    dense = torch.zeros(k, n, dtype=torch.long).scatter(0, base + positions, kept)
    ref_values, ref_metadata = pack_sparse_one_by_one(dense.tolist(), mask.tolist())
    assert values.tolist() == ref_values and metadata.tolist() == ref_metadata
    assert {(int(c), int(s)) for c, s in zip(kept[:, 0], t % 8)} == set(itertools.product(range(16), range(8)))
    nibbles = formats.unpack_codes(metadata)
    assert {(int(v), j) for r, row in enumerate(nibbles.tolist()) for v in row for j in [r % 8]} == \
        set(itertools.product(sp.VALID_NIBBLES, range(8)))
    assert torch.equal(sp.unpack_kept(values, metadata)[1], positions.to(torch.uint8))
    for weight_format in formats.WEIGHT_FORMATS:
        scales = torch.rand(1, n).half() + 0.5
        zeros = (torch.rand(1, n) * 15).half() if formats.has_zeros(weight_format) else None
        got = torch.ops.marlin.sparse24_dequantize(values, metadata, scales, zeros, weight_format, -1, torch.float32)
        ref = torch.tensor(dequantize_sparse_one_by_one(values.tolist(), metadata.tolist(), scales.float().tolist(),
                                                        None if zeros is None else zeros.float().tolist(),
                                                        weight_format, -1), dtype=torch.float64)
        assert torch.allclose(got.double(), ref, rtol=2 ** -23, atol=0)
        if weight_format != "uint4":  # exact; fp4 -0.0 stays -0.0, pruned weights are +0.0
            assert torch.equal(got, ref.float()) and torch.equal(torch.signbit(got), torch.signbit(ref.float()))


@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_reference_dequantize_matches_per_element(weight_format, group_size):
    values, metadata, scales, zeros = random_sparse(256, 5, weight_format, group_size)
    got = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, group_size, torch.float64)
    ref = dequantize_sparse_one_by_one(values.tolist(), metadata.tolist(), scales.float().tolist(),
                                       None if zeros is None else zeros.float().tolist(), weight_format, group_size)
    assert torch.equal(got, torch.tensor(ref, dtype=torch.float64))


def test_size_per_weight():
    """<= 3.125 bits per weight at g128 including metadata and scales (dense fp4 4.125)."""
    for weight_format, group_size, bits in [("fp4", 128, 3.125), ("int4", 128, 3.125), ("uint4", 128, 3.25),
                                            ("fp4", 32, 3.5), ("uint4", 32, 4.0)]:
        q = sp.SparseQuantizedWeight.empty(4096, 4096, weight_format, group_size)
        assert q.nbytes * 8 / (4096 * 4096) == bits


# --- ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_gemm_matches_float64_reference(weight_format, group_size):
    """GEMV (M <= 8: row blocks of 1..4, strips with tails) and tiled GEMM (M > 8), every dtype."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 64, 512), (2, 7, 256), (3, 200, 512), (5, 72, 256), (6, 40, 512), (8, 33, 256), (9, 65, 512),
                    (33, 64, 768), (130, 70, 256)]:
        if group_size > 0 and k % group_size:
            continue
        values, metadata, scales, zeros = random_sparse(k, n, weight_format, group_size, g)
        b64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, group_size, torch.float64)
        for dtype in DTYPES:
            x = torch.randn(m, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
            y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, bias, weight_format, group_size)
            assert_close_to_reference(y, x, b64, bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_gemv_one_row_wide_ranges(weight_format, group_size, threads):
    """M = 1 over column ranges of >= 512 per thread: the memory-order GEMV (tail strips, both metadata halves)."""
    g = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in [(1100, 256), (512 * threads, 512)]:
            if group_size > 0 and k % group_size:
                continue
            values, metadata, scales, zeros = random_sparse(k, n, weight_format, group_size, g)
            b64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, group_size,
                                                 torch.float64)
            for dtype in DTYPES:
                x = torch.randn(1, k, generator=g).to(dtype)
                y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format, group_size)
                assert_close_to_reference(y, x, b64, None)
            # The strip walk (rows 1 of 2) gives the same first row, bit for bit.
            x2 = torch.randn(2, k, generator=g)
            y2 = torch.ops.marlin.sparse24_gemm(x2, values, metadata, scales, zeros, None, weight_format, group_size)
            y1 = torch.ops.marlin.sparse24_gemm(x2[:1], values, metadata, scales, zeros, None, weight_format,
                                                group_size)
            assert torch.equal(y1[0], y2[0])
    finally:
        torch.set_num_threads(before)


def test_gemv_one_row_checks_metadata_in_tail_strips():
    values, metadata, scales, _ = random_sparse(96, 1100, "fp4", 32)
    for row, col, j in [(0, 1099, 7), (2, 700, 0), (1, 3, 4)]:
        bad = metadata.clone()
        word = int(bad[row, col]) & 0xFFFFFFFF
        word = (word & ~(0xF << (4 * j))) | (3 << (4 * j))
        bad[row, col] = word - (1 << 32) if word >= 1 << 31 else word
        with pytest.raises(ValueError, match=rf"word \[{row}, {col}\] nibble {j} "):
            torch.ops.marlin.sparse24_gemm(torch.randn(1, 96), values, bad, scales, None, None, "fp4", 32)


@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_dequantize_is_exact(weight_format, group_size):
    values, metadata, scales, zeros = random_sparse(512, 77, weight_format, group_size)
    for dtype in DTYPES:
        got = torch.ops.marlin.sparse24_dequantize(values, metadata, scales, zeros, weight_format, group_size, dtype)
        expected = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, group_size, dtype)
        assert got.dtype == dtype
        if weight_format == "uint4":
            assert torch.all((got.double() - expected.double()).abs() <= EPS[dtype] * expected.double().abs())
        else:
            assert torch.equal(got, expected)
        assert torch.equal(got != 0, sp.dense_mask(metadata) & (expected != 0))


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_gemm_large_k_batch_dims_and_empty(weight_format):
    k, n = 8192, 48
    values, metadata, scales, zeros = random_sparse(k, n, weight_format, 128)
    b64 = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, 128, torch.float64)
    x = torch.randn(2, 3, k)
    y = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, None, weight_format, 128)
    assert y.shape == (2, 3, n)
    assert_close_to_reference(y.view(6, n), x.view(6, k), b64)
    empty = torch.ops.marlin.sparse24_gemm(torch.randn(0, k), values, metadata, scales, zeros, None, weight_format, 128)
    assert empty.shape == (0, n)


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_opcheck_compile_and_autograd(weight_format):
    values, metadata, scales, zeros = random_sparse(128, 24, weight_format, 32)
    x = torch.randn(3, 128, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    op = torch.ops.marlin.sparse24_gemm.default
    torch.library.opcheck(op, (x, values, metadata, scales, zeros, bias, weight_format, 32))
    torch.library.opcheck(op, (x.detach().half(), values, metadata, scales, zeros, None, weight_format, 32))
    torch.library.opcheck(torch.ops.marlin.sparse24_dequantize.default, (values, metadata, scales, zeros,
                                                                         weight_format, 32), {"dtype": torch.bfloat16})
    y = op(x, values, metadata, scales, zeros, bias, weight_format, 32)
    y.square().sum().backward()
    w = sp.dequantize_sparse_reference(values, metadata, scales, zeros, weight_format, 32)
    assert torch.allclose(x.grad, (2 * y.detach()) @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(bias.grad, 2 * y.detach().sum(0), rtol=1e-5, atol=1e-5)

    compiled = torch.compile(lambda t: op(t, values, metadata, scales, zeros, None, weight_format, 32).relu(),
                             fullgraph=True, backend="eager")
    xd = x.detach()
    assert torch.equal(compiled(xd), op(xd, values, metadata, scales, zeros, None, weight_format, 32).relu())


def _metadata_with(nibble, where=(1, 3, 5)):
    values, metadata, scales, _ = random_sparse(96, 8, "fp4", 32)
    row, col, j = where
    word = int(metadata[row, col]) & 0xFFFFFFFF
    word = (word & ~(0xF << (4 * j))) | (nibble << (4 * j))
    metadata[row, col] = word - (1 << 32) if word >= 1 << 31 else word
    return values, metadata, scales


@pytest.mark.parametrize("nibble", [0, 5, 10, 15, 1, 6, 11, 2, 3, 7])  # equal positions, then pos0 > pos1
@pytest.mark.parametrize("m", [1, 16])
def test_invalid_metadata_is_an_error_naming_it(nibble, m):
    values, metadata, scales = _metadata_with(nibble)
    message = (rf"metadata has an invalid 2:4 pattern: word \[1, 3\] nibble 5 \(K rows 52\.\.55\) is {nibble} "
               rf"= positions \({nibble & 3}, {nibble >> 2}\)")
    with pytest.raises(ValueError, match=message):
        torch.ops.marlin.sparse24_gemm(torch.randn(m, 96), values, metadata, scales, None, None, "fp4", 32)
    with pytest.raises(ValueError, match=message):
        torch.ops.marlin.sparse24_dequantize(values, metadata, scales, None, "fp4", 32)
    with pytest.raises(ValueError, match=message):
        sp.check_metadata(metadata)


def test_every_nibble_is_checked():
    """All 8 nibbles of words in both halves, any column: the kernels see every one."""
    for j, (row, col) in itertools.product(range(8), [(0, 0), (2, 7)]):
        values, metadata, scales = _metadata_with(3, (row, col, j))
        for m in (1, 9):
            with pytest.raises(ValueError, match=rf"word \[{row}, {col}\] nibble {j} "):
                torch.ops.marlin.sparse24_gemm(torch.randn(m, 96), values, metadata, scales, None, None, "fp4", 32)


def _args(**over):
    values, metadata, scales, zeros = random_sparse(64, 8, "uint4", 32)
    args = dict(x=torch.randn(2, 64), values=values, metadata=metadata, scales=scales, zeros=zeros, bias=None,
                weight_format="uint4", group_size=32)
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "x must be float16, bfloat16 or float32"),
    (dict(x=torch.randn(2, 63)), r"x.size\(-1\) must equal K = 16 \* values.size\(0\) = 64"),
    (dict(bias=torch.randn(9)), r"bias must have shape \[N\] = \[8\]"),
    (dict(weight_format="nf3"), "weight_format must be one of"),
    (dict(group_size=48), "group_size must be one of"),
    (dict(group_size=128), "must be a multiple of group_size = 128"),
    (dict(values=torch.zeros(4, 8, dtype=torch.int64)), "values must be int32"),
    (dict(values=torch.zeros(3, 8, dtype=torch.int32)), r"K = 16 \* values.size\(0\) = 48 must be a multiple of 32"),
    (dict(metadata=torch.zeros(2, 8, dtype=torch.int16)), "metadata must be int32"),
    (dict(metadata=torch.zeros(4, 8, dtype=torch.int32)), r"metadata must have shape \[K/32, N\] = \[2, 8\]"),
    (dict(metadata=torch.zeros(2, 7, dtype=torch.int32)), r"metadata must have shape \[K/32, N\] = \[2, 8\]"),
    (dict(metadata=torch.zeros(2, 16, dtype=torch.int32)[:, ::2]), "metadata must be contiguous"),
    (dict(scales=torch.ones(4, 8).half()), r"scales must have shape \[K/group_size, N\] = \[2, 8\]"),
    (dict(zeros=None), "zeros is required for weight_format='uint4'"),
    (dict(weight_format="fp4"), "zeros must be None for weight_format='fp4'"),
    (dict(x=torch.randn(2, 64, device="meta")), "x must be on the same device as values"),
])
def test_gemm_bad_input(over, message):
    a = _args(**over)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        torch.ops.marlin.sparse24_gemm(a["x"], a["values"], a["metadata"], a["scales"], a["zeros"], a["bias"],
                                       a["weight_format"], a["group_size"])
    if not {"x", "bias"} & set(over) and "contiguous" not in message:  # the Python mirror (fake kernel) agrees
        with pytest.raises((ValueError, TypeError), match=message.split()[0]):
            sp.check_sparse_quantized(a["values"], a["metadata"], a["scales"], a["zeros"], a["weight_format"],
                                      a["group_size"])


@pytest.mark.parametrize("kept, positions, message", [
    ([[1], [2]], [[1], [1]], r"positions of block 0 .* are \(1, 1\): two equal positions"),
    ([[1], [2]], [[3], [0]], r"are \(3, 0\): positions out of order"),
    ([[1], [2]], [[0], [4]], r"positions must lie in 0..3 .* got 4 at \[1, 0\]"),
    ([[1], [2]], [[-1], [2]], r"positions must lie in 0..3"),
])
def test_pack_bad_positions(kept, positions, message):
    kept = torch.tensor(kept).repeat(8, 1)
    positions = torch.tensor(positions).repeat(8, 1)
    positions[2:] = torch.tensor([[0], [1]]).repeat(7, 1)
    with pytest.raises(ValueError, match=message):
        sp.pack_kept(kept, positions)


# Every kernel build this CPU runs is checked by test_ops.py::test_kernel_build_matches_reference.
