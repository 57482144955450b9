"""Convert a Hugging Face model directory into a torch_marlin checkpoint.

Float sources are quantized layer by layer; GPTQ, AWQ, compressed-tensors,
MXFP4 and NVFP4 sources are repacked without re-quantization. Tensors are
read, converted and written one at a time (peak memory ~ one tensor), into
a temporary directory next to DST that is renamed at the end, so a failed
or interrupted run leaves no DST behind.

    torch-marlin convert SRC DST --format fp4 --group-size 128
    python -m torch_marlin.convert SRC DST ...          (the same)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import formats
from ..layouts import QuantizedExperts, QuantizedWeight, layout_for_sparsity
from ..quantize import quantizer_names
from .checkpoint import PICKLE_INDEX, SAFETENSORS_INDEX, SourceCheckpoint
from .config import build_quantization_config
from .errors import CheckpointError, UnsupportedQuantization
from .hub import resolve_source
from .importers import ConvertedLayer, FloatSource, Importer, make_importer, source_quantization, source_side_files
from .importers.gguf import GGUFCheckpoint, gguf_path
from .importers.reencode import ImportOptions
from .model_layers import describe_model, expert_parts
from .modules import layout_state
from .safetensors_io import ShardedWriter

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_FINITE_CHECK_ELEMENTS = 1 << 22


@dataclass
class ConversionSummary:
    source_method: str
    layers_converted: int = 0  # linear layers
    stacks_converted: int = 0  # expert stacks (each E experts' weights of one projection)
    layers_in_float: List[str] = field(default_factory=list)
    bytes_before: int = 0  # all source tensors
    bytes_after: int = 0  # all written tensors
    quantized_params: int = 0  # weights (N*K) of converted layers
    padded_params: int = 0  # the same with K zero-padded to whole groups, as stored
    quantized_bytes: int = 0  # packed + scales (+ zeros) of converted layers
    mean_relative_error: Optional[float] = None  # float sources only
    formats: Dict[str, int] = field(default_factory=dict)  # "fp4/g128" (or "fp4/g128/2:4") -> layer count
    already_sparse: List[str] = field(default_factory=list)  # sparsity: layers that were already 2:4
    sparsity: Optional[str] = None  # float sources: the layout asked for (expert stacks stay dense)
    notes: List[str] = field(default_factory=list)  # inexact values, dropped tensors
    source_lines: List[str] = field(default_factory=list)  # per source: exact / within bound / kept float
    seconds: float = 0.0
    output: str = ""

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.quantized_bytes / self.quantized_params if self.quantized_params else float("nan")

    def __str__(self) -> str:
        mib = 2.0 ** -20
        lines = [
            f"converted {self.layers_converted} linear layers"
            + (f" and {self.stacks_converted} expert stacks" if self.stacks_converted else "")
            + f" from {self.source_method} "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(self.formats.items()))}); "
            f"{len(self.layers_in_float)} left in float",
            f"size {self.bytes_before * mib:.2f} MiB -> {self.bytes_after * mib:.2f} MiB; "
            f"{self.bits_per_weight:.3f} bits per quantized weight" + self._padding(),
        ]
        lines += self.source_lines
        if self.mean_relative_error is not None:
            lines.append(f"mean relative weight error {self.mean_relative_error:.4f}")
        if self.already_sparse:
            lines.append(f"{len(self.already_sparse)} layers were already 2:4 sparse and kept their pattern")
        if self.sparsity is not None and self.stacks_converted:
            lines.append(f"{self.stacks_converted} expert stacks stored dense: the expert-stack layout has no "
                         f"{self.sparsity} form")
        if self.notes:
            lines.append(f"{len(self.notes)} warnings:")
            lines += [f"  - {note}" for note in self.notes[:20]]
            if len(self.notes) > 20:
                lines.append(f"  ... and {len(self.notes) - 20} more")
        lines.append(f"wrote {self.output} in {self.seconds:.1f} s")
        return "\n".join(lines)

    def _padding(self) -> str:
        """Why bits per weight exceed the format's 4 + 16/g (docs/FORMAT.md): K padded to whole groups."""
        if self.padded_params <= self.quantized_params:
            return ""
        return (f" ({8 * self.quantized_bytes / self.padded_params:.3f} per stored weight: K is zero-padded "
                f"to whole groups, {100 * (self.padded_params / self.quantized_params - 1):.1f}% more weights)")


