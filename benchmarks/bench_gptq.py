"""GPTQ cost for one large linear layer (the shapes of a 7B Llama block) on the CPU.

Times torch_marlin.gptq.gptq_quantize on a random weight [N, K] with the Hessian of
correlated random inputs, for each format at group 128, and prints wall and CPU time.
The Hessian's construction is not timed (in a real run it is accumulated during the
calibration forward passes, see docs/CONVERT.md for the forward-pass cost).

    python benchmarks/bench_gptq.py                      # 4096 x 4096
    python benchmarks/bench_gptq.py --shapes 11008x4096 4096x11008 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from torch_marlin.gptq import gptq_quantize


def correlated_hessian(k: int, rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.zeros(k, k)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    scale = torch.linspace(0.1, 3.0, k)[torch.randperm(k, generator=g)]
    for r0 in range(0, rows, 1024):
        x = (torch.randn(1024, k, generator=g) @ mix + 0.2 * torch.randn(1024, k, generator=g)) * scale
        h.addmm_(x.t(), x)
    return h.double() / rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x4096"], help="NxK (out x in)")
    parser.add_argument("--formats", nargs="+", default=["fp4", "int4", "uint4"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--refine-rounds", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| N x K | format | group | refine rounds | s | cpu s | rel. output error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        h = correlated_hessian(k, max(2 * k, 4096))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02
        for fmt in args.formats:
            for rounds in args.refine_rounds:
                start, cpu = time.time(), time.process_time()
                result = gptq_quantize(w, h, fmt, args.group_size, act_order=args.act_order, refine_rounds=rounds)
                print(f"| {n} x {k} | {fmt} | {args.group_size} | {rounds} | {time.time() - start:.1f} | "
                      f"{time.process_time() - cpu:.1f} | {result.relative_output_error:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
