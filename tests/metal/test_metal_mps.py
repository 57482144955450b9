"""The MPS implementations on a real Apple GPU against the CPU op (skipped
without MPS). Same cases and tolerances as the emulator tests."""

import pytest
import torch

import torch_marlin.ops  # noqa: F401

from metal_helpers import has_zeros, DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, K_FOR_GROUP, make_weight, rel_err


def _mps_ready():
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return "no MPS device"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("marlin::gemm", "MPS"):
        return "torch_marlin was built without the MPS bridge"
    return None


_REASON = _mps_ready()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"MPS tests: {_REASON}")


def _to(t):
    return None if t is None else t.to("mps")


@pytest.mark.parametrize("m", (1, 3, 8, 16, 33, 64, 130))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_on_device(fmt, dtype, m):
    for i, group_size in enumerate(GROUP_SIZES):
        gen = torch.Generator().manual_seed(100 * m + i)
        k, n = K_FOR_GROUP[group_size], 83
        packed, scales, zeros = make_weight(fmt, k, n, group_size, gen=gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        ref = torch.ops.marlin.gemm(x, packed, scales, zeros, b, fmt, group_size)
        out = torch.ops.marlin.gemm(_to(x), _to(packed), _to(scales), _to(zeros), _to(b), fmt, group_size)
        assert rel_err(out.cpu(), ref) <= GEMM_TOL[dtype]


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_every_row_count_on_device(fmt, m):
    # the GEMV's row-count and group-size specializations, with (N = 64) and without (N = 83) vector loads
    for i, group_size in enumerate(GROUP_SIZES):
        for n in (83, 64):
            gen = torch.Generator().manual_seed(31 * m + i + n)
            k = K_FOR_GROUP[group_size]
            packed, scales, zeros = make_weight(fmt, k, n, group_size, gen=gen)
            x = torch.randn(m, k, generator=gen).half()
            ref = torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, group_size)
            out = torch.ops.marlin.gemm(_to(x), _to(packed), _to(scales), _to(zeros), None, fmt, group_size)
            assert rel_err(out.cpu(), ref) <= GEMM_TOL[torch.float16]


@pytest.mark.parametrize("m", (1, 5, 16, 130))
@pytest.mark.parametrize("fmt", FORMATS)
def test_k_parallel_on_device(fmt, m):
    packed, scales, zeros = make_weight(fmt, 4096, 40, 128)
    x = torch.randn(m, 4096).half()
    ref = torch.ops.marlin.gemm(x, packed, scales, zeros, None, fmt, 128)
    out = torch.ops.marlin.gemm(_to(x), _to(packed), _to(scales), _to(zeros), None, fmt, 128)
    assert rel_err(out.cpu(), ref) <= GEMM_TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_on_device(fmt, dtype):
    packed, scales, zeros = make_weight(fmt, 512, 37, 64)
    ref = torch.ops.marlin.dequantize(packed, scales, zeros, fmt, 64, dtype)
    out = torch.ops.marlin.dequantize(_to(packed), _to(scales), _to(zeros), fmt, 64, dtype).cpu()
    if fmt == "uint4":
        assert (out.float() - ref.float()).abs().max() <= torch.finfo(dtype).eps * ref.float().abs().max()
    else:
        assert torch.equal(out, ref)


def test_non_contiguous_and_offset_inputs_on_device():
    # storage offsets of x (a slice) and bias go through setBuffer:offset:
    packed, scales, _ = make_weight("fp4", 256, 64, 32)
    big, b_big = torch.randn(5, 300).half(), torch.randn(65).half()
    ref = torch.ops.marlin.gemm(big[1:4, 10:266], packed, scales, None, b_big[1:], "fp4", 32)
    big_d, b_d = big.to("mps"), b_big.to("mps")
    out = torch.ops.marlin.gemm(big_d[1:4, 10:266], packed.to("mps"), scales.to("mps"), None, b_d[1:],
                                "fp4", 32)
    assert rel_err(out.cpu(), ref) <= GEMM_TOL[torch.float16]


@pytest.mark.parametrize("m", (1, 3, 8, 16, 33, 130))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse24_on_device(fmt, dtype, m):
    from test_metal_sparse24 import K_FOR_GROUP as SPARSE_K, make_sparse

    for i, group_size in enumerate(GROUP_SIZES):
        gen = torch.Generator().manual_seed(100 * m + i)
        values, metadata, scales, zeros = make_sparse(fmt, SPARSE_K[group_size], 83, group_size, gen)
        x = torch.randn(m, SPARSE_K[group_size], generator=gen).to(dtype)
        b = torch.randn(83, generator=gen).to(dtype)
        ref = torch.ops.marlin.sparse24_gemm(x, values, metadata, scales, zeros, b, fmt, group_size)
        out = torch.ops.marlin.sparse24_gemm(_to(x), _to(values), _to(metadata), _to(scales), _to(zeros), _to(b),
                                             fmt, group_size)
        assert rel_err(out.cpu(), ref) <= GEMM_TOL[dtype]
        deq = torch.ops.marlin.sparse24_dequantize(_to(values), _to(metadata), _to(scales), _to(zeros), fmt,
                                                   group_size, dtype).cpu()
        ref_deq = torch.ops.marlin.sparse24_dequantize(values, metadata, scales, zeros, fmt, group_size, dtype)
        assert rel_err(deq, ref_deq) <= (2.0 ** -10 if has_zeros(fmt) else 0.0)


@pytest.mark.parametrize("fmt", ("grid", "fp4"))
def test_rans_decode_on_device(fmt):
    from test_metal_rans import CHUNK_BAD, K_BAD, N_BAD, _bad_chunk_cases, make_coded

    gen = torch.Generator().manual_seed(8)
    stream, sym = make_coded(fmt, K_BAD, N_BAD, CHUNK_BAD, 12, K_BAD if fmt == "grid" else 32, gen)[:2]
    args = (stream.words, stream.word_offsets, stream.states, stream.freqs, K_BAD, N_BAD, CHUNK_BAD, 12)
    assert torch.equal(torch.ops.marlin.rans_decode(*map(_to, args[:4]), *args[4:]).cpu().long(), sym)
    for name, words, offsets, _ in _bad_chunk_cases(stream):  # a bad chunk raises the CPU op's error
        bad = (words, offsets, *args[2:])
        with pytest.raises(ValueError) as cpu:
            torch.ops.marlin.rans_decode(*bad)
        with pytest.raises(ValueError) as mps:
            torch.ops.marlin.rans_decode(*map(_to, bad[:4]), *bad[4:])
        assert str(mps.value) == str(cpu.value), name