def convert(src: str, dst: str, weight_format: str = "fp4", group_size: int = 128,
            exclude: Sequence[str] = (), dtype: Optional[str] = None, quantizer: str = "mse",
            overwrite: bool = False, allow_pickle: bool = False, quantize_lm_head: bool = False,
            max_shard_bytes: int = 2 * 2 ** 30, progress: bool = True,
            revision: Optional[str] = None, sparsity: Optional[str] = None,
            requantize: bool = False, gguf_file: Optional[str] = None,
            fuse_projections: bool = False) -> ConversionSummary:
    """Convert model directory `src` into torch_marlin checkpoint directory `dst`.

    `src` may also be a Hugging Face Hub repo id ("org/name", at `revision`),
    resolved with huggingface_hub: downloaded when online, taken from the
    Hub cache with HF_HUB_OFFLINE=1 (torch_marlin/hf/hub.py).
    `src` may be a GGUF file (model.gguf), or a directory or Hub repo holding `gguf_file`.
    weight_format/group_size/quantizer/exclude/quantize_lm_head apply to float
    sources; quantized sources keep their own format. `dtype` ("float16",
    "bfloat16", "float32" or None to keep) casts the tensors left in float.
    `sparsity="2:4"` prunes float sources to 2:4 by magnitude before quantizing;
    a weight that is already 2:4 (trained sparse) keeps its pattern. Expert
    stacks have no 2:4 layout and are quantized dense (the summary says so).
    `requantize` applies to MLX and GGUF sources: their layers stored in a form
    with no exact torch_marlin format (8-bit, Q6_K, ...) are re-quantized with
    weight_format/group_size/quantizer instead of kept in float (docs/CONVERT.md).
    `fuse_projections=True` marks the checkpoint so that loading fuses its q|k|v
    and gate|up siblings (torch_marlin.fused_projections; the tensors stay per layer).
    """
    if not isinstance(fuse_projections, bool):
        raise TypeError(f"fuse_projections must be a bool, got {fuse_projections!r}")
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    layout_for_sparsity(sparsity)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    if quantizer not in quantizer_names():
        raise ValueError(f"quantizer must be one of {quantizer_names()}, got {quantizer!r}")
    if isinstance(exclude, str):
        exclude = [exclude]
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(f"revision must be a branch, tag or commit name, got {revision!r}")
    start = time.time()
    src, dst = check_paths(src, dst, overwrite,
                           resolve=lambda path: resolve_source(path, revision, allow_pickle, progress, gguf_file))
    gguf = gguf_path(src, gguf_file)
    source = GGUFCheckpoint(gguf) if gguf else SourceCheckpoint(src, allow_pickle=allow_pickle)
    method, source_config = source_quantization(source)
    shapes = {key: source.shape(key) for key in source.keys()}
    layout = describe_model(source.directory, shapes)
    if method is None:
        importer: Importer = FloatSource(source, layout=layout, weight_format=weight_format,
                                         group_size=group_size, quantizer=quantizer, exclude=list(exclude),
                                         quantize_lm_head=quantize_lm_head, sparsity=sparsity)
    elif sparsity is not None:
        raise ValueError(f"sparsity={sparsity!r} applies to float sources; {src} is already quantized "
                         f"({method}) and is repacked as it is")
    else:
        importer = make_importer(source, method, source_config, layout=layout, options=ImportOptions(
            requantize=requantize, weight_format=weight_format, group_size=group_size, quantizer=quantizer))
    if not layout.exact:
        importer.note("linear layers were found by name (the model class could not be built); check the list")

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would carry over to DST
    writer = ShardedWriter(tmp, max_shard_bytes)
    try:
        result, modules = _write_tensors(importer.tensor_source(), importer, layout, writer, DTYPES.get(dtype),
                                         progress)
        writer.finish()
        _copy_other_files(source.directory, tmp)
        config = dict(source.config)
        for key in ("quantization_config", *importer.CONFIG_KEYS):
            config.pop(key, None)
        config["quantization_config"] = build_quantization_config(importer, modules, result.layers_in_float)
        if fuse_projections:
            config["quantization_config"]["fuse_projections"] = True
        if dtype is not None:
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} appeared during the conversion; not replacing it")
        _replace_directory(tmp, dst)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.bytes_before = source.total_bytes()
    result.bytes_after = writer.total_bytes
    result.notes = list(importer.notes)
    result.source_lines = importer.summary_lines()
    result.seconds = time.time() - start
    result.output = dst
    return result


