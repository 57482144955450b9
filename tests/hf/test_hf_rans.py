"""Entropy-coded checkpoints: `torch-marlin convert --bits` / `--entropy-code`, loaded by
from_pretrained and transformers without building dense weights."""

from __future__ import annotations

import pytest
import torch
import transformers

import torch_marlin
from hf_helpers import VOCAB, load_float, marlin_modules, read_config
from torch_marlin.cli import main as cli_main
from torch_marlin.hf import from_pretrained
from torch_marlin.layouts import RansQuantizedWeight

IDS = torch.tensor([[2, 5, 9, 17, 33, 40, 41, 7, 3, 11], [2, 4, 8, 60, 12, 13, 14, 15, 1, 3]]) % VOCAB


def _load_and_compare(dst, src):
    model = from_pretrained(dst)
    layers = marlin_modules(model)
    assert layers and all(isinstance(m.quantized_weight(), RansQuantizedWeight) for m in layers.values())
    with torch.no_grad():
        logits = model(IDS).logits
        again = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()(IDS).logits
        float_logits = load_float(src)(IDS).logits
    assert torch.equal(logits, again)
    return layers, torch.nn.functional.cosine_similarity(logits.flatten(), float_logits.flatten(), dim=0)


@pytest.mark.parametrize("argv,kind", [([], "tcq"), (["--format", "grid"], "grid")])
def test_cli_bits_writes_a_checkpoint_within_the_budget(tiny_model_dir, tmp_path, capsys, argv, kind):
    src = tiny_model_dir("llama")
    dst = str(tmp_path / "rans")
    assert cli_main(["convert", src, dst, "--bits", "4.5", "--no-progress"] + argv) == 0
    assert "entropy-coded" in capsys.readouterr().out
    qc = read_config(dst)["quantization_config"]
    entries = qc["modules"]
    assert all(e["layout"] == "rans" and e["weight_format"] == kind and e["group_size"] == -1
               for e in entries.values())  # tcq: the default of round to nearest
    assert qc["source"]["bits"] == 4.5
    layers, cosine = _load_and_compare(dst, src)
    assert set(layers) == set(entries)
    coded = [m.quantized_weight() for m in layers.values()]
    assert sum(8 * q.nbytes for q in coded) / sum(q.num_weights for q in coded) <= 4.5
    for name, layer in layers.items():
        assert layer.words.numel() == entries[name]["num_words"]
    assert cosine > 0.95


def test_cli_entropy_code_is_lossless(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    dense, coded = str(tmp_path / "dense"), str(tmp_path / "coded")
    common = ["--format", "int4", "--group-size", "32", "--no-progress"]
    assert cli_main(["convert", src, dense] + common) == 0
    assert cli_main(["convert", src, coded, "--entropy-code"] + common) == 0
    layers, _ = _load_and_compare(coded, src)
    reference = marlin_modules(from_pretrained(dense))
    for name, layer in layers.items():
        assert torch.equal(layer.quantized_weight().dequantize(torch.float64),
                           reference[name].quantized_weight().dequantize(torch.float64))


@pytest.mark.parametrize("argv,message", [
    (["--bits", "3.5", "--entropy-code"], "exclude each other"),
    (["--bits", "0.5"], "--bits must be in"),
    (["--bits", "3.5", "--sparsity", "2:4"], "without --sparsity"),
    (["--bits", "3.5", "--method", "gptq"], "go together"),
    (["--format", "tcq"], "add --bits"),
    (["--format", "tcq", "--entropy-code"], "add --bits"),
])
def test_cli_bad_input(tiny_model_dir, tmp_path, capsys, argv, message):
    assert cli_main(["convert", tiny_model_dir("llama"), str(tmp_path / "x")] + argv) != 0
    assert message in capsys.readouterr().err
