"""`torch-marlin` command line.

    torch-marlin convert SRC DST --format fp4|uint4|int4 --group-size N
                 [--exclude PATTERN ...] [--dtype float16|bfloat16|float32] [--revision REV]

SRC is a model directory or a Hugging Face Hub repo id (torch_marlin/hf/hub.py).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

from .formats import GROUP_SIZES, WEIGHT_FORMATS
from .quantize import quantizer_names

_EXIT_OK, _EXIT_ERROR, _EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    from .hf.importers import supported_sources

    parser = argparse.ArgumentParser(prog="torch-marlin", description="torch_marlin tools")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a Hugging Face model directory to torch_marlin",
                          description="Quantize a float model, or repack a quantized one ("
                                      + ", ".join(supported_sources())
                                      + "), into a torch_marlin checkpoint directory.")
    conv.add_argument("src", help="source model directory (config.json + safetensors), or a Hugging Face Hub "
                                  "repo id (org/name): downloaded, or read from the Hub cache with HF_HUB_OFFLINE=1")
    conv.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    conv.add_argument("--format", dest="weight_format", default="fp4", choices=WEIGHT_FORMATS,
                      help="weight format for float sources (default fp4)")
    conv.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                      help="group size along K for float sources (default 128; -1 = per channel)")
    conv.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                      help="glob on module names to keep in float (repeatable), e.g. '*.mlp.down_proj'")
    conv.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                      help="cast the tensors left in float (default: keep the source dtype)")
    conv.add_argument("--quantizer", default="mse", choices=quantizer_names(),
                      help="quantizer for float sources (default mse)")
    conv.add_argument("--sparsity", choices=("2:4",), default=None,
                      help="prune float sources to 2:4 structured sparsity before quantizing (magnitude; "
                           "weights that are already 2:4 keep their pattern); docs/FORMAT.md")
    conv.add_argument("--quantize-lm-head", action="store_true",
                      help="also quantize the output projection (unless tied to the embeddings)")
    conv.add_argument("--max-shard-size", type=int, default=2048, metavar="MiB",
                      help="maximum output shard size in MiB (default 2048)")
    conv.add_argument("--allow-pickle", action="store_true",
                      help="accept pytorch_model.bin weights (loaded with weights_only=True)")
    conv.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo id SRC (default main)")
    conv.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and usage errors
        return int(e.code or 0)
    if args.command == "convert":
        return _convert(args)
    return _EXIT_USAGE


def _convert(args) -> int:
    from .convert import convert
    from .hf.errors import CheckpointError

    if args.max_shard_size <= 0:
        print("error: --max-shard-size must be a positive number of MiB", file=sys.stderr)
        return _EXIT_USAGE
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # notes are repeated in the summary
            summary = convert(args.src, args.dst, weight_format=args.weight_format, group_size=args.group_size,
                              exclude=args.exclude, dtype=args.dtype, quantizer=args.quantizer,
                              overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                              quantize_lm_head=args.quantize_lm_head,
                              max_shard_bytes=args.max_shard_size * 2 ** 20, progress=not args.no_progress,
                              revision=args.revision, sparsity=args.sparsity)
    except (CheckpointError, FileExistsError, ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return _EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: nothing was written to the destination", file=sys.stderr)
        return 130
    print(summary)
    return _EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
