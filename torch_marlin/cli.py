"""`torch-marlin` command line.

    torch-marlin --version
    torch-marlin convert SRC DST [--format FORMAT] [--group-size N]
                 [--exclude PATTERN ...] [--dtype float16|bfloat16|float32] [--revision REV]
                 [--sparsity 2:4] [--method gptq|sparsegpt|wanda --calibration FILE
                 [--calibration-samples N] [--calibration-length L]] [--bits BITS | --entropy-code]

SRC is a model directory or a Hugging Face Hub repo id (torch_marlin/hf/hub.py);
with a calibrated --method it must be a local directory.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

import torch

from . import __version__
from .formats import GROUP_SIZES, WEIGHT_FORMATS
from .rans import GRID_KINDS
from .quantize import quantizer_names

_EXIT_OK, _EXIT_ERROR, _EXIT_USAGE = 0, 1, 2
CALIBRATED_METHODS = ("gptq", "sparsegpt", "wanda")


def _parser() -> argparse.ArgumentParser:
    from .hf.importers import supported_sources

    parser = argparse.ArgumentParser(prog="torch-marlin", description="torch_marlin tools")
    parser.add_argument("--version", action="version", version=f"torch-marlin {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a Hugging Face model directory to torch_marlin",
                          description="Quantize a float model, or repack a quantized one ("
                                      + ", ".join(supported_sources())
                                      + "), into a torch_marlin checkpoint directory.")
    conv.add_argument("src", help="source model directory (config.json + safetensors), a .gguf file, or a Hugging "
                                  "Face Hub repo id (org/name): downloaded, or read from the Hub cache with HF_HUB_OFFLINE=1")
    conv.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    conv.add_argument("--format", dest="weight_format", default="fp4", choices=WEIGHT_FORMATS + GRID_KINDS,
                      help="weight format for float sources (default fp4); with --bits: 'tcq' (the trellis-coded "
                           "grid, the default of --method rtn) or 'grid' (the scalar grid, the one of gptq)")
    conv.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                      help="group size along K for float sources (default 128; -1 = per channel)")
    conv.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                      help="glob on module names to keep in float (repeatable), e.g. '*.mlp.down_proj'")
    conv.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                      help="cast the tensors left in float (default: keep the source dtype)")
    conv.add_argument("--quantizer", default="mse", choices=quantizer_names(),
                      help="quantizer for float sources (default mse)")
    conv.add_argument("--sparsity", choices=("2:4",), default=None,
                      help="prune float sources to 2:4 structured sparsity before quantizing (by magnitude, "
                           "or with --method sparsegpt|wanda; weights that are already 2:4 keep their "
                           "pattern); docs/SPARSITY.md")
    conv.add_argument("--bits", type=float, default=None, metavar="BITS",
                      help="entropy-coded layout (docs/ENTROPY.md): a uniform grid rate-allocated to at most BITS "
                           "bits per weight on average, every byte counted (e.g. 3.5); with --method rtn (default) "
                           "or gptq --calibration FILE; loads the float model with transformers")
    conv.add_argument("--entropy-code", action="store_true",
                      help="code the --format/--group-size result losslessly with the entropy-coded layout "
                           "(same weights, fewer bytes; docs/ENTROPY.md)")
    conv.add_argument("--quantize-lm-head", action="store_true",
                      help="also quantize the output projection (unless tied to the embeddings)")
    conv.add_argument("--requantize", action="store_true",
                      help="MLX and GGUF sources: re-quantize the linear layers stored in a form "
                           "with no exact torch_marlin format (MLX 8-bit, GGUF Q5/Q6/Q8/F16/IQ4_NL) with --format/"
                           "--group-size/--quantizer (default: keep them in float, dequantized)")
    conv.add_argument("--max-shard-size", type=int, default=2048, metavar="MiB",
                      help="maximum output shard size in MiB (default 2048)")
    conv.add_argument("--allow-pickle", action="store_true",
                      help="accept pytorch_model.bin weights (loaded with weights_only=True)")
    conv.add_argument("--gguf-file", default=None, metavar="NAME",
                      help="convert this GGUF file of the SRC directory or Hub repo (SRC may also be a .gguf file)")
    conv.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo id SRC (default main)")
    conv.add_argument("--fuse-projections", action="store_true",
                      help="load q|k|v and gate|up as one weight each (exact; the tensors stay per layer)")
    conv.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_calibration_arguments(conv)
    return parser


def _add_calibration_arguments(conv) -> None:
    from .hf.calibrated import DEFAULT_BATCH_SIZE, DEFAULT_LENGTH, DEFAULT_SAMPLES

    group = conv.add_argument_group("calibrated quantization (--method gptq|sparsegpt|wanda; docs/CONVERT.md)")
    group.add_argument("--method", choices=("rtn",) + CALIBRATED_METHODS, default="rtn",
                       help="rtn: round to nearest with --quantizer (with --sparsity: magnitude pruning), "
                            "streaming (default); gptq: GPTQ on calibration text; sparsegpt, wanda (with "
                            "--sparsity 2:4): 2:4 pruning on calibration text; the calibrated methods load "
                            "the float model with transformers")
    group.add_argument("--calibration", metavar="FILE",
                       help="calibration text: JSON lines with a \"text\" field, or plain text, one sample per line")
    group.add_argument("--calibration-samples", type=int, default=DEFAULT_SAMPLES, metavar="N",
                       help=f"number of samples drawn from FILE (default {DEFAULT_SAMPLES})")
    group.add_argument("--calibration-length", type=int, default=DEFAULT_LENGTH, metavar="L",
                       help=f"maximum tokens per sample; longer lines are split (default {DEFAULT_LENGTH})")
    group.add_argument("--calibration-batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B",
                       help=f"samples per forward pass (default {DEFAULT_BATCH_SIZE})")
    group.add_argument("--seed", type=int, default=0, help="seed for drawing the samples (default 0)")
    group.add_argument("--act-order", action="store_true",
                       help="quantize columns by decreasing input energy (stores an input permutation)")
    group.add_argument("--experts-rtn", action="store_true",
                       help="with --method gptq: quantize expert stacks with round to nearest instead of GPTQ "
                            "per expert on the tokens routed to it")
    group.add_argument("--damp", type=float, default=0.01,
                       help="Hessian damping, relative to its mean diagonal (default 0.01)")
    group.add_argument("--block-size", type=int, default=128, help="GPTQ lazy-update block size (default 128)")
    group.add_argument("--calibration-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="dtype the float model runs in during calibration (bfloat16: half the memory)")


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and usage errors
        return int(e.code or 0)
    if args.command == "convert":
        return _convert(args)
    return _EXIT_USAGE


def _convert(args) -> int:
    from .hf.converter import convert

    if args.max_shard_size <= 0:
        print("error: --max-shard-size must be a positive number of MiB", file=sys.stderr)
        return _EXIT_USAGE
    calibrated = args.method in CALIBRATED_METHODS
    if calibrated != (args.calibration is not None):
        method = args.method if calibrated else "gptq"
        print(f"error: --method {method} and --calibration FILE go together", file=sys.stderr)
        return _EXIT_USAGE
    if calibrated and args.revision is not None:
        print(f"error: --revision is for Hub repo ids; --method {args.method} takes a local model directory",
              file=sys.stderr)
        return _EXIT_USAGE
    if args.method in ("sparsegpt", "wanda") and args.sparsity is None:
        print(f"error: --method {args.method} prunes to 2:4: add --sparsity 2:4", file=sys.stderr)
        return _EXIT_USAGE
    if args.method == "gptq" and args.sparsity is not None:
        print("error: --sparsity 2:4 takes --method sparsegpt or wanda (GPTQ keeps every weight)", file=sys.stderr)
        return _EXIT_USAGE
    if args.act_order and args.method != "gptq":
        print("error: --act-order is a GPTQ option (--method gptq)", file=sys.stderr)
        return _EXIT_USAGE
    if calibrated and args.fuse_projections:
        print("error: --fuse-projections is not supported with --method yet; convert without it and load with "
              "torch_marlin.from_pretrained(path, fuse_projections=True)", file=sys.stderr)
        return _EXIT_USAGE
    if args.weight_format in GRID_KINDS and args.bits is None:
        print(f"error: --format {args.weight_format} is a value kind of the entropy-coded layout: add --bits BITS",
              file=sys.stderr)
        return _EXIT_USAGE
    if args.bits is not None or args.entropy_code:
        return _convert_entropy_coded(args)
    if calibrated:
        return _convert_calibrated(args)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # notes are repeated in the summary
            return convert(args.src, args.dst, weight_format=args.weight_format, group_size=args.group_size,
                           exclude=args.exclude, dtype=args.dtype, quantizer=args.quantizer,
                           overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                           quantize_lm_head=args.quantize_lm_head,
                           max_shard_bytes=args.max_shard_size * 2 ** 20, progress=not args.no_progress,
                           revision=args.revision, sparsity=args.sparsity, requantize=args.requantize,
                           gguf_file=args.gguf_file, fuse_projections=args.fuse_projections)
    return _report(run)


def _report(run) -> int:
    """Print what run() returns, or the error; the exit status."""
    from .hf.errors import CheckpointError, MissingDependency

    try:
        result = run()
    except (CheckpointError, MissingDependency, FileExistsError, ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return _EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: nothing was written to the destination", file=sys.stderr)
        return 130
    print(result)
    return _EXIT_OK


def _convert_entropy_coded(args) -> int:
    from .hf.calibrated import convert_with_calibration

    if args.bits is not None and args.entropy_code:
        print("error: --bits (rate-controlled grid) and --entropy-code (lossless) exclude each other", file=sys.stderr)
        return _EXIT_USAGE
    if args.bits is not None and not 1.0 <= args.bits <= 8.0:
        print(f"error: --bits must be in [1, 8] bits per weight, got {args.bits}", file=sys.stderr)
        return _EXIT_USAGE
    if args.sparsity is not None or args.method not in ("rtn", "gptq"):
        print("error: --bits / --entropy-code take --method rtn or gptq, without --sparsity", file=sys.stderr)
        return _EXIT_USAGE
    if args.revision is not None:
        print("error: --bits / --entropy-code take a local model directory (no --revision)", file=sys.stderr)
        return _EXIT_USAGE
    return _report(lambda: convert_with_calibration(
        args.src, args.dst, args.calibration, weight_format=args.weight_format, group_size=args.group_size,
        method=args.method, samples=args.calibration_samples, length=args.calibration_length,
        batch_size=args.calibration_batch_size, seed=args.seed, act_order=args.act_order, damp=args.damp,
        block_size=args.block_size, exclude=args.exclude, dtype=args.dtype, quantize_lm_head=args.quantize_lm_head,
        overwrite=args.overwrite, max_shard_bytes=args.max_shard_size * 2 ** 20,
        calibration_dtype=args.calibration_dtype, bits=args.bits, entropy_code=args.entropy_code,
        quantizer=args.quantizer))


def _convert_calibrated(args) -> int:
    from .hf.calibrated import convert_with_calibration

    return _report(lambda: convert_with_calibration(
        args.src, args.dst, args.calibration, weight_format=args.weight_format, group_size=args.group_size,
        method=args.method, sparsity=args.sparsity,
        samples=args.calibration_samples, length=args.calibration_length, batch_size=args.calibration_batch_size,
        seed=args.seed, act_order=args.act_order, damp=args.damp, block_size=args.block_size,
        calibrate_experts=not args.experts_rtn, exclude=args.exclude, dtype=args.dtype, quantize_lm_head=args.quantize_lm_head, overwrite=args.overwrite,
        max_shard_bytes=args.max_shard_size * 2 ** 20, calibration_dtype=args.calibration_dtype))


if __name__ == "__main__":
    sys.exit(main())
