"""Sequential calibration: collect each linear layer's input Hessian and quantize it with GPTQ.

Layers are quantized in the order the model first calls them. For each step
the calibration batches are run through the model as it is at that moment
(earlier layers already quantized), forward hooks add x x^T of the step's
layers' inputs into one [K, K] float32 Hessian, and the forward stops right
after the last of those layers was reached. Memory is one Hessian per step
plus one batch's activations; nothing else is kept between batches. Layers
that the model calls one after another on the same input tensor (q/k/v,
gate/up) share one Hessian and one step. The cost is one forward pass over
the calibration data to find the order plus one partial pass per step.

Padding is excluded: when a batch is a dict with a 2-D `attention_mask` and a
layer's input starts with the mask's [batch, sequence] dimensions, only the
positions where the mask is nonzero count.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn


class CalibrationError(ValueError):
    """The calibration data cannot be used (empty, rejected by the model, NaN/Inf activations)."""


class _StopForward(BaseException):
    """Raised from a hook once a step has what it needs; BaseException so that model code
    catching Exception does not swallow it."""


@dataclass
class CalibrationStats:
    batches: int = 0
    tokens: Dict[str, int] = field(default_factory=dict)  # inputs rows seen per layer (first pass)
    unreached: List[str] = field(default_factory=list)
    steps: int = 0
    seconds_forward: float = 0.0
    seconds_quantize: float = 0.0


def as_batches(calibration) -> list:
    """The calibration iterable as a list of batches (iterated once); validates each item."""
    if calibration is None:
        raise CalibrationError("method='gptq' needs calibration data: calibration=[batch, ...] where a "
                               "batch is a Tensor (model(t)), a tuple (model(*t)) or a dict (model(**d))")
    if isinstance(calibration, (torch.Tensor, dict, str, bytes)):
        raise CalibrationError(f"calibration must be an iterable of batches (e.g. a list of tensors), "
                               f"got a single {type(calibration).__name__}; wrap it in a list")
    try:
        batches = list(calibration)
    except TypeError as e:
        raise CalibrationError(f"calibration must be an iterable of batches, got {type(calibration).__name__}") from e
    if not batches:
        raise CalibrationError("calibration is empty: give at least one batch of model inputs")
    for i, batch in enumerate(batches):
        if not isinstance(batch, (torch.Tensor, tuple, list, dict)):
            raise CalibrationError(f"calibration batch {i} must be a Tensor, a tuple or a dict of model inputs, "
                                   f"got {type(batch).__name__}")
    return batches


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _mask_of(batch) -> Optional[torch.Tensor]:
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            return mask != 0
    return None


class _Runner:
    """Runs calibration batches through the model with hooks on some layers."""

    def __init__(self, model: nn.Module, batches: list, stats: CalibrationStats):
        self.model = model
        self.batches = batches
        self.stats = stats
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.batch_index = 0
        self.mask = None

    def rows(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """A layer's input as [rows, K] float32, padding removed; checks for NaN/Inf."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            raise CalibrationError(f"layer {name!r} was called without a tensor input")
        if self.mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(self.mask.shape):
            x = x[self.mask.to(x.device)]
        x = x.reshape(-1, x.shape[-1])
        if not torch.isfinite(x).all():
            raise CalibrationError(f"layer {name!r} received NaN or Inf inputs in calibration batch "
                                   f"{self.batch_index}; the calibration data (or the model in its "
                                   f"partially quantized state) produces non-finite activations")
        return x.float()

    def run(self, hooks: Dict[nn.Module, Callable], stop_when: Optional[Callable[[], bool]] = None):
        handles = [m.register_forward_pre_hook(fn, with_kwargs=True) for m, fn in hooks.items()]
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for i, batch in enumerate(self.batches):
                    self.batch_index = i
                    self.mask = _mask_of(batch)
                    batch = _to_device(batch, self.device)
                    try:
                        if isinstance(batch, torch.Tensor):
                            self.model(batch)
                        elif isinstance(batch, dict):
                            self.model(**batch)
                        else:
                            self.model(*batch)
                    except _StopForward:
                        pass
                    except CalibrationError:
                        raise
                    except Exception as e:
                        raise CalibrationError(f"the model rejected calibration batch {i}: "
                                               f"{type(e).__name__}: {e}") from e
        finally:
            for h in handles:
                h.remove()
            self.stats.seconds_forward += time.perf_counter() - start


