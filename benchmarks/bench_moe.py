"""Mixture-of-experts benchmark (a benchmark, not a test).

Speed: one Qwen3-30B-A3B-shaped experts layer (128 experts, top-8, hidden 2048,
moe_intermediate 768) on the CPU: transformers' own Qwen3MoeExperts with bf16
weights under each experts implementation it has on CPU (eager, batched_mm,
grouped_mm) against MarlinExperts (4-bit stacks, torch.ops.marlin.moe_gemm),
for T tokens routed top-8 at random (softmax weights). Both sides compute the
same function: the bf16 weights are the dequantized 4-bit ones. Medians of
repeated calls, all in one process; per T the implementations are called in
turn, round after round, so that load from other processes shifts them alike.

Memory: what gpt-oss-20b and Qwen3-30B-A3B occupy with torch_marlin against
bf16, computed from their published config.json (numbers copied below, no
download) by building the models on the meta device and the quantized modules
(MarlinExperts, MarlinLinear) on it too: the real tensor sizes of the layouts.

    python benchmarks/bench_moe.py [--threads 2] [--tokens 1,8,32,128,512] [--format fp4] [--group-size 128]
    python benchmarks/bench_moe.py --device mps     # on a Mac: the Metal kernels against transformers on MPS
    python benchmarks/bench_moe.py --memory-only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

import torch_marlin as tm

GIB = 2 ** 30

# Published config.json values (Hugging Face openai/gpt-oss-20b, Qwen/Qwen3-30B-A3B).
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, attention_bias=True, tie_word_embeddings=False,
                   layer_types=["sliding_attention", "full_attention"] * 12)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False, norm_topk_prob=True)


def interleaved_medians(fns: dict, rounds: int, sync=lambda: None) -> dict:
    """Median seconds of each function, called in turn round after round (after one
    warm-up call each), so that a shared machine's load shifts them alike. `sync`
    waits for the device (MPS) before and after each call."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# --- speed ----------------------------------------------------------------------------

