"""GPTQ for expert stacks against round to nearest, on held-out tokens (docs/GPTQ.md, "Expert stacks").

Two parts (both report per experts module the relative output error of each expert,
||f_q(X_e) - f(X_e)|| / ||f(X_e)|| with f the expert's MLP on the held-out tokens the
float model routes to it, averaged over the experts that received at least 64
calibration tokens; same format and group size for both methods):

- `tiny`: tiny random Mixtral / Qwen3-MoE / OLMoE / gpt-oss / DeepSeek-V3 models built
  from configs, quantized with quantize_model(method="gptq") (stacks calibrated) and
  with calibrate_experts=False (stacks round to nearest); calibration on the first 240
  lines of torch_marlin/testing/calibration_en.txt, held out the last 47 (characters
  mapped to token ids: random models have no tokenizer).
- `layer`: one Qwen3-30B-A3B-shaped experts module (128 experts, top 8, 2048 -> 768,
  random weights as the model initializes them), on activations that are not i.i.d.:
  all-MiniLM-L6-v2's hidden states (its 6 layers' outputs concatenated, first 2048
  dims) over English text, routed by a random softmax top-8 router. Calibration:
  `--sequences` x 128 tokens of docs/*.md and the first 240 calibration lines;
  held out: the last 47 lines and the next 64 chunks (--experts N: only the first N experts are built and
  calibrated, the routing still over 128, to extrapolate the time). Prints CPU time (process time) and peak RSS of the
  calibration itself.

    OMP_NUM_THREADS=1 python benchmarks/bench_gptq_moe.py tiny
    OMP_NUM_THREADS=1 python benchmarks/bench_gptq_moe.py layer --sequences 256
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import sys
import time

import torch

import torch_marlin as tm
from torch_marlin.calibration import ModuleCall
from torch_marlin.moe import experts_structure, linear_stack
from torch_marlin.moe_gptq import calibrate_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION_TEXT = os.path.join(ROOT, "torch_marlin", "testing", "calibration_en.txt")
MIN_TOKENS = 64


def text_lines():
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[:240], lines[-47:]


def expert_outputs(module, stacks, x, e):
    """Expert e's MLP (float64) on rows x, with weights {param: [E, out, in]} and biases."""
    structure = module.structure if hasattr(module, "structure") else experts_structure(module)
    (first, _, _), (down, _, _) = structure.stacks
    h = x @ stacks[first][0][e].t()
    if stacks[first][1] is not None:
        h = h + stacks[first][1][e]
    h = gate_of(module, structure)(h)
    y = h @ stacks[down][0][e].t()
    return y + stacks[down][1][e] if stacks[down][1] is not None else y


def gate_of(module, structure):
    if isinstance(module, tm.MarlinExperts):
        return module._apply_gate if structure.has_gate else module.act_fn
    return (lambda h: type(module)._apply_gate(module, h)) if structure.has_gate else module.act_fn


def float_stacks(module):
    structure = experts_structure(module)
    return {name: (linear_stack(getattr(module, name).detach(), structure.is_transposed).double(),
                   getattr(module, f"{name}_bias").detach().double() if structure.has_bias else None)
            for name, _, _ in structure.stacks}


def quantized_stacks(module):
    return {name: (stack.quantized_weight().dequantize(torch.float64),
                   None if stack.bias is None else stack.bias.double()) for name, stack in module.stacks().items()}


def per_expert_errors(float_module, float_w, quantized, x, ids):
    """{expert: relative output error} on held-out rows x [T, H] routed by ids [T, k]."""
    q_w = quantized_stacks(quantized)
    out = {}
    for e in range(next(iter(float_w.values()))[0].shape[0]):
        rows = x[(ids == e).any(-1)].double()
        if rows.shape[0] == 0:
            continue
        want = expert_outputs(float_module, float_w, rows, e)
        got = expert_outputs(quantized, q_w, rows, e)
        out[e] = float((got - want).norm() / want.norm())
    return out


