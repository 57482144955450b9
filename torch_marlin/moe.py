"""Mixture-of-experts modules on the expert-stack layout (torch_marlin/layouts/experts.py).

- `MarlinExpertsLinear`: E linear layers of one shape in one module; forward(x,
  expert_ids, topk_weights=None) multiplies each routed row by its expert's weight
  through `torch.ops.marlin.moe_gemm`.
- `MarlinExperts`: a drop-in for a transformers 5 experts module (the classes
  decorated with `@use_experts_implementation`: Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek, gpt-oss, ...), found by that structure rather than by class name. Its
  3-D weight stacks become MarlinExpertsLinear; everything else of the original
  module is kept, and its own gating (`_apply_gate`, e.g. gpt-oss's clamped
  SwiGLU over interleaved gate/up columns) or activation is called as is.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .layouts import QuantizedExperts
from .layouts.dense import quantize_weight
from .linear import QuantizedModule


class UnsupportedExperts(ValueError):
    """An experts module whose structure MarlinExperts cannot reproduce."""


def quantize_experts(weight: torch.Tensor, weight_format: str = "fp4", group_size: int = 128,
                     method: str = "mse") -> QuantizedExperts:
    """Quantize float expert weights [E, N, K] (nn.Linear convention per expert) one
    expert at a time; the same codes as quantize_weight on each W_e."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.dtype.is_floating_point:
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 3-D floating-point tensor [E, N, K], got {shape}")
    if weight.shape[0] == 0:
        raise ValueError("weight must hold at least one expert, got E = 0")
    parts, err2, norm2 = [], 0.0, 0.0
    for e in range(weight.shape[0]):
        q = quantize_weight(weight[e], weight_format, group_size, method)
        norm = float(weight[e].detach().float().norm()) ** 2
        err2, norm2 = err2 + q.relative_error ** 2 * norm, norm2 + norm
        parts.append(q)
    stacked = QuantizedExperts.stack(parts)
    stacked.relative_error = math.sqrt(err2 / norm2) if norm2 > 0 else 0.0
    return stacked


class MarlinExpertsLinear(QuantizedModule):
    """E linear layers [in_features -> out_features] stored as one 4-bit expert stack.

    forward(x, expert_ids, topk_weights=None): x [T, in_features] (each token's row
    goes to all its experts) or [T, top_k, in_features] (one row per token and
    expert), expert_ids [T, top_k] -> [T, top_k, out_features] (x_tj @ W_e^T + b_e for
    e = expert_ids[t, j]), or with topk_weights [T, top_k] their weighted sum
    [T, out_features]. Computed in x's dtype with fp32 accumulation; weights are
    frozen, gradients flow to x, topk_weights and the bias.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 weight_format: str = "fp4", group_size: int = 128, device=None, dtype=None) -> None:
        super().__init__()
        self._init_weight(QuantizedExperts, in_features, out_features, weight_format, group_size, device=device,
                          num_experts=num_experts)
        self.num_experts = num_experts
        b = (torch.zeros(num_experts, out_features, dtype=dtype or torch.get_default_dtype(), device=device)
             if bias else None)
        self.register_buffer("bias", b)

    @classmethod
    def from_quantized(cls, qweight: QuantizedExperts, bias: Optional[torch.Tensor] = None) -> "MarlinExpertsLinear":
        if not isinstance(qweight, QuantizedExperts):
            raise TypeError(f"qweight must be a QuantizedExperts, got {type(qweight).__name__}")
        shape = (qweight.num_experts, qweight.out_features)
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"bias must have shape [E, N] = {list(shape)}, got {list(bias.shape)}")
        module = cls(qweight.num_experts, qweight.in_features, qweight.out_features, bias is not None,
                     qweight.weight_format, qweight.group_size, device=qweight.packed.device,
                     dtype=None if bias is None else bias.dtype)
        module._copy_weight(qweight)
        if bias is not None:
            module.bias.copy_(bias.detach())
        return module

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, weight_format: str = "fp4",
                   group_size: int = 128, method: str = "mse") -> "MarlinExpertsLinear":
        """Quantize expert weights [E, out, in] (+ bias [E, out]); the result is on weight's device."""
        if weight.device.type == "meta":
            raise ValueError("weight is on the meta device (not loaded); cannot quantize it")
        q = quantize_experts(weight.detach(), weight_format, group_size, method)
        module = cls.from_quantized(q, None if bias is None else bias.detach().cpu())
        module.quantization_error = q.relative_error
        return module.to(weight.device)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.in_features:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [T, in_features={self.in_features}] or "
                             f"[T, top_k, {self.in_features}], got {shape}")
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return self.quantized_weight().routed_linear(x, expert_ids, topk_weights, bias)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._weight_repr()}")


# --- transformers experts modules -------------------------------------------------------