def check_paths(src, dst, overwrite: bool, resolve: Optional[Callable[[str], str]] = None):
    """Absolute (src, dst) directory paths. dst must not exist unless `overwrite` (checked
    before `resolve`, which turns a Hub repo id SRC into a local directory, downloads
    anything), nor be src or inside it. Also used by torch_marlin.hf.calibrated."""
    for name, value in (("src", src), ("dst", dst)):
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            hub = " or a Hub repo id" if name == "src" and resolve is not None else ""
            raise ValueError(f"{name} must be a directory path{hub}, got {value!r}")
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    src = os.fspath(src)
    src = os.path.abspath(resolve(src) if resolve is not None else src)
    if dst == src or dst.startswith(src + os.sep):
        raise ValueError(f"dst must not be src or inside it: {dst}")
    return src, dst


def _write_tensors(source: SourceCheckpoint, importer: Importer, layout, writer: ShardedWriter,
                   dtype: Optional[torch.dtype], progress: bool):
    """Stream every source tensor to the writer; returns (summary, {module: entry})."""
    plans = importer.plan()
    summary = ConversionSummary(importer.method)
    modules: Dict[str, dict] = {}
    owner = {key: module for module, plan in plans.items() for key in plan.keys}
    biases = {plan.bias_key: module for module, plan in plans.items() if plan.bias_key}
    # Per-expert linear layers that form one stack are converted and written together.
    parts = expert_parts(layout, plans) if layout.exact else {}
    members: Dict[str, List[str]] = {}
    for module, part in parts.items():
        members.setdefault(part.stack, []).append(module)
    done = set()
    errors = []
    keys = source.keys()
    bar = _progress_bar(len(keys), progress)
    for key in keys:
        bar.update(1)
        if key in biases:
            continue  # written together with its layer
        module = owner.get(key)
        if module is None:
            tensor = source.load(key)
            check_finite(key, tensor)
            if dtype is not None and tensor.is_floating_point() and tensor.element_size() >= 2:
                tensor = tensor.to(dtype)
            writer.add(key, tensor)
            continue
        name = parts[module].stack if module in parts else module
        if name in done:
            continue
        done.add(name)
        bar.set_postfix_str(name[-40:], refresh=False)
        if module in parts:
            layer = _stack_parts(importer, plans, members[name], parts, layout.stacks[name], source)
        else:
            layer = importer.convert(module, plans[module])
        _check_against_layout(name, layer, layout)
        q = layer.qweight
        modules[name] = {"weight_format": q.weight_format, "group_size": q.group_size,
                         "in_features": q.in_features, "out_features": q.out_features}
        if isinstance(q, QuantizedExperts):
            modules[name].update(layout="experts", num_experts=q.num_experts)
        if q.SPARSITY is not None:
            modules[name]["sparsity"] = q.SPARSITY
        if layer.input_perm is not None:
            modules[name]["act_order"] = True
        _write_layer(name, layer, modules[name], None if module in parts else plans[module].bias_key, source,
                     writer, dtype)
        if isinstance(q, QuantizedExperts):
            summary.stacks_converted += 1
        else:
            summary.layers_converted += 1
        summary.quantized_params += q.num_weights
        summary.padded_params += q.num_weights // q.in_features * q.padded_in_features
        summary.quantized_bytes += q.nbytes
        tag = f"{q.weight_format}/g{q.group_size}" + (f"/{q.SPARSITY}" if q.SPARSITY else "")
        summary.formats[tag] = summary.formats.get(tag, 0) + 1
        if isinstance(importer, FloatSource):
            errors.append(q.relative_error)
    bar.close()
    missing = sorted({parts[m].stack if m in parts else m for m in plans} - set(modules))
    if missing:
        raise CheckpointError(f"layers without their tensors: {missing[:5]}")
    converted = [layout.resolve(m, layout.linears) or m for m in modules]
    summary.layers_in_float = importer.layers_in_float(list(layout.linears), converted)
    for experts, reason in layout.experts_unsupported.items():
        importer.note(f"{experts} stays in float: {reason}")
    if errors:
        summary.mean_relative_error = sum(errors) / len(errors)
    summary.already_sparse = list(getattr(importer, "already_sparse", []))
    summary.sparsity = getattr(importer, "sparsity", None)
    return summary, modules


