"""Bitwise dequant helpers (metal/marlin_dequant.h) and the standalone
dequantize kernel (metal/dequant.metal), on the emulator, against the CPU op."""

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.formats import E2M1_VALUES, NF4_BITSANDBYTES
from torch_marlin.testing import run_metal
from torch_marlin.testing.metal import run_metal_with_stats

from metal_helpers import as_flushing_gpu, has_zeros, DTYPES, FORMATS, GROUP_SIZES, SEEDS, make_weight

ALL_CODES = torch.arange(16)


def _every_code_weight(fmt, n=48):
    # Column c of the 16-row block holds code (r + c) % 16 in row r: every code
    # in every nibble position of a word and in every column.
    k = 16
    codes = (torch.arange(k).view(-1, 1) + torch.arange(n).view(1, -1)) % 16
    packed, _, _ = make_weight(fmt, k, n, -1, codes=codes)
    return codes, packed


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_unit_scale(fmt, dtype):
    codes, packed = _every_code_weight(fmt)
    n = packed.shape[1]
    scales = torch.ones(1, n, dtype=torch.float16)
    zeros = torch.zeros(1, n, dtype=torch.float16) if has_zeros(fmt) else None
    out = run_metal("dequantize", packed, scales, zeros, fmt, -1, dtype)
    if fmt == "fp4":
        expect = E2M1_VALUES[codes.long()]
    elif fmt == "int4":
        expect = codes.float() - 8
    elif fmt == "nf4":  # bitsandbytes' table rounded to fp16 (docs/FORMAT.md)
        expect = torch.tensor(NF4_BITSANDBYTES, dtype=torch.float64).half().float()[codes.long()]
    else:  # q (uint4 with zero 0, affine with bias 0)
        expect = codes.float()
    assert out.dtype == dtype
    expect = expect.to(dtype).float()  # one rounding (nf4's values are not all exact in bf16)
    assert torch.equal(out.float(), expect)
    # sign bits too: fp4 code 0x8 is -0.0, code 0x0 is +0.0
    assert torch.equal(torch.signbit(out.float()), torch.signbit(expect))
    if fmt == "fp4":
        assert torch.signbit(out.float()[codes == 8]).all()
        assert (out.float()[codes == 1] == 0.5).all() and (out.float()[codes == 9] == -0.5).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_with_scales_and_zeros(fmt):
    # Scales spanning fp16's range (incl. > 4, where folding 2^14 into a half
    # scale would overflow) and fractional zeros.
    codes, packed = _every_code_weight(fmt)
    n = packed.shape[1]
    scales = torch.tensor([2.0 ** e for e in range(-12, 12)] * 2, dtype=torch.float16)[:n].view(1, n)
    scales = scales * torch.tensor([1.0, -0.7734375, 1.5, 3.0 / 7.0] * (n // 4), dtype=torch.float16)
    zeros = (torch.arange(n).view(1, n) * 0.3359375).half() if has_zeros(fmt) else None
    for dtype in DTYPES:
        # fp16 outputs below 2^-14 (small scales) are zeros on a GPU that flushes subnormals
        ref = as_flushing_gpu(torch.ops.marlin.dequantize(packed, scales, zeros, fmt, -1, dtype))
        out = run_metal("dequantize", packed, scales, zeros, fmt, -1, dtype)
        if fmt == "uint4":
            # docs/FORMAT.md: within one ulp of the output dtype
            ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((out.float() - ref.float()).abs() <= ulp).all()
        else:
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               ref.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel_matches_cpu(fmt, group_size, dtype):
    gen = torch.Generator().manual_seed(FORMATS.index(fmt) * 1000 + group_size)
    k = 512 if group_size in (256, -1) else 4 * group_size + 8 * (group_size == -1)
    n = 37  # tail: not a multiple of the 32-column threadgroup
    packed, scales, zeros = make_weight(fmt, k, n, group_size, gen=gen)
    ref = torch.ops.marlin.dequantize(packed, scales, zeros, fmt, group_size, dtype)
    for seed in SEEDS:
        out, plan, stats = run_metal_with_stats("dequantize", packed, scales, zeros, fmt, group_size,
                                                dtype=dtype, seed=seed)
        assert [l["kernel"] for l in plan["launches"]] == [f"marlin_dequant_{fmt}_{plan['dtype']}"]
        assert out.shape == ref.shape and out.dtype == ref.dtype
        if fmt == "uint4":
            ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((out.float() - ref.float()).abs() <= ulp).all()
        else:
            assert torch.equal(out, ref)


def test_dequantize_default_dtype_and_packed_bytes_read_once():
    packed, scales, _ = make_weight("fp4", 64, 40, 32)
    out, plan, stats = run_metal_with_stats("dequantize", packed, scales, None, "fp4", 32)
    assert out.dtype == torch.float16
    assert stats[0].buffer_bytes[0] == packed.numel() * 4
