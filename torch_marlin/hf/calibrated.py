"""`torch-marlin convert SRC DST --method gptq --calibration FILE`: calibrated conversion
(also `--sparsity 2:4 --method sparsegpt | wanda`, docs/SPARSITY.md).

Unlike the streaming converter, GPTQ (and calibrated pruning) needs the model running: the float model
is loaded with transformers (in float32 or bfloat16, on the CPU), the calibration text is
tokenized with the model's own tokenizer, `quantize_model(method="gptq")`
quantizes the linear layers in forward order, and the result is written as an
ordinary torch_marlin checkpoint (the same `quantization_config`, loaded by
`torch_marlin.from_pretrained` and transformers' `from_pretrained`).

Calibration file: JSON lines with a string "text" field (when the first
non-empty line is a JSON object), otherwise plain text with one sample per
non-empty line. Each sample is tokenized with the tokenizer's special tokens;
a sample longer than `length` tokens is cut into several of at most `length`.
When there are more than `samples`, that many are drawn at random (seeded),
kept in file order.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from torch import nn

from .. import formats
from ..layouts.rans import GRID_KINDS
from ..calibration import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, CalibrationError
from ..model import QuantizationReport, matches_any, quantize_model
from ..moe_gptq import describe_expert_errors
from ..quantize import calibrated_method
from ..sparsity import split_method
from .config import build_quantization_config
from .model_layers import layout_of_model
from .converter import DTYPES, _copy_other_files, _replace_directory, _umask, check_finite, check_paths
from .errors import CheckpointError, import_transformers
from .modules import keep_stacks_on_save, modules_table
from .safetensors_io import index_single_file

DEFAULT_SAMPLES = 128
DEFAULT_LENGTH = 512
DEFAULT_BATCH_SIZE = 8


@dataclass
class CalibratedConversion:
    report: QuantizationReport
    samples: int
    tokens: int
    layers_in_float: List[str] = field(default_factory=list)  # linear layers and expert stacks
    stacks: int = 0  # expert stacks quantized (GPTQ per expert, or round to nearest: report.expert_errors says)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    output: str = ""
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        mib = 2.0 ** -20
        errors = self.report.output_errors.values()
        method, baseline = self.report.method_name, self.report.baseline_name
        how = method + " per expert" if self.report.expert_errors else "round to nearest"
        stacks = f" and {self.stacks} expert stacks ({how})" if self.stacks else ""
        lines = [f"{method}: {len(self.report.replaced)} linear layers{stacks} quantized on {self.samples} "
                 f"calibration samples ({self.tokens} tokens); {len(self.layers_in_float)} left in float"]
        if errors:
            rtn = sum(e[0] for e in errors) / len(errors)
            gptq = sum(e[1] for e in errors) / len(errors)
            lines.append(f"mean relative output error on the calibration data: {baseline} {rtn:.4f} "
                         f"-> {method} {gptq:.4f}")
        for stack, per_expert in self.report.expert_errors.items():
            rtn, calibrated = self.report.output_errors[stack]
            lines += describe_expert_errors(f"{stack} ({baseline} {rtn:.4f} -> {method} {calibrated:.4f})",
                                            per_expert)
        if self.report.unreached:
            lines.append(f"never reached by the calibration data ({baseline}): "
                         f"{', '.join(self.report.unreached)}")
        lines += [f"  - {note}" for note in self.notes]
        lines.append(f"size {self.bytes_before * mib:.2f} MiB -> {self.bytes_after * mib:.2f} MiB")
        lines.append(f"wrote {self.output} in {self.seconds:.1f} s")
        return "\n".join(lines)


def read_calibration_texts(path: str) -> List[str]:
    """Samples of a calibration file: JSON lines with a "text" field, or one per line."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise CalibrationError(f"calibration file not found: {path!r}")
    with open(path, encoding="utf-8") as f:
        lines = [(i, line.strip()) for i, line in enumerate(f.read().splitlines(), 1) if line.strip()]
    if not lines:
        raise CalibrationError(f"calibration file {path} contains no text")
    if not _is_json_object(lines[0][1]):
        return [line for _, line in lines]
    texts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}:{number}: not valid JSON ({e.msg}); a JSON lines calibration "
                                   f"file needs one object with a \"text\" field per line") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CalibrationError(f"{path}:{number}: expected a JSON object with a string \"text\" field")
        if record["text"].strip():
            texts.append(record["text"])
    if not texts:
        raise CalibrationError(f"calibration file {path} contains no text")
    return texts


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def calibration_batches(tokenizer, texts: Sequence[str], samples: int = DEFAULT_SAMPLES,
                        length: int = DEFAULT_LENGTH, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0):
    """Tokenize `texts` into at most `samples` samples of at most `length` tokens and pad
    them into batches (dicts of the tokenizer's model inputs, with attention_mask).
    Returns (batches, number of samples, number of tokens)."""
    for arg, value in (("samples", samples), ("length", length), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    names = [n for n in getattr(tokenizer, "model_input_names", ["input_ids", "attention_mask"])
             if n in ("input_ids", "attention_mask", "token_type_ids")]
    chunks = []
    for text in texts:
        enc = tokenizer(text, truncation=True, max_length=length, return_overflowing_tokens=True)
        ids = enc["input_ids"]
        per_chunk = ids if ids and isinstance(ids[0], list) else [ids]
        for j, chunk in enumerate(per_chunk):
            if chunk:
                chunks.append({n: list(enc[n][j] if isinstance(ids[0], list) else enc[n])
                               for n in names if n in enc})
    if not chunks:
        raise CalibrationError("the calibration text produced no tokens")
    if len(chunks) > samples:
        generator = torch.Generator().manual_seed(seed)
        keep = sorted(torch.randperm(len(chunks), generator=generator)[:samples].tolist())
        chunks = [chunks[i] for i in keep]
    # Similar lengths together: less padding to run through the model.
    order = sorted(range(len(chunks)), key=lambda i: (-len(chunks[i]["input_ids"]), i))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for b0 in range(0, len(order), batch_size):
        group = [chunks[i] for i in order[b0:b0 + batch_size]]
        width = max(len(c["input_ids"]) for c in group)
        batch = {}
        for n in names:
            if n == "attention_mask":
                rows = [[1] * len(c["input_ids"]) + [0] * (width - len(c["input_ids"])) for c in group]
            else:
                fill = pad_id if n == "input_ids" else 0
                rows = [c[n] + [fill] * (width - len(c[n])) for c in group]
            batch[n] = torch.tensor(rows, dtype=torch.long)
        batches.append(batch)
    tokens = sum(len(c["input_ids"]) for c in chunks)
    return batches, len(chunks), tokens


def convert_with_calibration(src: str, dst: str, calibration: str, weight_format: str = "fp4",
                             group_size: int = 128, samples: int = DEFAULT_SAMPLES, length: int = DEFAULT_LENGTH,
                             batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, act_order: bool = False,
                             damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE,
                             exclude: Sequence[str] = (), dtype: Optional[str] = None,
                             quantize_lm_head: bool = False, overwrite: bool = False,
                             max_shard_bytes: int = 2 * 2 ** 30,
                             calibration_dtype: str = "float32", method: str = "gptq",
                             sparsity: Optional[str] = None, bits: Optional[float] = None,
                             entropy_code: bool = False, quantizer: str = "mse",
                             calibrate_experts: bool = True) -> CalibratedConversion:
    """GPTQ-quantize the float model in directory `src` on the text in `calibration` and
    write a torch_marlin checkpoint to `dst` (see the module docstring). The model runs
    in `calibration_dtype` ("float32" or "bfloat16": half the memory, less exact).
    method="sparsegpt" | "wanda" with sparsity="2:4" prunes to 2:4 instead (docs/SPARSITY.md).
    Expert stacks get GPTQ per expert (torch_marlin.moe_gptq) unless calibrate_experts=False
    (round to nearest); with the pruning methods they are always round to nearest."""
    start = time.time()
    coded = bits is not None or entropy_code  # the entropy-coded layout (docs/ENTROPY.md)
    if calibrated_method(method) is None and not (coded and method == "rtn"):
        also = " or 'rtn'" if coded else ""  # round to nearest: only the entropy-coded layout loads the model
        raise ValueError(f"method must be 'gptq', 'sparsegpt' or 'wanda'{also}, got {method!r}")
    if method != "rtn":
        split_method(method, sparsity)  # validates the pair: gptq dense, sparsegpt / wanda with 2:4
    if act_order and method != "gptq":
        raise ValueError(f"act_order is a GPTQ option, got method={method!r}")
    if not calibrate_experts and method != "gptq":
        raise ValueError(f"calibrate_experts=False (--experts-rtn) is a GPTQ option, got method={method!r}")
    if bits is None:
        formats.check_weight_format(weight_format)
        formats.check_group_size(group_size)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    if calibration_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"calibration_dtype must be 'float32' or 'bfloat16', got {calibration_dtype!r}")
    if isinstance(exclude, str):
        exclude = [exclude]
    transformers = import_transformers(f"calibrated conversion (method={method!r})")
    src, dst = check_paths(src, dst, overwrite)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CheckpointError(f"{src} is not a model directory (no config.json)")
    batches, n_samples, n_tokens = None, 0, 0
    if method != "rtn":
        batches, n_samples, n_tokens = _calibration(src, calibration, transformers, samples, length, batch_size,
                                                    seed)
    notes = []
    if n_samples and n_samples < samples:
        notes.append(f"the calibration file gave {n_samples} samples (fewer than the {samples} asked for)")

    model, source_dtype = _load_float_model(src, transformers, DTYPES[calibration_dtype])

    for name, tensor in model.state_dict().items():  # before a NaN reaches the next layer's inputs
        check_finite(name, tensor)
    targets, layers_in_float, notes_on_experts = _choose_layers(model, exclude, quantize_lm_head)
    notes += notes_on_experts
    if not targets:
        raise CheckpointError(f"{src}: no linear layer left to quantize (all excluded, tied or output heads)")
    options = {"act_order": act_order, "calibrate_experts": calibrate_experts} if method == "gptq" else {}
    if method != "rtn":
        options.update(damp=damp, block_size=block_size)
    if coded:
        options.update(bits=bits, entropy_code=entropy_code)
        if bits is not None:  # "grid" / "tcq" name the value kind, other formats ask for the method's default
            weight_format, group_size = (weight_format, -1) if weight_format in GRID_KINDS else ("fp4", 128)
    report = quantize_model(model, weight_format, group_size, include=targets,
                            method=quantizer if method == "rtn" else method, sparsity=sparsity,
                            calibration=batches, **options)
    out_dtype = DTYPES[dtype] if dtype is not None else source_dtype
    model.to(out_dtype)  # layers in float back to the source's dtype; scales stay fp16
    modules = modules_table(model, report)
    if coded:
        description_extra = {"bits": bits} if bits is not None else {"entropy_code": True}
    else:
        description_extra = {}
    description = {"method": "float", "quantizer": method, **description_extra, "act_order": bool(act_order),
                   "damp": damp, "block_size": block_size,
                   "experts_quantizer": "gptq" if report.expert_errors else "mse",
                   "calibration_samples": n_samples, "calibration_tokens": n_tokens,
                   "calibration_dtype": calibration_dtype, **({"sparsity": sparsity} if sparsity else {})}
    config = build_quantization_config(_Described(description), modules, layers_in_float)
    model.config.quantization_config = config
    model.config.dtype = str(out_dtype).replace("torch.", "")

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        keep_stacks_on_save(model)
        model.save_pretrained(tmp, max_shard_size=max_shard_bytes)
        index_single_file(tmp)  # save_pretrained indexes sharded checkpoints only; the converter always does
        _copy_other_files(src, tmp)
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} appeared during the conversion; not replacing it")
        _replace_directory(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stacks = sum(1 for entry in modules.values() if entry.get("layout") == "experts")
    return CalibratedConversion(report, n_samples, n_tokens, layers_in_float, stacks, _weights_bytes(src),
                                _weights_bytes(dst), time.time() - start, dst, notes)


def _calibration(src: str, calibration: str, transformers, samples: int, length: int, batch_size: int, seed: int):
    """(batches, samples, tokens) of a calibration file, tokenized with the model's tokenizer."""
    texts = read_calibration_texts(calibration)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (missing files, unknown tokenizer class...)
        raise CheckpointError(f"cannot load the tokenizer of {src} ({type(e).__name__}: {e}); "
                              f"calibration text is tokenized with the model's own tokenizer") from e
    return calibration_batches(tokenizer, texts, samples, length, batch_size, seed)


@dataclass
class _Described:
    """What build_quantization_config reads from an importer."""

    source: dict

    def description(self) -> dict:
        return self.source


def _load_float_model(src: str, transformers, run_dtype: torch.dtype):
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise CheckpointError(f"{src} is already quantized ({method}); calibrated conversion needs a float model")
    model_class = next((getattr(transformers, a) for a in config.get("architectures") or []
                        if hasattr(transformers, a)), transformers.AutoModel)
    source_dtype = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)
    model = model_class.from_pretrained(src, dtype=run_dtype, local_files_only=True)
    return model.eval(), source_dtype


