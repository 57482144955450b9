"""CPU decode against llama.cpp on the same weights (a benchmark, not a test).

One random-weight Llama-shaped model (hidden 2048, MLP 8192, 4 layers, 32 query /
8 KV heads, vocabulary 32000, untied output head) is quantized once with
llama.cpp's Q4_0 rule, (q - 8) x fp16 scale per block of 32, and run two ways:

  llama.cpp      written as GGUF Q4_0 (every linear layer and the head; the
                 embedding too) with the `gguf` package's writer and quantizer,
                 run through llama-cpp-python
  marlin-int4    the transformers model, quantize_model(weight_format="int4",
                 group_size=32) with a quantizer registered here that applies the
                 same Q4_0 rule: the same codes and scales as the GGUF file
                 (checked on one layer), with float32 x and int8 x
                 (torch_marlin.cpu_int8_activations)
  marlin engine  the same quantized model through torch_marlin.CpuDecoder: the whole
                 token in C++ (csrc/cpu/decode_engine.cpp) on the same MarlinLinear
                 buffers, float32 x and int8 x

Greedy decode with a KV cache, batch 1: ms per token (median step) after a short
prompt, and for torch_marlin also the sum of the MarlinLinear calls' times per
token (forward hooks). Every variant is in this one process, timed round by
round. At one thread the process CPU time (--clock cpu) is the steadier
measure on a shared machine; with more threads use wall time.

llama-cpp-python is not a dependency: build it into a private venv, e.g.

    python -m venv --system-site-packages /tmp/llama-venv
    CMAKE_ARGS="-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \\
        /tmp/llama-venv/bin/pip install llama-cpp-python gguf
    PYTHONPATH=. /tmp/llama-venv/bin/python benchmarks/bench_llamacpp.py --threads 1 --clock cpu

Without llama_cpp (or gguf) it says so and runs the torch_marlin rows only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np
import torch
from torch import nn

import torch_marlin

BLOCK = 32
CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def q4_0_codes(w: torch.Tensor):
    """llama.cpp's quantize_row_q4_0_ref on rows of blocks [..., 32] (float32): the
    value of largest magnitude maps to -8, d = max / -8, q = min(15, trunc(x / d + 8.5))."""
    idx = w.abs().argmax(-1, keepdim=True)
    d = w.gather(-1, idx) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (w * inv + 8.5).to(torch.int32).clamp(max=15)  # trunc toward zero, as the C cast (values >= 0.5)
    return q.to(torch.uint8), d.squeeze(-1).half()


def _q4_0_quantizer(groups: torch.Tensor, weight_format: str, group_size: int):
    if weight_format != "int4" or groups.shape[-1] != BLOCK:
        raise ValueError("the q4_0 quantizer makes int4 codes in groups of 32")
    codes, scale = q4_0_codes(groups.float())
    return codes, scale, None


torch_marlin.register_quantizer("q4_0", _q4_0_quantizer)


def build_model() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, attn_implementation="sdpa"), dtype=torch.float32)
    with torch.no_grad():  # weights of a trained model's scale, so that activations stay finite
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model.eval()


def write_gguf(model: nn.Module, path: str) -> None:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("bench-llama-4l")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(CONFIG["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # A vocabulary llama.cpp accepts (the benchmark feeds token ids, never text).
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    tokens += [f"t{i}".encode() for i in range(c.vocab_size - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (c.vocab_size - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def q4_0(t: torch.Tensor):
        return gguf.quants.quantize(t.detach().float().numpy(), gguf.GGMLQuantizationType.Q4_0)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:  # convert_hf_to_gguf's rotary layout
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def add(name: str, t: torch.Tensor, quantize: bool) -> None:
        if quantize:
            w.add_tensor(name, q4_0(t), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(name, t.detach().float().numpy())

    m = model.model
    add("token_embd.weight", m.embed_tokens.weight, True)
    add("output_norm.weight", m.norm.weight, False)
    add("output.weight", model.lm_head.weight, True)
    for i, layer in enumerate(m.layers):
        a, f = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, False)
        add(f"blk.{i}.attn_q.weight", permute(a.q_proj.weight, c.num_attention_heads), True)
        add(f"blk.{i}.attn_k.weight", permute(a.k_proj.weight, c.num_key_value_heads), True)
        add(f"blk.{i}.attn_v.weight", a.v_proj.weight, True)
        add(f"blk.{i}.attn_output.weight", a.o_proj.weight, True)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, False)
        add(f"blk.{i}.ffn_gate.weight", f.gate_proj.weight, True)
        add(f"blk.{i}.ffn_up.weight", f.up_proj.weight, True)
        add(f"blk.{i}.ffn_down.weight", f.down_proj.weight, True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def same_weights_as_gguf(model: nn.Module, marlin: nn.Module) -> float:
    """Largest difference between the GGUF Q4_0 weights (gguf's own dequantizer) and
    torch_marlin's of one layer (down_proj of layer 0): 0 when both used the same rule."""
    import gguf

    ref = model.model.layers[0].mlp.down_proj.weight.detach().float().numpy()
    ours = marlin.model.layers[0].mlp.down_proj.quantized_weight().dequantize(torch.float32).numpy()
    theirs = gguf.quants.dequantize(gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q4_0),
                                    gguf.GGMLQuantizationType.Q4_0)
    return float(np.abs(ours - theirs).max())


class GemvTimer:
    """Sums the time of every MarlinLinear call (forward hooks)."""

    def __init__(self, model: nn.Module, clock):
        self.clock, self.total, self._start = clock, 0.0, {}
        for mod in model.modules():
            if isinstance(mod, torch_marlin.MarlinLinear):
                mod.register_forward_pre_hook(self._pre)
                mod.register_forward_hook(self._post)

    def _pre(self, mod, args):
        self._start[id(mod)] = self.clock()

    def _post(self, mod, args, out):
        self.total += self.clock() - self._start.pop(id(mod))


