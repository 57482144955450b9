"""What every source format provides to the converter, and shared helpers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple, Type

import torch

from ... import formats
from ...layouts import QuantizedLayout, QuantizedWeight
from ..checkpoint import SourceCheckpoint
from ..errors import CheckpointError, UnsupportedQuantization

# Every Importer subclass that names the quant_method values it handles, in
# definition order (torch_marlin/hf/importers/__init__.py imports every module
# of the package, so a new importer is one new file).
REGISTERED: List[Type["Importer"]] = []


@dataclass
class ConvertedLayer:
    qweight: QuantizedLayout  # QuantizedWeight, or QuantizedExperts for an expert stack
    # Input permutation of K for act-order checkpoints: x' = x[..., input_perm].
    input_perm: Optional[torch.Tensor] = None
    # The layer's bias when the converter assembled it (expert stacks from per-expert layers);
    # otherwise it is the plan's bias_key, copied as stored.
    bias: Optional[torch.Tensor] = None


@dataclass
class LayerPlan:
    keys: List[str]  # source tensors consumed by this layer (bias excluded)
    bias_key: Optional[str] = None


@dataclass
class Importer:
    """Base: maps module names to the source tensors of each quantized layer.

    A subclass that sets QUANT_METHODS registers itself: `torch-marlin convert`
    then picks it for a source whose config.json says
    `quantization_config.quant_method` is one of them, or, without that, whose
    directory holds one of its SIDE_FILES (read by `config_from_side_file`).
    """

    QUANT_METHODS: ClassVar[Tuple[str, ...]] = ()  # quant_method values handled (lower case)
    SIDE_FILES: ClassVar[Tuple[str, ...]] = ()  # quantization configs next to config.json (not copied)
    LABEL: ClassVar[str] = ""  # how --help names the source
    CONFIG_KEYS: ClassVar[Tuple[str, ...]] = ()  # the source's own config.json keys, dropped from the output

    source: SourceCheckpoint
    notes: List[str] = field(default_factory=list)  # inexact values etc., for the summary
    method: str = "float"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.QUANT_METHODS:
            REGISTERED.append(cls)

    @classmethod
    def from_config(cls, source: SourceCheckpoint, method: str, config: dict, layout=None,
                    options=None) -> "Importer":
        """The importer for a source whose quant_method is `method` (one of QUANT_METHODS);
        `layout` (the model's ModelLayout) and `options` (reencode.ImportOptions) are for
        importers that need them."""
        return cls(source, config=config)

    @classmethod
    def detect(cls, config: dict) -> Optional[dict]:
        """The quantization config (with its quant_method) of a config.json that names none
        the usual way (MLX's `quantization`), or None."""
        return None

    def tensor_source(self):
        """What the converter streams: the source, or a view with some tensors dequantized."""
        return self.source

    def summary_lines(self) -> List[str]:
        """Lines for the conversion summary (what was imported exactly, within a bound, ...)."""
        return []

    @classmethod
    def config_from_side_file(cls, name: str, data: dict) -> dict:
        """The quantization config held by side file `name` (parsed JSON)."""
        return data

    def layers_in_float(self, linears: List[str], converted: List[str]) -> List[str]:
        """Which of the model's linear layers `linears` stay float, given those converted."""
        done = set(converted)
        return sorted(name for name in linears if name not in done)

    def plan(self) -> Dict[str, LayerPlan]:
        raise NotImplementedError

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        raise NotImplementedError

    def description(self) -> dict:
        """Recorded under quantization_config["source"]."""
        return {"method": self.method}

    def note(self, message: str) -> None:
        """Something not exactly representable: kept for the summary and warned about now."""
        self.notes.append(message)
        warnings.warn(message, stacklevel=3)

    # --- helpers shared by importers -------------------------------------------------

    def plan_layers(self, suffix: str, label: str, tensors_of) -> Dict[str, LayerPlan]:
        """One LayerPlan per '<module><suffix>' tensor: tensors_of(module, key) lists
        the layer's tensors; the bias is added when the checkpoint has one."""
        plans = {}
        for key in self.source.keys():
            if key.endswith(suffix):
                module = key[: -len(suffix)]
                bias = f"{module}.bias"
                plans[module] = LayerPlan(tensors_of(module, key), bias if bias in self.source else None)
        if not plans:
            raise UnsupportedQuantization(f"config says {label} but no '*{suffix}' tensors were found")
        return plans

    def present(self, *keys: str) -> List[str]:
        """The optional tensors among `keys` that the checkpoint has."""
        return [k for k in keys if k in self.source]

    @staticmethod
    def require_4bit(label: str, config: dict) -> None:
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise UnsupportedQuantization(f"{label} bits={bits!r} is not supported; torch_marlin imports 4-bit only")

    def require(self, key: str, dtype=None, shape=None) -> torch.Tensor:
        if key not in self.source:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        if dtype is not None and self.source.dtype(key) not in (dtype if isinstance(dtype, tuple) else (dtype,)):
            raise CheckpointError(f"tensor {key!r} must have dtype {dtype}, got {self.source.dtype(key)}")
        if shape is not None and tuple(self.source.shape(key)) != tuple(shape):
            raise CheckpointError(f"tensor {key!r} has shape {list(self.source.shape(key))}, "
                                  f"expected {list(shape)} from the config and the other tensors")
        return self.source.load(key)

    def to_fp16_scales(self, scales: torch.Tensor, module: str) -> torch.Tensor:
        """Exact fp16 copy of scales computed in float32/64; errors on overflow, notes rounding."""
        wide = scales.to(torch.float64)
        if not torch.isfinite(wide).all():
            raise UnsupportedQuantization(f"{module}: scales contain NaN or Inf")
        if wide.abs().max() > formats.FP16_MAX:
            raise UnsupportedQuantization(f"{module}: scale {float(wide.abs().max()):.6g} exceeds the fp16 "
                                          f"range (max {formats.FP16_MAX}); torch_marlin stores fp16 scales")
        half = scales.to(torch.float16)
        back = half.to(torch.float64)
        if not torch.equal(back, wide):
            diff = (back - wide).abs()
            underflow = int(((half == 0) & (wide != 0)).sum())
            rel = float((diff / wide.abs().clamp_min(1e-300)).max())
            msg = (f"{module}: {int((diff > 0).sum())} of {wide.numel()} scales are not exactly "
                   f"representable in fp16 (max relative change {rel:.3g}")
            self.note(msg + (f"; {underflow} underflow to 0)" if underflow else ")"))
        return half.contiguous()


def supported_group_size(k: int, group_size: int) -> int:
    """Our group size for a source group size: equal if supported, else the largest
    supported divisor (scales are then repeated, which is exact)."""
    if group_size == -1 or group_size > k:
        return -1
    if group_size in formats.GROUP_SIZES:
        return group_size
    for candidate in sorted((g for g in formats.GROUP_SIZES if g > 0), reverse=True):
        if group_size % candidate == 0:
            return candidate
    raise UnsupportedQuantization(f"group size {group_size} cannot be expressed with torch_marlin's "
                                  f"group sizes {formats.GROUP_SIZES}")


def expand_groups(t: torch.Tensor, source_group: int, target_group: int) -> torch.Tensor:
    """Repeat per-group rows [G, N] so each source group becomes several target groups."""
    if target_group == -1 or source_group == target_group:
        return t
    return t.repeat_interleave(source_group // target_group, dim=0)


def unpack_int32_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> [R, C*8]: nibble i of word [r, c] is column 8c+order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64).view(1, 1, 8)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in nibble order
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(packed.shape[0], packed.shape[1] * 8).to(torch.uint8)


def unpack_uint8_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., M] -> [..., 2M]: low nibble is element 2i, high nibble element 2i+1."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def act_order_permutation(g_idx: torch.Tensor, group_size: int, module: str) -> Optional[torch.Tensor]:
    """None if g_idx is the trivial k // group_size; otherwise the permutation of K that
    makes groups contiguous (checked to give exactly group_size rows per group)."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    trivial = torch.arange(k) // (k if group_size == -1 else group_size)
    if torch.equal(g_idx, trivial):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise UnsupportedQuantization(f"{module}: g_idx does not assign exactly group_size={group_size} "
                                      f"rows to each group; cannot make groups contiguous")
    return perm


def codes_to_layer(codes, scales, zeros, module, k, n, source_group) -> QuantizedWeight:
    """Build a QuantizedWeight from integer codes [K, N] (uint4 semantics when zeros given)."""
    group = supported_group_size(k, source_group)
    scales = expand_groups(scales, source_group, group)
    if zeros is not None:
        zeros = expand_groups(zeros, source_group, group)
        if torch.all(zeros == 8):  # symmetric after all: (q - 8) * s is exactly int4
            zeros = None
    weight_format = "uint4" if zeros is not None else "int4"
    kp = formats.padded_in_features(k, group)
    if kp != k:
        pad_code = 0 if weight_format == "uint4" else formats.INT4_OFFSET
        codes = torch.cat([codes, torch.full((kp - k, n), pad_code, dtype=codes.dtype)])
    return QuantizedWeight.from_codes(codes, scales, None if zeros is None else zeros.to(torch.float16),
                                      weight_format, group, in_features=k, out_features=n)