@dataclass(frozen=True)
class ExpertsStructure:
    """What MarlinExperts needs to know of a transformers experts module."""

    num_experts: int
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    has_post_expert_norm: bool
    stacks: Tuple[Tuple[str, int, int], ...]  # (parameter name, in_features, out_features), in forward order
    dtype: torch.dtype

    def bias_name(self, stack: str) -> Optional[str]:
        return f"{stack}_bias" if self.has_bias else None


_EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def _dispatching_forward():
    """(code, interface) of the forward that transformers' @use_experts_implementation
    installs: every class decorated with the default interface shares them."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None, None

    @moe.use_experts_implementation
    class _Probe(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    return _Probe.forward.__code__, moe.ALL_EXPERTS_FUNCTIONS


def holds_expert_stacks(module: nn.Module) -> bool:
    """Whether a module looks like an experts module: the attributes the transformers
    decorator sets, or two or more 3-D floating-point parameters of its own with the
    same leading (expert) dimension, in a class that is not one of torch.nn's (whose
    convolutions have 3-D weights)."""
    if isinstance(module, MarlinExperts) or type(module).__module__.startswith("torch.nn"):
        return False
    if all(hasattr(module, flag) for flag in ("has_gate", "is_transposed")):
        return True
    leading = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()]
    return len(leading) >= 2 and len(set(leading)) == 1


def experts_structure(module: nn.Module) -> ExpertsStructure:
    """The structure of a transformers experts module, or UnsupportedExperts saying why
    MarlinExperts cannot stand in for it."""
    cls = type(module)
    code, interface = _dispatching_forward()
    forward = getattr(cls, "forward", None)
    if code is None or getattr(forward, "__code__", None) is not code:
        raise UnsupportedExperts(f"{cls.__name__} is not a transformers @use_experts_implementation experts class "
                                 f"(its forward is its own)")
    if inspect.getclosurevars(forward).nonlocals.get("experts_interface") is not interface:
        raise UnsupportedExperts(f"{cls.__name__} dispatches through its own experts interface")
    flags = {flag: getattr(module, flag, None) for flag in _EXPERTS_FLAGS}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise UnsupportedExperts(f"{cls.__name__} lacks the experts flags {_EXPERTS_FLAGS}: {flags}")
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExperts(f"{cls.__name__} is expert-parallel (sharded experts are not supported)")
    has_gate, has_bias, transposed = flags["has_gate"], flags["has_bias"], flags["is_transposed"]
    names = ["gate_up_proj" if has_gate else "up_proj", "down_proj"]
    expected = set(names) | ({f"{n}_bias" for n in names} if has_bias else set())
    params = dict(module.named_parameters(recurse=False))
    if set(params) != expected:
        raise UnsupportedExperts(f"{cls.__name__} has parameters {sorted(params)}, expected {sorted(expected)}")
    stacks, experts = [], None
    for name in names:
        w = params[name]
        if w.dim() != 3 or not w.is_floating_point():
            raise UnsupportedExperts(f"{cls.__name__}.{name} must be a 3-D float stack, got {w.dtype} {list(w.shape)}")
        e, out_features, in_features = w.shape
        if transposed:
            in_features, out_features = out_features, in_features
        if experts not in (None, e):
            raise UnsupportedExperts(f"{cls.__name__}: {name} has {e} experts, {names[0]} has {experts}")
        experts = e
        if has_bias and tuple(params[f"{name}_bias"].shape) != (e, out_features):
            raise UnsupportedExperts(f"{cls.__name__}.{name}_bias has shape {list(params[f'{name}_bias'].shape)}, "
                                     f"expected {[e, out_features]}")
        stacks.append((name, in_features, out_features))
    return ExpertsStructure(experts, has_gate, has_bias, transposed, bool(getattr(module, "has_post_expert_norm", False)),
                            tuple(stacks), params[names[0]].dtype)


def linear_stack(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A stack parameter as per-expert nn.Linear weights [E, out, in]."""
    return param.transpose(1, 2) if transposed else param


