"""GPTQ (AutoGPTQ / GPTQModel) 4-bit checkpoints.

Layout per layer `prefix`: qweight int32 [K/8, N] (nibble j of word [r, n] is
row 8r+j, the same packing as torch_marlin), qzeros int32 [G, N/8] packed
along N, scales fp16 [G, N], optional g_idx int32 [K] (group of each row).
Checkpoint format "gptq" (v1) stores each zero point minus one, and its
dequantization adds the one back without masking (a stored 15 means 16);
"gptq_v2" stores the zero point itself. w[k, n] = (q - z[g_idx[k], n]) * s[g_idx[k], n].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from ...formats import unpack_codes
from ..errors import UnsupportedQuantization
from .base import ConvertedLayer, Importer, LayerPlan, act_order_permutation, codes_to_layer, unpack_int32_cols


@dataclass
class GPTQSource(Importer):
    QUANT_METHODS = ("gptq",)
    SIDE_FILES = ("quantize_config.json",)  # AutoGPTQ's, when config.json has no quantization_config
    LABEL = "GPTQ"

    config: dict = field(default_factory=dict)
    method: str = "gptq"

    def __post_init__(self):
        self.require_4bit("GPTQ", self.config)
        self.group_size = int(self.config.get("group_size", 128))
        # AutoGPTQ/transformers say checkpoint_format, newer GPTQModel says format.
        fmt = self.config.get("checkpoint_format") or self.config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"GPTQ checkpoint_format={fmt!r} is not supported "
                                          f"(expected 'gptq' or 'gptq_v2')")
        self.zero_offset = 1 if fmt == "gptq" else 0

    def plan(self) -> Dict[str, LayerPlan]:
        return self.plan_layers(".qweight", "GPTQ", lambda module, key: [
            key, f"{module}.qzeros", f"{module}.scales", *self.present(f"{module}.g_idx")])

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        qweight = self.require(f"{module}.qweight", torch.int32)
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        qzeros = self.require(f"{module}.qzeros", torch.int32, (groups, -(-n // 8)))
        scales = self.require(f"{module}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n))
        codes = unpack_codes(qweight)
        zeros = unpack_int32_cols(qzeros)[:, :n].to(torch.float32) + self.zero_offset
        perm = None
        if f"{module}.g_idx" in self.source:
            g_idx = self.require(f"{module}.g_idx", (torch.int32, torch.int64), (k,))
            if g_idx.min() < 0 or g_idx.max() >= groups:
                raise UnsupportedQuantization(f"{module}.g_idx has values outside 0..{groups - 1}")
            perm = act_order_permutation(g_idx, self.group_size, module)
        if perm is not None:
            codes = codes[perm]
        q = codes_to_layer(codes, self.to_fp16_scales(scales, module), zeros, module, k, n, self.group_size)
        return ConvertedLayer(q, input_perm=None if perm is None else perm.to(torch.int32))

    def description(self) -> dict:
        return {"method": "gptq", "group_size": self.group_size,
                "desc_act": bool(self.config.get("desc_act", False)), "sym": self.config.get("sym")}
