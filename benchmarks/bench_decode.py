"""End-to-end CPU benchmark: a Llama-3.2-1B-shaped decoder (a benchmark, not a test).

The model is built from a transformers LlamaConfig with the shapes of
Llama-3.2-1B (16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads,
vocabulary 128256, tied embeddings) and random weights: nothing is
downloaded, and speed does not depend on the weights' values. Variants:

  float32, bfloat16     the model as built
  torch-int4            torch's int4 CPU path on every nn.Linear (bf16 activations):
                        torchao's Int4WeightOnlyConfig if torchao is installed, else
                        aten._weight_int4pack_mm_for_cpu behind a small module swap
  marlin-fp4/int4/uint4 torch_marlin.quantize_model (every nn.Linear, group 128, with a
                        crude fast quantizer: the codes do not change speed)
  marlin-*-2:4          the same, pruned to 2:4 by magnitude (sparsity="2:4"); the
                        weights are random, so this measures speed, not quality
  marlin-*-fused        marlin-* with fuse_projections=True: q|k|v and gate|up as one
                        weight each (the same codes; one matmul per group)

Measured at batch 1 with 2 threads (--threads): greedy decode of 128 new
tokens after a 32-token prompt (tokens/s from the median time per token) and
prefill of a 512-token prompt (tokens/s, logits for the last position only,
as generate() does). All variants live in one process and are timed round by
round, so a noisy neighbour slows them alike; the ratios compare medians from
the same process. Peak RSS is measured per variant in a separate process:
the peak while decoding and prefilling (VmHWM, reset after the model is
built), and the lifetime peak including building and quantizing.

    python benchmarks/bench_decode.py [--quick] [--variants bfloat16,marlin-fp4] [--json bench_decode.json]
    python benchmarks/bench_decode.py --device mps --no-rss   # on a Mac: the Metal kernels (scripts/mac_report.py)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import torch_marlin

VARIANTS = ["float32", "bfloat16", "torch-int4", "marlin-fp4", "marlin-int4", "marlin-uint4", "marlin-fp4-2:4",
            "marlin-int4-2:4", "marlin-uint4-2:4", "marlin-fp4-fused", "marlin-int4-fused"]
GROUP_SIZE = 128


def llama_1b_config(layers: int = 16):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")


def build_base(dtype: torch.dtype, layers: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_1b_config(layers), dtype=dtype).eval()


def _fast_quantizer(groups: torch.Tensor, weight_format: str, group_size: int):
    """A crude quantizer for this benchmark only: scale = group absmax / 6 (fp4) or / 8,
    codes = 4 bits of each weight's mantissa. Speed does not depend on the codes, and
    quantize_model's default search would take minutes per format for a 1B model."""
    scale = (groups.abs().amax(-1) / (6 if weight_format == "fp4" else 8)).clamp(min=2 ** -14).half()
    codes = ((groups.view(torch.int32) >> 19) & 15).to(torch.uint8)
    zeros = torch.full_like(scale, 8.0) if weight_format == "uint4" else None
    return codes, scale, zeros


torch_marlin.register_quantizer("bench-fast", _fast_quantizer)


class TorchInt4Linear(nn.Module):
    """nn.Linear through torch's int4 CPU kernel: w = (q - 8) * scale + zero per group of 128 (as torchao)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.bias = linear.bias
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed, GROUP_SIZE,
                                                       self.scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def torch_int4(model: nn.Module) -> str:
    """Quantizes every nn.Linear for torch's int4 CPU kernel; returns which path did it."""
    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError:
        torchao = None
    if torchao is not None:
        try:
            quantize_(model, Int4WeightOnlyConfig(group_size=GROUP_SIZE, int4_packing_format="opaque"))
            return f"torchao {torchao.__version__} Int4WeightOnlyConfig(opaque)"
        except Exception as e:  # noqa: BLE001  (older/newer torchao API: fall back, and say so)
            print(f"# torchao {torchao.__version__} could not quantize ({type(e).__name__}: {e}); "
                  "using the module swap", file=sys.stderr)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            model.set_submodule(name, TorchInt4Linear(module))
    return "aten._weight_int4pack_mm_for_cpu (module swap)"


def release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back to the OS (glibc)
    except OSError:
        pass


def build_variant(variant: str, layers: int, base: nn.Module | None = None):
    """(model, note). `base` (a bfloat16 model) is copied instead of rebuilt when given."""
    if variant == "float32":
        return build_base(torch.float32, layers), ""
    model = copy.deepcopy(base) if base is not None else build_base(torch.bfloat16, layers)
    note = ""
    if variant == "torch-int4":
        note = torch_int4(model)
    elif variant.startswith("marlin-"):
        sparsity = "2:4" if variant.endswith("-2:4") else None  # magnitude 2:4: pruning does not change speed
        report = torch_marlin.quantize_model(model, variant.split("-")[1], GROUP_SIZE, method="bench-fast",
                                             sparsity=sparsity, fuse_projections=variant.endswith("-fused"))
        note = str(report)
    release_memory()
    return model, note


