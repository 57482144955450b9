"""GGUF files written with the gguf package, converted, and compared with gguf's own dequantize
and with transformers' GGUF loading (its names, config and q/k un-permutation)."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
import torch
import transformers

from gguf_helpers import T, build_k_quant_model, gguf, llama_cpp_permute_inverse, write_gguf
from hf_helpers import build_tiny_model, marlin_modules, read_config
from test_hf_quiet_loading import expect_silence
from torch_marlin.cli import main
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.errors import CheckpointError


def reference_model(path: str):
    """The model as transformers loads the GGUF file: its config, its dequantized float32 tensors."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # a tied head
    return model


def compare_logits(dst: str, reference, tol: float = 0.0, generate: bool = True):
    model = from_pretrained(dst, dtype=torch.float32)
    ids = torch.arange(24).reshape(2, 12) % reference.config.vocab_size
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= tol * want.abs().max() + 1e-5 * want.abs().max(), \
        float((got - want).abs().max() / want.abs().max())
    if generate:
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], **kwargs), reference.generate(ids[:1], **kwargs))
    return model


@pytest.mark.parametrize("arch,qtype,fmt", [("llama", T.Q4_0, "int4"), ("qwen2", T.Q4_1, "affine"),
                                            ("llama-tied", T.MXFP4, "fp4")])
def test_exact_types_equal_gguf_dequantize(tmp_path, arch, qtype, fmt):
    path = str(tmp_path / "model.gguf")
    refs = write_gguf(path, build_tiny_model(arch), lambda name, w: qtype)
    dst = str(tmp_path / "out")
    summary = convert(path, dst, progress=False)
    assert not summary.notes and "exact" in str(summary)
    model = compare_logits(dst, reference_model(path))
    layers = marlin_modules(model)
    assert len(layers) == len([k for k in refs if k != "model.embed_tokens.weight" and refs[k].dim() == 2])
    for name, layer in layers.items():
        assert layer.weight_format == fmt and layer.group_size == 32
        assert torch.equal(layer.dequantize(torch.float32), refs[f"{name}.weight"]), name
    # The embedding (a quantized tensor, not a linear layer) is kept in float: gguf's values.
    assert torch.equal(model.model.embed_tokens.weight, refs["model.embed_tokens.weight"])
    assert os.path.exists(os.path.join(dst, "tokenizer.json"))
    assert "gguf" not in read_config(dst)


