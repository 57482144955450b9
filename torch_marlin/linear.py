"""MarlinLinear: an nn.Linear drop-in whose weight is stored in 4 bits."""

from __future__ import annotations

from typing import Optional, Type

import torch
from torch import nn

from .float_linear import is_conv1d, linear_weight
from .layouts import QuantizedLayout, QuantizedWeight, layout_by_code, layout_for_sparsity
from .layouts.base import known_layout_codes
from .quantize import calibrated_method
from .rans_quantize import grid_weight, value_kind
from .sparsity import split_method


class QuantizedModule(nn.Module):
    """Base of the modules holding one quantized weight of a layout class: its buffers
    are the layout's tensors, `quantized_weight()` gives the layout object, `.half()` and
    `.to(dtype)` leave fp16 metadata alone, and the state_dict carries the layout
    descriptor (`_extra_state`) so that loading another layout, format, group size or
    shape is refused instead of computing garbage."""

    layout: Type[QuantizedLayout]

    def _init_weight(self, layout: Type[QuantizedLayout], in_features: int, out_features: int,
                     weight_format: str, group_size: int, device=None, **shape) -> None:
        if not (isinstance(layout, type) and issubclass(layout, QuantizedLayout)):
            raise TypeError(f"layout must be a QuantizedLayout class, got {layout!r}")
        layout.check_arguments(weight_format, group_size)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_format, self.group_size = weight_format, group_size
        self.layout = layout
        empty = layout.empty(in_features, out_features, weight_format, group_size, device=device, **shape)
        self._layout_options = empty.options()
        for name in layout.TENSORS:
            self.register_buffer(name, getattr(empty, name))

    def _copy_weight(self, qweight: QuantizedLayout) -> None:
        for name, tensor in qweight.tensors().items():
            self._buffers[name].copy_(tensor)

    def quantized_weight(self) -> QuantizedLayout:
        """The weight as its layout object, sharing this module's buffers."""
        return self.layout(**{name: self._buffers[name] for name in self.layout.TENSORS},
                           weight_format=self.weight_format, group_size=self.group_size,
                           in_features=self.in_features, out_features=self.out_features,
                           **getattr(self, "_layout_options", {}))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.layout.VARIABLE_TENSORS:  # take the saved stream's length
            saved, mine = state_dict.get(prefix + name), self._buffers.get(name)
            if isinstance(saved, torch.Tensor) and mine is not None and saved.shape != mine.shape:
                self._buffers[name] = mine.new_empty(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight W [..., out_features, in_features] as a dense tensor (computed in fp32,
        on the module's device, by the layout's dequantize op)."""
        return self.quantized_weight().weight(dtype)

    def _apply(self, fn, recurse=True):
        # .half()/.to(dtype) must not touch fp16 scales/zeros: apply fn to an
        # int16 view (device moves still happen, dtype casts skip integers).
        fp16 = [name for name in self.layout.FP16_TENSORS if self._buffers.get(name) is not None]
        for name in fp16:
            self._buffers[name] = self._buffers[name].view(torch.int16)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name in fp16:
                self._buffers[name] = self._buffers[name].view(torch.float16)

    # state_dict carries the layout next to the tensors, because fp4 and int4
    # weights of the same shape are otherwise indistinguishable: loading one
    # into the other must fail, not compute garbage.

    def get_extra_state(self) -> torch.Tensor:
        """The layout descriptor [layout code, format number, group_size, in_features, ...]
        (int64, docs/FORMAT.md)."""
        return torch.tensor(self.quantized_weight().descriptor(), dtype=torch.int64)

    def set_extra_state(self, state) -> None:
        cls = type(self).__name__
        mine = self.quantized_weight().descriptor()
        if not (isinstance(state, torch.Tensor) and state.dim() == 1 and state.numel() >= 4
                and not state.dtype.is_floating_point):
            raise ValueError(f"{cls} state_dict '_extra_state' must be the layout descriptor "
                             f"[layout, format, group_size, in_features, ...], got {state!r}")
        saved = [int(v) for v in state.tolist()]
        if saved == mine:
            return
        if layout_by_code(saved[0]) is None or not layout_by_code(saved[0]).knows_format_number(saved[1]):
            raise ValueError(f"{cls} state_dict has layout {saved[0]} / format number {saved[1]}, which this "
                             f"torch_marlin does not know (it reads layouts {known_layout_codes()})")
        raise ValueError(f"state_dict was saved from {cls}({self.layout.describe_descriptor(saved)}); "
                         f"this module has {self.layout.describe_descriptor(mine)}: build it with the saved values")

    def _weight_repr(self) -> str:
        q = self.quantized_weight()
        bits = q.nbytes * 8 / q.num_weights
        return (f"weight_format={self.weight_format}, group_size={self.group_size}, "
                f"bits_per_weight={bits:.2f}")


class MarlinLinear(QuantizedModule):
    """y = x @ W^T + b with W stored as packed 4-bit codes plus group scales.

    Input dtype (float16, bfloat16 or float32) selects the compute dtype.
    Weights are frozen buffers; gradients flow to the input (and to the bias
    if it requires grad), so adapters such as LoRA train on top.

    `layout` is the weight layout class (torch_marlin/layouts/; default the
    dense QuantizedWeight): the module's buffers are that layout's tensors and
    its forward is that layout's op. `sparsity` ("2:4") is a shorthand for the
    layout registered under that name (SparseQuantizedWeight).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight_format: str = "fp4", group_size: int = 128,
                 device=None, dtype=None, layout: Optional[Type[QuantizedLayout]] = None,
                 sparsity: Optional[str] = None, **layout_options) -> None:
        super().__init__()
        self._init_weight(_choose_layout(layout, sparsity), in_features, out_features, weight_format, group_size,
                          device=device, **layout_options)
        b = torch.zeros(out_features, dtype=dtype or torch.get_default_dtype(), device=device) if bias else None
        self.register_buffer("bias", b)
        self.register_load_state_dict_post_hook(_check_loaded_contents)

    @classmethod
    def from_quantized(cls, qweight: QuantizedLayout, bias: Optional[torch.Tensor] = None) -> "MarlinLinear":
        if not isinstance(qweight, QuantizedLayout):
            raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
        if bias is not None and tuple(bias.shape) != (qweight.out_features,):
            raise ValueError(f"bias must have shape [{qweight.out_features}], got {list(bias.shape)}")
        tensors = qweight.tensors()
        device = next(iter(tensors.values())).device
        module = cls(qweight.in_features, qweight.out_features, bias is not None,
                     qweight.weight_format, qweight.group_size, device=device,
                     dtype=None if bias is None else bias.dtype, layout=type(qweight), **qweight.shape_options())
        module._copy_weight(qweight)
        if bias is not None:
            module.bias.copy_(bias.detach())
        return module

    @classmethod
    def from_linear(cls, linear: nn.Module, weight_format: str = "fp4", group_size: int = 128,
                    method: str = "mse", sparsity: Optional[str] = None, hessian: Optional[torch.Tensor] = None,
                    bits: Optional[float] = None, **options) -> "MarlinLinear":
        """Quantize an nn.Linear (or transformers Conv1D) on any device; the result
        stays on that device. This is the one path every float linear weight takes
        (quantize_model, quantize-on-load). `method` is the quantizer.

        method="gptq" needs `hessian`, mean(x x^T) [in_features, in_features] of the layer's
        inputs, and takes act_order / damp / block_size / refine_rounds (torch_marlin.gptq);
        with act_order the result is a PermutedInputMarlinLinear.

        sparsity="2:4" prunes the weight to 2:4 first (docs/SPARSITY.md): by magnitude
        (method "magnitude" or a quantizer name), or with method="sparsegpt" | "wanda" and
        `hessian` (damp / block_size: torch_marlin.sparsegpt); a weight that is already 2:4
        keeps its pattern.

        bits=<float> quantizes onto the entropy-coded grid at most `bits` bits per weight, every
        byte counted (docs/ENTROPY.md); method "mse"/"rtn" (round to nearest) or "gptq" with
        `hessian` (act_order / damp / block_size); weight_format "tcq" (the trellis-coded grid,
        round to nearest only) or "grid" with group_size -1 choose the value kind, the defaults
        ("fp4", 128) mean tcq for round to nearest and the grid for GPTQ."""
        if bits is not None:
            if sparsity is not None:
                raise ValueError(f"bits= does not combine with sparsity={sparsity!r}")
            _check_linear(linear)
            if linear.weight.device.type == "meta":
                raise ValueError("linear.weight is on the meta device (not loaded); cannot quantize it")
            weight = linear_weight(linear.weight.detach(), is_conv1d(linear))
            method = "rtn" if method == "mse" else method
            coded = grid_weight(weight, bits, value_kind(weight_format, group_size, method), method, hessian,
                                **options)
            module = cls.from_quantized(coded, None if linear.bias is None else linear.bias.detach().cpu())
            module.quantization_error = coded.relative_error
            return module.to(linear.weight.device)
        layout = _choose_layout(None, sparsity)
        pruning, quantizer = split_method(method, sparsity)
        calibrated = calibrated_method(pruning or method)
        if calibrated is not None:
            return _from_calibrated(linear, calibrated, pruning or method, weight_format, group_size, hessian,
                                    **options)
        if hessian is not None or options:
            raise ValueError(f"hessian/{sorted(options) or 'options'} are only used by method='gptq' "
                             f"(and with sparsity='2:4' by 'sparsegpt' and 'wanda'), got method={method!r}")
        _check_linear(linear)
        if linear.weight.device.type == "meta":
            raise ValueError("linear.weight is on the meta device (not loaded); cannot quantize it")
        weight = linear_weight(linear.weight.detach(), is_conv1d(linear))
        qweight = layout.from_float(weight, weight_format, group_size, quantizer)
        bias = None if linear.bias is None else linear.bias.detach().cpu()
        module = cls.from_quantized(qweight, bias)
        module.quantization_error = qweight.relative_error
        return module.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        layout = "" if self.layout is QuantizedWeight else f", layout={self.layout.LAYOUT}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._weight_repr()}{layout}")


