"""Float Hugging Face models -> torch_marlin checkpoints -> loaded models."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import torch_marlin
from hf_helpers import leftovers, load_float, marlin_modules, read_config
from torch_marlin.cli import main as cli_main
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.safetensors_io import read_header

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 41, 7, 3, 11, 60], [4, 4, 8, 90, 12, 13, 14, 15, 0, 1, 2, 3]])

CASES = [  # (architecture, format, group size)
    ("llama", "fp4", 32), ("qwen2", "uint4", 64), ("mistral", "int4", 32),
    ("phi", "fp4", -1), ("gemma", "uint4", 32), ("gpt2", "int4", 64),
]


def _linear_weights(model):
    """{name: weight [out, in]} of every nn.Linear / Conv1D (Conv1D stores [in, out])."""
    result = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            result[name] = module.weight.detach()
        elif isinstance(module, Conv1D):
            result[name] = module.weight.detach().t()
    return result


def _reference_model(float_model, expected):
    """The float model with each quantized layer's weight replaced by its dequantization."""
    ref = copy.deepcopy(float_model)
    for name, module in ref.named_modules():
        if name in expected:
            w = expected[name]
            with torch.no_grad():
                module.weight.copy_(w.t() if isinstance(module, Conv1D) else w)
    return ref


@pytest.mark.parametrize("arch,weight_format,group_size", CASES)
def test_architectures_convert_and_load(tiny_model_dir, tmp_path, arch, weight_format, group_size):
    src = tiny_model_dir(arch)
    dst = str(tmp_path / "q")
    summary = convert(src, dst, weight_format, group_size, progress=False)
    float_model = load_float(src)
    linears = _linear_weights(float_model)
    output_head = {n for n, m in float_model.named_modules() if m is float_model.get_output_embeddings()}
    expected_names = set(linears) - output_head
    assert summary.layers_converted == len(expected_names)

    model = from_pretrained(dst)
    quantized = marlin_modules(model)
    assert set(quantized) == expected_names
    assert not isinstance(model.get_output_embeddings(), torch_marlin.MarlinLinear)

    expected = {}
    for name, module in quantized.items():
        assert (module.weight_format, module.group_size) == (weight_format, group_size)
        reference = torch_marlin.quantize_weight(linears[name], weight_format, group_size).dequantize()
        assert torch.equal(module.dequantize(torch.float32), reference), name
        expected[name] = reference

    with torch.no_grad():
        got = model(IDS).logits
        want = _reference_model(float_model, expected)(IDS).logits
        original = float_model(IDS).logits
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-4 * scale
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), original.flatten(), dim=0)
    assert cosine > 0.98, f"{arch}: logits cosine vs float {cosine:.4f}"


def test_transformers_auto_class_loads_converted_dir(tiny_model_dir, tmp_path):
    import transformers

    dst = str(tmp_path / "q")
    convert(tiny_model_dir("llama"), dst, "int4", 32, progress=False)
    auto = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    ours = from_pretrained(dst)
    assert set(marlin_modules(auto)) == set(marlin_modules(ours))
    with torch.no_grad():
        assert torch.equal(auto(IDS).logits, ours(IDS).logits)


@pytest.mark.parametrize("arch", ["llama-tied", "gpt2", "gemma"])
def test_tied_embeddings_stay_tied_and_float(tiny_model_dir, tmp_path, arch):
    src = tiny_model_dir(arch)
    dst = str(tmp_path / "q")
    convert(src, dst, "fp4", 32, quantizer="absmax", quantize_lm_head=True, progress=False)  # tied: stays float
    model = from_pretrained(dst)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is nn.Linear
    assert head.weight is embed.weight
    assert torch.equal(embed.weight, load_float(src).get_input_embeddings().weight)


def test_quantize_lm_head_when_untied(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "q")
    convert(tiny_model_dir("llama"), dst, "fp4", 32, quantize_lm_head=True, progress=False)
    assert isinstance(from_pretrained(dst).lm_head, torch_marlin.MarlinLinear)