@torch.inference_mode()
def marlin_steps(model: nn.Module, prompt: list, new_tokens: int, clock, timer: GemvTimer | None):
    """(seconds per decode step, GEMV seconds per step)."""
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    steps, gemv = [], []
    for _ in range(new_tokens):
        if timer:
            timer.total = 0.0
        start = clock()
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(clock() - start)
        gemv.append(timer.total if timer else float("nan"))
    return steps, gemv


def engine_steps(decoder, prompt: list, new_tokens: int, clock):
    """(seconds per decode step, GEMV seconds per step) of torch_marlin.CpuDecoder."""
    decoder.reset()
    for t in prompt:
        logits = decoder.step(t)
    token = int(logits.argmax())
    steps, gemv = [], []
    for _ in range(new_tokens):
        before = decoder.engine.gemv_seconds()
        start = clock()
        logits = decoder.step(token)
        token = int(logits.argmax())
        steps.append(clock() - start)
        gemv.append(decoder.engine.gemv_seconds() - before)
    return steps, gemv


def llama_steps(llm, prompt: list, new_tokens: int, clock):
    llm.reset()
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    steps = []
    for _ in range(new_tokens):
        start = clock()
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        steps.append(clock() - start)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="torch_marlin's activation dtype")
    parser.add_argument("--only", nargs="*", default=[],
                        help="parts of variant names to run, e.g. 'llama.cpp' or 'engine, int8': "
                             "llama.cpp's OpenMP runtime and torch's are two, and in one process each one's "
                             "threads may spin while the other's work; run each alone, alternating, to see that")
    parser.add_argument("--json", default="bench_llamacpp.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_cpu import CLOCKS, cpu_description

    clock = CLOCKS[args.clock]
    try:
        import gguf  # noqa: F401
        from llama_cpp import Llama
        missing = None
    except ImportError as e:
        missing = f"{e} (llama-cpp-python and gguf: see this file's docstring)"
    cpu = cpu_description()
    info = json.loads(torch.ops.marlin._cpu_kernels())
    print(f"# {cpu['model']}, ISA flags: {' '.join(cpu['isa_flags'])}; torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.clock} clock; torch_marlin kernels: {info['selected']} "
          f"(int8 dot: {info['int_dot']}); load average {os.getloadavg()[0]:.1f}")

    model = build_model()
    prompt = list(range(10, 10 + args.prompt_tokens))
    llm, tmp = None, None
    if missing:
        print(f"# llama.cpp: skipped, {missing}")
    else:
        import llama_cpp

        tmp = tempfile.NamedTemporaryFile(suffix=".gguf", delete=False)
        tmp.close()
        write_gguf(model, tmp.name)
        llm = Llama(model_path=tmp.name, n_ctx=512, n_batch=64, n_threads=args.threads,
                    n_threads_batch=args.threads, verbose=False)
        print(f"# llama.cpp: llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode()}")

    dtype = getattr(torch, args.dtype)
    marlin = build_model().to(dtype)
    torch_marlin.quantize_model(marlin, "int4", BLOCK, method="q4_0")
    if llm is not None:
        print(f"# largest weight difference to the GGUF file (layer 0 down_proj): {same_weights_as_gguf(model, marlin):.3g}")
    del model
    timer = GemvTimer(marlin, clock)

    variants = {}
    if llm is not None:
        variants["llama.cpp Q4_0"] = lambda: (llama_steps(llm, prompt, args.new_tokens, clock), None)
    for int8 in (False, True):
        def run(int8=int8):
            with torch_marlin.cpu_int8_activations(int8):
                return marlin_steps(marlin, prompt, args.new_tokens, clock, timer)
        variants[f"marlin int4 g32, {'int8' if int8 else args.dtype} x"] = run
    if dtype == torch.float32:  # the engine runs float32 models
        decoder = torch_marlin.CpuDecoder(marlin, max_length=args.prompt_tokens + args.new_tokens + 1)
        decoder.engine.time_gemvs(args.clock)
        for int8 in (False, True):
            def run_engine(int8=int8):
                with torch_marlin.cpu_int8_activations(int8):
                    return engine_steps(decoder, prompt, args.new_tokens, clock)
            variants[f"marlin engine, {'int8' if int8 else 'float32'} x"] = run_engine
    if args.only:
        variants = {v: fn for v, fn in variants.items() if any(part in v for part in args.only)}
        if not variants:
            raise SystemExit(f"--only {' '.join(args.only)!r} matches no variant")
    steps = {v: [] for v in variants}
    gemv = {v: [] for v in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(args.rounds):
        for v, fn in variants.items():
            s, g = fn()
            steps[v] += s
            gemv[v] += g or []
    results = []
    print(f"{'variant':28} | {'ms/token':>8} | {'GEMVs ms/token':>14}")
    for v in variants:
        ms = statistics.median(steps[v]) * 1e3
        g = statistics.median(gemv[v]) * 1e3 if gemv[v] else None
        results.append(dict(variant=v, ms_per_token=ms, gemv_ms_per_token=g))
        print(f"{v:28} | {ms:8.2f} | {'-' if g is None else f'{g:14.2f}':>14}")
    with open(args.json, "w") as f:
        json.dump(dict(cpu=cpu, kernels=info, threads=args.threads, clock=args.clock, dtype=args.dtype,
                       llama_cpp=missing or "ok", results=results), f, indent=1)
    if tmp is not None:
        os.unlink(tmp.name)


if __name__ == "__main__":
    main()