def _discover(runner: _Runner, targets: Dict[str, nn.Module]):
    """One full pass: first-call order, rows seen and calls per batch of every target,
    and which consecutive calls share their input tensor."""
    order: List[str] = []
    rows: Dict[str, int] = {name: 0 for name in targets}
    calls: Dict[str, tuple] = {}  # name -> (batch index, calls in that batch)
    repeated = set()  # called more than once in one forward
    shares_input_with_previous: Dict[str, bool] = {}
    last = {"input": None, "name": None}

    def hook_for(name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("input")
            rows[name] += runner.rows(name, args, kwargs).shape[0]
            batch, count = calls.get(name, (-1, 0))
            count = count + 1 if batch == runner.batch_index else 1
            calls[name] = (runner.batch_index, count)
            if count > 1:
                repeated.add(name)
            if name not in shares_input_with_previous:
                # Same tensor as the call just before, and that call was the previous new layer.
                shares_input_with_previous[name] = last["input"] is x and bool(order) and last["name"] == order[-1]
                order.append(name)
            last["input"], last["name"] = x, name
        return hook

    hooks = {module: hook_for(name) for name, module in targets.items()}
    try:
        runner.run(hooks)
    finally:
        last["input"] = None
    steps: List[List[str]] = []
    for name in order:
        if shares_input_with_previous[name] and steps:
            steps[-1].append(name)
        else:
            steps.append([name])
    once = {name: name not in repeated for name in order}
    return steps, rows, once


def _dense_stand_in(quantized: nn.Module, linear: nn.Linear) -> nn.Linear:
    """nn.Linear computing what `quantized` (a MarlinLinear, maybe with input_perm) computes."""
    weight = quantized.dequantize(torch.float32)
    perm = getattr(quantized, "input_perm", None)
    if perm is not None:
        unpermuted = torch.empty_like(weight)
        unpermuted[:, perm.long()] = weight
        weight = unpermuted
    stand_in = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device="meta")
    stand_in.weight = nn.Parameter(weight.to(linear.weight.dtype), requires_grad=False)
    if linear.bias is not None:
        stand_in.bias = linear.bias
    return stand_in.to(linear.weight.device)


def quantize_sequentially(model: nn.Module, targets: Dict[str, nn.Module], calibration: Iterable,
                          quantize_layer: Callable[[str, nn.Module, torch.Tensor], nn.Module],
                          quantize_unreached: Callable[[str, nn.Module], nn.Module]) -> CalibrationStats:
    """Quantize `targets` ({qualified name: nn.Linear} of `model`) in forward order.

    quantize_layer(name, linear, hessian) returns the replacement module (a MarlinLinear).
    Until the end, later steps run through an nn.Linear holding its dequantized weight:
    the same function, computed by the float GEMM, which is much faster than the 4-bit
    kernel on calibration-sized batches. Layers the calibration never reaches are
    replaced by quantize_unreached(name, linear) and listed in the stats, with a warning."""
    batches = as_batches(calibration)
    stats = CalibrationStats(batches=len(batches))
    runner = _Runner(model, batches, stats)
    steps, rows, once = _discover(runner, targets)
    quantized: Dict[str, nn.Module] = {}
    stats.tokens = {name: rows[name] for name in rows if rows[name]}
    for step in steps:
        first = targets[step[0]]
        k = first.in_features
        hessian = torch.zeros(k, k, dtype=torch.float32, device=runner.device)
        seen = {"rows": 0}
        last = step[-1]
        # Full passes when a step's layers run more than once per forward (shared weights).
        stop = all(once[name] for name in step)

        def accumulate(module, args, kwargs, name=step[0]):
            x = runner.rows(name, args, kwargs)
            hessian.addmm_(x.t(), x)
            seen["rows"] += x.shape[0]

        def stop_after(module, args, kwargs):
            raise _StopForward

        hooks = {first: accumulate}
        if stop:
            # Hook on the step's last layer (which runs after the others) ends the forward.
            if targets[last] is first:
                def accumulate_and_stop(module, args, kwargs):
                    accumulate(module, args, kwargs)
                    raise _StopForward
                hooks[first] = accumulate_and_stop
            else:
                hooks[targets[last]] = stop_after
        runner.run(hooks)
        stats.steps += 1
        if seen["rows"] == 0:  # cannot happen for layers found by _discover, but be safe
            raise CalibrationError(f"layer {step[0]!r} received no calibration inputs")
        hessian = hessian.cpu().double() / seen["rows"]
        start = time.perf_counter()
        for name in step:
            quantized[name] = quantize_layer(name, targets[name], hessian)
            model.set_submodule(name, _dense_stand_in(quantized[name], targets[name]))
        stats.seconds_quantize += time.perf_counter() - start
    for name, module in quantized.items():
        model.set_submodule(name, module)
    reached = {name for step in steps for name in step}
    stats.unreached = [name for name in targets if name not in reached]
    if stats.unreached:
        warnings.warn(f"{len(stats.unreached)} linear layers were never called on the calibration data and "
                      f"are quantized without it (round to nearest, method='mse'): "
                      f"{', '.join(stats.unreached[:10])}{' ...' if len(stats.unreached) > 10 else ''}",
                      stacklevel=3)
        for name in stats.unreached:
            model.set_submodule(name, quantize_unreached(name, targets[name]))
    return stats