_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class MarlinExperts(nn.Module):
    """A transformers experts module with its weight stacks in 4 bits.

    forward(hidden_states [T, H], top_k_index [T, top_k], top_k_weights [T, top_k]) -> [T, H],
    what transformers' experts implementations compute: first stack (gate_up_proj or
    up_proj, + bias), the original class's `_apply_gate` (or `act_fn` without a gate),
    down_proj (+ bias), the optional post-expert norm, then the routing-weighted sum,
    here through torch.ops.marlin.moe_gemm (the routing weights and the sum are fused
    into the second matmul). The original module's other attributes and submodules
    are kept; `config._experts_implementation` does not apply (this always runs
    moe_gemm).
    """

    def __init__(self, source: nn.Module, weight_format: str = "fp4", group_size: int = 128, device=None,
                 structure: Optional[ExpertsStructure] = None) -> None:
        """Empty (zero) quantized stacks shaped like `source` (any device, e.g. meta)."""
        super().__init__()
        structure = structure or experts_structure(source)
        for name, value in vars(source).items():
            if name not in _MODULE_INTERNALS and not name.startswith("_is_hf"):
                setattr(self, name, value)
        for name, child in source.named_children():
            self.add_module(name, child)
        for name, buffer in source.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in source._non_persistent_buffers_set)
        self.source_class = f"{type(source).__module__}.{type(source).__qualname__}"
        self._gate_fn = getattr(type(source), "_apply_gate", None) if structure.has_gate else None
        self.structure = structure
        bias_dtype = structure.dtype
        for name, in_features, out_features in structure.stacks:
            self.add_module(name, MarlinExpertsLinear(structure.num_experts, in_features, out_features,
                                                      structure.has_bias, weight_format, group_size,
                                                      device=device, dtype=bias_dtype))
        self._check_gate()

    def _check_gate(self) -> None:
        """Run the gating on a meta row: it must work on this module and give down_proj's width."""
        (first, _, width), (_, down_in, _) = self.structure.stacks
        probe = torch.zeros(1, width, device="meta", dtype=self.structure.dtype)
        try:
            out = self._apply_gate(probe) if self.structure.has_gate else self.act_fn(probe)
        except Exception as e:  # noqa: BLE001  (whatever the model's code raises)
            raise UnsupportedExperts(f"{self.source_class}: its gating does not run without its weight stacks "
                                     f"({type(e).__name__}: {e})") from e
        if tuple(out.shape) != (1, down_in):
            raise UnsupportedExperts(f"{self.source_class}: gating maps {first} width {width} to "
                                     f"{out.shape[-1]}, but down_proj takes {down_in}")

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gate_fn(self, gate_up)

    @classmethod
    def from_float(cls, source: nn.Module, weight_format: str = "fp4", group_size: int = 128,
                   method: str = "mse") -> "MarlinExperts":
        """Quantize a loaded transformers experts module; the result is on its device."""
        structure = experts_structure(source)
        device = getattr(source, structure.stacks[0][0]).device
        module = cls(source, weight_format, group_size, device="meta", structure=structure)
        errors = []
        for name, _, _ in structure.stacks:
            weight = linear_stack(getattr(source, name).detach(), structure.is_transposed)
            bias = getattr(source, f"{name}_bias") if structure.has_bias else None
            quantized = MarlinExpertsLinear.from_float(weight, bias, weight_format, group_size, method)
            errors.append((quantized.quantization_error, float(weight.float().norm()) ** 2))
            module.add_module(name, quantized)
        norm2 = sum(n for _, n in errors)
        module.quantization_error = math.sqrt(sum(e * e * n for e, n in errors) / norm2) if norm2 > 0 else 0.0
        return module.to(device)

    def stacks(self) -> Dict[str, MarlinExpertsLinear]:
        return {name: getattr(self, name) for name, _, _ in self.structure.stacks}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        ids = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(ids.shape)
        (first, _, _), (down, _, _) = self.structure.stacks
        h = getattr(self, first)(x, ids)  # [T, top_k, out]
        tokens, top_k = ids.shape
        flat = h.reshape(tokens * top_k, -1)
        h = (self._apply_gate(flat) if self.structure.has_gate else self.act_fn(flat)).reshape(tokens, top_k, -1)
        if self.structure.has_post_expert_norm:
            y = self.post_expert_norm(getattr(self, down)(h, ids))
            out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        else:
            out = getattr(self, down)(h, ids, weights)
        return out.to(hidden_states.dtype).reshape(*lead, -1)

    def extra_repr(self) -> str:
        return f"source={self.source_class}, num_experts={self.structure.num_experts}"


def find_experts_modules(model: nn.Module) -> Tuple[Dict[str, ExpertsStructure], Dict[str, str]]:
    """({name: structure} of the experts modules MarlinExperts handles, {name: reason} of
    modules holding expert stacks that it cannot handle)."""
    supported, unsupported = {}, {}
    for name, module in model.named_modules():
        if not holds_expert_stacks(module):
            continue
        try:
            supported[name] = experts_structure(module)
        except UnsupportedExperts as e:
            unsupported[name] = str(e)
    return supported, unsupported


def warn_unsupported(model: nn.Module, unsupported: Dict[str, str], stacklevel: int = 3) -> None:
    """One warning naming the experts classes left in float, and why for the first."""
    if not unsupported:
        return
    import warnings

    classes = sorted({type(model.get_submodule(name)).__name__ for name in unsupported})
    name, reason = next(iter(unsupported.items()))
    warnings.warn(f"torch_marlin leaves {len(unsupported)} experts modules in float (class {', '.join(classes)}); "
                  f"{name}: {reason}", stacklevel=stacklevel)


__all__ = ["ExpertsStructure", "MarlinExperts", "MarlinExpertsLinear", "UnsupportedExperts", "experts_structure",
           "find_experts_modules", "quantize_experts"]
