"""bitsandbytes 4-bit checkpoints made by bitsandbytes itself (functional.quantize_4bit and its
QuantState's packed serialization, which is what Linear4bit / transformers save), compared with
bitsandbytes' own dequantize_4bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from hf_helpers import build_tiny_model, marlin_modules, read_config
from test_hf_quiet_loading import expect_silence
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.errors import UnsupportedQuantization

from reference_libs import require

bnb_functional = require("bitsandbytes.functional", "pip install bitsandbytes")


def make_bnb_checkpoint(path, arch="llama", quant_type="nf4", double_quant=True, dtype=torch.float16):
    """Every linear layer but lm_head quantized by bitsandbytes (blocksize 64), saved with its
    packed quant state as transformers saves Linear4bit. Returns (dir, {module: bitsandbytes'
    float32 dequantization}, float model carrying them)."""
    from safetensors.torch import save_file

    model = build_tiny_model(arch).to(dtype)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    refs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, qs = bnb_functional.quantize_4bit(module.weight.detach(), blocksize=64, quant_type=quant_type,
                                                 compress_statistics=double_quant)
            del state[f"{name}.weight"]
            state[f"{name}.weight"] = q
            state.update({f"{name}.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
            qs.dtype = torch.float32  # bitsandbytes' own value before its cast to the model dtype
            refs[name] = bnb_functional.dequantize_4bit(q, qs)
    os.makedirs(path)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    config = read_config(path)
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
        "bnb_4bit_compute_dtype": "float16", "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    model = model.float().eval()
    with torch.no_grad():
        for name, weight in refs.items():
            model.get_submodule(name).weight.copy_(weight)
    return str(path), refs, model


@pytest.mark.parametrize("quant_type,double_quant,arch", [("nf4", True, "llama"), ("nf4", False, "qwen2"),
                                                          ("fp4", True, "llama"), ("fp4", False, "llama")])
def test_bitsandbytes_imports_within_the_stated_bound(tmp_path, quant_type, double_quant, arch):
    src, refs, reference = make_bnb_checkpoint(tmp_path / "bnb", arch, quant_type, double_quant)
    dst = str(tmp_path / "out")
    summary = convert(src, dst, progress=False)
    model = from_pretrained(dst, dtype=torch.float32)
    layers = marlin_modules(model)
    assert set(layers) == set(refs)
    for name, layer in layers.items():
        assert layer.weight_format == quant_type and layer.group_size == 64
        got, want = layer.dequantize(torch.float32), refs[name]
        if quant_type == "nf4":  # absmax and the table value each rounded once to fp16
            assert ((got - want).abs() <= want.abs() * 2.0 ** -10).all(), name
        else:  # absmax / 6 rounded once; bitsandbytes' +-absmax/192 code becomes 0
            absmax = want.abs().reshape(want.shape[0], -1, 64).amax(-1, keepdim=True)
            tiny = (want.abs().reshape(absmax.shape[0], -1, 64) - absmax / 192).abs() <= absmax * 2.0 ** -20
            err = (got - want).abs().reshape(tiny.shape)
            assert (err[~tiny] <= want.abs().reshape(tiny.shape)[~tiny] * 2.0 ** -11 * 1.01).all(), name
            assert (err[tiny] <= absmax.expand_as(tiny)[tiny] / 192 * 1.01).all(), name
    ids = torch.arange(24).reshape(2, 12) % reference.config.vocab_size
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert "within bound" in str(summary)
    assert read_config(dst)["quantization_config"]["source"]["method"] == "bitsandbytes"


def test_bitsandbytes_checkpoint_loads_silently(tmp_path, capfd):
    src, _, _ = make_bnb_checkpoint(tmp_path / "bnb")
    dst = str(tmp_path / "out")
    convert(src, dst, progress=False)
    with expect_silence(capfd):
        transformers.AutoModelForCausalLM.from_pretrained(dst)


def test_bitsandbytes_8bit_is_a_clear_error(tmp_path):
    src, _, _ = make_bnb_checkpoint(tmp_path / "bnb")
    config = read_config(src)
    config["quantization_config"].update(load_in_8bit=True, load_in_4bit=False)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedQuantization, match="8-bit"):
        convert(src, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
