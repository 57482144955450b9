"""quantize_model with bits= or entropy_code=True (docs/ENTROPY.md): the model-level
side of the entropy-coded layout. The quantizers (codes on the grid, rate allocation)
are torch_marlin.rans_quantize; this module swaps a model's linear layers for
MarlinLinear modules holding their coded weights."""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from torch import nn

from . import rans
from .calibration import output_error, quantize_sequentially
from .float_linear import is_conv1d, linear_weight
from .layouts.rans import GRID, RansQuantizedWeight
from .linear import MarlinLinear, PermutedInputMarlinLinear
from .rans_quantize import (RATE_AWARE, ROW_POWER, WEIGHTING, fit_layer, gptq_grid, plan, quantize_grid,
                            round_to_nearest)


def entropy_code_modules(model: nn.Module, names: List[str], chunk_k: Optional[int] = None,
                         prob_bits: int = rans.DEFAULT_PROB_BITS) -> None:
    """Lossless: replace the dense MarlinLinear modules `names` by entropy-coded ones."""
    for name in names:
        module = model.get_submodule(name)
        qweight = module.quantized_weight()
        coded = RansQuantizedWeight.from_dense(qweight, chunk_k, prob_bits)
        replacement = _module_like(module, coded)
        if not isinstance(replacement, MarlinLinear):
            raise TypeError(f"{name}: cannot entropy-code a {type(module).__name__}")
        model.set_submodule(name, replacement)


def _module_like(module, coded: RansQuantizedWeight):
    """A MarlinLinear (or PermutedInputMarlinLinear, with the same input_perm) holding `coded`."""
    bias = module.bias
    new = MarlinLinear.from_quantized(coded.to(bias.device if bias is not None else "cpu"), bias)
    if isinstance(module, PermutedInputMarlinLinear):
        permuted = PermutedInputMarlinLinear(new.in_features, new.out_features, bias is not None,
                                             new.weight_format, new.group_size,
                                             dtype=None if bias is None else bias.dtype,
                                             layout=RansQuantizedWeight, **coded.shape_options())
        permuted.load_state_dict(new.state_dict(), strict=False)
        permuted.input_perm.copy_(module.input_perm)
        new = permuted
    new.quantization_error = getattr(module, "quantization_error", coded.relative_error)
    return new


# --- rate-controlled quantization of modules ----------------------------------------------------


def quantize_model_bits(model: nn.Module, targets: Dict[str, nn.Module], report, bits: float, method: str,
                        calibration=None, act_order: bool = False, damp: float = 0.01, block_size: int = 128,
                        prob_bits: int = rans.DEFAULT_PROB_BITS, chunk_k: Optional[int] = None,
                        rate_aware: bool = RATE_AWARE, row_power: float = ROW_POWER, weighting: str = WEIGHTING,
                        weight_format: str = GRID) -> None:
    """quantize_model(model, bits=...): the grid or tcq (`weight_format`, rans_quantize.value_kind)
    at an average of `bits` per weight over `targets`."""
    if method not in ("mse", "rtn", "gptq"):
        raise ValueError(f"method must be 'rtn' (round to nearest, the default) or 'gptq' with bits=, got {method!r}")
    if method != "gptq" and calibration is not None:
        raise ValueError("calibration is only used by method='gptq'")
    weights = {name: linear_weight(m.weight.detach(), is_conv1d(m)) for name, m in targets.items()}
    p = plan(weights, bits, prob_bits, chunk_k, rate_aware, row_power, weighting)

    def replace(name, linear, coded):
        bias = None if linear.bias is None else linear.bias.detach().cpu()
        module = MarlinLinear.from_quantized(coded, bias).to(linear.weight.device)
        module.quantization_error = coded.relative_error
        report.record(name, linear, module)
        report.bits_per_layer[name] = 8 * coded.nbytes / coded.num_weights
        return module

    if method != "gptq":
        for name, linear in targets.items():
            model.set_submodule(name, replace(name, linear, round_to_nearest(p, name, weight_format)))
        return

    start = time.perf_counter()

    def quantize_layer(name, linear, hessian):
        coded = fit_layer(p, name, lambda steps, lam, table: gptq_grid(
            weights[name], hessian, steps, lam, table, act_order, damp, block_size))
        rtn = quantize_grid(weights[name], p.layers[name].choice[p.lam], p.lam / p.layers[name].importance,
                            prob_bits, rate_aware, row_power)
        rtn_weight = rtn.codes.float() * rtn.steps.float().unsqueeze(1)
        report.output_errors[name] = (output_error(weights[name], rtn_weight, hessian.float()),
                                      output_error(weights[name], coded.dequantize(), hessian.float()))
        return replace(name, linear, coded)

    def quantize_unreached(name, linear):
        return replace(name, linear, round_to_nearest(p, name, GRID))

    report.method_name = "GPTQ on the grid"
    stats = quantize_sequentially(model, targets, calibration, quantize_layer, quantize_unreached)
    report.unreached = list(stats.unreached)
    report.calibration_batches = stats.batches
    report.seconds = time.perf_counter() - start


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.buffers(recurse=False) if t is not None)