def _q4k_bound(path: str, gguf_name: str) -> torch.Tensor:
    """Per weight: 2^-11 * (15 |d * sc| + |dmin * m|), from gguf's own reading of the Q4_K blocks."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    blocks = np.asarray(tensor.data).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    bound = 2.0 ** -11 * (15 * np.abs(d * sc) + np.abs(dmin * m))  # [blocks, 8]
    rows = int(tensor.shape[1])
    return torch.from_numpy(np.repeat(bound, 32, axis=1).reshape(rows, -1).astype(np.float32))


def q4_k_m(name, weight):
    """A Q4_K_M-like mix: Q6_K for attn_v and ffn_down and the embedding, F16, Q8_0, IQ4_NL and Q5_0 on some."""
    if name.endswith(("v_proj.weight", "down_proj.weight", "embed_tokens.weight")):
        return T.Q6_K
    if name == "model.layers.1.self_attn.o_proj.weight":
        return T.F16
    if name == "model.layers.1.mlp.up_proj.weight":
        return T.Q8_0
    if name == "model.layers.0.mlp.up_proj.weight":
        return T.IQ4_NL
    if name == "lm_head.weight":
        return T.Q5_0
    return T.Q4_K


def test_q4_k_m_file(tmp_path):
    path = str(tmp_path / "model.gguf")
    model = build_k_quant_model()
    refs = write_gguf(path, model, q4_k_m)
    dst = str(tmp_path / "out")
    summary = convert(path, dst, progress=False)
    text = str(summary)
    assert "within bound" in text and "kept float" in text, text
    reference = reference_model(path)
    converted = compare_logits(dst, reference, tol=2e-3, generate=False)
    layers = marlin_modules(converted)
    assert set(layers) == {n[: -len(".weight")] for n in refs if refs[n].dim() == 2 and q4_k_m(n, None) == T.Q4_K}
    for name, layer in layers.items():
        assert layer.weight_format == "affine" and layer.group_size == 32
        got, want = layer.dequantize(torch.float32), refs[f"{name}.weight"]
        gguf_name = {"q_proj": "attn_q", "k_proj": "attn_k", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate"}[name.rpartition(".")[2]]
        bound = _q4k_bound(path, f"blk.{name.split('.')[2]}.{gguf_name}.weight")
        if gguf_name in ("attn_q", "attn_k"):  # the file's rows are llama.cpp's order; ours the model's
            heads = model.config.num_attention_heads if gguf_name == "attn_q" else model.config.num_key_value_heads
            bound = torch.from_numpy(llama_cpp_permute_inverse(bound.numpy(), model.config.num_attention_heads, heads))
        slack = want.abs() * 2.0 ** -23 + 2.0 ** -40  # the final fp32 rounding on each side
        assert ((got - want).abs() <= bound + slack).all(), name
        assert not torch.equal(got, want)  # the fp16 rounding of d * sc is visible: a real bound
    # Kept in float: exactly gguf's float32 dequantization (F16 as stored).
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.up_proj", "model.layers.0.mlp.up_proj",
                 "lm_head", "model.layers.1.self_attn.o_proj"):
        assert name not in layers
        assert torch.equal(converted.get_submodule(name).weight, refs[f"{name}.weight"]), name
    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj"):
        assert name in text


def test_requantize_option(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, build_k_quant_model(), q4_k_m)
    dst = str(tmp_path / "out")
    summary = convert(path, dst, weight_format="nf4", group_size=32, requantize=True, progress=False)
    layers = marlin_modules(from_pretrained(dst))
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.up_proj", "model.layers.0.mlp.up_proj",
                 "model.layers.1.self_attn.o_proj", "lm_head"):
        assert layers[name].weight_format == "nf4", name
    assert layers["model.layers.0.self_attn.q_proj"].weight_format == "affine"
    assert "re-quantized" in str(summary)


def test_cli_single_file_and_gguf_file_option(tmp_path, capsys):
    path = str(tmp_path / "repo" / "tiny-Q4_0.gguf")
    os.makedirs(os.path.dirname(path))
    write_gguf(path, build_tiny_model("llama-tied"), lambda name, w: T.Q4_0)
    assert main(["convert", path, str(tmp_path / "a"), "--no-progress"]) == 0
    assert "GGUF: " in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "repo"), str(tmp_path / "b"), "--gguf-file", "tiny-Q4_0.gguf",
                 "--no-progress"]) == 0
    assert main(["convert", str(tmp_path / "repo"), str(tmp_path / "c"), "--gguf-file", "missing.gguf",
                 "--no-progress"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("loader", ["AutoModelForCausalLM", "from_pretrained"])
def test_converted_gguf_loads_silently(tmp_path, capfd, loader):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, build_tiny_model("llama"), lambda name, w: T.Q4_0)
    dst = str(tmp_path / "out")
    convert(path, dst, progress=False)
    load = transformers.AutoModelForCausalLM.from_pretrained if loader != "from_pretrained" else from_pretrained
    with expect_silence(capfd):
        load(dst)


def test_corrupt_gguf_is_a_clear_error_and_writes_nothing(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, build_tiny_model("llama"), lambda name, w: T.Q4_0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model.gguf"):
        convert(path, str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


def test_iq4_nl_table_is_none_of_our_formats():
    """IQ4_NL would import exactly only if its 16 values were a scaled copy of one of our
    formats' tables (then its d would be the scale): they are not, so it is kept float or
    re-quantized (test_q4_k_m_file)."""
    from torch_marlin.formats import VALUE_FORMATS

    iq4 = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float64).sort().values
    for name, fmt in VALUE_FORMATS.items():
        ours = fmt.values.double().sort().values
        for scale in (iq4[0] / ours[0], iq4[-1] / ours[-1]):
            assert not torch.allclose(ours * scale, iq4, rtol=0, atol=1e-3), name


def test_hub_repo_with_gguf_file(tmp_path, monkeypatch):
    """A Hub repo of GGUF files (several quantizations side by side): --gguf-file picks one, read
    from the Hub cache offline, and online only that file (and no safetensors) is asked for."""
    import huggingface_hub
    from huggingface_hub import constants

    repo, commit = "tiny-org/tiny-llama-GGUF", "c" * 40
    storage = tmp_path / "hub-cache" / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    os.makedirs(snapshot)
    write_gguf(str(snapshot / "tiny-Q4_0.gguf"), build_tiny_model("llama"), lambda name, w: T.Q4_0)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    summary = convert(repo, str(tmp_path / "offline"), gguf_file="tiny-Q4_0.gguf", progress=False)
    assert summary.layers_converted == 15
    with pytest.raises(CheckpointError, match="no file 'tiny-Q8_0.gguf'"):
        convert(repo, str(tmp_path / "missing"), gguf_file="tiny-Q8_0.gguf", progress=False)

    calls = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kwargs: calls.append(kwargs) or str(snapshot))
    convert(repo, str(tmp_path / "online"), gguf_file="tiny-Q4_0.gguf", progress=False)
    (call,) = calls
    assert "tiny-Q4_0.gguf" in call["allow_patterns"] and "*.safetensors" not in call["allow_patterns"]


_GROWTH = textwrap.dedent("""
    import sys
    from torch_marlin.convert import convert

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    convert(sys.argv[1], sys.argv[3] + "-warm", progress=False)  # imports, caches
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark
    before = status("VmRSS")
    convert(sys.argv[2], sys.argv[3], progress=False)
    print(status("VmHWM") - before)