def _check_linear(linear) -> None:
    if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
        raise TypeError(f"linear must be an nn.Linear (or transformers Conv1D), got {type(linear).__name__}")


def _from_calibrated(linear, calibrated, method: str, weight_format: str, group_size: int, hessian,
                     **options) -> "MarlinLinear":
    """from_linear with a calibrated method (torch_marlin.quantize.calibrated_method): a
    MarlinLinear, or a PermutedInputMarlinLinear when the method permuted K (GPTQ act_order).
    Sets `quantization_error` (relative weight error), `output_error` (relative output
    error on H) and `damp` (the damping used)."""
    _check_linear(linear)
    if hessian is None:
        raise ValueError(f"method={method!r} needs hessian=H, the [in_features, in_features] matrix "
                         f"mean(x x^T) of the layer's inputs (or use quantize_model(..., calibration=...))")
    calibrated.check_options(weight_format, group_size, **options)
    weight = linear_weight(linear.weight.detach(), is_conv1d(linear))
    result = calibrated.quantize(weight, hessian, weight_format, group_size, **options)
    bias = None if linear.bias is None else linear.bias.detach().cpu()
    module = MarlinLinear.from_quantized(result.qweight, bias)
    if result.input_perm is not None:
        permuted = PermutedInputMarlinLinear(module.in_features, module.out_features, bias is not None,
                                             weight_format, group_size, dtype=None if bias is None else bias.dtype)
        permuted.load_state_dict(module.state_dict(), strict=False)
        permuted.input_perm.copy_(result.input_perm)
        module = permuted
    module.quantization_error = result.qweight.relative_error
    module.output_error = result.relative_output_error
    module.damp = result.damp
    return module.to(linear.weight.device)


