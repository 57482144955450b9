"""Sequential calibration: collect each linear layer's input Hessian and hand it to a quantizer.

The engine knows nothing about GPTQ: `quantize_sequentially(model, targets,
calibration, quantize_layer, quantize_unreached)` calls
`quantize_layer(name, layer, H)` for each target (an nn.Linear or a
transformers Conv1D) with `H = mean(x x^T)`, float64 `[in_features,
in_features]` on the CPU, over the unpadded input rows the layer saw, and puts
the module it returns in the layer's place. That module must have
`in_features`, `out_features` and `dequantize(dtype) -> [out, in]` (and may
have an int `input_perm` of its input columns, as PermutedInputMarlinLinear):
until the end the model runs an nn.Linear holding that dequantized weight.
`quantize_model_calibrated` drives it for quantize_model with any calibrated
method of the registry (torch_marlin.quantize.register_calibrated_method: GPTQ,
SparseGPT, Wanda); any other Hessian-based method can use the engine unchanged.

Layers are quantized in the order the model first calls them, each on the
inputs it receives from the model with all earlier layers already quantized.
A step is one layer, or several that the model calls one after another on
the same input tensor (q/k/v, gate/up: they share one Hessian). For each step
forward hooks add x x^T of the step's input rows into one [K, K] float32
Hessian; nothing else is kept between batches.

How the inputs are produced:

- Generic (any nn.Module): the calibration batches run through the whole
  model, and the forward stops right after the step's last layer was reached.
  Cost: one pass to find the order plus about half a pass per step.
- Blocks (transformer stacks, found and verified automatically): when the
  layers sit in the children of an nn.ModuleList that the model calls one
  after another, each feeding its output to the next with the same other
  arguments (checked by object identity during the first pass), the inputs of
  the current block are kept for every batch and only that block runs: its
  steps, then once more to produce the next block's inputs. Cost: about
  three passes in all; memory: one block's inputs for the calibration set.
  The results are identical to the generic way (same operations on the same
  inputs); layers outside the blocks (embeddings side, pooler, heads) use it.

Padding is excluded: when a batch is a dict with a 2-D `attention_mask` and a
layer's input starts with the mask's [batch, sequence] dimensions, only the
positions where the mask is nonzero count. A model whose config has
`use_cache` runs with it off during calibration (no key/value caches).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from .float_linear import is_conv1d, linear_weight
from .quantize import calibrated_method

# Options of the Hessian-based methods (GPTQ, SparseGPT): damp * mean(diag H) is added to
# diag(H); columns are updated in blocks of block_size.
DEFAULT_DAMP = 0.01
DEFAULT_BLOCK_SIZE = 128


class CalibrationError(ValueError):
    """The calibration data cannot be used (empty, rejected by the model, NaN/Inf activations)."""


class _StopForward(BaseException):
    """Raised from a hook once a step has what it needs; BaseException so that model code
    catching Exception does not swallow it."""


@dataclass
class CalibrationStats:
    batches: int = 0
    rows: Dict[str, int] = field(default_factory=dict)  # input rows (tokens) seen per layer
    unreached: List[str] = field(default_factory=list)
    steps: int = 0
    blocks: Optional[str] = None  # the nn.ModuleList run block by block, if any
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


def _input_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("input")


def _looks_like_cache(value) -> bool:
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


@dataclass
class ModuleCall:
    """One batch's call of a module (the current block, or a module quantized on its kept
    inputs): its arguments and the batch's attention mask."""

    args: tuple
    kwargs: dict
    mask: Optional[torch.Tensor]


