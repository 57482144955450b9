"""Conversion benchmark: a Llama-3.2-1B-shaped bf16 checkpoint through `torch-marlin convert`.

Writes a synthetic checkpoint (random weights made here: 16 layers, hidden
2048, intermediate 8192, 32 heads / 8 KV heads, vocab 32000, tied
embeddings, bf16, one model.safetensors) into a temporary directory, then
converts it with the default quantizer in a fresh Python process, as
`torch-marlin convert` would. Reports, per run, the process's wall time, the
time convert() itself took, the process's peak RSS (/proc/self/status VmHWM,
read by the process at the end), the output size and the bits per quantized
weight. A baseline process that only imports torch_marlin and transformers
gives the RSS the imports alone cost. Needs the `hf` extra (transformers).

    python benchmarks/bench_convert.py [--repeat 3] [--format fp4] [--json out.json]
    python benchmarks/bench_convert.py --layers 2 --profile    # where the time goes (cProfile)
    python benchmarks/bench_convert.py --sparsity 2:4          # 2:4 (magnitude pruning)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 32, 8, 64, 32000

# Runs in the child process: convert, then report what it measured about itself.
_PEAK_RSS = """
def peak_rss_bytes():
    # VmHWM: this process's own peak. ru_maxrss would also count the parent's RSS at
    # fork time, which Linux carries across exec.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""
_CONVERT = _PEAK_RSS + """
import json, sys, time
start = time.perf_counter()
from torch_marlin.convert import convert
src, dst, fmt, group_size, quantizer, sparsity, profile = sys.argv[1:8]
call = lambda: convert(src, dst, weight_format=fmt, group_size=int(group_size), quantizer=quantizer,
                       sparsity=sparsity or None, progress=False)
if profile == "1":
    import cProfile, pstats
    profiler = cProfile.Profile()
    summary = profiler.runcall(call)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
else:
    summary = call()
print(json.dumps({"convert_seconds": summary.seconds, "process_seconds": time.perf_counter() - start,
                  "peak_rss_bytes": peak_rss_bytes(), "bits_per_weight": summary.bits_per_weight, "layers": summary.layers_converted,
                  "quantized_params": summary.quantized_params,
                  "mean_relative_error": summary.mean_relative_error}))
"""
_IMPORT_ONLY = _PEAK_RSS + """
import json
import torch_marlin.convert, transformers  # convert() imports transformers to read the model's layout
print(json.dumps({"peak_rss_bytes": peak_rss_bytes()}))
"""


def llama_tensors(layers: int):
    """(name, shape) of a Llama-3.2-1B-shaped checkpoint with tied embeddings (no lm_head)."""
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)
        yield p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)
        yield p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)
    yield "model.norm.weight", (HIDDEN,)


def write_checkpoint(path: str, layers: int) -> int:
    """Random bf16 weights (std 0.02, norms 1), written one tensor at a time; returns bytes."""
    from torch_marlin.hf.safetensors_io import ShardedWriter

    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "tie_word_embeddings": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generator = torch.Generator().manual_seed(0)
    writer = ShardedWriter(path, max_shard_bytes=1 << 40)  # one file, like the real checkpoint
    for name, shape in llama_tensors(layers):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        writer.add(name, tensor)
    writer.finish()
    return writer.total_bytes


def run_child(code: str, *args: str, stderr=None) -> tuple:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.PIPE,
                         stderr=stderr, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--format", default="fp4", choices=["fp4", "int4", "uint4"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--quantizer", default="mse")
    parser.add_argument("--sparsity", choices=["2:4"], default=None, help="prune to 2:4 by magnitude")
    parser.add_argument("--repeat", type=int, default=1, help="conversions of the same checkpoint")
    parser.add_argument("--profile", action="store_true", help="cProfile the (first) conversion, to stderr")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file ('-': stdout)")
    args = parser.parse_args(argv)

    root = tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir)
    try:
        src = os.path.join(root, "src")
        start = time.perf_counter()
        source_bytes = write_checkpoint(src, args.layers)
        print(f"wrote a {args.layers}-layer Llama-3.2-1B-shaped bf16 checkpoint: {source_bytes / 2**30:.2f} GiB "
              f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        baseline, _ = run_child(_IMPORT_ONLY)
        runs = []
        for i in range(args.repeat):
            dst = os.path.join(root, f"dst{i}")
            result, wall = run_child(_CONVERT, src, dst, args.format, str(args.group_size), args.quantizer,
                                     args.sparsity or "", "1" if args.profile and i == 0 else "0")
            result.update(wall_seconds=wall, output_bytes=directory_bytes(dst))
            runs.append(result)
            print(f"run {i + 1}: wall {wall:.1f} s (convert() {result['convert_seconds']:.1f} s), peak RSS "
                  f"{result['peak_rss_bytes'] / 2**30:.2f} GiB, output {result['output_bytes'] / 2**20:.0f} MiB, "
                  f"{result['bits_per_weight']:.3f} bits per quantized weight", file=sys.stderr)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    walls = [r["wall_seconds"] for r in runs]
    rss = [r["peak_rss_bytes"] for r in runs]
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cpu_count": os.cpu_count(), "loadavg_after": os.getloadavg(), "torch": torch.__version__},
        "config": vars(args), "source_bytes": source_bytes,
        "import_only_peak_rss_bytes": baseline["peak_rss_bytes"], "runs": runs,
        "wall_seconds_median": statistics.median(walls), "wall_seconds_min": min(walls),
        "wall_seconds_max": max(walls), "peak_rss_bytes_max": max(rss),
    }
    print(f"{args.format} g{args.group_size} {args.quantizer}{' 2:4' if args.sparsity else ''}: wall median {report['wall_seconds_median']:.1f} s "
          f"(min {min(walls):.1f}, max {max(walls):.1f}, {len(walls)} runs); peak RSS max {max(rss) / 2**30:.2f} GiB "
          f"(import alone {baseline['peak_rss_bytes'] / 2**30:.2f} GiB); source {source_bytes / 2**30:.2f} GiB -> "
          f"output {runs[0]['output_bytes'] / 2**20:.0f} MiB; {runs[0]['bits_per_weight']:.3f} bits per quantized "
          f"weight")
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
