"""2:4 sparse checkpoints: torch-marlin convert --sparsity 2:4, loading, and
checkpoints that are already 2:4 (trained sparse, stored dense with zeros)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

from hf_helpers import build_tiny_model, marlin_modules, read_config
from torch_marlin.cli import main as cli_main
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.layouts import SparseQuantizedWeight
from torch_marlin.layouts.sparse24 import quantize_sparse
from torch_marlin.sparsity import mask_2to4

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 41, 7, 3, 11, 60]])


def _linears(model):
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}


def test_convert_sparse_and_load(tiny_model_dir, tmp_path):
    import transformers

    src, dst = tiny_model_dir("llama"), str(tmp_path / "q")
    summary = convert(src, dst, "fp4", 32, sparsity="2:4", progress=False)
    assert summary.formats == {"fp4/g32/2:4": 14} and summary.already_sparse == []
    assert summary.bits_per_weight == pytest.approx(3.5)  # 2 + 1 (metadata) + 16/32
    qc = read_config(dst)["quantization_config"]
    assert qc["sparsity"] == "2:4" and qc["source"]["pruning"] == "magnitude"
    assert all(entry["sparsity"] == "2:4" for entry in qc["modules"].values())

    float_model = build_tiny_model("llama")
    model = from_pretrained(dst)
    modules = marlin_modules(model)
    assert len(modules) == 14
    for name, linear in _linears(float_model).items():
        module = modules[name]
        assert module.layout is SparseQuantizedWeight
        expected = quantize_sparse(linear.weight.detach(), "fp4", 32)
        assert torch.equal(module.quantized_weight().mask(), mask_2to4(linear.weight.detach().abs()))
        assert torch.equal(module.dequantize(), expected.weight())
    auto = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        assert torch.equal(auto(IDS).logits, model(IDS).logits)


def test_checkpoint_already_2to4_keeps_its_pattern(tmp_path):
    model = build_tiny_model("qwen2", seed=3)
    masks = {}
    with torch.no_grad():
        for name, linear in _linears(model).items():  # "trained sparse": random 2:4 zeros
            mask = mask_2to4(torch.rand_like(linear.weight))
            linear.weight.mul_(mask)
            masks[name] = mask
    src = tmp_path / "sparse-float"
    model.save_pretrained(src)
    dst = str(tmp_path / "q")
    summary = convert(str(src), dst, "int4", 64, sparsity="2:4", progress=False)
    assert sorted(summary.already_sparse) == sorted(masks)
    assert "14 layers were already 2:4 sparse and kept their pattern" in str(summary)
    loaded = from_pretrained(dst)
    for name, mask in masks.items():
        assert torch.equal(loaded.get_submodule(name).quantized_weight().mask(), mask), name


def test_cli_sparsity(tiny_model_dir, tmp_path, capsys):
    dst = str(tmp_path / "q")
    assert cli_main(["convert", tiny_model_dir("gpt2"), dst, "--format", "uint4", "--group-size", "64",
                     "--sparsity", "2:4", "--quantizer", "absmax", "--no-progress"]) == 0
    assert "uint4/g64/2:4: 8" in capsys.readouterr().out
    assert cli_main(["convert", "a", "b", "--sparsity", "4:8"]) == 2
    assert read_config(dst)["quantization_config"]["sparsity"] == "2:4"
    assert from_pretrained(dst)(IDS).logits.shape[-1] == 96


def test_sparsity_of_a_quantized_source_is_an_error(tiny_model_dir, tmp_path):
    src = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir("llama"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sparsity='2:4' applies to float sources"):
        convert(str(src), str(tmp_path / "q"), sparsity="2:4", progress=False)
    with pytest.raises(ValueError, match="sparsity must be None or one of"):
        convert(str(src), str(tmp_path / "q"), sparsity="2:8", progress=False)
    assert not os.path.exists(tmp_path / "q")