class _Runner:
    """Runs calibration batches through the model (or one block) with pre-hooks on some modules."""

    def __init__(self, model: nn.Module, batches: list, stats: CalibrationStats):
        self.model = model
        self.batches = batches
        self.stats = stats
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.batch_index = 0
        self.mask = None

    def rows(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """A layer's input as [rows, K] float32, padding removed; checks for NaN/Inf."""
        x = _input_of(args, kwargs)
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

    def _hooked(self, hooks: Dict[nn.Module, Callable]):
        return [m.register_forward_pre_hook(fn, with_kwargs=True) for m, fn in hooks.items()]

    def run(self, hooks: Dict[nn.Module, Callable]) -> None:
        """Every batch through the whole model."""
        handles = self._hooked(hooks)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for i, batch in enumerate(self.batches):
                    self.batch_index, self.mask = i, _mask_of(batch)
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

    def run_block(self, block: nn.Module, calls: List[ModuleCall], hooks: Dict[nn.Module, Callable],
                  keep_outputs: bool = False) -> list:
        """Every batch's stored call of one block; returns the outputs if asked."""
        handles = self._hooked(hooks)
        start = time.perf_counter()
        outputs = []
        try:
            with torch.no_grad():
                for i, call in enumerate(calls):
                    self.batch_index, self.mask = i, call.mask
                    try:
                        out = block(*call.args, **call.kwargs)
                    except _StopForward:
                        out = None
                    if keep_outputs:
                        outputs.append(out)
        finally:
            for h in handles:
                h.remove()
            self.stats.seconds_forward += time.perf_counter() - start
        return outputs


@dataclass
class _Discovery:
    steps: List[List[str]]  # layer names per step, in forward order
    rows: Dict[str, int]
    once: Dict[str, bool]  # called at most once per forward
    block_of: Dict[str, Optional[int]]  # index of the block a layer runs in (None: outside)
    blocks: Optional[List[nn.Module]] = None  # set when block-by-block running was verified
    blocks_name: Optional[str] = None
    output_is_tuple: bool = False  # the next block's input is output[0] (else the output itself)


def _candidate_blocks(model: nn.Module, targets: Dict[str, nn.Module]):
    """The nn.ModuleList holding the most target layers (at least two children with some)."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not name:
            continue
        used = {t[len(name) + 1:].split(".", 1)[0] for t in targets if t.startswith(name + ".")}
        count = sum(1 for t in targets if t.startswith(name + "."))
        if len(used) >= 2 and (best is None or count > best[0]):
            best = (count, name, list(module))
    return (best[1], best[2]) if best else (None, None)


def _discover(runner: _Runner, model: nn.Module, targets: Dict[str, nn.Module], alone=frozenset()) -> _Discovery:
    """One full pass over the batches: first-call order, rows seen and calls per batch of every
    target, which consecutive calls share their input tensor, and whether the candidate blocks
    can be run one by one (each called once, in order, fed by the previous one's output)."""
    order: List[str] = []
    rows = {name: 0 for name in targets}
    calls: Dict[str, tuple] = {}  # name -> (batch index, calls in that batch)
    repeated = set()
    shares_previous: Dict[str, bool] = {}
    block_of: Dict[str, Optional[int]] = {}
    last = {"input": None, "name": None}
    blocks_name, blocks = _candidate_blocks(model, targets)
    chain = {"ok": blocks is not None, "why": "", "tuple": None, "current": None, "previous": None,
             "expected": 0, "out": None}

    def refuse(why):
        chain["ok"], chain["why"] = False, why

    def target_hook(name):
        def hook(module, args, kwargs):
            x = _input_of(args, kwargs)
            rows[name] += runner.rows(name, args, kwargs).shape[0]
            batch, count = calls.get(name, (-1, 0))
            count = count + 1 if batch == runner.batch_index else 1
            calls[name] = (runner.batch_index, count)
            if count > 1:
                repeated.add(name)
            where = chain["current"]
            if name in block_of and block_of[name] != where:
                refuse(f"{name} runs in more than one place")
            block_of[name] = where
            if name not in shares_previous:
                # Same tensor as the call just before, and that call was the previous new layer.
                shares_previous[name] = (last["input"] is x and bool(order) and last["name"] == order[-1]
                                         and name not in alone)
                order.append(name)
            # A module quantized on its kept inputs is a step of its own.
            last["input"], last["name"] = (None if name in alone else x), name
        return hook

    def block_pre_hook(index):
        def hook(module, args, kwargs):
            if index != chain["expected"]:
                refuse(f"block {index} ran out of order")
            chain["expected"] = index + 1
            if any(_looks_like_cache(v) for v in list(args) + list(kwargs.values())):
                refuse("a block receives a key/value cache")
            previous = chain["previous"]
            if previous is not None and chain["ok"]:
                p_args, p_kwargs, out = previous
                fed = out[0] if isinstance(out, (tuple, list)) and out else out
                as_tuple = fed is not out
                if not (args and args[0] is fed and len(args) == len(p_args)
                        and all(a is b for a, b in zip(args[1:], p_args[1:]))
                        and kwargs.keys() == p_kwargs.keys()
                        and all(kwargs[k] is p_kwargs[k] for k in kwargs)):
                    refuse(f"block {index} is not fed by block {index - 1}'s output with the same arguments")
                elif chain["tuple"] not in (None, as_tuple):
                    refuse("blocks return different kinds of output")
                chain["tuple"] = as_tuple
            chain["current"] = index
            chain["previous"] = (args, kwargs, None)
        return hook

    def block_hook(index):
        def hook(module, args, kwargs, output):
            chain["current"] = None
            chain["previous"] = (args, kwargs, output)
        return hook

    hooks = {module: target_hook(name) for name, module in targets.items()}
    handles = []
    if blocks is not None:
        for i, block in enumerate(blocks):
            if block in hooks:  # a target itself: not a block of layers
                refuse("the list holds linear layers, not blocks")
            handles.append(block.register_forward_pre_hook(block_pre_hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(block_hook(i), with_kwargs=True))

    original_run = runner.run

    def run_checking_each_batch(hooks_):
        # Each batch must call every block once, in order.
        def batch_start(module, args, kwargs):
            if chain["expected"] not in (0, len(blocks)):
                refuse("a forward did not call every block")
            chain["expected"], chain["previous"], chain["current"] = 0, None, None
        extra = {model: batch_start} if blocks is not None else {}
        original_run({**extra, **hooks_})

    try:
        run_checking_each_batch(hooks)
    finally:
        for h in handles:
            h.remove()
        last["input"] = None
        chain["previous"] = None
    if blocks is not None and chain["expected"] not in (0, len(blocks)):
        refuse("a forward did not call every block")

    steps: List[List[str]] = []
    for name in order:
        if shares_previous[name] and steps:
            steps[-1].append(name)
        else:
            steps.append([name])
    found = _Discovery(steps, rows, {name: name not in repeated for name in order}, block_of)
    if blocks is not None and chain["ok"] and _steps_fit_blocks(steps, block_of):
        found.blocks, found.blocks_name, found.output_is_tuple = blocks, blocks_name, bool(chain["tuple"])
    return found


def _steps_fit_blocks(steps: List[List[str]], block_of: Dict[str, Optional[int]]) -> bool:
    """Steps must not mix blocks, and block steps must be in block order with no outside
    step between the first and the last block's steps."""
    where = []
    for step in steps:
        places = {block_of[name] for name in step}
        if len(places) != 1:
            return False
        where.append(places.pop())
    inside = [i for i, w in enumerate(where) if w is not None]
    if not inside:
        return False
    span = where[inside[0]:inside[-1] + 1]
    return None not in span and span == sorted(span)


def _dense_stand_in(quantized: nn.Module, linear: nn.Module) -> nn.Linear:
    """nn.Linear computing what `quantized` (a MarlinLinear, maybe with input_perm) computes;
    `linear` (nn.Linear or Conv1D) gives the bias and dtype."""
    weight = quantized.dequantize(torch.float32)
    perm = getattr(quantized, "input_perm", None)
    if perm is not None:
        unpermuted = torch.empty_like(weight)
        unpermuted[:, perm.long()] = weight
        weight = unpermuted
    stand_in = nn.Linear(quantized.in_features, quantized.out_features, bias=linear.bias is not None,
                         device="meta")
    stand_in.weight = nn.Parameter(weight.to(linear.weight.dtype), requires_grad=False)
    if linear.bias is not None:
        stand_in.bias = linear.bias
    return stand_in.to(linear.weight.device)


def quantize_sequentially(model: nn.Module, targets: Dict[str, nn.Module], calibration: Iterable,
                          quantize_layer: Callable[[str, nn.Module, torch.Tensor], nn.Module],
                          quantize_unreached: Callable[[str, nn.Module], nn.Module],
                          use_blocks: bool = True,
                          quantize_on_inputs: Optional[Callable[[str, nn.Module, List["ModuleCall"]], nn.Module]] = None,
                          on_inputs: Iterable[str] = ()) -> CalibrationStats:
    """Quantize `targets` ({qualified name: nn.Linear or Conv1D of `model`}) in forward order.

    quantize_layer(name, linear, hessian) returns the replacement module (a MarlinLinear,
    or any module meeting the contract in the module docstring); hessian is float64 [K, K].
    Until the end, later steps run through an nn.Linear holding its dequantized weight:
    the same function, computed by the float GEMM, which is faster than the 4-bit
    kernel on calibration-sized batches. Layers the calibration never reaches are
    replaced by quantize_unreached(name, linear) and listed in the stats, with a warning.
    use_blocks=False forces the generic way (the tests compare the two).

    The targets named in `on_inputs` (any modules, e.g. mixture-of-experts modules) are
    not reduced to a Hessian: their step keeps every batch's call (ModuleCall: args,
    kwargs, mask) and quantize_on_inputs(name, module, calls) returns the module that
    replaces it (and runs from then on); quantize_unreached also takes them."""
    on_inputs = frozenset(on_inputs)
    for name, layer in targets.items():  # else the NaN surfaces as the next layer's non-finite inputs
        for param, value in ([("weight", layer.weight)] if name not in on_inputs else layer.named_parameters()):
            if not torch.isfinite(value).all():
                raise ValueError(f"{name}.{param} contains NaN or Inf")
    batches = as_batches(calibration)
    stats = CalibrationStats(batches=len(batches))
    runner = _Runner(model, batches, stats)
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False
    try:
        found = _discover(runner, model, targets, on_inputs)
        stats.rows = {name: n for name, n in found.rows.items() if n}
        quantized: Dict[str, nn.Module] = {}

        def finish(step, hessian, seen_rows):
            stats.steps += 1
            hessian = hessian.cpu().double() / seen_rows
            start = time.perf_counter()
            for name in step:
                quantized[name] = quantize_layer(name, targets[name], hessian)
                model.set_submodule(name, _dense_stand_in(quantized[name], targets[name]))
            stats.seconds_quantize += time.perf_counter() - start

        def finish_on_inputs(name, calls):
            stats.steps += 1
            start = time.perf_counter()
            quantized[name] = quantize_on_inputs(name, targets[name], calls)
            model.set_submodule(name, quantized[name])
            stats.seconds_quantize += time.perf_counter() - start

        def run_step(step, run):
            if step[0] in on_inputs:
                _keep_inputs(runner, step[0], targets[step[0]], found.once[step[0]], finish_on_inputs, run)
            else:
                _run_step(runner, step, targets, found.once, finish, run)

        blocks = found.blocks if use_blocks else None
        block_steps: Dict[int, List[List[str]]] = {}
        for step in found.steps:
            index = found.block_of[step[0]] if blocks is not None else None
            if index is None:
                if block_steps and blocks is not None:  # after the blocks: run them first
                    _run_blocks(runner, blocks, block_steps, found, run_step)
                    block_steps = {}
                    blocks = None
                run_step(step, lambda hooks: runner.run(hooks))
            else:
                block_steps.setdefault(index, []).append(step)
        if block_steps and blocks is not None:
            _run_blocks(runner, blocks, block_steps, found, run_step)
        if found.blocks is not None and use_blocks:
            stats.blocks = found.blocks_name
    finally:
        if use_cache:
            config.use_cache = use_cache
    for name, module in quantized.items():
        model.set_submodule(name, module)
    reached = {name for step in found.steps for name in step}
    stats.unreached = [name for name in targets if name not in reached]
    if stats.unreached:
        warnings.warn(f"{len(stats.unreached)} linear layers were never called on the calibration data and "
                      f"are quantized without it (round to nearest, method='mse'): "
                      f"{', '.join(stats.unreached[:10])}{' ...' if len(stats.unreached) > 10 else ''}",
                      stacklevel=3)
        for name in stats.unreached:
            model.set_submodule(name, quantize_unreached(name, targets[name]))
    return stats


def _run_step(runner: _Runner, step: List[str], targets, once, finish, run) -> None:
    """Accumulate the Hessian of one step's input with `run(hooks)`, then quantize the step."""
    first = targets[step[0]]
    in_features = first.weight.shape[0] if is_conv1d(first) else first.in_features
    hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=runner.device)
    seen = {"rows": 0}

    def accumulate(module, args, kwargs):
        x = runner.rows(step[0], args, kwargs)
        hessian.addmm_(x.t(), x)
        seen["rows"] += x.shape[0]

    def stop(module, args, kwargs):
        raise _StopForward

    def accumulate_and_stop(module, args, kwargs):
        accumulate(module, args, kwargs)
        raise _StopForward

    hooks = {first: accumulate}
    # The forward can end at the step's last layer (which runs after the others), unless a
    # layer runs more than once per forward (shared weights): then the whole forward counts.
    if all(once[name] for name in step):
        last = targets[step[-1]]
        hooks[last] = accumulate_and_stop if last is first else stop
    run(hooks)
    if seen["rows"] == 0:
        raise CalibrationError(f"layer {step[0]!r} received no calibration inputs")
    finish(step, hessian, seen["rows"])


def _keep_inputs(runner: _Runner, name: str, module: nn.Module, once: bool, finish, run) -> None:
    """Keep every batch's call of `module` with `run(hooks)`, then quantize it on them."""
    calls: List[ModuleCall] = []

    def keep(module, args, kwargs):
        runner.rows(name, args, kwargs)  # NaN / Inf check
        calls.append(ModuleCall(args, kwargs, runner.mask))
        if once:
            raise _StopForward

    run({module: keep})
    if not calls:
        raise CalibrationError(f"module {name!r} received no calibration inputs")
    finish(name, calls)


def _run_blocks(runner: _Runner, blocks: List[nn.Module], block_steps: Dict[int, List[List[str]]],
                found: _Discovery, run_step) -> None:
    """Quantize the blocks' layers block by block on kept block inputs."""
    first = min(block_steps)
    calls: List[ModuleCall] = []

    def capture(module, args, kwargs):
        calls.append(ModuleCall(args, kwargs, runner.mask))
        raise _StopForward

    runner.run({blocks[first]: capture})
    for index in range(first, max(block_steps) + 1):
        block = blocks[index]
        for step in block_steps.get(index, []):
            run_step(step, lambda hooks: runner.run_block(block, calls, hooks))
        if index < max(block_steps):
            outputs = runner.run_block(block, calls, {}, keep_outputs=True)
            for call, out in zip(calls, outputs):
                fed = out[0] if found.output_is_tuple else out
                call.args = (fed,) + tuple(call.args[1:])


def output_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error sqrt(tr(E H E^T) / tr(W H W^T)), E = W - dequantized, both [N, K]:
    what a calibrated method minimizes. Computed in float64 for a float64 hessian, else in float32."""
    dtype = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    h = hessian.detach().to(device="cpu", dtype=dtype)
    w = weight.detach().to(device="cpu", dtype=dtype)
    e = w - dequantized.detach().to(device="cpu", dtype=dtype)
    reference = float(((w @ h) * w).sum(dtype=torch.float64))
    error = float(((e @ h) * e).sum(dtype=torch.float64))
    return math.sqrt(max(error, 0.0) / reference) if reference > 0 else 0.0


def quantize_model_calibrated(model: nn.Module, targets: Dict[str, nn.Module], report, method: str,
                              weight_format: str, group_size: int, calibration, from_linear: Callable,
                              modules: Optional[Dict[str, nn.Module]] = None,
                              quantize_module: Optional[Callable] = None, quantize_module_unreached=None,
                              **options) -> None:
    """quantize_model with a calibrated method (`method`: a name registered with
    torch_marlin.quantize.register_calibrated_method, e.g. "gptq", "sparsegpt"): the layers
    `targets` ({name: nn.Linear or Conv1D}) quantized in forward order (quantize_sequentially),
    each module built by `from_linear` (MarlinLinear.from_linear) with the layer's Hessian.
    Fills `report` (a QuantizationReport): every layer, and its relative output error next to
    the method's baseline (the quantizer "mse" in the same layout: round to nearest, magnitude 2:4).
    `modules` ({name: module}, e.g. experts modules) are quantized in the same forward order on
    their kept inputs by quantize_module(name, module, calls), or by
    quantize_module_unreached(name, module) if the calibration never calls them."""
    calibrated = calibrated_method(method)
    calibrated.check_options(weight_format, group_size, **options)
    report.method_name, report.baseline_name = calibrated.label, calibrated.baseline
    damp = options.get("damp", DEFAULT_DAMP)
    start = time.perf_counter()

    modules = modules or {}

    def quantize_unreached(name, linear):
        if name in modules:
            return quantize_module_unreached(name, linear)
        module = from_linear(linear, weight_format, group_size, "mse", sparsity=calibrated.sparsity)
        report.record(name, linear, module)
        return module

    def quantize_layer(name, linear, hessian):
        module = from_linear(linear, weight_format, group_size, method, sparsity=calibrated.sparsity,
                             hessian=hessian, **options)
        if module.damp > damp:
            warnings.warn(f"layer {name!r}: its Hessian needed damp={module.damp:g} (asked {damp:g}) "
                          f"to be positive definite; more or more varied calibration data helps", stacklevel=4)
        weight = linear_weight(linear.weight.detach(), is_conv1d(linear))
        baseline = from_linear(linear, weight_format, group_size, "mse", sparsity=calibrated.sparsity)
        report.output_errors[name] = (output_error(weight, baseline.quantized_weight().to("cpu").dequantize(),
                                                   hessian.float()), module.output_error)
        report.record(name, linear, module)
        return module

    stats = quantize_sequentially(model, {**targets, **modules}, calibration, quantize_layer, quantize_unreached,
                                  quantize_on_inputs=quantize_module, on_inputs=modules)
    report.unreached = list(stats.unreached)
    report.calibration_batches = stats.batches
    report.seconds = time.perf_counter() - start
