"""FP4 (E2M1) checkpoints: MXFP4 (gpt-oss, compressed-tensors) and NVFP4 (modelopt, compressed-tensors).

All store E2M1 codes two per byte, low nibble first, along K of the
nn.Linear weight [N, K]; the E2M1 code table equals torch_marlin's fp4.
- MXFP4 gpt-oss: `X_blocks` uint8 [N, K/32, 16] and `X_scales` uint8 [N, K/32]
  holding E8M0 exponents, scale = 2^(e - 127); gpt-oss's expert stacks add a
  leading expert dimension ([E, N, K/32, 16], [E, N, K/32]).
- MXFP4 compressed-tensors (`mxfp4-pack-quantized`): `weight_packed` uint8
  [N, K/2] and `weight_scale` uint8 [N, K/32], the same E8M0 exponents; no
  global scale. Byte for byte the gpt-oss layout with the blocks flattened.
- NVFP4 modelopt: `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn
  [N, K/16], `weight_scale_2` fp32 scalar; scale = weight_scale * weight_scale_2.
- NVFP4 compressed-tensors: `weight_packed` uint8 [N, K/2], `weight_scale`
  float8_e4m3fn [N, K/16], `weight_global_scale` fp32 holding the reciprocal:
  scale = weight_scale / weight_global_scale.
Scales are folded into one fp16 scale per group; values fp16 cannot hold
exactly are reported (Importer.to_fp16_scales), never silently changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from ...layouts import QuantizedExperts, QuantizedWeight
from ..errors import CheckpointError, UnsupportedQuantization
from .base import ConvertedLayer, Importer, LayerPlan, unpack_uint8_pairs

E8M0_NAN = 255


def e8m0_scales(exponents: torch.Tensor, where: str) -> torch.Tensor:
    """E8M0 exponents -> float64 scales 2^(e - 127); the NaN code (255) is refused.
    `where` names the layer and the tensor in the error."""
    exponents = exponents.to(torch.int32)
    if (exponents == E8M0_NAN).any():
        raise UnsupportedQuantization(f"{where}: E8M0 scale 255 (NaN)")
    return torch.pow(2.0, (exponents - 127).to(torch.float64))


def fp4_layer(codes_nk: torch.Tensor, scales_ng: torch.Tensor, group_size: int) -> QuantizedWeight:
    """codes [N, K] uint8 E2M1 and fp16 scales [N, K/group] -> QuantizedWeight."""
    n, k = codes_nk.shape
    if k % 8:
        raise UnsupportedQuantization(f"in_features {k} is not a multiple of 8")
    return QuantizedWeight.from_codes(codes_nk.t().contiguous(), scales_ng.t().contiguous(), None,
                                      "fp4", group_size, in_features=k, out_features=n)


@dataclass
class MXFP4Source(Importer):
    """gpt-oss layout (`flavor="gpt-oss"`: linear weights `<module>.weight_blocks` and
    expert stacks `<experts>.<param>_blocks` [E, N, K/32, 16] with `_scales` [E, N, K/32]
    and an optional `<param>_bias` [E, N], each expert exactly like a linear weight) or
    compressed-tensors (`flavor="compressed-tensors"`, planned by CompressedTensorsSource,
    which hands each MXFP4 layer to `convert`)."""

    QUANT_METHODS = ("mxfp4",)
    LABEL = "MXFP4"

    config: dict = field(default_factory=dict)
    flavor: str = "gpt-oss"
    method: str = "mxfp4"

    def __post_init__(self):
        if self.flavor not in ("gpt-oss", "compressed-tensors"):
            raise ValueError(f"flavor must be 'gpt-oss' or 'compressed-tensors', got {self.flavor!r}")

    def plan(self) -> Dict[str, LayerPlan]:
        def tensors(module, key):
            if len(self.source.shape(key)) != 3:
                raise UnsupportedQuantization(f"{key}: expected [N, K/32, 16] for a linear weight, got "
                                              f"{list(self.source.shape(key))} (expert stacks are "
                                              f"'<experts>.<param>_blocks')")
            return [key, f"{module}.weight_scales"]

        plans = {}
        for key in self.source.keys():
            if key.endswith("_blocks") and not key.endswith(".weight_blocks"):
                stack = key[: -len("_blocks")]
                if len(self.source.shape(key)) != 4:
                    raise UnsupportedQuantization(
                        f"{key}: MXFP4 tensor of parameter {stack.rpartition('.')[2]!r} must be an expert stack "
                        f"[E, N, K/32, 16], got {list(self.source.shape(key))}")
                bias = f"{stack}_bias"
                plans[stack] = LayerPlan([key, f"{stack}_scales"], bias if bias in self.source else None)
        if any(key.endswith(".weight_blocks") for key in self.source.keys()) or not plans:
            plans.update(self.plan_layers(".weight_blocks", "MXFP4", tensors))
        return plans

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        """plan.keys: the E2M1 bytes, then the E8M0 exponents."""
        packed = self.require(plan.keys[0], torch.uint8)
        if self.flavor == "gpt-oss":
            if packed.dim() not in (3, 4) or packed.shape[-1] != 16:
                raise CheckpointError(f"{plan.keys[0]}: expected [N, K/32, 16] or an expert stack [E, N, K/32, 16] "
                                      f"(16 bytes = 32 values per block), got {list(packed.shape)}")
            packed = packed.reshape(*packed.shape[:-2], -1)
        elif packed.dim() != 2 or packed.shape[1] % 16:
            raise CheckpointError(f"{plan.keys[0]}: expected [N, K/2] with K a multiple of 32, "
                                  f"got {list(packed.shape)}")
        rows, groups = tuple(packed.shape[:-1]), packed.shape[-1] // 16  # rows: [N] or [E, N]
        exponents = self.require(plan.keys[1], torch.uint8, (*rows, groups))
        scales = self.to_fp16_scales(e8m0_scales(exponents, f"{module} ({plan.keys[1]})"), module)
        codes = unpack_uint8_pairs(packed)
        if len(rows) == 1:
            return ConvertedLayer(fp4_layer(codes, scales, 32))
        return ConvertedLayer(QuantizedExperts.stack([fp4_layer(codes[e], scales[e], 32) for e in range(rows[0])]))


@dataclass
class NVFP4Source(Importer):
    """modelopt layout (`flavor="modelopt"`) or compressed-tensors (`flavor="compressed-tensors"`)."""

    QUANT_METHODS = ("modelopt",)
    SIDE_FILES = ("hf_quant_config.json",)  # modelopt's
    LABEL = "modelopt (NVFP4)"

    config: dict = field(default_factory=dict)
    flavor: str = "modelopt"
    method: str = "nvfp4"
    group_size: int = 16

    def __post_init__(self):
        if self.flavor == "modelopt":
            self.packed_name, self.global_name, self.reciprocal = "weight", "weight_scale_2", False
        elif self.flavor == "compressed-tensors":
            self.packed_name, self.global_name, self.reciprocal = "weight_packed", "weight_global_scale", True
        else:
            raise ValueError(f"flavor must be 'modelopt' or 'compressed-tensors', got {self.flavor!r}")
        group = int(self.config.get("group_size", 16) or 16)
        if group != 16:
            raise UnsupportedQuantization(f"NVFP4 group_size={group} is not supported (expected 16)")

    @classmethod
    def from_config(cls, source, method, config, layout=None, options=None):
        algo = str(config.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise UnsupportedQuantization(f"modelopt quant_algo={algo!r} is not supported (only NVFP4)")
        return cls(source, config=config, flavor="modelopt")

    @classmethod
    def config_from_side_file(cls, name, data):
        return dict(data.get("quantization", data))

    def plan(self) -> Dict[str, LayerPlan]:
        # Activation scales only matter for FP4 activations; torch_marlin is weight-only.
        return self.plan_layers("." + self.global_name, f"NVFP4 ({self.flavor})", lambda module, key: [
            f"{module}.{self.packed_name}", f"{module}.weight_scale", key,
            *self.present(f"{module}.input_scale", f"{module}.input_global_scale")])

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        packed = self.require(plan.keys[0], torch.uint8)
        n, half_k = packed.shape
        k = half_k * 2
        if k % self.group_size:
            raise CheckpointError(f"{plan.keys[0]}: K={k} is not a multiple of 16")
        block_scales = self.require(plan.keys[1], torch.float8_e4m3fn, (n, k // 16)).to(torch.float64)
        global_scale = self.require(plan.keys[2], (torch.float32, torch.float16, torch.bfloat16))
        if global_scale.numel() != 1:
            raise CheckpointError(f"{plan.keys[2]} must hold one value, got shape {list(global_scale.shape)}")
        # Same arithmetic as the source's dequantization: float32 product/quotient.
        g = global_scale.to(torch.float32).reshape(())
        if self.reciprocal:
            if g == 0:
                raise UnsupportedQuantization(f"{plan.keys[2]} is zero")
            scales = block_scales.to(torch.float32) / g
        else:
            scales = block_scales.to(torch.float32) * g
        codes = unpack_uint8_pairs(packed)
        return ConvertedLayer(fp4_layer(codes, self.to_fp16_scales(scales, module), 16))

    def description(self) -> dict:
        return {"method": "nvfp4", "flavor": self.flavor, "group_size": 16}
