"""The kernels are subnormal-free: tests/metal runs them in the emulator's flush-subnormals mode
(conftest.py), as a GPU that flushes fp16 / fp32 subnormals would. The fp4 decode used to make +-0.5
the half subnormal 0x0200 (value * 2^-14, 2^14 folded into the scale): right on an IEEE GPU, codes 1
and 9 decoded as 0 on a flushing one. This shows the mode catches that decode, and that the decode
of metal/ is right in it."""
import re
import shutil

import pytest
import torch

from torch_marlin.formats import E2M1_VALUES
from torch_marlin.testing import run_metal
from torch_marlin.testing.metal import metal_dir

from metal_helpers import FLUSH_SUBNORMALS_ENV, make_weight

OLD_FP4_DECODE = """inline half2 marlin_fp4_pair(uint w, uint p) {
  const uint t = p < 2 ? w << (8 - 4 * p) : w >> (4 * p - 8);
  return as_type<half2>(((t + t) & 0x0E000E00u) | ((t << 4) & 0x80008000u));
}"""


@pytest.fixture(scope="module")
def old_decode_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("metal_old_fp4") / "metal"
    shutil.copytree(metal_dir(), d)
    header = d / "marlin_dequant.h"
    text, n = re.subn(r"inline half2 marlin_fp4_pair\(uint w, uint p\) \{.*?\n\}", OLD_FP4_DECODE,
                      header.read_text(), flags=re.S)
    text, m = re.subn(r"kMarlinFp4ScaleFold = [0-9.]+f;", "kMarlinFp4ScaleFold = 16384.0f;", text)
    assert n == m == 1
    header.write_text(text)
    return d


def _dequant_every_code():
    codes = torch.arange(16).repeat(8, 1)  # [8 rows of K, 16 columns]: code c in column c
    codes = torch.cat([codes, codes.roll(8, dims=1)])  # and in both halves of a word
    packed, _, _ = make_weight("fp4", 16, 16, -1, codes=codes)
    scales = torch.ones(1, 16, dtype=torch.float16)
    return codes, run_metal("dequantize", packed, scales, None, "fp4", -1, torch.float16).float()


@pytest.mark.parametrize("flush", ["0", "1"])
def test_old_fp4_decode_depends_on_subnormals(old_decode_dir, monkeypatch, flush):
    monkeypatch.setenv("TORCH_MARLIN_METAL_DIR", str(old_decode_dir))
    monkeypatch.setenv(FLUSH_SUBNORMALS_ENV, flush)
    codes, out = _dequant_every_code()
    expect = E2M1_VALUES[codes]
    if flush == "0":
        assert torch.equal(out, expect)
    else:  # 0.5 and -0.5 flushed to zero, everything else right
        half = (codes == 1) | (codes == 9)
        assert (out[half] == 0).all() and torch.equal(out[~half], expect[~half])


def test_fp4_decode_is_subnormal_free(monkeypatch):
    monkeypatch.setenv(FLUSH_SUBNORMALS_ENV, "1")
    codes, out = _dequant_every_code()
    assert torch.equal(out, E2M1_VALUES[codes])
    assert torch.equal(torch.signbit(out), torch.signbit(E2M1_VALUES[codes]))  # code 8 is -0.0
