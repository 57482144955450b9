"""GGUF import benchmark: a Llama-3.2-1B-shaped Q4_K_M file through `torch-marlin convert model.gguf DST`.

Writes a synthetic GGUF file with the gguf package (16 layers, hidden 2048, intermediate 8192,
32 heads / 8 KV heads, vocab 32000 with a SentencePiece-style tokenizer, tied embeddings) in
llama.cpp's Q4_K_M mix: Q4_K for q, k, o, gate and up and for half of the layers' v and down,
Q6_K for the other half and for the embedding (random block bytes with small scales: every bit
pattern is a valid block). Then converts it in a fresh Python process with the defaults (Q4_K
imported as affine g32, Q6_K kept in float) and reports the process's wall time, its CPU time
(the steadier figure on a shared machine), the time convert() took, peak RSS and output size.
Needs the gguf package and transformers.

    OMP_NUM_THREADS=1 python benchmarks/bench_convert_gguf.py [--repeat 2] [--layers 16] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 2048, 8192, 32, 8

_CONVERT = """
import json, resource, sys, time
start = time.perf_counter()
from torch_marlin.convert import convert
t0 = time.perf_counter()
summary = convert(sys.argv[1], sys.argv[2], progress=False)
convert_s = time.perf_counter() - t0
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"convert_s": convert_s, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss": peak,
                  "summary": str(summary)}))
"""


def write_file(path: str, layers: int, vocab: int = 32000) -> None:
    import numpy as np
    import gguf

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)

    def blocks(qtype, rows, k):
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, size=(rows, k // values, nbytes), dtype=np.uint8)
        scale = lambda n: (rng.random((rows, k // values, n)) * 1e-3).astype(np.float16).view(np.uint8)  # noqa: E731
        if qtype == T.Q4_K:
            b[..., 0:4] = scale(2)
        else:  # Q6_K: d is the last two bytes
            b[..., -2:] = scale(1)
        return b.reshape(rows, -1)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("bench-1b")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(vocab - 3)])
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(vocab - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", blocks(T.Q6_K, vocab, HIDDEN), raw_dtype=T.Q6_K)
    for i in range(layers):
        six = T.Q6_K if i % 2 == 0 else T.Q4_K  # Q4_K_M: half the layers' v and down in Q6_K
        kv = KV_HEADS * head_dim
        for name, rows, k, qtype in (("attn_q", HIDDEN, HIDDEN, T.Q4_K), ("attn_k", kv, HIDDEN, T.Q4_K),
                                     ("attn_v", kv, HIDDEN, six), ("attn_output", HIDDEN, HIDDEN, T.Q4_K),
                                     ("ffn_gate", INTERMEDIATE, HIDDEN, T.Q4_K), ("ffn_up", INTERMEDIATE, HIDDEN, T.Q4_K),
                                     ("ffn_down", HIDDEN, INTERMEDIATE, six)):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(qtype, rows, k), raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000, help="128256 for Llama 3's vocabulary size")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-gguf-")
    try:
        path = os.path.join(work, "model-Q4_K_M.gguf")
        t0 = time.perf_counter()
        write_file(path, args.layers, args.vocab)
        print(f"wrote {path}: {os.path.getsize(path) / 2 ** 20:.0f} MiB in {time.perf_counter() - t0:.0f} s")
        for run in range(args.repeat):
            dst = os.path.join(work, f"out{run}")
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", _CONVERT, path, dst], check=True, capture_output=True,
                                 text=True).stdout
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            import json

            result = json.loads(out.strip().splitlines()[-1])
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            size = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
            print(f"run {run}: wall {wall:.1f} s, process CPU {cpu:.1f} s, convert() {result['convert_s']:.1f} s, "
                  f"peak RSS {result['peak_rss'] / 2 ** 30:.2f} GiB, output {size / 2 ** 20:.0f} MiB")
            if run == 0:
                print(result["summary"])
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
