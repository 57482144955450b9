"""What every weight layout provides (docs/ARCHITECTURE.md, "the layout seam").

A quantized weight is a layout (how codes and their metadata are arranged in
tensors: dense 2-D `[K/8, N]` today) times a value format (what a 4-bit code
means: torch_marlin/formats.py). A layout is a class deriving from
QuantizedLayout, in its own file under torch_marlin/layouts/, that knows its
tensors, how to dequantize them (the plain-torch reference), how they are
multiplied (its torch.ops.marlin.* ops, whose fake kernels and autograd live
in the same file) and how its state_dict is guarded against loading another
layout. MarlinLinear builds its buffers and its forward from the layout class
it is given, so a new layout adds files instead of editing the module.
"""

from __future__ import annotations

from typing import ClassVar, Dict, List, Optional, Tuple, Type

import torch

from .. import formats

# LAYOUT_CODE -> class, and sparsity string ("2:4") -> class, filled by register_layout.
_LAYOUTS: Dict[int, Type["QuantizedLayout"]] = {}
_SPARSITIES: Dict[str, Type["QuantizedLayout"]] = {}


def fake_gemm_output(x: torch.Tensor, weight: torch.Tensor, weight_name: str, k: int, n: int,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A gemm op's fake kernel: the checks on x and bias (the C++ op's words) and the empty output."""
    torch._check(x.dtype in formats.ACTIVATION_DTYPES, lambda: f"x must be float16, bfloat16 or float32, got {x.dtype}")
    torch._check(x.device == weight.device,
                 lambda: f"x must be on the same device as {weight_name} ({weight.device}), got {x.device}")
    torch._check(x.dim() >= 1 and x.shape[-1] == k, lambda: f"x.size(-1) must equal K = {k}, got {list(x.shape)}")
    if bias is not None:
        torch._check(tuple(bias.shape) == (n,), lambda: f"bias must have shape [{n}], got {list(bias.shape)}")
    return x.new_empty((*x.shape[:-1], n))


def register_layout(cls: Type["QuantizedLayout"]) -> Type["QuantizedLayout"]:
    """Class decorator: makes a layout known to MarlinLinear's state_dict guard
    (and, if it sets SPARSITY, to `sparsity=` arguments)."""
    if cls.LAYOUT_CODE in _LAYOUTS:
        raise ValueError(f"layout code {cls.LAYOUT_CODE} is taken by {_LAYOUTS[cls.LAYOUT_CODE].__name__}")
    if cls.SPARSITY is not None and cls.SPARSITY in _SPARSITIES:
        raise ValueError(f"sparsity {cls.SPARSITY!r} is taken by {_SPARSITIES[cls.SPARSITY].__name__}")
    _LAYOUTS[cls.LAYOUT_CODE] = cls
    if cls.SPARSITY is not None:
        _SPARSITIES[cls.SPARSITY] = cls
    return cls


def layout_for_sparsity(sparsity: Optional[str]) -> Optional[Type["QuantizedLayout"]]:
    """The layout class of a `sparsity=` argument ("2:4"); None for None (dense)."""
    if sparsity is None:
        return None
    if not isinstance(sparsity, str) or sparsity not in _SPARSITIES:
        raise ValueError(f"sparsity must be None or one of {sorted(_SPARSITIES)}, got {sparsity!r}")
    return _SPARSITIES[sparsity]


def layout_by_code(code: int) -> Optional[Type["QuantizedLayout"]]:
    return _LAYOUTS.get(code)


def known_layout_codes() -> List[int]:
    return sorted(_LAYOUTS)


class QuantizedLayout:
    """Base of the layout classes. A subclass defines the class attributes and
    the abstract methods below; the generic methods here use them."""

    LAYOUT: ClassVar[str]  # name, e.g. "dense"
    # First integer of the state_dict descriptor (MarlinLinear's _extra_state):
    # identifies the layout and its version. Persisted: never reuse a code.
    LAYOUT_CODE: ClassVar[int]
    TENSORS: ClassVar[Tuple[str, ...]]  # tensor attributes, in state_dict order (None when absent)
    SPARSITY: ClassVar[Optional[str]] = None  # the `sparsity=` string that selects this layout ("2:4")
    FP16_TENSORS: ClassVar[Tuple[str, ...]] = ("scales", "zeros")  # stay fp16 under .half()/.to(dtype)
    # Tensors whose length depends on the content (an entropy-coded stream): a module
    # takes the length of the state_dict it loads.
    VARIABLE_TENSORS: ClassVar[Tuple[str, ...]] = ()

    weight_format: str
    group_size: int
    in_features: int  # K the caller sees (the layout may pad it)
    out_features: int

    # --- abstract -----------------------------------------------------------------

    @classmethod
    def empty(cls, in_features: int, out_features: int, weight_format: str, group_size: int,
              device=None, **shape) -> "QuantizedLayout":
        """A zero-filled weight of this shape (what a module registers as buffers). `shape`
        holds a layout's further dimensions (the expert stack's num_experts)."""
        raise NotImplementedError

    @classmethod
    def from_float(cls, weight: torch.Tensor, weight_format: str, group_size: int,
                   method: str = "mse") -> "QuantizedLayout":
        """Quantize a float nn.Linear weight [N, K] into this layout (`method`: a quantizer
        of torch_marlin.quantize); what MarlinLinear.from_linear calls."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [..., out_features, in_features] (leading dimensions of stacked layouts
        first), computed from the reference formulas in float64."""
        raise NotImplementedError

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [..., out_features, in_features] through the layout's dequantize op (fp32
        inside, on the weight's device): what the fast paths compute."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [..., in_features] @ W^T (+ bias) through the layout's op, in x's dtype
        (2-D layouts; expert stacks have routed_linear instead)."""
        raise NotImplementedError

    def check_contents(self) -> None:
        """Raise ValueError if the tensors' contents (not only shapes) break the layout's
        rules; MarlinLinear calls it after loading a state_dict. Default: nothing to check."""

    def descriptor_extra(self) -> List[int]:
        """Layout-specific integers appended to the state_dict descriptor."""
        return []

    @classmethod
    def check_arguments(cls, weight_format: str, group_size: int) -> None:
        """Raise ValueError unless the layout takes this format and group size."""
        formats.check_weight_format(weight_format)
        formats.check_group_size(group_size)

    @classmethod
    def knows_format_number(cls, number: int) -> bool:
        """Whether a descriptor's format number is one this layout reads."""
        return 0 <= number < len(formats.WEIGHT_FORMATS)

    def options(self) -> dict:
        """Layout-specific constructor fields beyond the common ones (a module keeps them)."""
        return {}

    def shape_options(self) -> dict:
        """What `empty` needs besides the common arguments to make tensors of this weight's shapes."""
        return self.options()

    # --- generic ------------------------------------------------------------------

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The layout's tensors by name (absent optional ones left out)."""
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def num_weights(self) -> int:
        """Weights this represents (K unpadded); stacked layouts multiply by their count."""
        return self.in_features * self.out_features

    def to(self, device) -> "QuantizedLayout":
        """The same weight with its tensors on `device` (fp16 metadata stays fp16)."""
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return self.replace(**moved)

    def replace(self, **tensors) -> "QuantizedLayout":
        import dataclasses

        return dataclasses.replace(self, **tensors)

    def descriptor(self) -> List[int]:
        """What a state_dict records of the layout: [LAYOUT_CODE, format number,
        group_size, in_features, *descriptor_extra()] (docs/FORMAT.md)."""
        return [self.LAYOUT_CODE, formats.WEIGHT_FORMATS.index(self.weight_format), self.group_size,
                self.in_features, *self.descriptor_extra()]

    @classmethod
    def describe_descriptor(cls, descriptor: List[int]) -> str:
        """Constructor arguments a descriptor stands for, for error messages."""
        code, fmt, group_size, in_features = descriptor[:4]
        layout = layout_by_code(code)
        name = formats.WEIGHT_FORMATS[fmt] if 0 <= fmt < len(formats.WEIGHT_FORMATS) else f"#{fmt}"
        text = f"weight_format={name!r}, group_size={group_size}, in_features={in_features}"
        if layout is None:
            return f"unknown layout {code}, " + text
        if layout is not cls:
            text = f"layout={layout.LAYOUT!r}, " + text
        return layout.describe_extra(text, descriptor[4:])

    @classmethod
    def describe_extra(cls, text: str, extra: List[int]) -> str:
        return text