""")


def test_gguf_conversion_streams(tmp_path):
    """Peak memory is about one tensor, not the file: tripling the layers (Q4_0 attention, F32
    MLP tensors of 2 MiB) moves the peak growth by a tenth of the added size at most, and it
    stays below an eighth of the file (measured: 5.7 and 10.2-10.6 MiB for 39 and 113 MiB files)."""
    import subprocess
    import sys

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4)
    sizes, growth = {}, {}
    for layers in (2, 6, 18):
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        path = str(tmp_path / f"l{layers}.gguf")
        write_gguf(path, model, lambda name, w: T.Q4_0 if "self_attn" in name else T.F32, tokenizer=False)
        sizes[layers] = os.path.getsize(path)
    # glibc keeps freed blocks below its mmap threshold, which it raises at run time: a fixed one
    # makes VmHWM follow live memory. What malloc keeps can only add to a run's figure, so the
    # smaller of two runs is the closer bound (one CI run under load read 13.4 MiB once).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 20))

    def peak_growth(layers: int, attempt: int) -> int:
        run = subprocess.run([sys.executable, "-c", _GROWTH, str(tmp_path / "l2.gguf"), str(tmp_path / f"l{layers}.gguf"),
                              str(tmp_path / f"out{layers}-{attempt}")], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])

    for layers in (6, 18):
        growth[layers] = min(peak_growth(layers, attempt) for attempt in range(2))
    added = sizes[18] - sizes[6]
    print(f"peak growth {growth[6] / 2 ** 20:.1f} and {growth[18] / 2 ** 20:.1f} MiB for "
          f"{sizes[6] / 2 ** 20:.0f} and {sizes[18] / 2 ** 20:.0f} MiB files")
    assert growth[18] - growth[6] < added / 10
    assert growth[18] < sizes[18] / 8
