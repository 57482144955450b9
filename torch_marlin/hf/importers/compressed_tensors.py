"""compressed-tensors checkpoints (llm-compressor): `pack-quantized` int4 here,
`nvfp4-pack-quantized` and `mxfp4-pack-quantized` FP4 in fp4.py.

Layout per layer `prefix`: weight_packed int32 [N, ceil(K/8)] (nibble i of
word [n, c] is column k = 8c+i, holding q + 8 for the signed value q),
weight_scale [N, G] (G = 1 for the channel strategy), weight_shape [2] =
[N, K] (int32 or int64), weight_zero_point for asymmetric schemes (int32
[ceil(N/8), G] packed along N, each nibble zp + 8), optional weight_g_idx.
w[n, k] = (q - zp) * s, i.e. (stored - (zp + 8)) * s: uint4 with zero =
zp + 8, or int4 when symmetric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ...formats import unpack_codes
from ..errors import CheckpointError, UnsupportedQuantization
from .base import ConvertedLayer, Importer, LayerPlan, act_order_permutation, codes_to_layer, unpack_int32_cols
from .fp4 import MXFP4Source, NVFP4Source

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _target_matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    # Class names ("Linear") match every linear layer; otherwise a module name or suffix.
    return target[:1].isupper() and "." not in target or module == target or module.endswith("." + target)


@dataclass
class CompressedTensorsSource(Importer):
    QUANT_METHODS = ("compressed-tensors",)
    LABEL = "compressed-tensors"

    config: dict = field(default_factory=dict)
    method: str = "compressed-tensors"

    def __post_init__(self):
        groups = self.config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise UnsupportedQuantization("compressed-tensors config has no 'config_groups'")
        self.groups = groups
        self.ignore = list(self.config.get("ignore") or [])
        self.default_format = self.config.get("format")
        self._nvfp4 = NVFP4Source(self.source, self.notes, config={"group_size": 16}, flavor="compressed-tensors")
        self._mxfp4 = MXFP4Source(self.source, self.notes, flavor="compressed-tensors")

    def _scheme(self, module: str):
        for name, group in self.groups.items():
            if any(_target_matches(t, module) for t in group.get("targets", [])):
                return name, group
        if len(self.groups) == 1:
            return next(iter(self.groups.items()))
        raise UnsupportedQuantization(f"{module}: no config group targets this layer")

    def _format(self, module: str):
        """(compressed-tensors format, weights args) of the config group that targets `module`."""
        _, group = self._scheme(module)
        return group.get("format") or self.default_format, group.get("weights") or {}

    def plan(self) -> Dict[str, LayerPlan]:
        def tensors(module, key):
            fmt, _ = self._format(module)
            if fmt == "nvfp4-pack-quantized":
                return [key, f"{module}.weight_scale", f"{module}.weight_global_scale",
                        *self.present(f"{module}.input_global_scale")]
            if fmt == "mxfp4-pack-quantized":  # activation scales of MXFP4 are dynamic: none stored
                return [key, f"{module}.weight_scale"]
            if fmt == "pack-quantized":
                return [key, *self.present(*(f"{module}.{n}" for n in ("weight_scale", "weight_shape",
                                                                        "weight_zero_point", "weight_g_idx")))]
            raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} is not supported (supported: "
                                          f"pack-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized)")

        return self.plan_layers(".weight_packed", "compressed-tensors", tensors)

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        fmt, args = self._format(module)
        if fmt == "nvfp4-pack-quantized":
            if args.get("num_bits") != 4 or args.get("type") != "float" or args.get("group_size", 16) != 16:
                raise UnsupportedQuantization(f"{module}: nvfp4 weights args {args} are not FP4 group 16")
            return self._nvfp4.convert(module, plan)
        if fmt == "mxfp4-pack-quantized":
            if (args.get("num_bits") != 4 or args.get("type") != "float" or args.get("group_size") != 32
                    or args.get("symmetric") is False):
                raise UnsupportedQuantization(f"{module}: mxfp4 weights args {args} are not symmetric FP4 group 32")
            return self._mxfp4.convert(module, plan)
        return self._convert_int4(module, args)

    def _convert_int4(self, module: str, args: dict) -> ConvertedLayer:
        if args.get("num_bits") != 4 or args.get("type", "int") != "int":
            raise UnsupportedQuantization(f"{module}: weights args num_bits={args.get('num_bits')!r}, "
                                          f"type={args.get('type')!r}; only 4-bit int is supported")
        strategy = args.get("strategy")
        shape = self.require(f"{module}.weight_shape", (torch.int32, torch.int64))
        if shape.numel() != 2:
            raise CheckpointError(f"{module}.weight_shape must hold [N, K], got {shape.tolist()}")
        n, k = (int(v) for v in shape.tolist())
        words = -(-k // 8)
        packed = self.require(f"{module}.weight_packed", torch.int32, (n, words))
        if strategy == "group":
            source_group = int(args.get("group_size") or 0)
            if source_group <= 0:
                raise UnsupportedQuantization(f"{module}: group strategy without a group_size")
            groups = -(-k // source_group)
        elif strategy in ("channel", "tensor"):
            source_group, groups = -1, 1
        else:
            raise UnsupportedQuantization(f"{module}: strategy {strategy!r} is not supported "
                                          f"(group, channel, tensor)")
        scale_key = f"{module}.weight_scale"
        if strategy == "tensor":
            scales = self.require(scale_key, _FLOAT_DTYPES).reshape(-1)
            if scales.numel() != 1:
                raise CheckpointError(f"{scale_key}: tensor strategy needs one scale, got {scales.numel()}")
            scales = scales.expand(n).reshape(n, 1)
        else:
            scales = self.require(scale_key, _FLOAT_DTYPES, (n, groups))
        codes = unpack_int32_cols(packed)[:, :k].t().contiguous()  # [K, N]
        zeros = self._zero_points(module, args, n, groups)
        perm = None
        if f"{module}.weight_g_idx" in self.source and source_group > 0:
            g_idx = self.require(f"{module}.weight_g_idx", (torch.int32, torch.int64), (k,))
            perm = act_order_permutation(g_idx, source_group, module)
        if perm is not None:
            codes = codes[perm]
        scales16 = self.to_fp16_scales(scales.t(), module)
        q = codes_to_layer(codes, scales16, zeros, module, k, n, source_group)
        return ConvertedLayer(q, input_perm=None if perm is None else perm.to(torch.int32))

    def _zero_points(self, module: str, args: dict, n: int, groups: int) -> Optional[torch.Tensor]:
        """uint4 zero points [G, N] as float (zp + 8), or None when symmetric."""
        key = f"{module}.weight_zero_point"
        if args.get("symmetric", True):
            return None
        if key not in self.source:
            raise CheckpointError(f"{key} is missing for an asymmetric scheme")
        dtype = self.source.dtype(key)
        if dtype == torch.int32:  # packed along N: [ceil(N/8), G]
            zp = self.require(key, torch.int32, (-(-n // 8), groups))
            return unpack_codes(zp)[:n].t().to(torch.float32)
        zp = self.require(key, (torch.int8, torch.int16, torch.int64) + _FLOAT_DTYPES, (n, groups))
        return zp.t().to(torch.float32) + 8  # unpacked signed zero points

    def description(self) -> dict:
        return {"method": "compressed-tensors", "format": self.default_format}