def _choose_layout(layout, sparsity) -> Type[QuantizedLayout]:
    by_sparsity = layout_for_sparsity(sparsity)
    if layout is None:
        return by_sparsity or QuantizedWeight
    if not (isinstance(layout, type) and issubclass(layout, QuantizedLayout)):
        raise TypeError(f"layout must be a QuantizedLayout class, got {layout!r}")
    if sparsity is not None and layout is not by_sparsity:
        raise ValueError(f"layout={layout.__name__} and sparsity={sparsity!r} disagree: give one of them")
    return layout


def _check_loaded_contents(module: "MarlinLinear", incompatible_keys) -> None:
    """After load_state_dict: the layout's content rules (e.g. valid 2:4 metadata)."""
    qweight = module.quantized_weight()
    if all(t.device.type != "meta" for t in qweight.tensors().values()):
        qweight.check_contents()


class PermutedInputMarlinLinear(MarlinLinear):
    """MarlinLinear whose K rows were reordered (GPTQ / compressed-tensors act-order):
    groups are contiguous after the permutation, so the input is permuted the same way."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight_format: str = "fp4",
                 group_size: int = 128, device=None, dtype=None, layout=None, sparsity=None,
                 **layout_options) -> None:
        super().__init__(in_features, out_features, bias, weight_format, group_size, device=device, dtype=dtype,
                         layout=layout, sparsity=sparsity, **layout_options)
        self.register_buffer("input_perm", torch.arange(in_features, dtype=torch.int32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.input_perm.to(torch.long)))


def quantized_linear(x: torch.Tensor, qweight: QuantizedLayout, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Functional form: x [..., in_features] -> [..., out_features] in x's dtype."""
    if not isinstance(qweight, QuantizedLayout):
        raise TypeError(f"qweight must be a QuantizedWeight, got {type(qweight).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != qweight.in_features:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [..., in_features={qweight.in_features}], got {shape}")
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return qweight.linear(x, bias)
