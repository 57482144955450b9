"""transformers' quantizer API: quant_method "torch_marlin" on load, quantize-on-load, save/load."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from torch import nn

import torch_marlin
from hf_helpers import load_float, marlin_modules, read_config
from torch_marlin.convert import convert
from torch_marlin.hf import MarlinConfig, from_pretrained

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_quantize_on_load_then_save_and_reload(tiny_model_dir, tmp_path, arch):
    src = tiny_model_dir(arch)
    config = MarlinConfig(weight_format="uint4", group_size=32, quantizer="absmax")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=config).eval()
    layers = marlin_modules(model)
    assert layers and type(model.get_output_embeddings()) is nn.Linear
    # Same quantization as the converter's: identical dequantized weights.
    converted = str(tmp_path / "converted")
    convert(src, converted, "uint4", 32, quantizer="absmax", progress=False)
    reference = from_pretrained(converted)
    assert set(layers) == set(marlin_modules(reference))
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), reference.get_submodule(name).dequantize())

    saved = str(tmp_path / "saved")
    model.save_pretrained(saved)
    qc = read_config(saved)["quantization_config"]
    assert qc["quant_method"] == "torch_marlin" and set(qc["modules"]) == set(layers)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    assert set(marlin_modules(reloaded)) == set(layers)
    with torch.no_grad():
        logits = model(IDS).logits
        assert torch.equal(reloaded(IDS).logits, logits)
        assert torch.equal(from_pretrained(saved)(IDS).logits, logits)
        float_logits = load_float(src)(IDS).logits
    assert torch.nn.functional.cosine_similarity(logits.flatten(), float_logits.flatten(), dim=0) > 0.98


def test_quantize_on_load_respects_modules_to_not_convert(tiny_model_dir):
    config = MarlinConfig(weight_format="fp4", group_size=64, quantizer="absmax",
                          modules_to_not_convert=["*.mlp.*"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), quantization_config=config)
    names = set(marlin_modules(model))
    assert names and not any(".mlp." in n for n in names)
    config = MarlinConfig(weight_format="fp4", group_size=64, quantizer="absmax", modules_to_not_convert=["mlp.gate"])
    with pytest.warns(UserWarning, match="exclude pattern 'mlp.gate' matches no linear layer"):
        transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), quantization_config=config)


def test_marlin_config_validates():
    with pytest.raises(ValueError, match="weight_format"):
        MarlinConfig(weight_format="nf3")
    with pytest.raises(ValueError, match="group_size"):
        MarlinConfig(group_size=100)
    with pytest.raises(ValueError, match=r"quantizer must be one of \('mse', 'absmax'\), got 'gptq'"):
        MarlinConfig(quantizer="gptq")  # quantize-on-load has no calibration data


def test_converted_checkpoint_saves_and_reloads(tiny_model_dir, tmp_path):
    converted = str(tmp_path / "converted")
    convert(tiny_model_dir("mistral"), converted, "fp4", 32, progress=False)
    model = from_pretrained(converted)
    saved = str(tmp_path / "saved")
    model.save_pretrained(saved)
    again = from_pretrained(saved)
    for name, layer in marlin_modules(model).items():
        other = again.get_submodule(name)
        assert torch.equal(layer.packed, other.packed) and torch.equal(layer.scales, other.scales)


_PLAIN_IMPORT = textwrap.dedent("""
    import sys
    import torch_marlin
    assert "transformers" not in sys.modules, "import torch_marlin must not import transformers"
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
    print(type(model.model.layers[0].self_attn.q_proj).__name__)
""")


def test_import_torch_marlin_enables_auto_classes(tiny_model_dir, tmp_path):
    """After a plain `import torch_marlin`, AutoModel*.from_pretrained(converted) gives MarlinLinear
    layers, and torch_marlin did not pay for importing transformers itself."""
    converted = str(tmp_path / "converted")
    convert(tiny_model_dir("llama"), converted, "int4", 32, quantizer="absmax", progress=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", _PLAIN_IMPORT, converted], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "MarlinLinear"


_WITHOUT_IMPORT = textwrap.dedent("""
    import sys
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
    assert "torch_marlin" not in sys.modules
    print(type(model.model.layers[0].self_attn.q_proj).__name__)
""")


def test_without_import_transformers_returns_a_float_model(tiny_model_dir, tmp_path):
    """The trap README and docs/CONVERT.md (Load) warn about, as they describe it: transformers skips
    the unknown quant_method with a warning and a load report, and returns randomly initialised
    nn.Linear layers without raising. Should transformers start raising, update those docs."""
    converted = str(tmp_path / "converted")
    convert(tiny_model_dir("llama"), converted, "int4", 32, quantizer="absmax", progress=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TRANSFORMERS_VERBOSITY="warning")
    run = subprocess.run([sys.executable, "-c", _WITHOUT_IMPORT, converted], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "Linear"
    log = " ".join(run.stderr.split())
    assert "Unknown quantization type, got torch_marlin" in log and "we will skip the quantization" in log
    assert re.search(r"self_attn\.q_proj\.packed \| UNEXPECTED", log)
    assert re.search(r"self_attn\.q_proj\.weight \| MISSING", log)


def test_torch_marlin_exports_from_pretrained():
    assert torch_marlin.from_pretrained is torch_marlin.hf.from_pretrained
    parameters = inspect.signature(torch_marlin.from_pretrained).parameters
    assert list(parameters)[:4] == ["path", "device", "dtype", "model_class"]
    assert parameters["device"].default == "cpu"
    assert "meta device" in torch_marlin.from_pretrained.__doc__