@torch.inference_mode()
def decode_step_times(model: nn.Module, prompt: torch.Tensor, new_tokens: int, clock=time.perf_counter) -> list:
    """Seconds per greedy decode step after prefilling `prompt`."""
    out = model(prompt, use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(new_tokens):
        start = clock()
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(clock() - start)
    return times


@torch.inference_mode()
def prefill_seconds(model: nn.Module, prompt: torch.Tensor, clock=time.perf_counter) -> float:
    start = clock()
    model(prompt, use_cache=True, logits_to_keep=1)
    return clock() - start


def vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_rss(args) -> dict:
    """In this (fresh) process: build one variant, reset the peak, run decode and prefill."""
    model, _ = build_variant(args.rss_child, args.layers)
    release_memory()
    build_peak = vm_hwm_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    vocab = model.config.vocab_size
    decode_step_times(model, torch.randint(vocab, (1, 32)), 16)
    prefill_seconds(model, torch.randint(vocab, (1, args.prefill_tokens)))
    running_peak = vm_hwm_mib()
    return dict(variant=args.rss_child, running_peak_mib=running_peak, lifetime_peak_mib=max(build_peak, running_peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="wall",
                        help="wall time, or process CPU time (steadier with --threads 1 on a shared machine)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds over all variants")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 round, 16 new tokens, 128-token prefill")
    parser.add_argument("--no-rss", action="store_true", help="skip the per-variant RSS processes")
    parser.add_argument("--json", default="bench_decode.json")
    parser.add_argument("--device", default="cpu", help="cpu, or mps on a Mac (wall clock, synchronized per step)")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rounds, args.new_tokens, args.prefill_tokens = 2, 1, 16, 128
    torch.set_num_threads(args.threads)
    if args.rss_child:
        print(json.dumps(measure_rss(args)))
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_cpu import CLOCKS, cpu_description

    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    device = torch.device(args.device)
    clock = CLOCKS[args.clock]
    if device.type == "mps":  # asynchronous: each timed step ends with a synchronize
        if "torch-int4" in variants or not args.no_rss:
            raise SystemExit("--device mps: torch-int4 is a CPU path, and the RSS processes measure CPU memory; "
                             "pass --no-rss and leave torch-int4 out")
        if args.clock != "wall":
            raise SystemExit("--device mps measures wall time (--clock wall)")
        clock = lambda: (torch.mps.synchronize(), time.perf_counter())[1]  # noqa: E731
    elif device.type != "cpu":
        raise SystemExit(f"--device must be cpu or mps, got {args.device!r}")
    cpu = cpu_description()
    kernels = json.loads(torch.ops.marlin._cpu_kernels())["selected"]
    print(f"# {cpu['model']}, ISA flags: {' '.join(cpu['isa_flags'])}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; torch_marlin kernels: {kernels}")
    print(f"# Llama-3.2-1B shapes, {args.layers} layers, random weights; decode: {args.new_tokens} new tokens after "
          f"{args.prompt_tokens}; prefill: {args.prefill_tokens} tokens; {args.rounds} interleaved rounds; "
          f"{args.clock} clock")

    base = build_base(torch.bfloat16, args.layers) if any(v != "float32" for v in variants) else None
    models, notes = {}, {}
    for v in variants:
        models[v], notes[v] = build_variant(v, args.layers, base)
        models[v].to(device)
        if notes[v]:
            print(f"# {v}: {notes[v]}")
    del base
    release_memory()

    vocab = llama_1b_config().vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (1, args.prompt_tokens), generator=g).to(device)
    long_prompt = torch.randint(vocab, (1, args.prefill_tokens), generator=g).to(device)
    steps = {v: [] for v in variants}
    prefills = {v: [] for v in variants}
    for v in variants:  # warm-up
        decode_step_times(models[v], prompt, 2)
        prefill_seconds(models[v], long_prompt[:, :64])
    for _ in range(args.rounds):
        for v in variants:
            steps[v] += decode_step_times(models[v], prompt, args.new_tokens, clock)
            prefills[v].append(prefill_seconds(models[v], long_prompt, clock))

    rss = {}
    if not args.no_rss:
        for v in variants:
            cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", v, "--threads", str(args.threads),
                   "--layers", str(args.layers), "--prefill-tokens", str(args.prefill_tokens)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            rss[v] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else dict(error=r.stderr[-500:])

    results = []
    ref = {}
    for v in variants:
        decode = 1 / statistics.median(steps[v])
        prefill = args.prefill_tokens / statistics.median(prefills[v])
        ref[v] = (decode, prefill)
        results.append(dict(variant=v, decode_tokens_per_s=decode, prefill_tokens_per_s=prefill,
                            decode_step_ms_median=statistics.median(steps[v]) * 1e3,
                            decode_total_tokens_per_s=len(steps[v]) / sum(steps[v]),
                            note=notes[v], **{k: val for k, val in rss.get(v, {}).items() if k != "variant"}))
    header = (f"{'variant':13} | {'decode tok/s':>12} {'x bf16':>6} {'x int4':>6} | {'prefill tok/s':>13} "
              f"{'x bf16':>6} | {'RSS run MiB':>11} {'RSS peak MiB':>12}")
    print(header)
    print("-" * len(header))
    for r in results:
        d, p = ref[r["variant"]]
        xb = (f"{d / ref['bfloat16'][0]:6.2f}", f"{p / ref['bfloat16'][1]:6.2f}") if "bfloat16" in ref else ("     -",) * 2
        xi = f"{d / ref['torch-int4'][0]:6.2f}" if "torch-int4" in ref else "     -"
        run_peak, life_peak = (f"{r[k]:.0f}" if k in r else "-" for k in ("running_peak_mib", "lifetime_peak_mib"))
        print(f"{r['variant']:13} | {d:12.2f} {xb[0]} {xi} | {p:13.1f} {xb[1]} | {run_peak:>11} {life_peak:>12}")
    with open(args.json, "w") as f:
        json.dump(dict(cpu=cpu, kernels=kernels, device=args.device, torch=torch.__version__, threads=args.threads, clock=args.clock, layers=args.layers,
                       new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                       prefill_tokens=args.prefill_tokens, rounds=args.rounds, results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
