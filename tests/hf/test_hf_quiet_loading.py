"""Loading prints nothing (no transformers LOAD REPORT, no warnings) on every path, and the
MarlinLinear layout guard (`_extra_state`) still makes a checkpoint whose config disagrees with
its tensors fail loudly."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hf_helpers import marlin_modules, read_config
from torch_marlin.convert import convert
from torch_marlin.hf import MarlinConfig, from_pretrained

LOADERS = {"AutoModelForCausalLM": transformers.AutoModelForCausalLM.from_pretrained,
           "torch_marlin.from_pretrained": from_pretrained}


@contextlib.contextmanager
def expect_silence(capfd):
    """Fail if the block writes to stdout/stderr, logs through transformers at warning level
    (a new user's default; the test session sets it to error) or emits a Python warning
    (torch's warn-once warnings included: another test may have used up the once).
    Progress bars stay off (conftest): they are transformers' own, shown for any model."""
    capfd.readouterr()
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch.set_warn_always(warn_always)
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    out, err = capfd.readouterr()
    assert not records, "transformers logged:\n" + "\n".join(r.getMessage() for r in records)
    assert not caught, [str(w.message) for w in caught]
    assert out == "" and err == "", (out, err)


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """converted(arch) -> directory of its fp4 g32 conversion (cached)."""
    cache = {}

    def make(arch: str) -> str:
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(f"converted-{arch}") / "q")
            convert(tiny_model_dir(arch), path, "fp4", 32, quantizer="absmax", progress=False)
            cache[arch] = path
        return cache[arch]

    return make


def _copy_with(src: str, dst: str, edit_config=None, drop=lambda key: False) -> str:
    """A copy of converted checkpoint `src` with its config edited and some tensors dropped."""
    os.makedirs(dst)
    tensors = {k: v for k, v in load_file(os.path.join(src, "model.safetensors")).items() if not drop(k)}
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = read_config(src)
    if edit_config is not None:
        edit_config(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loading_a_converted_checkpoint_is_silent(converted, capfd, arch, loader):
    path = converted(arch)
    with expect_silence(capfd):
        model = LOADERS[loader](path)
    layers = marlin_modules(model)
    assert layers
    names = set(load_file(os.path.join(path, "model.safetensors")))
    for name, layer in layers.items():  # the checkpoint holds each layer's whole state_dict
        assert {f"{name}.{k}" for k in layer.state_dict()} <= names


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_checkpoints_without_layout_state_load_silently(converted, tmp_path, capfd, loader):
    """Checkpoints converted before `_extra_state` was written: the config's table is enough."""
    path = converted("llama")
    old = _copy_with(path, str(tmp_path / "old"), drop=lambda key: key.endswith("._extra_state"))
    with expect_silence(capfd):
        model = LOADERS[loader](old)
    reference = from_pretrained(path)
    for name, layer in marlin_modules(model).items():
        assert torch.equal(layer.dequantize(), reference.get_submodule(name).dequantize())


@pytest.mark.parametrize("arch,config", [
    ("qwen2", dict(weight_format="uint4", group_size=32, quantizer="absmax")),
    ("gpt2", dict(weight_format="fp4", group_size=32)),  # Conv1D weights are transposed views; mse quantizer
])
def test_quantize_on_load_and_its_save_reload_are_silent(tiny_model_dir, tmp_path, capfd, arch, config):
    with expect_silence(capfd):
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch),
                                                                  quantization_config=MarlinConfig(**config))
    assert marlin_modules(model)
    saved = str(tmp_path / "saved")
    model.save_pretrained(saved)
    for loader in LOADERS.values():
        with expect_silence(capfd):
            loader(saved)


def test_the_silence_check_sees_a_real_load_report(converted, tmp_path, capfd):
    """A checkpoint that really lacks a tensor still gets transformers' report (and the check fails)."""
    broken = _copy_with(converted("llama"), str(tmp_path / "broken"), drop=lambda key: key == "model.norm.weight")
    with pytest.raises(AssertionError, match="model.norm.weight"):
        with expect_silence(capfd):
            transformers.AutoModelForCausalLM.from_pretrained(broken)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("field,value", [("weight_format", "int4"), ("weight_format", "uint4"),
                                         ("group_size", 64)])
def test_a_config_that_disagrees_with_the_tensors_fails_loudly(converted, tmp_path, loader, field, value):
    """fp4 -> int4 keeps every tensor shape: only the layout state tells them apart."""
    layer = "model.layers.1.mlp.up_proj"

    def tamper(config):
        config["quantization_config"]["modules"][layer][field] = value

    tampered = _copy_with(converted("llama"), str(tmp_path / "tampered"), edit_config=tamper)
    with pytest.raises(ValueError, match=r"saved from MarlinLinear\(weight_format='fp4', group_size=32"):
        LOADERS[loader](tampered)
