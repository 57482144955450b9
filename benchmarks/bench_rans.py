"""Speed of the entropy-coded layout's CPU op (torch.ops.marlin.rans_gemm)
against the dense op (torch.ops.marlin.gemm) on the same shapes, per kernel build.

Same process, one thread, process CPU time (the machine is shared), medians of
interleaved rounds (every other round in reverse order; rans / dense is the
median of the rounds' own ratios, and again over the rounds that had the core to
themselves by benchmarks/core_probe.py, where it runs: on a shared VM another
tenant's thread on the same core slows the two ops unequally): at M = 1 the
fused decode + GEMV in decoded weights per second per core next to the dense
GEMV, and at M = 32 / 128 the time against the dense op's. Lossless rows
code the dense fp4 codes of a Gaussian weight
(quantized to the nearest fp4 value per group of 128); grid rows code integer
codes of a Gaussian on a uniform grid whose step gives about 4 bits of entropy;
tcq rows decode the grid rows' stream as weight_format "tcq" (the same words and
symbols through the trellis), so that tcq / grid is the trellis' cost alone.

    python benchmarks/bench_rans.py [--builds avx512,avx2,generic] [--shapes 4096x4096]

Each build runs in a child process (TORCH_MARLIN_CPU_KERNELS fixes a process's build).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import core_probe

LANES = 32


def encode(codes, chunk_k, prob_bits, symbols):
    """The spec's reference encoder (as tests/test_rans_ops.py), vectorized over column blocks."""
    codes = np.asarray(codes, dtype=np.int64)
    k, n = codes.shape
    counts = np.bincount(codes.reshape(-1), minlength=symbols).astype(np.float64)
    m = 1 << prob_bits
    freqs = np.where(counts > 0, np.maximum(1, np.floor(counts * m / counts.sum())), 0).astype(np.int64)
    freqs[np.argmax(freqs)] += m - freqs.sum()
    cum = np.concatenate([[0], np.cumsum(freqs)[:-1]])
    blocks = -(-n // LANES)
    padded = np.full((k, blocks * LANES), int(np.argmax(freqs)), dtype=np.int64)
    padded[:, :n] = codes
    kchunks = -(-k // chunk_k)
    chunk_words = [[None] * kchunks for _ in range(blocks)]
    states = np.zeros((blocks, kchunks, LANES), dtype=np.uint64)
    f64, c64 = freqs.astype(np.uint64), cum.astype(np.uint64)
    for c in range(kchunks):
        sym = padded[c * chunk_k:min(k, (c + 1) * chunk_k)].reshape(-1, blocks, LANES)
        steps = sym.shape[0]
        x = np.full((blocks, LANES), 1 << 16, dtype=np.uint64)
        need_all = np.zeros((steps, blocks, LANES), dtype=bool)
        low_all = np.zeros((steps, blocks, LANES), dtype=np.uint16)
        for i, t in enumerate(range(steps - 1, -1, -1)):
            f, cu = f64[sym[t]], c64[sym[t]]
            need = x >= (f << np.uint64(32 - prob_bits))
            need_all[i], low_all[i] = need, (x & np.uint64(0xFFFF)).astype(np.uint16)
            x = np.where(need, x >> np.uint64(16), x)
            x = ((x // f) << np.uint64(prob_bits)) + x % f + cu
        states[:, c] = x
        for b in range(blocks):  # emitted in (t descending, lane descending) order; the chunk's words reversed
            emitted = low_all[:, b, ::-1][need_all[:, b, ::-1]]
            chunk_words[b][c] = emitted[::-1]
    flat = [chunk_words[b][c] for b in range(blocks) for c in range(kchunks)]
    offsets = np.concatenate([[0], np.cumsum([len(w) for w in flat])]).astype(np.int32)
    words = np.concatenate(flat) if flat else np.zeros(0, np.uint16)
    return (torch.from_numpy(words.astype(np.uint16).view(np.int16)), torch.from_numpy(offsets),
            torch.from_numpy(states.reshape(-1, LANES).astype(np.uint32).view(np.int32)),
            torch.from_numpy(freqs.astype(np.uint16).view(np.int16)))


def fp4_codes(k, n, group=128, seed=0):
    """Nearest-fp4 codes of a Gaussian weight, one absmax scale per group of K."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g)
    scale = w.view(k // group, group, n).abs().amax(1, keepdim=True) / 6
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    idx = ((w.view(k // group, group, n) / scale).unsqueeze(-1) - values).abs().argmin(-1)
    return idx.view(k, n), scale.view(k // group, n).half()


def grid_codes(k, n, seed=0):
    """s = round(w / step) + 128 for a Gaussian, step 0.35 sigma: about 4.3 bits of entropy."""
    g = torch.Generator().manual_seed(seed)
    q = torch.round(torch.randn(k, n, generator=g) / 0.35).clamp(-127, 127)
    return (q + 128).long(), torch.full((1, n), 0.01).half()


def entropy(codes, symbols):
    p = np.bincount(codes.reshape(-1).numpy(), minlength=symbols) / codes.numel()
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def cpu_times(fns, rounds, probe=None):
    """Process CPU seconds per call of each fn, per round; rounds interleave the fns (every
    other round in reverse order), so that a round's times share the machine's phase. With a
    probe (core_probe.load()), also its mean before and after each round."""
    times = [[] for _ in fns]
    probes = []
    for r in range(rounds):
        before = probe() if probe else 0.0
        order = list(enumerate(fns))
        for i, fn in order if r % 2 == 0 else order[::-1]:
            start = time.process_time()
            reps = 0
            while True:
                fn()
                reps += 1
                if time.process_time() - start > 0.05:
                    break
            times[i].append((time.process_time() - start) / reps)
        probes.append((before + probe()) / 2 if probe else 0.0)
    return times, probes


def run_build(args):
    import torch_marlin as tm

    torch.set_num_threads(1)
    info = json.loads(torch.ops.marlin._cpu_kernels())
    probe = core_probe.load()
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        chunk_k = min(args.chunk_k, -(-k // LANES) * LANES)  # (the op's limit: K rounded up to 32)
        dense_codes, dense_scales = fp4_codes(k, n)
        packed = tm.pack_codes(dense_codes)
        lossless = encode(dense_codes.numpy(), chunk_k, args.prob_bits, 16)
        gcodes, gscales = grid_codes(k, n)
        grid = encode(gcodes.numpy(), chunk_k, args.prob_bits, 256)
        variants = [("fp4 lossless", lossless, dense_scales, "fp4", 128, entropy(dense_codes, 16)),
                    ("grid", grid, gscales, "grid", k, entropy(gcodes, 256)),
                    ("tcq", grid, gscales, "tcq", k, entropy(gcodes, 256))]
        for m in args.rows:
            x = torch.randn(m, k).to(getattr(torch, args.dtype))
            fns = [lambda x=x: torch.ops.marlin.gemm(x, packed, dense_scales, None, None, "fp4", 128)]
            for _, t, scales, fmt, group, _ in variants:
                fns.append(lambda x=x, t=t, s=scales, f=fmt, g=group:
                           torch.ops.marlin.rans_gemm(x, *t, s, None, None, f, k, chunk_k, args.prob_bits, g))
            times, probes = cpu_times(fns, args.rounds, probe)
            dense = statistics.median(times[0])
            for (name, t, _, _, _, ent), rans in zip(variants, times[1:]):
                sec = statistics.median(rans)
                # the ratio: median of the rounds' own ratios (the VM's phases move whole rounds)
                ratio = statistics.median(r / d for r, d in zip(rans, times[0]))
                own_ratios = core_probe.own_core([r / d for r, d in zip(rans, times[0])], probes)
                own_ratio = statistics.median(own_ratios) if own_ratios else None
                bits = (t[0].numel() * 2 + t[1].numel() * 4 + t[2].numel() * 4 + t[3].numel() * 2) * 8 / (k * n)
                rows.append(dict(build=info["selected"], shape=f"{n}x{k}", m=m, variant=name, ms=sec * 1e3,
                                 dense_ms=dense * 1e3, ratio=ratio, own_ratio=own_ratio, own_rounds=len(own_ratios),
                                 gweights_s=k * n / sec / 1e9,
                                 dense_gweights_s=k * n / dense / 1e9, bits=bits, entropy=ent))
    print(json.dumps(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", default="", help="comma-separated kernel builds (default: every build this CPU runs)")
    p.add_argument("--shapes", default="4096x4096", help="N x K, comma-separated")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-k", type=int, default=1024, help="at most K rounded up to 32 (clipped)")
    p.add_argument("--prob-bits", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return run_build(args)
    import torch_marlin  # noqa: F401

    info = json.loads(torch.ops.marlin._cpu_kernels())
    builds = args.builds.split(",") if args.builds else [b for b, why in info["builds"].items() if not why]
    print(f"1 thread, process CPU time, median of {args.rounds} interleaved rounds; x {args.dtype}, "
          f"chunk_k {args.chunk_k} (at most K rounded up to 32), prob_bits {args.prob_bits}; dense = torch.ops.marlin.gemm fp4 g128")
    print("| build | N x K | M | weights | bits/weight (entropy) | rans ms | dense ms | rans / dense | "
          "on own core (rounds) | rans Gweights/s | dense Gweights/s |")
    print("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for build in builds:
        env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS=build, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, __file__, "--child", "--shapes", args.shapes, "--rows",
                              *map(str, args.rows), "--dtype", args.dtype, "--chunk-k", str(args.chunk_k),
                              "--prob-bits", str(args.prob_bits), "--rounds", str(args.rounds)],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"| {build} | failed: {out.stderr.strip().splitlines()[-1]} |")
            continue
        for r in json.loads(out.stdout.strip().splitlines()[-1]):
            own = f"{r['own_ratio']:.2f} ({r['own_rounds']})" if r["own_ratio"] is not None else "-"
            print(f"| {r['build']} | {r['shape']} | {r['m']} | {r['variant']} | {r['bits']:.2f} ({r['entropy']:.2f}) "
                  f"| {r['ms']:.3f} | {r['dense_ms']:.3f} | {r['ratio']:.2f} | {own} | {r['gweights_s']:.2f} "
                  f"| {r['dense_gweights_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
