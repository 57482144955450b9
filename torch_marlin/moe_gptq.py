"""GPTQ for expert stacks, from the tokens the model's own router sends to each expert.

`calibrate_experts(source, calls, ...)` quantizes a transformers experts module
(torch_marlin.moe.experts_structure) into a MarlinExperts, given the calls the
calibration forward made to it (torch_marlin.calibration keeps one experts
module's inputs for the calibration set: hidden states [T, H], the router's
top_k_index [T, top_k] and weights, padding removed). Expert by expert:

1. the rows X_e of the tokens routed to expert e give H_e = X_e^T X_e / n_e for
   the first stack (gate_up_proj or up_proj), quantized with GPTQ;
2. those rows run through the *quantized* first stack (+ bias) and the module's
   own gating (gpt-oss's clamped SwiGLU over interleaved columns, or act_fn),
   giving the inputs of down_proj and its Hessian; down_proj is quantized.

So the second stack sees the first's quantization errors, as later layers do in
the dense engine, and memory is the module's kept inputs plus one expert's
Hessian and activations at a time (never E Hessians); Hessians and activations
are computed in float64 (the GPTQ factorization needs it anyway). The Hessians are not
weighted by the routing weights (as GPTQModel and llm-compressor do).

Rare experts (the rule, per expert and stack; `ExpertError.rule` reports it):
- `"gptq"`: n_e >= K (the Hessian can have full rank): plain GPTQ;
- `"gptq-shrunk"`: 0 < n_e < K: H_e has rank <= n_e, and GPTQ would fit those
  few tokens at the expense of every other input; H_e is shrunk toward its
  diagonal, H' = a H_e + (1 - a) diag(H_e) with a = n_e / K (a diagonal Hessian
  is round to nearest weighted by each input's energy);
- `"rtn"`: no token: round to nearest (`mse`).
The report's errors are measured on the unshrunk H_e (the calibration tokens).

Act-order needs a permutation of each expert's input, which the expert-stack
layout does not have: refused unless group_size=-1 (where the order does not
change the layout). All experts of a stack share one layout, format and group size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn

from .calibration import DEFAULT_DAMP
from .gptq import gptq_quantize
from .layouts import QuantizedExperts
from .layouts.dense import quantize_weight
from .moe import MarlinExperts, MarlinExpertsLinear, experts_structure, linear_stack

RULES = ("gptq", "gptq-shrunk", "rtn")


@dataclass
class ExpertError:
    """One expert of one stack: calibration tokens routed to it, the rule applied, and the
    relative output error on those tokens of round to nearest and of the result (NaN
    without tokens)."""

    tokens: int
    rule: str
    rtn: float
    gptq: float


def check_experts_options(group_size: int, act_order: bool = False, **_) -> None:
    if act_order and group_size != -1:
        raise ValueError("act_order=True cannot be used for expert stacks: the expert-stack layout has no "
                         "per-expert input permutation (act-order is only free with group_size=-1); pass "
                         "act_order=False, or calibrate_experts=False to quantize the stacks with round to nearest")


def routed_inputs(calls) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x float32 [T, H], top_k_index int64 [T, top_k]) of the kept calls of an experts module,
    forward(hidden_states, top_k_index, top_k_weights); padded tokens (the batch's
    attention mask, when hidden_states has one row per position) are left out."""
    xs, ids = [], []
    for call in calls:
        args, kwargs = call.args, call.kwargs
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if k in ("top_k_index", "router_indices"))
        x = hidden.reshape(-1, hidden.shape[-1])
        index = index.reshape(x.shape[0], -1)
        if call.mask is not None and call.mask.numel() == x.shape[0]:
            keep = call.mask.reshape(-1).to(x.device)
            x, index = x[keep], index[keep]
        xs.append(x.float().cpu())
        ids.append(index.long().cpu())
    return torch.cat(xs), torch.cat(ids)


def shrunk_hessian(h: torch.Tensor, tokens: int) -> torch.Tensor:
    """The rare-expert rule: H itself with at least K tokens, else a H + (1 - a) diag(H), a = tokens / K."""
    k = h.shape[0]
    if tokens >= k:
        return h
    a = tokens / k
    return a * h + (1 - a) * torch.diag(torch.diagonal(h))


def _traces(w: torch.Tensor, deq: torch.Tensor, h: torch.Tensor) -> Tuple[float, float]:
    """(tr(E H E^T), tr(W H W^T)) with E = w - deq, in float64."""
    w, e = w.double(), w.double() - deq.double()
    return float(((e @ h) * e).sum()), float(((w @ h) * w).sum())


def _relative(error: float, reference: float) -> float:
    return math.sqrt(max(error, 0.0) / reference) if reference > 0 else 0.0