def qwen3_experts_layer(weight_format: str, group_size: int):
    """(transformers Qwen3MoeExperts in bf16, MarlinExperts) computing the same function:
    random 4-bit codes and scales, and their exact dequantization in bf16-rounded floats."""
    import transformers

    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B)
    config.num_hidden_layers = 1
    with torch.device("meta"):
        layer = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    layer.config = config
    marlin = tm.MarlinExperts(layer, weight_format, group_size, device="cpu")
    g = torch.Generator().manual_seed(0)
    for stack in marlin.stacks().values():
        stack.packed.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, stack.packed.shape, generator=g, dtype=torch.int32))
        stack.scales.copy_((torch.rand(stack.scales.shape, generator=g) * 0.004 + 0.001).half())
        if stack.zeros is not None:
            stack.zeros.fill_(8.0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    for name, stack in marlin.stacks().items():
        q = stack.quantized_weight()
        param = getattr(layer, name)
        for e in range(q.num_experts):  # one expert at a time: no full fp32 copy
            param.data[e].copy_(q.expert(e).weight(torch.bfloat16))
    return layer, marlin


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def speed(args) -> list:
    torch.set_num_threads(args.threads)
    layer, marlin = qwen3_experts_layer(args.format, args.group_size)
    device = torch.device(args.device)
    layer, marlin = layer.to(device), marlin.to(device)
    sync = torch.mps.synchronize if device.type == "mps" else (lambda: None)
    top_k, experts = QWEN3_30B_A3B["num_experts_per_tok"], QWEN3_30B_A3B["num_experts"]
    hidden, inter = QWEN3_30B_A3B["hidden_size"], QWEN3_30B_A3B["moe_intermediate_size"]
    impls = ["eager", "batched_mm", "grouped_mm"]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {device.type}, "
          f"{torch.get_num_threads()} threads; Qwen3-30B-A3B experts layer: {experts} experts, top-{top_k}, hidden {hidden}, "
          f"moe_intermediate {inter}; torch_marlin {args.format} g{args.group_size} vs bf16; medians (ms)")
    header = (f"{'T':>5} | {'marlin':>9} | " + " | ".join(f"{i:>10}" for i in impls)
              + f" | {'x eager':>7} {'x fastest':>9} | rel diff to eager")
    print(header)
    print("-" * len(header))
    rows = []
    for tokens in args.tokens:
        ids, weights = (t.to(device) for t in routing(tokens, experts, top_k, seed=tokens))
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)

        def transformers_impl(impl):
            def run():
                layer.config._experts_implementation = impl
                return layer(x, ids, weights)
            return run

        fns = {"marlin": lambda: marlin(x, ids, weights)}
        for impl in impls:
            # batched_mm gathers one weight matrix per (token, expert): skip it when that alone needs > 4 GiB.
            if not (impl == "batched_mm" and tokens * top_k * 3 * hidden * inter * 2 > 4 * GIB):
                fns[impl] = transformers_impl(impl)
        with torch.no_grad():
            for name, fn in list(fns.items()):  # an implementation this device lacks is left out
                try:
                    fn()
                except (RuntimeError, NotImplementedError) as e:
                    print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
                    del fns[name]
            times = interleaved_medians(fns, args.rounds if tokens < 128 else max(3, args.rounds // 3), sync)
            y_marlin, y_eager = marlin(x, ids, weights).float(), fns["eager"]().float()
            diff = float((y_marlin - y_eager).abs().max() / y_eager.abs().max())
        t_marlin = times.pop("marlin")
        fastest = min(times.values())
        row = dict(tokens=tokens, marlin_ms=t_marlin * 1e3, **{f"{k}_ms": times[k] * 1e3 if k in times else None
                                                                for k in impls},
                   speedup_vs_eager=times["eager"] / t_marlin, speedup_vs_fastest=fastest / t_marlin,
                   fastest=min(times, key=times.get), max_rel_diff=diff)
        rows.append(row)
        cells = " | ".join(f"{times[i] * 1e3:10.2f}" if i in times else f"{'skipped':>10}" for i in impls)
        print(f"{tokens:5} | {t_marlin * 1e3:9.2f} | {cells} | {row['speedup_vs_eager']:7.2f} "
              f"{row['speedup_vs_fastest']:9.2f} | {diff:.1e}", flush=True)
    return rows


# --- memory ---------------------------------------------------------------------------

def model_bytes(config, weight_format: str, group_size: int, quantize_linears: bool) -> dict:
    """bf16 bytes of the model and its bytes with expert stacks (and, if asked, the other
    linear layers but the output head) quantized, from the layouts' real tensors on meta."""
    import transformers

    from torch_marlin.moe import find_experts_modules
    from torch_marlin.float_linear import is_float_linear

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    experts, unsupported = find_experts_modules(model)
    assert not unsupported, unsupported
    head = model.get_output_embeddings()
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    total_bf16 = nbytes(model.parameters())
    quantized = total_bf16
    expert_weights = expert_bytes = 0
    for name, module in model.named_modules():
        if name in experts:
            marlin = tm.MarlinExperts(module, weight_format, group_size, device="meta")
            stacks = marlin.stacks().values()
            quantized += nbytes(b for s in stacks for b in s.buffers()) - nbytes(module.parameters())
            expert_weights += sum(s.num_experts * s.in_features * s.out_features for s in stacks)
            expert_bytes += nbytes(b for s in stacks for b in (s.packed, s.scales, s.zeros) if b is not None)
        elif quantize_linears and is_float_linear(module) and module is not head:
            q = tm.MarlinLinear(module.in_features, module.out_features, module.bias is not None, weight_format,
                                group_size, device="meta", dtype=torch.bfloat16)
            quantized += nbytes(q.buffers()) - nbytes(module.parameters())
    return dict(bf16_gib=total_bf16 / GIB, marlin_gib=quantized / GIB, params=sum(p.numel() for p in model.parameters()),
                expert_params=expert_weights, expert_bits=8 * expert_bytes / expert_weights)


def memory(args) -> list:
    import transformers

    models = [("gpt-oss-20b", transformers.GptOssConfig(**GPT_OSS_20B)),
              ("Qwen3-30B-A3B", transformers.Qwen3MoeConfig(**QWEN3_30B_A3B))]
    # fp4 g32 with the other layers bf16 is what importing gpt-oss's MXFP4 checkpoint gives.
    variants = [("fp4", 32, False), ("fp4", 32, True), ("fp4", 64, True), ("fp4", 128, True)]
    print("# memory from published configs (GiB); the output head and embeddings stay bf16")
    header = (f"{'model':14} {'params':>7} {'bf16':>6} | {'format':>6} {'group':>5} {'linears':>8} | "
              f"{'expert bits':>11} {'torch_marlin':>12} {'saved':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, config in models:
        for fmt, group, linears in variants:
            r = model_bytes(config, fmt, group, linears)
            rows.append(dict(model=name, format=fmt, group_size=group, linears_quantized=linears, **r))
            print(f"{name:14} {r['params'] / 1e9:6.1f}B {r['bf16_gib']:6.2f} | {fmt:>6} {group:5} "
                  f"{'4-bit' if linears else 'bf16':>8} | {r['expert_bits']:11.3f} {r['marlin_gib']:12.2f} "
                  f"{1 - r['marlin_gib'] / r['bf16_gib']:6.0%}")
    gpt = rows[0]
    print(f"gpt-oss-20b as imported from MXFP4: {gpt['marlin_gib']:.2f} GiB, {16 - gpt['marlin_gib']:.2f} GiB of 16 GiB "
          f"left for activations, KV cache and the system")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or mps on a Mac (the Metal kernels)")
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--format", default="fp4", choices=tm.WEIGHT_FORMATS)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved calls per implementation (T < 128)")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--json", default="bench_moe.json")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    result = dict(memory=memory(args))
    if not args.memory_only:
        print()
        result["speed"] = speed(args)
    with open(args.json, "w") as f:
        json.dump(dict(torch=torch.__version__, threads=args.threads, **result), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
