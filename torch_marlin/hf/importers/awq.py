"""AWQ (AutoAWQ, version "gemm") 4-bit checkpoints.

Layout per layer `prefix`: qweight int32 [K, N/8] packed along N, nibble i of
word [k, c] holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros int32
[G, N/8] packed the same way (zero points stored as is); scales [G, N].
w[k, n] = (q - z[k // g, n]) * s[k // g, n].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from ..errors import UnsupportedQuantization
from .base import ConvertedLayer, Importer, LayerPlan, codes_to_layer, unpack_int32_cols

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) held by nibble i


@dataclass
class AWQSource(Importer):
    QUANT_METHODS = ("awq",)
    SIDE_FILES = ("quant_config.json",)  # AutoAWQ's
    LABEL = "AWQ"

    config: dict = field(default_factory=dict)
    method: str = "awq"

    def __post_init__(self):
        self.require_4bit("AWQ", self.config)
        version = str(self.config.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"AWQ version={version!r} is not supported (only 'gemm': "
                                          f"the GEMV layout packs differently)")
        if not self.config.get("zero_point", True):
            raise UnsupportedQuantization("AWQ with zero_point=false is not supported")
        self.group_size = int(self.config.get("group_size", self.config.get("q_group_size", 128)))

    def plan(self) -> Dict[str, LayerPlan]:
        return self.plan_layers(".qweight", "AWQ", lambda module, key: [key, f"{module}.qzeros", f"{module}.scales"])

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        qweight = self.require(f"{module}.qweight", torch.int32)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        qzeros = self.require(f"{module}.qzeros", torch.int32, (groups, n // 8))
        scales = self.require(f"{module}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n))
        codes = unpack_int32_cols(qweight, AWQ_PACK_ORDER)
        zeros = unpack_int32_cols(qzeros, AWQ_PACK_ORDER).to(torch.float32)
        q = codes_to_layer(codes, self.to_fp16_scales(scales, module), zeros, module, k, n, self.group_size)
        return ConvertedLayer(q)

    def description(self) -> dict:
        return {"method": "awq", "group_size": self.group_size, "version": "gemm"}
