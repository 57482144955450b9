"""Converting streams: peak memory stays near one tensor, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from hf_helpers import build_tiny_model

MIB = 2 ** 20


def _write_sharded_llama(path, layers, shard_bytes=24 * MIB):
    """A float32 Llama of small (1 MiB) tensors, ~4 MiB per layer, written shard by shard."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    os.makedirs(path)
    config.save_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    shard, size, weight_map, names = {}, 0, {}, []

    def flush():
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        names.append(name)

    for key, shape in shapes.items():
        tensor = torch.randn(shape, generator=generator) * 0.02
        if size and size + tensor.numel() * 4 > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[key] = tensor
        size += tensor.numel() * 4
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    return largest, total, len(names)


# Peak resident memory of a step: reset the high-water mark (Linux clear_refs "5"), run
# the step, then compare the new high-water mark with the resident size before it.
_PEAK = textwrap.dedent("""
    import sys

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def peak_growth(step):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        result = step()
        return status("VmHWM") - before, result
""")

_MEASURE = _PEAK + textwrap.dedent("""
    from torch_marlin.convert import convert
    warm_src, src, dst = sys.argv[1:4]
    convert(warm_src, dst + "-warm", "int4", 64, quantizer="absmax", progress=False)  # imports, caches
    growth, summary = peak_growth(lambda: convert(src, dst, "int4", 64, quantizer="absmax", progress=False))
    print(growth, summary.layers_converted)
""")


_LOAD = _PEAK + textwrap.dedent("""
    import torch_marlin.hf
    torch_marlin.hf.from_pretrained(sys.argv[1])  # warm-up: imports, transformers' caches
    growth, model = peak_growth(lambda: torch_marlin.hf.from_pretrained(sys.argv[2]))
    print(growth)
""")


def _convert_growth(warm, src, dst, env):
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(warm), str(src), str(dst)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    growth, layers = run.stdout.split()
    return int(growth), int(layers)


def test_peak_memory_is_about_one_tensor(tmp_path):
    warm = tmp_path / "warm"
    build_tiny_model("llama").save_pretrained(warm)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    growth = {}
    for layers in (8, 24):
        largest, total, shards = _write_sharded_llama(str(tmp_path / f"big{layers}"), layers)
        assert shards >= 2 and largest <= MIB
        growth[layers], converted = _convert_growth(warm, tmp_path / f"big{layers}", tmp_path / f"q{layers}", env)
        assert converted == layers * 7
        print(f"convert: peak growth {growth[layers] / MIB:.1f} MiB for a {total / MIB:.0f} MiB model "
              f"(largest tensor {largest / MIB:.1f} MiB)")
    # The peak is the quantizer's working set on one tensor (about a dozen float32 copies)
    # plus bookkeeping; tripling the model (34 -> 98 MiB) must not move it by more than a
    # tenth of the added size, and it stays far below the model (measured: 16.8 and 17.6 MiB).
    assert growth[24] - growth[8] < 10 * MIB
    assert growth[24] < total / 4

    # Loading builds the model on the meta device: memory ~ the quantized checkpoint, never
    # the float model (measured: 15.4 MiB for the 14.8 MiB checkpoint of the 98 MiB model).
    quantized = sum(os.path.getsize(tmp_path / "q24" / f) for f in os.listdir(tmp_path / "q24")
                    if f.endswith(".safetensors"))
    run = subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path / "q24-warm"), str(tmp_path / "q24")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    load_growth = int(run.stdout.split()[-1])
    print(f"load: peak growth {load_growth / MIB:.1f} MiB, quantized checkpoint {quantized / MIB:.1f} MiB")
    assert load_growth < 2.5 * quantized < total / 2