def _stack_parts(importer: Importer, plans, members: List[str], parts, spec, source: SourceCheckpoint) -> ConvertedLayer:
    """Convert the per-expert layers of one stack and assemble it: each expert's parts
    concatenated along out_features in the conversion mapping's order, the experts stacked."""
    stack = f"{spec.experts_module}.{spec.param}"
    positions = parts[members[0]].positions
    grid = [[None] * positions for _ in range(spec.num_experts)]
    for module in members:
        part = parts[module]
        if part.expert >= spec.num_experts:
            raise CheckpointError(f"{module}: expert {part.expert}, but {stack} has {spec.num_experts} experts")
        grid[part.expert][part.position] = module
    absent = [(e, p) for e in range(spec.num_experts) for p in range(positions) if grid[e][p] is None]
    if absent:
        raise CheckpointError(f"{stack}: the checkpoint lacks expert {absent[0][0]}'s part {absent[0][1]} "
                              f"({len(absent)} parts missing)")
    experts, biases, errors = [], [], []
    with_bias = [plans[m].bias_key is not None for row in grid for m in row]
    if any(with_bias) and not all(with_bias):
        raise CheckpointError(f"{stack}: some experts' layers have a bias and others do not")
    for row in grid:
        layers = [importer.convert(module, plans[module]) for module in row]
        if any(layer.input_perm is not None for layer in layers):
            raise UnsupportedQuantization(f"{stack}: act-order (g_idx) experts permute K differently per expert; "
                                          f"an expert stack needs one input order")
        experts.append(QuantizedWeight.concat_out([layer.qweight for layer in layers]))
        errors += [layer.qweight.relative_error for layer in layers]
        if with_bias[0]:
            biases.append(torch.cat([source.load(plans[module].bias_key) for module in row]))
    formats_used = {q.weight_format for q in experts}
    if formats_used == {"int4", "uint4"}:
        experts = [q.as_uint4() if q.weight_format == "int4" else q for q in experts]
    try:
        stacked = QuantizedExperts.stack(experts)
    except ValueError as e:
        raise UnsupportedQuantization(f"{stack}: its experts cannot form one stack: {e}") from e
    stacked.relative_error = sum(errors) / len(errors)
    return ConvertedLayer(stacked, bias=torch.stack(biases) if biases else None)


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """A CheckpointError naming the tensor if it holds NaN or Inf: the model would compute NaN.
    Also used by torch_marlin.hf.calibrated. Float8 tensors (scales) are checked by their importers."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        return
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHECK_ELEMENTS):  # slices: a small temporary
        finite = torch.isfinite(flat[start:start + _FINITE_CHECK_ELEMENTS])
        if not finite.all():
            index = start + int((~finite).nonzero()[0])
            value = float(flat[index])
            where = [int(i) for i in torch.unravel_index(torch.tensor(index), tensor.shape)]
            raise CheckpointError(f"{name} contains {'NaN' if value != value else value} at {where}: a model "
                                  f"with a non-finite weight computes NaN")


def _check_against_layout(module: str, layer: ConvertedLayer, layout) -> None:
    if not layout.exact:
        return
    q = layer.qweight
    if isinstance(q, QuantizedExperts):
        name = layout.resolve(module, layout.stacks)
        if name is None:
            raise CheckpointError(f"{module}: quantized expert stack for a parameter that is not an expert stack of "
                                  f"{layout.architecture or 'the model'}")
        spec = layout.stacks[name]
        if (spec.num_experts, spec.in_features, spec.out_features) != (q.num_experts, q.in_features, q.out_features):
            raise CheckpointError(f"{module}: tensors give {q.num_experts} experts of in/out features "
                                  f"{q.in_features}x{q.out_features} but the config describes {spec.num_experts} "
                                  f"experts of {spec.in_features}x{spec.out_features}")
        return
    name = layout.resolve(module, layout.linears)
    if name is None:
        raise CheckpointError(f"{module}: quantized tensors for a module that is not a linear layer of "
                              f"{layout.architecture or 'the model'}")
    spec = layout.linears[name]
    if (spec.in_features, spec.out_features) != (q.in_features, q.out_features):
        raise CheckpointError(f"{module}: tensors give in/out features {q.in_features}x{q.out_features} "
                              f"but the config describes {spec.in_features}x{spec.out_features}")


def _write_layer(module: str, layer: ConvertedLayer, entry: dict, bias_key: Optional[str],
                 source: SourceCheckpoint, writer: ShardedWriter, dtype: Optional[torch.dtype]) -> None:
    """The layer's tensors under its module's state_dict names (MarlinLinear, MarlinExpertsLinear; docs/FORMAT.md)."""
    q = layer.qweight
    writer.add(f"{module}._extra_state", layout_state(entry))
    for name, tensor in q.tensors().items():  # the layout's tensors (dense: packed, scales, zeros)
        writer.add(f"{module}.{name}", tensor)
    if layer.input_perm is not None:
        writer.add(f"{module}.input_perm", layer.input_perm)
    bias = layer.bias if layer.bias is not None else (None if bias_key is None else source.load(bias_key))
    if bias is not None:
        check_finite(bias_key or f"{module}.bias", bias)
        expected = (q.num_experts, q.out_features) if isinstance(q, QuantizedExperts) else (q.out_features,)
        if tuple(bias.shape) != expected:
            raise CheckpointError(f"{bias_key or module + '.bias'} has shape {list(bias.shape)}, expected "
                                  f"{list(expected)}")
        writer.add(f"{module}.bias", bias.to(dtype) if dtype is not None else bias)


def _copy_other_files(src: str, dst: str) -> None:
    """Tokenizer, generation config, sentence-transformers modules...: everything but weights."""
    skip = {"config.json", SAFETENSORS_INDEX, PICKLE_INDEX, *source_side_files()}
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if entry in skip or entry.endswith(_WEIGHT_SUFFIXES) or entry.startswith(".tmp"):
            continue
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(dst, entry))
        else:
            shutil.copy2(path, os.path.join(dst, entry))


def _replace_directory(tmp: str, dst: str) -> None:
    if not os.path.exists(dst):
        os.rename(tmp, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
    os.rmdir(old)
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _NoBar:
    def update(self, n):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="tensor", desc="converting", dynamic_ncols=True)

