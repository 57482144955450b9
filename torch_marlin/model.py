"""quantize_model: swap a model's linear layers for MarlinLinear, and its
transformers experts modules for MarlinExperts, in place."""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple, Union

from torch import nn

from . import formats, fused_projections
from .calibration import quantize_model_calibrated
from .float_linear import is_float_linear
from .linear import MarlinLinear
from .moe import MarlinExperts, UnsupportedExperts, find_experts_modules, warn_unsupported
from .moe_gptq import ExpertError, calibrate_experts, check_experts_options, describe_expert_errors
from .layouts.rans import TCQ
from .quantize import calibrated_method
from .rans_model import entropy_code_modules, module_bytes, quantize_model_bits
from .rans_quantize import check_bits, value_kind
from .sparsity import split_method

Patterns = Union[str, Iterable[str], None]


@dataclass
class QuantizationReport:
    replaced: List[str] = field(default_factory=list)  # qualified names now MarlinLinear
    skipped: List[str] = field(default_factory=list)  # linear layers left in float (excluded)
    bytes_before: int = 0  # float weight + bias bytes of the replaced layers
    bytes_after: int = 0  # packed + scales (+ zeros) + bias bytes of the same layers
    relative_errors: Dict[str, float] = field(default_factory=dict)
    experts_replaced: List[str] = field(default_factory=list)  # experts modules now MarlinExperts
    experts_skipped: List[str] = field(default_factory=list)  # experts modules left in float (excluded)
    experts_unsupported: Dict[str, str] = field(default_factory=dict)  # left in float: why
    # method="gptq" (or a calibrated 2:4 method): relative output error on the calibration
    # data, (baseline, method): (round to nearest, GPTQ), (magnitude 2:4, SparseGPT / Wanda)
    output_errors: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    method_name: str = "GPTQ"
    baseline_name: str = "round to nearest"
    unreached: List[str] = field(default_factory=list)  # never called on the calibration data: mse
    # method="gptq" on expert stacks: {stack name: [ExpertError per expert]} (torch_marlin.moe_gptq)
    expert_errors: Dict[str, List[ExpertError]] = field(default_factory=dict)
    fused: List[str] = field(default_factory=list)  # fused projections (fuse_projections=True)
    calibration_batches: int = 0
    seconds: float = 0.0
    # bits= (entropy-coded layout): every byte of each layer's coded weight per weight
    bits_per_layer: Dict[str, float] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def record(self, name: str, linear: nn.Module, quantized: nn.Module) -> None:
        self.bytes_before += _nbytes(linear)
        self.bytes_after += _nbytes(quantized)
        self.relative_errors[name] = quantized.quantization_error
        self.replaced.append(name)

    def __str__(self) -> str:
        mib = 1 / 2 ** 20
        experts = ""
        if self.experts_replaced or self.experts_skipped or self.experts_unsupported:
            left = len(self.experts_skipped) + len(self.experts_unsupported)
            experts = f" and {len(self.experts_replaced)} experts modules ({left} left in float)"
        text = (f"quantized {len(self.replaced)} linear layers ({len(self.skipped)} left in float){experts}: "
                f"{self.bytes_before * mib:.2f} MiB -> {self.bytes_after * mib:.2f} MiB")
        if self.output_errors:
            lines = [text, f"{self.method_name} on {self.calibration_batches} calibration batches in "
                           f"{self.seconds:.1f} s; relative output error per layer "
                           f"({self.baseline_name} -> {self.method_name}):"]
            for name, (rtn, gptq) in self.output_errors.items():
                lines.append(f"  {name}: {rtn:.4f} -> {gptq:.4f}")
                if name in self.expert_errors:
                    lines += ["  " + line for line in describe_expert_errors("per expert", self.expert_errors[name])]
            if self.unreached:
                lines.append(f"  never reached by the calibration data ({self.baseline_name}): {', '.join(self.unreached)}")
            text = "\n".join(lines)
        if self.bits_per_layer:
            weights = {name: self.bits_per_layer[name] for name in self.bits_per_layer}
            text += "\nbits per weight per layer (entropy-coded, every byte counted):\n" + "\n".join(
                f"  {name}: {bits:.3f}" for name, bits in weights.items())
        return text


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """Glob match on a qualified module name; a plain pattern also matches as a suffix
    of dotted names ("lm_head" matches "model.lm_head", "q_proj" every q_proj)."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return True
    return False


def unmatched_patterns(patterns: Iterable[str], names: Iterable[str]) -> List[str]:
    """The patterns that match none of `names` (a typo, or a layer the model does not have)."""
    names = list(names)
    return [p for p in patterns if not any(matches_any(name, (p,)) for name in names)]


def _patterns(value: Patterns, name: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    patterns = list(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{name} must be a glob pattern or a list of them, got {value!r}")
    return patterns


def _nbytes(module: nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + [b for b in module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_model(model: nn.Module, weight_format: str = "fp4", group_size: int = 128,
                   include: Patterns = None, exclude: Patterns = None,
                   method: str = "mse", calibration: Optional[Iterable] = None,
                   sparsity: Optional[str] = None, bits: Optional[float] = None, entropy_code: bool = False,
                   fuse_projections: bool = False,
                   **options) -> QuantizationReport:
    """Replace every linear layer (nn.Linear, and transformers' Conv1D) whose
    qualified name matches `include` (glob patterns, a plain name also matching
    as a suffix; default all) and none of `exclude` with a MarlinLinear, and
    every transformers experts module (3-D expert weight stacks) whose name
    matches them with a MarlinExperts. Experts classes MarlinExperts cannot
    stand in for stay in float, with a warning naming them.
    Returns a QuantizationReport (what was replaced, memory before/after).

    method="gptq" quantizes the linear layers one after another in forward order with
    GPTQ on the inputs they receive from `calibration` (an iterable of model
    inputs: a Tensor is called as model(t), a tuple as model(*t), a dict as
    model(**d)); options act_order / damp / block_size / refine_rounds are
    described in torch_marlin.gptq and torch_marlin.calibration. Expert stacks are
    then calibrated too, each expert on the tokens the model routes to it
    (torch_marlin.moe_gptq; act_order only with group_size=-1), unless
    calibrate_experts=False (round to nearest, "mse", for the stacks).

    sparsity="2:4" prunes every such linear layer to 2:4 (SparseQuantizedWeight,
    docs/SPARSITY.md); `method` then names the pruning method: "magnitude" (no
    data; or a quantizer name, "mse"/"absmax": magnitude pruning with that
    quantizer), "sparsegpt" or "wanda" (sequential on `calibration` as GPTQ;
    options damp / block_size, torch_marlin.sparsegpt).

    fuse_projections=True then fuses the quantized linear layers that read the
    same input (q_proj|k_proj|v_proj, gate_proj|up_proj siblings) into one wider
    weight each (torch_marlin.fused_projections: one matmul per group at decode,
    outputs identical to the separate layers); report.fused lists them.

    Expert stacks are always quantized dense; with a pruning method, without
    calibration (the quantizer "mse"): SparseGPT and 2:4 for experts are not implemented.

    bits=<float> selects the entropy-coded layout (docs/ENTROPY.md): every selected linear
    layer on a uniform grid, rate-allocated so that the coded weights average at most
    `bits` bits per weight, every byte counted; method "rtn" (default) or "gptq" with
    `calibration`. weight_format "tcq" (the trellis-coded grid, the default of "rtn") or
    "grid" (the scalar grid, the one of "gptq"), group_size -1, chooses the value kind.
    entropy_code=True codes the dense result (weight_format, group_size, method as
    without it) losslessly instead. Neither codes expert stacks (refused)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if bits is not None or entropy_code:
        if fuse_projections:
            raise ValueError("fuse_projections=True works on the dense layout only, not with bits= / entropy_code=True")
        return _quantize_model_entropy_coded(model, weight_format, group_size, include, exclude, method,
                                            calibration, sparsity, bits, entropy_code, **options)
    # Checked here, not per layer, so the error does not carry the first layer's name.
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    if not isinstance(fuse_projections, bool):
        raise TypeError(f"fuse_projections must be a bool, got {fuse_projections!r}")
    pruning, quantizer = split_method(method, sparsity)
    include_p, exclude_p = _patterns(include, "include"), _patterns(exclude, "exclude") or []
    report = QuantizationReport()
    targets = select_linear_layers(model, include_p, exclude_p, report)
    layers = {name: model.get_submodule(name) for name in targets}
    experts = _experts_to_quantize(model, include_p, exclude_p, report)
    if calibrated_method(pruning or method) is not None:
        calibrated = {}
        if (pruning or method) == "gptq" and options.pop("calibrate_experts", True):
            if experts:
                check_experts_options(group_size, **options)
            calibrated, experts = experts, {}
        elif "calibrate_experts" in options:
            raise ValueError(f"calibrate_experts is an option of method='gptq', got method={method!r}")

        def quantize_on_inputs(name, source, calls):
            try:
                quantized, errors, totals = calibrate_experts(source, calls, weight_format, group_size, name=name,
                                                              **options)
            except ValueError as e:  # name the module
                raise ValueError(f"{name}: {e}") from e
            for stack, per_expert in errors.items():
                report.output_errors[f"{name}.{stack}"] = totals[stack]
                report.expert_errors[f"{name}.{stack}"] = per_expert
            _record_experts(report, name, source, quantized)
            return quantized

        def quantize_unreached(name, source):
            return _quantize_experts_rtn(name, source, weight_format, group_size, "mse", report) or source

        quantize_model_calibrated(model, layers, report, pruning or method, weight_format, group_size, calibration,
                                  MarlinLinear.from_linear, modules=calibrated, quantize_module=quantize_on_inputs,
                                  quantize_module_unreached=quantize_unreached, **options)
        quantizer = "mse"  # for the expert stacks left
    else:
        if calibration is not None or options:
            raise ValueError(f"calibration/{sorted(options) or 'options'} are only used by method='gptq' "
                             f"(and with sparsity='2:4' by 'sparsegpt' and 'wanda'), got method={method!r}")
        for name in targets:
            linear = model.get_submodule(name)
            try:
                quantized = MarlinLinear.from_linear(linear, weight_format, group_size, quantizer, sparsity=sparsity)
            except ValueError as e:  # name the layer
                raise ValueError(f"{name}: {e}") from e
            model.set_submodule(name, quantized)
            report.record(name, linear, quantized)
    for name, source in experts.items():
        quantized = _quantize_experts_rtn(name, source, weight_format, group_size, quantizer, report)
        if quantized is not None:
            model.set_submodule(name, quantized)
    warn_unsupported(model, report.experts_unsupported, stacklevel=3)
    _warn_unmatched(report, include_p or [], exclude_p)
    if fuse_projections:
        report.fused = fused_projections.fuse_projections(model)
    return report


def select_linear_layers(model: nn.Module, include_p: Optional[List[str]], exclude_p: List[str],
                         report: QuantizationReport) -> List[str]:
    """Names of the float linear layers to quantize; the others go to report.skipped."""
    targets = []
    for name, module in model.named_modules():
        if not is_float_linear(module):
            continue
        selected = include_p is None or matches_any(name, include_p)
        if not selected or matches_any(name, exclude_p):
            report.skipped.append(name)
        else:
            targets.append(name)
    return targets


def _warn_unmatched(report: QuantizationReport, include_p: List[str], exclude_p: List[str]) -> None:
    names = (report.replaced + report.skipped + report.experts_replaced + report.experts_skipped
             + list(report.experts_unsupported))
    for kind, patterns in (("include", include_p), ("exclude", exclude_p)):
        for pattern in unmatched_patterns(patterns, names):
            warnings.warn(f"quantize_model: {kind} pattern {pattern!r} matches no linear layer or experts module "
                          f"(patterns are globs on qualified module names, e.g. '*.mlp.*'; a plain name also "
                          f"matches as a suffix, e.g. 'q_proj')", stacklevel=3)


def _experts_to_quantize(model: nn.Module, include_p: Optional[List[str]], exclude_p: List[str],
                         report: QuantizationReport) -> Dict[str, nn.Module]:
    """{name: module} of the experts modules to quantize; the others are listed in the report."""
    supported, unsupported = find_experts_modules(model)
    selected = {}
    for name in supported:
        if not (include_p is None or matches_any(name, include_p)) or matches_any(name, exclude_p):
            report.experts_skipped.append(name)
        else:
            selected[name] = model.get_submodule(name)
    report.experts_unsupported.update(unsupported)
    return selected


def _record_experts(report: QuantizationReport, name: str, source: nn.Module, quantized: MarlinExperts) -> None:
    report.bytes_before += _nbytes(source)
    report.bytes_after += sum(_nbytes(stack) for stack in quantized.stacks().values())
    report.relative_errors[name] = quantized.quantization_error
    report.experts_replaced.append(name)


def _quantize_experts_rtn(name: str, source: nn.Module, weight_format: str, group_size: int, method: str,
                          report: QuantizationReport) -> Optional[MarlinExperts]:
    """An experts module quantized without calibration (None, listed as unsupported, if
    MarlinExperts cannot stand in for it)."""
    try:
        quantized = MarlinExperts.from_float(source, weight_format, group_size, method)
    except UnsupportedExperts as e:
        report.experts_unsupported[name] = str(e)
        return None
    except ValueError as e:  # name the module
        raise ValueError(f"{name}: {e}") from e
    _record_experts(report, name, source, quantized)
    return quantized


def _quantize_model_entropy_coded(model: nn.Module, weight_format: str, group_size: int, include, exclude,
                                 method: str, calibration, sparsity, bits: Optional[float], entropy_code: bool,
                                 **options):
    """quantize_model with bits= (the grid) or entropy_code=True (lossless); see quantize_model."""
    if bits is not None and entropy_code:
        raise ValueError("bits= (rate-controlled grid) and entropy_code=True (lossless) exclude each other")
    if not isinstance(entropy_code, bool):
        raise TypeError(f"entropy_code must be a bool, got {entropy_code!r}")
    if sparsity is not None:
        raise ValueError(f"sparsity={sparsity!r} does not combine with bits= / entropy_code=True")
    include_p, exclude_p = _patterns(include, "include"), _patterns(exclude, "exclude") or []
    supported, _ = find_experts_modules(model)
    selected = [name for name in supported
                if (include_p is None or matches_any(name, include_p)) and not matches_any(name, exclude_p)]
    if selected:
        raise ValueError(f"expert stacks are not entropy-coded (bits= / entropy_code=True): exclude the experts "
                         f"modules {selected} (exclude=[...]) or quantize them without bits=/entropy_code")
    coding = {k: options.pop(k) for k in ("chunk_k", "prob_bits") if k in options}
    if entropy_code:
        report = quantize_model(model, weight_format, group_size, include, exclude, method, calibration, **options)
        entropy_code_modules(model, report.replaced, **coding)
        report.method_name += ", entropy-coded"
        report.bytes_after = 0
        for name in report.replaced:
            module = model.get_submodule(name)
            report.bits_per_layer[name] = 8 * module.quantized_weight().nbytes / module.quantized_weight().num_weights
        report.bytes_after = sum(module_bytes(model.get_submodule(name)) for name in report.replaced)
        return report
    bits = check_bits(bits)
    kind = value_kind(weight_format, group_size, "gptq" if method == "gptq" else "rtn")
    report = QuantizationReport(method_name=f"entropy-coded {'trellis-coded grid (tcq)' if kind == TCQ else 'grid'}"
                                            f" (round to nearest)")
    report.experts_skipped = [name for name in supported if name not in selected]  # left in float
    targets = select_linear_layers(model, include_p, exclude_p, report)
    if not targets:
        raise ValueError("bits=: no linear layer selected (check include/exclude)")
    layers = {name: model.get_submodule(name) for name in targets}
    quantize_model_bits(model, layers, report, bits, "rtn" if method == "mse" else method, calibration,
                        **coding, **options, weight_format=kind)
    _warn_unmatched(report, include_p or [], exclude_p)
    return report
