"""Shared by tests/metal: inputs, tolerances, the emulator availability probe."""

import functools
import os
from unittest import mock

import torch
from mslsim import FLUSH_SUBNORMALS_ENV, flush_subnormals_default  # conftest.py turns it on for tests/metal

from torch_marlin.formats import ACTIVATION_DTYPES as DTYPES  # noqa: F401  (re-exported to the tests)
from torch_marlin.formats import GROUP_SIZES  # noqa: F401
from torch_marlin.formats import WEIGHT_FORMATS as FORMATS  # noqa: F401
from torch_marlin.formats import has_zeros, pack_codes  # noqa: F401  (has_zeros re-exported)
SEEDS = (0, 1)  # two random emulator schedules per case

# Max |metal - cpu| / max |cpu| for gemm. Both accumulate in fp32 (different
# order) and round once to the activation dtype, so the bound is about one
# ulp of the output dtype at the largest output plus fp32 summation noise.
GEMM_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-5}

# K per group size: tails are K not a multiple of the 32-deep GEMM stage.
K_FOR_GROUP = {16: 208, 32: 96, 64: 192, 128: 384, 256: 512, -1: 200}


@functools.lru_cache(maxsize=1)
def emulator_unavailable_reason():
    try:
        import mslsim
        from torch_marlin.testing.metal import library

        with mock.patch.dict(os.environ, {FLUSH_SUBNORMALS_ENV: os.environ.get(FLUSH_SUBNORMALS_ENV, "1")}):
            lib = library("dequant")  # in the mode of the tests, not to compile it twice
        if "marlin_dequant_fp4_f16" not in lib.kernels():
            return "metal/dequant.metal compiled without its kernels"
        del mslsim
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: skip with the reason
        return f"{type(e).__name__}: {e}"


def as_flushing_gpu(ref):
    """ref as a GPU that flushes subnormals returns it (tests/metal runs the kernels so: conftest.py):
    results below the dtype's smallest normal are signed zeros."""
    if not flush_subnormals_default():
        return ref
    return torch.where(ref.abs() < torch.finfo(ref.dtype).tiny, ref * 0, ref)  # * 0 keeps the sign


def make_weight(fmt, k, n, group_size, codes=None, gen=None):
    groups = 1 if group_size == -1 else k // group_size
    if codes is None:
        codes = torch.randint(0, 16, (k, n), generator=gen)
    packed = pack_codes(codes)
    scales = (torch.rand(groups, n, generator=gen) * 0.5 + 0.01).half()
    zeros = (torch.rand(groups, n, generator=gen) * 15).half() if has_zeros(fmt) else None
    return packed, scales, zeros


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# Largest rel_err seen per (kernel family, dtype) in this session, printed at
# the end of the run (conftest.py): the figures docs/KERNELS.md quotes.
LARGEST_ERRORS = {}


def record_error(kernel, dtype, err):
    parts = kernel.split("_")  # marlin_gemv_fp4_f16, marlin_gemm_fused_fp4_f16_tm32, ...
    family = "_".join(parts[1:3]) if parts[1] == "gemm" else parts[1]
    key = (family, str(dtype).split(".")[-1])
    LARGEST_ERRORS[key] = max(LARGEST_ERRORS.get(key, 0.0), err)
