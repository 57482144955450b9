"""MLX checkpoints (mlx-lm, the mlx-community models): config.json `quantization`.

`quantization` = {"group_size", "bits", "mode"} plus per-module entries (a module's own
{"group_size", "bits", "mode"}, or false for a float module). A quantized module `p` stores
`p.weight` uint32 [N, K * bits / 32] (codes along K, least significant bits first),
`p.scales` [N, K / group] and, for mode "affine", `p.biases` [N, K / group]:
- affine: w = scales * q + biases, scales and biases in the model dtype (bf16/fp16/fp32).
  4-bit: the word layout is torch_marlin's own (nibble j of word [n, c] is row 8c + j of
  B = W^T), so `packed` is the transposed words and the layer is `affine`: exactly when
  scales and biases are fp16 values (bf16 in fp16's normal range always is), else (fp32
  scales) each rounded once to fp16: |dw| <= 2^-11 (15 |scale| + |bias|) (2^-25 absolute
  per rounding below fp16's normal range); beyond fp16's range the layer is kept in float.
- mxfp4: E2M1 codes, `scales` uint8 E8M0 per 32: scale 2^(e - 127) -> fp4 g32.
- nvfp4: E2M1 codes, `scales` uint8 E4M3 per 16, optional `p.global_scale` (fp32, the
  tensor's absmax: the scale is e4m3 * global_scale / (448 * 6)) -> fp4 g16.
- other bit widths and mxfp8: dequantized by MLX's formula (in the model dtype, as
  mx.dequantize computes it) and kept in float, or re-quantized (ImportOptions).
Quantized embeddings (mlx-lm quantizes nn.Embedding too) are dequantized into float.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ... import formats
from ...layouts import QuantizedWeight
from ..errors import CheckpointError, UnsupportedQuantization
from .base import ConvertedLayer, LayerPlan
from .fp4 import e8m0_scales
from .reencode import ReencodingImporter, TensorView

MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # as mlx-lm
NVFP4_SCALE_DIVISOR = 448.0 * 6.0  # E4M3 max times E2M1 max: MLX's global_scale is the tensor absmax
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mlx_quantization(config: dict) -> Optional[dict]:
    """The MLX quantization dict of a config.json, or None."""
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q and "group_size" in q:
        return q
    return None


def unpack_bits(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """uint32 [N, W] holding `count` codes of `bits` per row as one little-endian bit stream
    (MLX's packing for every bit width) -> int64 codes [N, count]."""
    n = words.shape[0]
    raw = words.contiguous().view(torch.uint8).reshape(n, -1).to(torch.int64)
    if bits == 8:
        return raw[:, :count]
    if 8 % bits == 0:  # 2 and 4 bits: whole codes per byte
        shifts = torch.arange(0, 8, bits, dtype=torch.int64)
        return ((raw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(n, -1)[:, :count]
    stream = ((raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.int64)) & 1).reshape(n, -1)
    stream = stream[:, : count * bits].reshape(n, count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(-1)


@dataclass
class MLXSource(ReencodingImporter):
    QUANT_METHODS = ("mlx",)
    LABEL = "MLX"
    CONFIG_KEYS = ("quantization",)

    config: dict = field(default_factory=dict)
    method: str = "mlx"

    @classmethod
    def detect(cls, config: dict) -> Optional[dict]:
        q = mlx_quantization(config)
        return None if q is None else {"quant_method": "mlx", **q}

    def __post_init__(self):
        self.default = self._params("the default", self.config)
        self.view = TensorView(self.source)
        self.plans: Dict[str, LayerPlan] = {}
        self.params: Dict[str, dict] = {}
        kept = []  # linear layers kept in float, with why
        self.rounded = set()  # affine layers whose fp32 scales or biases fp16 rounds (within the bound)
        for key in self.source.keys():
            if not key.endswith(".scales"):
                continue
            module = key[: -len(".scales")]
            params = self._module_params(module)
            self.params[module] = params
            keys = [f"{module}.weight", key] + self.present(f"{module}.biases", f"{module}.global_scale")
            if f"{module}.weight" not in self.source:
                raise CheckpointError(f"{key}: MLX quantized module {module!r} has no {module}.weight")
            bias = f"{module}.bias" if f"{module}.bias" in self.source else None
            reason = self._inexact_reason(module, params)
            if self.is_linear(module) and (reason is None or self.options.requantize):
                self.plans[module] = LayerPlan(keys, bias)
                if reason is not None:
                    self.note(f"{module}: {reason}; re-quantized to {self.options.weight_format} "
                              f"g{self.options.group_size}")
            else:
                if self.is_linear(module):
                    kept.append(f"{module} ({reason})")
                n, k = self._shape(module, params)
                self.keep_float(module, keys, f"{module}.weight", self._float_dtype(module), (n, k),
                                lambda m=module: self.dequantize(m), self._bits_before(module, params))

        if kept:
            self.note(f"{len(kept)} linear layers kept in float (--requantize re-quantizes them with "
                      f"--format/--group-size): {'; '.join(kept[:4])}" + (" ..." if len(kept) > 4 else ""))

    # --- config ----------------------------------------------------------------------

    @staticmethod
    def _params(what: str, entry: dict) -> dict:
        mode = entry.get("mode", "affine")
        if mode not in MODES:
            raise UnsupportedQuantization(f"MLX quantization mode {mode!r} ({what}) is not supported; known modes: "
                                          f"{MODES}")
        group, bits = _MODE_DEFAULTS[mode]
        params = {"mode": mode, "group_size": int(entry.get("group_size") or group),
                  "bits": int(entry.get("bits") or bits)}
        if params["bits"] not in (1, 2, 3, 4, 5, 6, 8):
            raise UnsupportedQuantization(f"MLX bits={params['bits']} ({what}) is not a width MLX quantizes to")
        return params

    def _module_params(self, module: str) -> dict:
        entry = self.config.get(module)
        if entry is False:
            raise CheckpointError(f"{module}.scales exists but config.json quantization says {module!r}: false")
        if isinstance(entry, dict):
            return self._params(f"module {module}", {**self.default, **entry})
        return self.default

    def _shape(self, module: str, params: dict):
        n, words = self.source.shape(f"{module}.weight")[0], self.source.shape(f"{module}.weight")[-1]
        k = words * 32 // params["bits"]
        scales_shape = tuple(self.source.shape(f"{module}.scales"))
        if len(self.source.shape(f"{module}.weight")) != 2 or scales_shape != (n, k // params["group_size"]):
            raise CheckpointError(
                f"{module}: weight {list(self.source.shape(f'{module}.weight'))} and scales {list(scales_shape)} "
                f"do not fit {params['bits']}-bit {params['mode']} quantization with group size {params['group_size']}")
        return n, k

    def _inexact_reason(self, module: str, params: dict) -> Optional[str]:
        """Why a layer is not imported as a torch_marlin format exactly, or None."""
        if params["bits"] != 4 or params["mode"] == "mxfp8":
            return f"{params['bits']}-bit MLX {params['mode']} has no 4-bit torch_marlin format"
        self._shape(module, params)
        if params["group_size"] not in formats.GROUP_SIZES:
            return f"group size {params['group_size']} is not one of torch_marlin's {formats.GROUP_SIZES}"
        if params["mode"] == "affine":
            for name in ("scales", "biases"):
                key = f"{module}.{name}"
                if key not in self.source:
                    raise CheckpointError(f"{module}: MLX affine quantization needs {key}")
                if self.source.dtype(key) not in _FLOAT_DTYPES:
                    raise CheckpointError(f"{key}: expected a float tensor, got {self.source.dtype(key)}")
                if self.source.dtype(key) != torch.float16:
                    t = self.source.load(key)
                    if not torch.isfinite(t).all() or t.abs().max() > formats.FP16_MAX:
                        return f"{name} in {self.source.dtype(key)} exceed the fp16 range (max {formats.FP16_MAX})"
                    if not torch.equal(t.to(torch.float16).to(t.dtype), t):
                        self.rounded.add(module)
        elif self.source.dtype(f"{module}.scales") != torch.uint8:
            raise CheckpointError(f"{module}.scales: MLX {params['mode']} scales are uint8, got "
                                  f"{self.source.dtype(f'{module}.scales')}")
        return None

    def _float_dtype(self, module: str) -> torch.dtype:
        dtype = self.source.dtype(f"{module}.scales")
        return dtype if dtype in _FLOAT_DTYPES else torch.bfloat16  # mx.dequantize's default for fp scales

    @staticmethod
    def _bits_before(module, params) -> float:
        scale_bits = 8 if params["mode"] != "affine" else 32  # affine: scale + bias in 16 bits each
        return params["bits"] + scale_bits / params["group_size"]

    # --- conversion ------------------------------------------------------------------

    def plan(self) -> Dict[str, LayerPlan]:
        return dict(self.plans)

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        params = self.params[module]
        bits_before = self._bits_before(module, params)
        if self._inexact_reason(module, params) is not None:
            return self.requantized(module, self.dequantize(module), bits_before)
        n, k = self._shape(module, params)
        words = self.require(f"{module}.weight", (torch.uint32, torch.int32))
        packed = words.view(torch.int32).t().contiguous()  # MLX's words along K are ours
        group = params["group_size"]
        if params["mode"] == "affine":
            scales = self._fp16(f"{module}.scales", (n, k // group)).t()
            zeros = self._fp16(f"{module}.biases", (n, k // group)).t()
            q = QuantizedWeight(packed, scales.contiguous(), zeros.contiguous(), "affine", group, k, n)
        else:
            q = QuantizedWeight(packed, self._fp4_scales(module, params, n, k).t().contiguous(), None, "fp4",
                                group, k, n)
        formats.check_quantized(q.packed, q.scales, q.zeros, q.weight_format, q.group_size)
        exact = module not in self.rounded and not any(note.startswith(f"{module}:") for note in self.notes)
        return self.imported(module, q, bits_before, exact)

    def _fp16(self, key: str, shape) -> torch.Tensor:
        """Scales or biases rounded once to fp16 (exact for fp16 values: bf16 in fp16's normal range)."""
        half = self.require(key, _FLOAT_DTYPES, shape).to(torch.float16)
        if not torch.isfinite(half).all():  # checked in _inexact_reason; the file may have changed
            raise CheckpointError(f"{key}: values exceed the fp16 range")
        return half

    def _fp4_scales(self, module: str, params: dict, n: int, k: int) -> torch.Tensor:
        return self.to_fp16_scales(self._source_scales(module, params, n, k), module)

    def _source_scales(self, module: str, params: dict, n: int, k: int) -> torch.Tensor:
        """float32 scales [N, K / group] of an mxfp4, nvfp4 or mxfp8 layer, as MLX computes them."""
        raw = self.require(f"{module}.scales", torch.uint8, (n, k // params["group_size"]))
        if params["mode"] != "nvfp4":
            scales = e8m0_scales(raw, f"{module}.scales").float()  # exact: 2^-127 is a float32 subnormal
        else:
            scales = raw.view(torch.float8_e4m3fn).to(torch.float32)
            if f"{module}.global_scale" in self.source:
                g = self.require(f"{module}.global_scale", _FLOAT_DTYPES).to(torch.float32).reshape(-1)
                if g.numel() != 1:
                    raise CheckpointError(f"{module}.global_scale must hold one value, got {g.numel()}")
                scales = scales * (g[0] / NVFP4_SCALE_DIVISOR)
        if not torch.isfinite(scales).all():
            raise UnsupportedQuantization(f"{module}.scales: NaN scale (E4M3 NaN)")
        return scales

    def dequantize(self, module: str) -> torch.Tensor:
        """The weight [N, K] as mx.dequantize gives it (in the dtype of the scales; bf16 for
        uint8 scales): scales * q + biases with MLX's roundings, in that dtype."""
        params = self.params[module]
        n, k = self._shape(module, params)
        group, mode = params["group_size"], params["mode"]
        codes = unpack_bits(self.source.load(f"{module}.weight"), params["bits"], k)
        dtype = self._float_dtype(module)
        if mode == "affine":
            scales = self.source.load(f"{module}.scales").to(dtype).repeat_interleave(group, 1)
            biases = self.source.load(f"{module}.biases").to(dtype).repeat_interleave(group, 1)
            return scales * codes.to(dtype) + biases
        if mode == "mxfp8":
            values = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        else:
            values = formats.E2M1_VALUES[codes]
        return (values * self._source_scales(module, params, n, k).repeat_interleave(group, 1)).to(dtype)

    def description(self) -> dict:
        return {"method": "mlx", **self.default}