def _choose_layers(model: nn.Module, exclude: Sequence[str], quantize_lm_head: bool):
    """Names to quantize: linear layers (Conv1D ones become nn.Linear) and experts modules;
    the linear layers and expert stacks left in float; notes on experts left in float."""
    layout = layout_of_model(model)
    targets, in_float = [], []
    stacks_of = {}
    for name, spec in layout.stacks.items():
        stacks_of.setdefault(spec.experts_module, []).append(name)
    for experts, stacks in stacks_of.items():  # loading replaces a module with all its stacks quantized
        if any(matches_any(name, exclude) for name in [experts] + stacks):
            in_float += stacks
        else:
            targets.append(experts)
    notes = [f"{name} stays in float: {reason}" for name, reason in layout.experts_unsupported.items()]
    for name, spec in layout.linears.items():
        if (name in layout.tied or (name in layout.output_embeddings and not quantize_lm_head)
                or matches_any(name, exclude)):
            in_float.append(name)
            continue
        if spec.kind == "conv1d":  # transformers Conv1D stores [in, out]: an nn.Linear from here on
            conv = model.get_submodule(name)
            linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias, device="meta")
            linear.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=False)
            if spec.bias:
                linear.bias = nn.Parameter(conv.bias.detach(), requires_grad=False)
            model.set_submodule(name, linear)
        targets.append(name)
    return targets, sorted(in_float), notes


def _weights_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith((".safetensors", ".bin")))
