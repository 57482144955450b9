"""Quantizers: float nn.Linear weights [N, K] -> 4-bit codes, scales and zeros.

Every quantizer here is round-to-nearest with one scale (and for uint4 one
zero point, for affine one bias) per group of K. `method="absmax"` takes the scale from the group's
range; `method="mse"` (default) searches clipped ranges and refits scale (and
zero) by least squares on the chosen codes, keeping whatever gives the
smallest squared reconstruction error with the scales rounded to fp16 as
stored. Both are deterministic. Further quantizers plug in through the same
`Quantizer` interface and `register_quantizer`; methods that need the
layer's input Hessian (GPTQ, SparseGPT, Wanda) through `register_calibrated_method`.

This is the floor of the algorithms (with sparsity.py, gptq.py, sparsegpt.py and
calibration.py): they return codes (QuantizedCodes) and import no layout; a
layout packs them (torch_marlin/layouts/, `QuantizedLayout.pack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from . import formats
from .formats import FP16_MAX
from .layout_registry import layout_named

# Rows of N quantized at once: bounds the search's temporary memory.
_ROW_CHUNK_ELEMENTS = 1 << 20
_CLIP_RATIOS = torch.linspace(1.0, 0.6, 21).tolist()
_REFIT_ROUNDS = 2
_FP16_TINY = 2.0 ** -14  # smallest normal fp16: keeps w / scale finite


Quantizer = Callable[[torch.Tensor, str, int], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
"""(weight groups [R, G, gs] float32, weight_format, group_size) -> (codes, scales, zeros)."""

_QUANTIZERS: Dict[str, Quantizer] = {}


def register_quantizer(name: str, fn: Quantizer) -> None:
    _QUANTIZERS[name] = fn


def quantizer_names() -> Tuple[str, ...]:
    return tuple(_QUANTIZERS)


@dataclass
class QuantizedCodes:
    """A quantizer's result before a layout packs it: codes in K order with their group
    scales (and zeros), K padded as `layout` needs."""

    layout: str  # LAYOUT of the layout class that packs these ("dense", "sparse24")
    codes: torch.Tensor  # uint8 [K, N], 0..15 (sparse24: the kept codes [K/2, N])
    scales: torch.Tensor  # fp16 [G, N]
    zeros: Optional[torch.Tensor]  # fp16 [G, N] for formats with zeros, else None
    weight_format: str
    group_size: int
    in_features: int  # unpadded K
    out_features: int  # N
    relative_error: float = float("nan")  # ||W - Wq|| / ||W||
    positions: Optional[torch.Tensor] = None  # sparse24: uint8 [K/2, N], each kept code's place in its block of 4

    def pack(self):
        """These codes in their layout (torch_marlin.layouts), looked up by name."""
        return layout_named(self.layout).pack(self)


def quantize_codes(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                   method: str = "mse") -> QuantizedCodes:
    """Quantize an nn.Linear weight [N, K] with the registered Python quantizer `method`,
    K zero-padded to what the dense layout needs: the specification of the C++ path of
    "mse" and "absmax" (torch_marlin.layouts.dense.quantize_weight), and the path of every
    other quantizer."""
    check_float_weight(weight, weight_format, group_size, method)
    n, k = weight.shape
    kp = formats.padded_in_features(k, group_size)
    gs = formats.effective_group_size(kp, group_size)
    codes = torch.empty(n, kp, dtype=torch.uint8)
    scales = torch.empty(n, kp // gs, dtype=torch.float16)
    zeros = torch.empty_like(scales) if formats.has_zeros(weight_format) else None
    err2 = norm2 = 0.0
    # Row blocks of ~1M weights, converted to float32 one at a time: memory
    # beyond the weight is its uint8 codes plus one block's scratch. Contiguous,
    # because a transposed view (GPT-2 Conv1D) makes torch.bucketize warn.
    rows = max(1, _ROW_CHUNK_ELEMENTS // kp)
    for r0 in range(0, n, rows):
        block = weight.detach()[r0:r0 + rows].to(device="cpu", dtype=torch.float32).contiguous()
        if not torch.isfinite(block).all():
            raise ValueError("weight contains NaN or Inf")
        chunk = torch.nn.functional.pad(block, (0, kp - k)).view(-1, kp // gs, gs)
        c, s, z, e = quantize_groups(chunk, weight_format, method)
        codes[r0:r0 + rows] = c.view(-1, kp)
        scales[r0:r0 + rows] = s
        if zeros is not None:
            zeros[r0:r0 + rows] = z
        err2 += e
        norm2 += float((chunk ** 2).sum())
    return QuantizedCodes("dense", codes.t(), scales.t(), None if zeros is None else zeros.t(), weight_format,
                          group_size, k, n, relative_error(err2, norm2))


def relative_error(err2: float, norm2: float) -> float:
    """sqrt(err2 / norm2), 0 for a zero weight."""
    return (err2 / norm2) ** 0.5 if norm2 > 0 else 0.0


def check_float_weight(weight, weight_format: str, group_size: int, method: str) -> None:
    """The arguments every quantizer of a float linear weight [N, K] takes."""
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    if method not in _QUANTIZERS:
        raise ValueError(f"method must be one of {quantizer_names()}, got {method!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D floating-point tensor [N, K], got {formats._describe(weight)}")
    if weight.numel() == 0:
        raise ValueError(f"weight must not be empty, got shape {list(weight.shape)}")


def quantize_groups(groups: torch.Tensor, weight_format: str, method: str):
    """Round groups [R, G, gs] (float32) with quantizer `method`: (codes [R, G, gs] uint8,
    scales [R, G] fp16, zeros [R, G] fp16 or None, squared reconstruction error)."""
    c, s, z = _QUANTIZERS[method](groups, weight_format, groups.shape[-1])
    err2 = float(((_reconstruct(c, s, z, weight_format) - groups) ** 2).sum())
    return c, s, z, err2


# The built-in quantizers also run in C++ (torch.ops.marlin._quantize_weight,
# csrc/cpu/quantize_impl.h) on whole weights, straight to the packed layout
# (_quantize_weight_sparse24: pruned to 2:4 first, torch_marlin/sparsity.py);
# the Python functions below are its specification and it matches them bit for
# bit (tests/test_quantize_native.py, tests/test_sparsity.py).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_search(method: str) -> Optional[bool]:
    """`search` of the C++ implementation of quantizer `method`; None if it has none."""
    return _NATIVE.get(_QUANTIZERS[method])


def run_native(op, weight: torch.Tensor, weight_format: str, group_size: int, search: bool, *more):
    """A C++ quantizer op (torch.ops.marlin._quantize_weight, or _quantize_weight_sparse24
    with `more` = scores) on weight [N, K]: (its outputs but the sums, relative error)."""
    w = weight.detach()
    if w.device.type != "cpu" or w.dtype not in _NATIVE_DTYPES:
        w = w.to("cpu", w.dtype if w.dtype in _NATIVE_DTYPES else torch.float32)
    ratios, rounds = _search_space(search)
    *outputs, sums = op(w, weight_format, group_size, ratios, rounds, *more)
    return outputs, relative_error(*sums.tolist())


# --- rounding (the format's descriptor, formats.VALUE_FORMATS) --------------------------

def _round_codes(x: torch.Tensor, weight_format: str) -> torch.Tensor:
    """Nearest code for x = w / scale (+ zero for formats with zeros); uint8 of the same shape."""
    return formats.value_format(weight_format).round_codes(x)


def _reconstruct(codes, scales, zeros, weight_format):
    per_group = lambda t: None if t is None else t.float().unsqueeze(-1)
    return formats.value_format(weight_format).weights(formats.code_values(codes, weight_format),
                                                       per_group(scales), per_group(zeros))


def _to_fp16_scale(s: torch.Tensor) -> torch.Tensor:
    return s.clamp(_FP16_TINY, FP16_MAX).to(torch.float16)


# The search evaluates ~40 candidate (scale, zero) pairs per group. It keeps only
# the best pair (small [R, G] tensors) and its error, and computes the codes once
# at the end: codes are a function of the pair, so this gives the same result as
# carrying codes along at a fraction of the time and memory.

def _values(groups: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], weight_format: str):
    """Value of the nearest code before the scale, i.e. code_values(_round_codes(...))
    (minus zero for formats with zeros), for every weight; float32 like groups."""
    fmt = formats.value_format(weight_format)
    s = scale.float().unsqueeze(-1)
    if zero is None:
        return fmt.nearest_values(groups / s)
    z = zero.float().unsqueeze(-1)
    return fmt.nearest_values(groups / s + z).sub_(z)


def _search_space(search: bool):
    """(clip ratios, candidates per ratio): the clipped scale, then least-squares refits."""
    return (_CLIP_RATIOS, _REFIT_ROUNDS) if search else ([1.0], 1)


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in a fixed order: pairwise halving, x[i] + x[i + n/2],
    zero-padded to a power of two. torch.sum's order depends on the shape and the build;
    this one the C++ quantizer reproduces exactly, so both pick the same candidates."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.squeeze(-1)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _tree_sum(a * b)


def _squared_error(values, scale, groups):
    diff = values * scale.float().unsqueeze(-1) - groups
    return _dot(diff, diff)


def _keep_better(best, err, scale, zero):
    """best = [err, scale, zero]; ties keep the earlier candidate."""
    if best is None:
        return [err, scale, zero]
    better = err < best[0]
    best[0] = torch.where(better, err, best[0])
    best[1] = torch.where(better, scale, best[1])
    if zero is not None:
        best[2] = torch.where(better, zero, best[2])
    return best


def _symmetric(groups: torch.Tensor, weight_format: str, search: bool):
    qmax = formats.value_format(weight_format).max_value
    absmax = groups.abs().amax(-1)
    best = None
    ratios, rounds = _search_space(search)
    for ratio in ratios:
        scale = _to_fp16_scale(absmax * ratio / qmax)
        for round_ in range(rounds):
            v = _values(groups, scale, None, weight_format)
            best = _keep_better(best, _squared_error(v, scale, groups), scale, None)
            if round_ + 1 == rounds:
                break
            # Least-squares scale for these codes: argmin_s ||v*s - w||.
            vv = _dot(v, v)
            refit = _dot(v, groups) / vv.clamp_min(1e-30)
            scale = _to_fp16_scale(torch.where(vv > 0, refit, scale.float()))
    scale = best[1]
    return _round_codes(groups / scale.float().unsqueeze(-1), weight_format), scale, None


def _asymmetric(groups: torch.Tensor, weight_format: str, search: bool):
    """Formats with a second fp16 parameter per group: a zero point (uint4, w = (q - zero) * scale)
    or a bias (affine, w = q * scale + bias). The clipped range [lo, hi] * ratio (containing 0,
    so a zero point stays within the codes) maps onto the codes' range; each refit is the
    least-squares line w ~ a q + b on the codes: scale = a, zero = -b / a or bias = b."""
    fmt = formats.value_format(weight_format)
    lo = groups.amin(-1).clamp(max=0)
    hi = groups.amax(-1).clamp(min=0)
    n = groups.shape[-1]
    w_mean = _tree_sum(groups) / n
    w_centered = groups - w_mean.unsqueeze(-1)
    best = None
    ratios, rounds = _search_space(search)
    for ratio in ratios:
        scale = _to_fp16_scale((hi - lo) * ratio / fmt.value_range)
        zero = ((lo * ratio).clamp(-FP16_MAX, FP16_MAX) if fmt.bias else -lo * ratio / scale.float()).to(torch.float16)
        for round_ in range(rounds):
            s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
            q = fmt.nearest_values(fmt.code_inputs(groups, s, z))
            diff = fmt.weights(q, s, z) - groups
            best = _keep_better(best, _dot(diff, diff), scale, zero)
            if round_ + 1 == rounds:
                break
            if not fmt.bias:
                # A zero point's codes as the C++ quantizer has them: q - zero, then + zero again
                # (float rounding; bit for bit, tests/test_quantize_native.py).
                q = (q - z).add_(z)
            q_mean = _tree_sum(q) / n
            q_centered = q.sub_(q_mean.unsqueeze(-1))
            var = _dot(q_centered, q_centered)
            a = _dot(q_centered, w_centered) / var.clamp_min(1e-30)
            ok = (var > 0) & (a > _FP16_TINY)
            new_scale = _to_fp16_scale(torch.where(ok, a, scale.float()))
            b = w_mean - a * q_mean
            new_zero = torch.where(ok, b if fmt.bias else -b / new_scale.float(), zero.float())
            scale, zero = new_scale, new_zero.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    scale, zero = best[1], best[2]
    x = fmt.code_inputs(groups, scale.float().unsqueeze(-1), zero.float().unsqueeze(-1))
    return _round_codes(x, weight_format), scale, zero


def _rtn(search: bool) -> Quantizer:
    def quantize(groups, weight_format, group_size):
        if formats.has_zeros(weight_format):
            return _asymmetric(groups, weight_format, search)
        return _symmetric(groups, weight_format, search)
    return quantize


register_quantizer("mse", _rtn(search=True))
register_quantizer("absmax", _rtn(search=False))
# Registered Python quantizer -> `search` of its C++ implementation.
_NATIVE = {_QUANTIZERS["mse"]: True, _QUANTIZERS["absmax"]: False}


# --- calibrated methods -------------------------------------------------------------
# Quantizers that need the layer's input Hessian H = mean(x x^T) (calibration data),
# registered by their modules (gptq.py, sparsegpt.py). MarlinLinear.from_linear(method=,
# hessian=) and quantize_model(method=, calibration=) look them up here.

@dataclass(frozen=True)
class CalibratedMethod:
    label: str  # its name in reports, "GPTQ"
    baseline: str  # what reports compare it with, "round to nearest" (the quantizer "mse")
    sparsity: Optional[str]  # the sparsity of the layout it produces (None: dense)
    # (weight_format, group_size, **options): raises on bad options before any work.
    check_options: Callable[..., None]
    # (weight [N, K], hessian [K, K], weight_format, group_size, **options) -> a result with
    # qweight (a layout), input_perm (int32 [K] or None), relative_output_error, damp.
    quantize: Callable[..., object]


_CALIBRATED: Dict[str, CalibratedMethod] = {}


def register_calibrated_method(name: str, method: CalibratedMethod) -> None:
    _CALIBRATED[name] = method


def calibrated_method(name: str) -> Optional[CalibratedMethod]:
    """The calibrated method registered as `name`; None for any other name."""
    return _CALIBRATED.get(name)


def calibrated_method_names(sparsity: Optional[str]) -> Tuple[str, ...]:
    """The calibrated methods producing layouts of `sparsity` (None: dense), in registration order."""
    return tuple(name for name, m in _CALIBRATED.items() if m.sparsity == sparsity)