def summarize(label, errors_gptq, errors_rtn, tokens):
    """One table row: mean error over experts with >= MIN_TOKENS calibration tokens, and the rare ones."""
    common = [e for e in errors_gptq if e in errors_rtn]
    frequent = [e for e in common if tokens[e] >= MIN_TOKENS]
    rare = [e for e in common if tokens[e] < MIN_TOKENS]
    mean = lambda d, es: sum(d[e] for e in es) / len(es) if es else float("nan")
    g, r = mean(errors_gptq, frequent), mean(errors_rtn, frequent)
    gr, rr = mean(errors_gptq, rare), mean(errors_rtn, rare)
    print(f"| {label} | {len(frequent)} | {r:.4f} | {g:.4f} | {g / r:.3f} | {len(rare)} | {rr:.4f} | {gr:.4f} |",
          flush=True)


# --- tiny models ---------------------------------------------------------------------

def tiny_configs():
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)
    return {
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=8,
                                              num_experts_per_tok=2),
        "qwen3_moe": transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=64, moe_intermediate_size=64,
                                                 num_experts=8, num_experts_per_tok=2),
        "olmoe": transformers.OlmoeConfig(**common, intermediate_size=64, num_experts=8, num_experts_per_tok=2),
        "gpt_oss": transformers.GptOssConfig(**common, head_dim=16, intermediate_size=64, num_local_experts=8,
                                             num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
        "deepseek_v3": transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=64,
                                                     moe_intermediate_size=64, n_routed_experts=8,
                                                     num_experts_per_tok=2, n_group=2, topk_group=1,
                                                     first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=32,
                                                     kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                     v_head_dim=16),
    }


def char_ids(lines, length=64):
    ids = [torch.tensor([ord(c) % 128 for c in line[:length]]) for line in lines]
    return [torch.nn.utils.rnn.pad_sequence(ids[i:i + 8], batch_first=True) for i in range(0, len(ids), 8)]


def experts_inputs(model, batches):
    """{experts module name: (x [T, H], ids [T, k])} the model gives its experts modules."""
    kept = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, name=n: kept.setdefault(name, []).append(args))
               for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()
    return {name: (torch.cat([a[0].reshape(-1, a[0].shape[-1]) for a in calls]),
                   torch.cat([a[1].reshape(a[0].reshape(-1, a[0].shape[-1]).shape[0], -1) for a in calls]))
            for name, calls in kept.items()}


def run_tiny(args):
    import transformers

    train, held = text_lines()
    cal, test = char_ids(train), char_ids(held)
    print(f"| model / experts module | experts >= {MIN_TOKENS} tok | RTN | GPTQ | ratio | rare experts | RTN (rare) "
          f"| GPTQ (rare) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arch, config in tiny_configs().items():
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0, 0.02)
        state = reference.state_dict()
        held_inputs = experts_inputs(reference, test)
        models = {}
        for calibrate in (True, False):
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            model.load_state_dict(state)
            report = tm.quantize_model(model, args.format, args.group_size, method="gptq", calibration=cal,
                                       exclude=["lm_head"], calibrate_experts=calibrate)
            models[calibrate] = (model, report)
        report = models[True][1]
        for name, (x, ids) in held_inputs.items():
            source = reference.get_submodule(name)
            fw = float_stacks(source)
            first = experts_structure(source).stacks[0][0]
            tokens = {e: entry.tokens for e, entry in enumerate(report.expert_errors[f"{name}.{first}"])}
            errors = {c: per_expert_errors(source, fw, models[c][0].get_submodule(name), x, ids) for c in models}
            summarize(f"{arch} {name}", errors[True], errors[False], tokens)


# --- a Qwen3-30B-A3B-shaped layer ------------------------------------------------------

def minilm_features(texts, length):
    """[T, 2048] float32: MiniLM's 6 layer outputs concatenated (first 2048 dims), padding removed."""
    from torch_marlin.testing import minilm

    make_model, tokenizer, _ = minilm.load_offline()
    model = make_model()
    rows = []
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            enc = tokenizer(texts[i:i + 16], padding=True, truncation=True, max_length=length, return_tensors="pt")
            out = model(**enc, output_hidden_states=True)
            h = torch.cat(out.hidden_states[1:], -1)[..., :2048]
            rows.append(h[enc["attention_mask"] != 0])
    return torch.cat(rows)