def _quantize_expert(w, rows, weight_format, group_size, options, warn, shrink_rare):
    """(QuantizedWeight, ExpertError, (rtn, gptq error, reference traces)) of one expert's weight w [N, K]
    on its routed input rows [n, K]."""
    rtn = quantize_weight(w, weight_format, group_size, "mse")
    n, k = rows.shape[0], w.shape[1]
    if n == 0:
        return rtn, ExpertError(0, "rtn", math.nan, math.nan), (0.0, 0.0, 0.0)
    h = (rows.t() @ rows) / n
    result = gptq_quantize(w, shrunk_hessian(h, n) if shrink_rare else h, weight_format, group_size, **options)
    warn(result.damp)
    q = result.qweight
    rtn_err, reference = _traces(w, rtn.dequantize(torch.float64), h)
    gptq_err, _ = _traces(w, q.dequantize(torch.float64), h)
    rule = "gptq" if n >= k or not shrink_rare else "gptq-shrunk"
    entry = ExpertError(n, rule, _relative(rtn_err, reference), _relative(gptq_err, reference))
    return q, entry, (n * rtn_err, n * gptq_err, n * reference)


def calibrate_experts(source: nn.Module, calls, weight_format: str = "fp4", group_size: int = 128,
                      name: str = "experts", shrink_rare: bool = True, **options) -> Tuple[MarlinExperts, Dict[str, List[ExpertError]],
                                                                 Dict[str, Tuple[float, float]]]:
    """GPTQ for every stack of a transformers experts module on its kept calibration calls
    (see the module docstring). Returns (the MarlinExperts, {stack: [ExpertError per expert]},
    {stack: (round to nearest, GPTQ) relative output error over all its routed tokens}).
    shrink_rare=False gives experts with fewer than K tokens plain GPTQ (the benchmark's comparison)."""
    check_experts_options(group_size, **options)
    structure = experts_structure(source)
    device = getattr(source, structure.stacks[0][0]).device
    module = MarlinExperts(source, weight_format, group_size, device="meta", structure=structure)
    x, ids = routed_inputs(calls)
    damp = options.get("damp", DEFAULT_DAMP)
    raised = []

    def warn(used):
        if used > damp:
            raised.append(used)

    (first, _, _), (down, _, _) = structure.stacks
    weights = {stack: linear_stack(getattr(source, stack).detach(), structure.is_transposed).float().cpu()
               for stack in (first, down)}
    biases = {stack: getattr(source, f"{stack}_bias").detach().double().cpu() if structure.has_bias else None
              for stack in (first, down)}
    parts = {first: [], down: []}  # QuantizedWeight per expert
    errors = {first: [], down: []}
    sums = {first: [0.0, 0.0, 0.0], down: [0.0, 0.0, 0.0]}
    gate = module._apply_gate if structure.has_gate else module.act_fn
    for e in range(structure.num_experts):
        rows = x[(ids == e).any(-1)].double()  # a token routed twice to one expert counts once
        inputs = rows
        for stack in (first, down):
            q, entry, traces = _quantize_expert(weights[stack][e], inputs, weight_format, group_size, options, warn,
                                                shrink_rare)
            parts[stack].append(q)
            errors[stack].append(entry)
            sums[stack] = [a + b for a, b in zip(sums[stack], traces)]
            if stack == first and rows.shape[0]:  # down_proj's inputs through the quantized first stack
                out = rows @ q.dequantize(torch.float64).t()
                if biases[first] is not None:
                    out = out + biases[first][e]
                inputs = gate(out)
    totals, weight_error, weight_norm = {}, 0.0, 0.0
    for stack in (first, down):
        for e, q in enumerate(parts[stack]):
            w = weights[stack][e].double()
            weight_error += float((w - q.dequantize(torch.float64)).pow(2).sum())
            weight_norm += float(w.pow(2).sum())
        bias = getattr(source, f"{stack}_bias").detach().cpu() if structure.has_bias else None
        module.add_module(stack, MarlinExpertsLinear.from_quantized(QuantizedExperts.stack(parts[stack]), bias))
        rtn_err, gptq_err, reference = sums[stack]
        totals[stack] = (_relative(rtn_err, reference), _relative(gptq_err, reference))
    if raised:
        warnings.warn(f"{name}: {len(raised)} expert Hessians needed more damping (up to damp={max(raised):g}, "
                      f"asked {damp:g}) to be positive definite; more or more varied calibration data helps",
                      stacklevel=3)
    module.quantization_error = math.sqrt(weight_error / weight_norm) if weight_norm > 0 else 0.0
    return module.to(device), errors, totals


def describe_expert_errors(stack: str, errors: List[ExpertError]) -> List[str]:
    """Report lines for one stack: which experts got which rule, then each expert's errors."""
    by_rule = {rule: [e for e, entry in enumerate(errors) if entry.rule == rule] for rule in RULES}
    counts = ", ".join(f"{len(v)} {rule}" for rule, v in by_rule.items() if v)
    lines = [f"  {stack}: experts {counts}"
             + "".join(f"; {rule}: {_ranges(by_rule[rule])}" for rule in RULES[1:] if by_rule[rule])]
    cells = [f"e{e} n={entry.tokens} {entry.rtn:.4f}->{entry.gptq:.4f}" if entry.tokens else f"e{e} n=0 rtn"
             for e, entry in enumerate(errors)]
    lines += ["    " + ", ".join(cells[i:i + 4]) for i in range(0, len(cells), 4)]
    return lines


def _ranges(indices: List[int]) -> str:
    out, start = [], None
    for i, v in enumerate(indices):
        if start is None:
            start = v
        if i + 1 == len(indices) or indices[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


__all__ = ["ExpertError", "calibrate_experts", "check_experts_options", "describe_expert_errors",
           "routed_inputs", "shrunk_hessian"]
