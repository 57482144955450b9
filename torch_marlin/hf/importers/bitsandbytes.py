"""bitsandbytes 4-bit checkpoints (QLoRA's NF4, and FP4), as transformers saves them.

config.json `quantization_config`: quant_method "bitsandbytes", load_in_4bit, ...
A 4-bit linear layer `p` (bitsandbytes' Params4bit with its QuantState packed) is stored as
`p.weight` uint8 [N * K / 2, 1] (the row-major weight [N, K] flattened, two codes per byte,
HIGH nibble first), `p.weight.absmax` (float32 per block of `blocksize` values, or uint8
codes when double-quantized: then `p.weight.nested_absmax` float32 per 256 absmax codes,
`p.weight.nested_quant_map` float32 [256] and the JSON's nested_offset give
absmax = nested_quant_map[code] * nested_absmax + offset), `p.weight.quant_map` float32 [16]
and `p.weight.quant_state.bitsandbytes__nf4` (or `__fp4`), a uint8 tensor holding JSON
{quant_type, blocksize, dtype, shape, nested_blocksize, nested_offset}.
w = quant_map[code] * absmax[block].

- NF4 -> `nf4`, group = blocksize (64), scale = absmax rounded once to fp16. nf4's table is
  bitsandbytes' rounded to fp16; each moves at most 2^-11 relative, so every weight is
  within (1 + 2^-11)^2 - 1 < 2^-10 relative of bitsandbytes' float32 value.
- FP4 -> `fp4`: bitsandbytes' FP4 values are E2M1 / 6 for 14 codes (1/6, 1/4, 1/3, 1/2,
  2/3, 1), so scale = absmax / 6 rounded once to fp16 (within 2^-11 relative); but its codes
  1 and 9 mean +-1/192 (a subnormal E2M1 lacks: 0.5 / 6 is its smallest step): those weights
  become 0, an error of absmax / 192 each, counted in the summary.
Blocks must lie inside rows (K a multiple of blocksize); 8-bit (LLM.int8) is not imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict

import torch

from ... import formats
from ...layouts import QuantizedWeight
from ..errors import CheckpointError, UnsupportedQuantization
from .base import ConvertedLayer, LayerPlan
from .reencode import ReencodingImporter

_STATE = ".weight.quant_state.bitsandbytes__"
# bitsandbytes FP4 code -> torch_marlin fp4 (E2M1) code of 6x its value; codes 1 and 9 (+-1/192) -> +-0.
BNB_FP4_TO_E2M1 = torch.tensor([0, 0, 6, 7, 4, 5, 2, 3, 8, 8, 14, 15, 12, 13, 10, 11], dtype=torch.uint8)
BNB_FP4_TINY = (1, 9)


@dataclass
class BitsAndBytesSource(ReencodingImporter):
    QUANT_METHODS = ("bitsandbytes",)
    LABEL = "bitsandbytes"

    config: dict = field(default_factory=dict)
    method: str = "bitsandbytes"

    def __post_init__(self):
        if self.config.get("load_in_8bit") or not self.config.get("load_in_4bit", True):
            raise UnsupportedQuantization("bitsandbytes 8-bit (LLM.int8, load_in_8bit) checkpoints are not imported; "
                                          "torch_marlin imports bitsandbytes 4-bit (NF4, FP4)")
        self.view = self.source
        self.plans: Dict[str, LayerPlan] = {}
        for key in self.source.keys():
            if _STATE in key:
                module = key[: key.index(_STATE)]
                bias = f"{module}.bias" if f"{module}.bias" in self.source else None
                self.plans[module] = LayerPlan(
                    [f"{module}.weight", key] + self.present(*(f"{module}.weight.{name}" for name in (
                        "absmax", "quant_map", "nested_absmax", "nested_quant_map"))), bias)
        if not self.plans:
            raise UnsupportedQuantization("config says bitsandbytes 4-bit but no "
                                          "'*.weight.quant_state.bitsandbytes__nf4' or '__fp4' tensors were found")

    def plan(self) -> Dict[str, LayerPlan]:
        return dict(self.plans)

    def _state(self, module: str, key: str) -> dict:
        raw = self.require(key, torch.uint8)
        try:
            state = json.loads(bytes(raw.reshape(-1).tolist()).decode("utf-8"))
            state["blocksize"], state["shape"] = int(state["blocksize"]), [int(s) for s in state["shape"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{key}: not bitsandbytes' packed quant_state JSON ({e})") from e
        return state

    def absmax(self, module: str, state: dict, blocks: int) -> torch.Tensor:
        """float32 absmax per block, as bitsandbytes computes it (nested: code * absmax2, then + offset)."""
        key = f"{module}.weight.absmax"
        absmax = self.require(key, (torch.float32, torch.uint8), (blocks,))
        if absmax.dtype == torch.float32:
            return absmax
        nested = int(state.get("nested_blocksize", 256))
        code = self.require(f"{module}.weight.nested_quant_map", torch.float32, (256,))
        scale = self.require(f"{module}.weight.nested_absmax", torch.float32, (-(-blocks // nested),))
        values = code[absmax.long()] * scale.repeat_interleave(nested)[:blocks]
        return values + torch.tensor(float(state.get("nested_offset", 0.0)), dtype=torch.float32)

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        state = self._state(module, plan.keys[1])
        kind, blocksize = str(state.get("quant_type")), state["blocksize"]
        if kind not in ("nf4", "fp4"):
            raise UnsupportedQuantization(f"{module}: bitsandbytes quant_type {kind!r} is not 4-bit nf4/fp4")
        if len(state["shape"]) != 2:
            raise CheckpointError(f"{plan.keys[1]}: shape {state['shape']} is not a linear weight [N, K]")
        n, k = state["shape"]
        if blocksize not in formats.GROUP_SIZES or k % blocksize:
            raise UnsupportedQuantization(
                f"{module}: bitsandbytes blocksize {blocksize} with in_features {k}: blocks must be one of "
                f"torch_marlin's group sizes {formats.GROUP_SIZES} and lie inside rows; this layer cannot be "
                f"imported (quantize the float model instead)")
        packed = self.require(f"{module}.weight", torch.uint8)
        if packed.numel() != n * k // 2:
            raise CheckpointError(f"{module}.weight holds {packed.numel()} bytes; shape {[n, k]} needs {n * k // 2}")
        codes = torch.stack((packed.reshape(-1) >> 4, packed.reshape(-1) & 0xF), dim=-1).reshape(n, k)
        absmax = self.absmax(module, state, n * k // blocksize).reshape(n, k // blocksize)
        table = self.require(f"{module}.weight.quant_map", torch.float32, (16,))
        if kind == "nf4":
            expected = torch.tensor(formats.NF4_BITSANDBYTES, dtype=torch.float32)
            scales, fmt = absmax, "nf4"
        else:
            expected = formats.E2M1_VALUES[BNB_FP4_TO_E2M1.long()] / 6
            expected[list(BNB_FP4_TINY)] = torch.tensor([1 / 192, -1 / 192])
            tiny = int(((codes == BNB_FP4_TINY[0]) | (codes == BNB_FP4_TINY[1])).sum())
            if tiny:
                self.note(f"{module}: {tiny} weights use bitsandbytes FP4's +-1/192 code, which E2M1 lacks: set to 0 "
                          f"(each off by its block's absmax / 192)")
            codes = BNB_FP4_TO_E2M1[codes.long()]
            scales, fmt = absmax.double() / 6, "fp4"
        if not torch.allclose(table, expected, rtol=0, atol=1e-7):
            raise UnsupportedQuantization(f"{module}.weight.quant_map is not bitsandbytes' {kind.upper()} table: "
                                          f"{table.tolist()}")
        half = scales.to(torch.float16)  # one rounding: the stated bound, so no note per layer
        if not torch.isfinite(half).all():
            raise UnsupportedQuantization(f"{module}: an absmax exceeds the fp16 range (max {formats.FP16_MAX}); "
                                          f"torch_marlin stores fp16 scales")
        q = QuantizedWeight.from_codes(codes.t().contiguous(), half.t().contiguous(), None, fmt, blocksize,
                                       in_features=k, out_features=n)
        bits = 4 + (8 + 32 / 256 if self.source.dtype(f"{module}.weight.absmax") == torch.uint8 else 32) / blocksize
        return self.imported(module, q, bits, exact=False)

    def description(self) -> dict:
        return {"method": "bitsandbytes", "quant_type": self.config.get("bnb_4bit_quant_type"),
                "double_quant": bool(self.config.get("bnb_4bit_use_double_quant"))}

