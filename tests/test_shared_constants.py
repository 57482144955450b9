"""One source of truth: the facts of metal/marlin_common.h (C++ and Metal) equal
those of torch_marlin/formats.py (Python), and the persisted numbering is pinned."""

import torch

import torch_marlin
from torch_marlin import formats
import mslsim
from torch_marlin.testing.metal import metal_dir


def test_cpp_header_equals_formats_py():
    cpp = torch_marlin._C.SHARED_CONSTANTS
    assert cpp["WEIGHT_FORMATS"] == formats.WEIGHT_FORMATS
    assert cpp["FORMATS_WITH_ZEROS"] == formats.FORMATS_WITH_ZEROS
    assert cpp["GROUP_SIZES"] == formats.GROUP_SIZES
    assert cpp["PACK_FACTOR"] == formats.PACK_FACTOR
    assert cpp["INT4_OFFSET"] == formats.INT4_OFFSET


def test_persisted_format_numbers_are_pinned():
    # MarlinLinear state_dicts and checkpoints store these numbers: they never change.
    assert formats.WEIGHT_FORMATS[:5] == ("fp4", "uint4", "int4", "nf4", "affine")
    qweight = torch_marlin.quantize_weight(torch.randn(8, 64), "int4", 32)
    assert qweight.descriptor()[:2] == [1, 2]  # dense layout 1, int4 = 2


_PROBE = """
#include <metal_stdlib>
#include "marlin_common.h"
using namespace metal;
#define MARLIN_NAME_LENGTH(name, F, _) out[1 + int(marlin::F)] = int(sizeof(#name)) - 1;
[[kernel]] void probe(device int* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  if (tid != 0) return;
  out[0] = marlin::kNumWeightFormats;
  MARLIN_FOR_EACH_FORMAT(MARLIN_NAME_LENGTH, )
  for (int i = 0; i < marlin::kNumGroupSizes; ++i) out[8 + i] = marlin::kGroupSizes[i];
  out[16] = marlin::kPackFactor;
  out[17] = marlin::kInt4Offset;
  out[18] = marlin::has_zeros(marlin::kUint4) ? 1 : 0;
}
"""


def test_metal_sees_the_same_header():
    lib = mslsim.compile(_PROBE, include_dirs=(str(metal_dir()),))
    out = torch.zeros(32, dtype=torch.int32)
    lib.launch("probe", grid=(1, 1, 1), threadgroup=(1, 1, 1), args={0: out})
    n = len(formats.WEIGHT_FORMATS)
    assert out[0] == n
    assert out[1:1 + n].tolist() == [len(name) for name in formats.WEIGHT_FORMATS]
    assert tuple(out[8:8 + len(formats.GROUP_SIZES)].tolist()) == formats.GROUP_SIZES
    assert (out[16], out[17], out[18]) == (formats.PACK_FACTOR, formats.INT4_OFFSET, 1)