def docs_chunks(tokenizer_len_words=90):
    """English text of docs/*.md and README in chunks of about 128 MiniLM tokens."""
    words = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]:
        with open(path, encoding="utf-8") as f:
            words += f.read().split()
    return [" ".join(words[i:i + tokenizer_len_words]) for i in range(0, len(words), tokenizer_len_words)]


def qwen3_layer(seed=0, experts=128):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=experts,
                                         num_experts_per_tok=8)
    module = Qwen3MoeExperts(config).eval()
    with torch.no_grad():  # expert e's weights do not depend on how many experts are built
        for i, p in enumerate(module.parameters()):
            g = torch.Generator().manual_seed(100 * seed + i)
            for e in range(experts):
                p[e] = torch.randn(p.shape[1:], generator=g) * 0.02
    router = torch.randn(2048, 128, generator=torch.Generator().manual_seed(seed + 1)) / 2048 ** 0.5
    return module, router


def route(x, router, top_k=8):
    probs = torch.softmax((x - x.mean(0)) @ router * 4, -1)  # centred, sharpened: uneven expert loads
    weights, ids = probs.topk(top_k, -1)
    return ids, weights / weights.sum(-1, keepdim=True)


def run_layer(args):
    train, held = text_lines()
    chunks = docs_chunks() + train
    texts = chunks[:args.sequences]
    start = time.process_time()
    x_cal = minilm_features(texts, 128)
    x_held = minilm_features(held + chunks[args.sequences:args.sequences + 64], 128)
    print(f"activations: {x_cal.shape[0]} calibration tokens from {len(texts)} sequences (<= 128 tokens), "
          f"{x_held.shape[0]} held out; MiniLM {time.process_time() - start:.0f} CPU s", flush=True)
    module, router = qwen3_layer(experts=args.experts)  # routed over all 128; only the first --experts built
    ids_cal, w_cal = route(x_cal, router)
    ids_held, _ = route(x_held, router)
    calls = [ModuleCall((x_cal, ids_cal, w_cal), {}, None)]
    fw = float_stacks(module)
    rtn = tm.MarlinExperts.from_float(module, args.format, args.group_size, "mse")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for shrink in args.rules:
        start = time.process_time()
        quantized, errors, totals = calibrate_experts(module, calls, args.format, args.group_size,
                                                      shrink_rare=shrink == "shrink")
        cpu = time.process_time() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tokens = {e: entry.tokens for e, entry in enumerate(errors["gate_up_proj"])}
        loads = sorted(tokens.values())
        print(f"rule {shrink}: calibration {cpu:.0f} CPU s (1 thread), peak RSS {rss / 2 ** 20:.2f} GiB "
              f"(before calibrating: {rss_before / 2 ** 20:.2f} GiB); tokens per expert min {loads[0]} "
              f"median {loads[len(loads) // 2]} max {loads[-1]}; on the calibration tokens "
              f"gate_up {totals['gate_up_proj'][0]:.4f} -> {totals['gate_up_proj'][1]:.4f}, "
              f"down {totals['down_proj'][0]:.4f} -> {totals['down_proj'][1]:.4f}", flush=True)
        g = per_expert_errors(module, fw, quantized, x_held, ids_held)
        r = per_expert_errors(module, fw, rtn, x_held, ids_held)
        summarize(f"Qwen3-30B-A3B-shaped layer, {args.format} g{args.group_size}, rule {shrink}", g, r, tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("tiny", "layer"))
    parser.add_argument("--format", default="int4")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--rules", nargs="+", default=["shrink"], choices=("shrink", "damp"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--experts", type=int, default=128,
                        help="layer: calibrate only the first N of the 128 experts (routing unchanged) to save time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    (run_tiny if args.part == "tiny" else run_layer)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