def test_sharded_input_and_output(tiny_model_dir, tmp_path):
    sharded_src = tiny_model_dir("llama", max_shard_size="60KB")
    assert os.path.exists(os.path.join(sharded_src, "model.safetensors.index.json"))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    convert(tiny_model_dir("llama"), a, "int4", 32, progress=False)
    convert(sharded_src, b, "int4", 32, max_shard_bytes=40 * 1024, progress=False)
    with open(os.path.join(b, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 2
    for shard in shards:
        tensors, metadata = read_header(os.path.join(b, shard))
        assert metadata.get("format") == "pt"
        assert all(weight_map[name] == shard for name in tensors)
    assert sum(len(read_header(os.path.join(b, s))[0]) for s in shards) == len(weight_map)
    with torch.no_grad():
        assert torch.equal(from_pretrained(a)(IDS).logits, from_pretrained(b)(IDS).logits)


def test_exclude_patterns_and_dtype(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "q")
    summary = convert(tiny_model_dir("llama"), dst, "fp4", 64, exclude=["*.mlp.down_proj", "q_proj"],
                      dtype="bfloat16", progress=False)
    model = from_pretrained(dst)
    names = set(marlin_modules(model))
    assert not any(n.endswith((".down_proj", ".q_proj")) for n in names)
    assert any(n.endswith(".k_proj") for n in names)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "lm_head"} <= set(
        summary.layers_in_float)
    qc = read_config(dst)["quantization_config"]
    assert set(qc["modules_to_not_convert"]) == set(summary.layers_in_float)
    assert read_config(dst)["dtype"] == "bfloat16"
    tensors, _ = read_header(os.path.join(dst, "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.k_proj.scales"].dtype == torch.float16
    assert tensors["model.layers.0.self_attn.k_proj.packed"].dtype == torch.int32


@pytest.mark.parametrize("weight_format,group_size,bits", [("int4", 32, 4.5), ("fp4", 64, 4.25),
                                                           ("uint4", 32, 5.0)])
def test_summary_figures(tiny_model_dir, tmp_path, weight_format, group_size, bits):
    src = tiny_model_dir("llama")
    summary = convert(src, str(tmp_path / "q"), weight_format, group_size, quantizer="absmax", progress=False)
    assert summary.bits_per_weight == pytest.approx(bits)
    assert summary.bytes_after < summary.bytes_before
    assert summary.source_method == "float" and summary.mean_relative_error > 0
    text = str(summary)
    assert "converted 14 linear layers" in text and "bits per quantized weight" in text


@pytest.mark.parametrize("weight_format,stored_bits", [("fp4", 4.125), ("uint4", 4.25)])
def test_summary_explains_k_padding(tiny_model_dir, tmp_path, weight_format, stored_bits):
    """At g128 the tiny llama's K (64 and 128) is padded to whole groups: the bits per quantized
    weight exceed 4 + 16/g (+ 16/g zeros), and the summary says by how much and why."""
    summary = convert(tiny_model_dir("llama"), str(tmp_path / "q"), weight_format, 128, quantizer="absmax",
                      progress=False)
    layers = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]  # (K, N) of one block
    weights = sum(k * n for k, n in layers)
    padded = sum(128 * n for _, n in layers)
    assert summary.quantized_params == 2 * weights and summary.padded_params == 2 * padded
    assert summary.bits_per_weight == pytest.approx(stored_bits * padded / weights)
    assert (f"{summary.bits_per_weight:.3f} bits per quantized weight ({stored_bits:.3f} per stored weight: "
            f"K is zero-padded to whole groups, {100 * (padded / weights - 1):.1f}% more weights)") in str(summary)
    unpadded = convert(tiny_model_dir("llama"), str(tmp_path / "q64"), weight_format, 64, quantizer="absmax",
                       progress=False)
    assert unpadded.padded_params == unpadded.quantized_params and "stored weight" not in str(unpadded)


def test_exclude_pattern_that_matches_nothing_is_a_warning(tiny_model_dir, tmp_path):
    with pytest.warns(UserWarning, match="exclude pattern 'mlp.down' matches no linear layer"):
        summary = convert(tiny_model_dir("llama"), str(tmp_path / "q"), "fp4", 64, quantizer="absmax",
                          exclude=["mlp.down", "lm_head", "*.q_proj"], progress=False)
    assert summary.notes == ["exclude pattern 'mlp.down' matches no linear layer or experts module"]
    assert "- exclude pattern 'mlp.down' matches no linear layer" in str(summary)


def test_other_files_are_copied(tiny_model_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    base = tiny_model_dir("llama")
    for name in os.listdir(base):
        (src / name).write_bytes(open(os.path.join(base, name), "rb").read())
    (src / "tokenizer.json").write_text('{"fake": true}')
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    dst = tmp_path / "q"
    convert(str(src), str(dst), "fp4", 32, quantizer="absmax", progress=False)
    assert (dst / "tokenizer.json").read_text() == '{"fake": true}'
    assert (dst / "1_Pooling" / "config.json").exists()
    assert (dst / "generation_config.json").exists()
    assert leftovers(str(tmp_path), "q") == []


def test_cli_convert(tiny_model_dir, tmp_path, capsys):
    dst = str(tmp_path / "q")
    code = cli_main(["convert", tiny_model_dir("qwen2"), dst, "--format", "uint4", "--group-size", "64",
                     "--exclude", "*.o_proj", "--quantizer", "absmax", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "converted 12 linear layers" in out and "bits per quantized weight" in out
    assert read_config(dst)["quantization_config"]["weight_format"] == "uint4"
    assert cli_main(["convert", tiny_model_dir("qwen2"), dst, "--no-progress"]) == 1  # exists
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", tiny_model_dir("qwen2"), dst, "--overwrite", "--format", "int4",
                     "--quantizer", "absmax", "--no-progress"]) == 0
    assert read_config(dst)["quantization_config"]["weight_format"] == "int4"
    assert leftovers(str(tmp_path), "q") == []


def test_cli_version(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out == f"torch-marlin {torch_marlin.__version__} (torch {torch.__version__})\n"
    pyproject = open(os.path.join(os.path.dirname(torch_marlin.__file__), "..", "pyproject.toml")).read()
    assert f'\nversion = "{torch_marlin.__version__}"\n' in pyproject


def test_cli_usage_errors(capsys):
    assert cli_main(["convert", "a", "b", "--format", "int8"]) == 2
    assert cli_main(["convert", "a", "b", "--group-size", "48"]) == 2
    assert cli_main(["--help"]) == 0


def test_python_dash_m(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "q")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # -W error: runpy warns (RuntimeWarning) when the module it runs was already imported.
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "torch_marlin.convert",
                          tiny_model_dir("gpt2"), dst,
                          "--format", "fp4", "--group-size", "32", "--quantizer", "absmax", "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "converted 8 linear layers" in run.stdout


def test_help_lists_registered_sources(capsys):
    from torch_marlin.hf.importers import supported_sources

    assert cli_main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert len(supported_sources()) >= 5
    for label in supported_sources():
        assert label in text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_from_pretrained_dtype(tiny_model_dir, tmp_path, dtype):
    dst = str(tmp_path / "q")
    convert(tiny_model_dir("llama"), dst, "fp4", 32, quantizer="absmax", progress=False)
    full = from_pretrained(dst)
    half = from_pretrained(dst, dtype=dtype)
    assert half.get_input_embeddings().weight.dtype == dtype
    for name, layer in marlin_modules(half).items():
        assert layer.scales.dtype == torch.float16 and layer.packed.dtype == torch.int32
        assert torch.equal(layer.packed, full.get_submodule(name).packed)
    with torch.no_grad():
        low, high = half(IDS).logits, full(IDS).logits
    assert low.dtype == dtype
    assert torch.nn.functional.cosine_similarity(low.float().flatten(), high.flatten(), dim=0) > 0.999
