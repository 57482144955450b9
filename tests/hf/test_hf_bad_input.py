"""Broken or unsupported sources: a clear error, a non-zero exit, nothing left in DST."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest
import torch

from hf_helpers import leftovers, load_float
from torch_marlin.cli import main as cli_main
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.errors import CheckpointError


@pytest.fixture
def src(tiny_model_dir, tmp_path):
    path = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama"), path)
    return path


def _fails(src, tmp_path, match, capsys=None, **kwargs):
    """convert() raises with `match`, the CLI exits 1 with the same message, nothing is left."""
    dst = tmp_path / "dst"
    with pytest.raises((CheckpointError, ValueError, FileExistsError), match=match):
        convert(str(src), str(dst), progress=False, **kwargs)
    assert not dst.exists() and leftovers(str(tmp_path), "dst") == []
    if capsys is not None:
        capsys.readouterr()
        assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 1
        assert "error:" in capsys.readouterr().err
        assert not dst.exists() and leftovers(str(tmp_path), "dst") == []


def test_missing_directory(tmp_path, capsys):
    _fails(tmp_path / "nope", tmp_path, "not found", capsys)


def test_missing_config(src, tmp_path, capsys):
    os.remove(src / "config.json")
    _fails(src, tmp_path, "config.json not found", capsys)


def test_corrupt_config(src, tmp_path, capsys):
    (src / "config.json").write_text("{not json")
    _fails(src, tmp_path, "not valid JSON", capsys)


def test_no_weights(src, tmp_path, capsys):
    os.remove(src / "model.safetensors")
    _fails(src, tmp_path, "no weights", capsys)


def test_truncated_safetensors(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _fails(src, tmp_path, "truncated", capsys)


def test_wrong_header(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"garbage!"
    path.write_bytes(bytes(data))
    _fails(src, tmp_path, "not valid JSON", capsys)


def test_not_a_safetensors_file(src, tmp_path, capsys):
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 10 ** 12) + b"xx")
    _fails(src, tmp_path, "header length", capsys)


def test_index_lists_missing_shard(tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama", max_shard_size="60KB"), src)
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[-1]
    os.remove(src / shard)
    _fails(src, tmp_path, "missing", capsys)


def test_unknown_quantization_method(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes_9bit"}
    (src / "config.json").write_text(json.dumps(config))
    _fails(src, tmp_path, "unsupported quantization method 'bitsandbytes_9bit'", capsys)


def test_gptq_with_3_bits_is_refused(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    (src / "config.json").write_text(json.dumps(config))
    _fails(src, tmp_path, "bits=3", capsys)


def test_config_and_tensors_disagree(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96  # the tensors say 128
    (src / "config.json").write_text(json.dumps(config))
    _fails(src, tmp_path, "shape", capsys)


def test_non_float_linear_weight(src, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.int16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(src, tmp_path, "float weight", capsys)


def test_nan_in_a_linear_weight(src, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"][5, 7] = float("nan")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(src, tmp_path, r"layers\.1\.self_attn\.o_proj\.weight: weight contains NaN or Inf \(row 5\)", capsys)


@pytest.mark.parametrize("arch,key,index,value", [
    ("llama", "lm_head.weight", (3, 9), "NaN"),  # kept in float (output head)
    ("llama", "model.embed_tokens.weight", (0, 1), "-inf"),
    ("llama", "model.layers.0.input_layernorm.weight", (4,), "inf"),
    ("qwen2", "model.layers.1.self_attn.k_proj.bias", (2,), "NaN"),  # bias of a quantized layer
])
def test_non_finite_tensor_kept_in_float(tiny_model_dir, tmp_path, capsys, arch, key, index, value):
    """Refused like a non-finite weight of a quantized layer (the model would compute NaN),
    naming the tensor and the position; used to be converted silently."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "src"
    shutil.copytree(tiny_model_dir(arch), path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[key][index] = float(value)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _fails(path, tmp_path, rf"^{re.escape(key)} contains {value} at {re.escape(str(list(index)))}: ", capsys)


def test_unsupported_dtype_in_header(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n].replace(b'"F32"', b'"C64"', 1)
    path.write_bytes(data[:8] + header + data[8 + n:])
    _fails(src, tmp_path, "unsupported dtype", capsys)


def test_pickle_is_refused_then_loaded_with_weights_only(src, tmp_path, capsys):
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    os.remove(src / "model.safetensors")
    torch.save(state, src / "pytorch_model.bin")
    _fails(src, tmp_path, "allow-pickle", capsys)
    dst = tmp_path / "dst"
    assert cli_main(["convert", str(src), str(dst), "--allow-pickle", "--format", "int4", "--group-size", "32",
                     "--no-progress"]) == 0
    assert not any(p.endswith(".bin") for p in os.listdir(dst))
    with torch.no_grad():
        ids = torch.arange(10).unsqueeze(0)
        cosine = torch.nn.functional.cosine_similarity(
            from_pretrained(str(dst))(ids).logits.flatten(), load_float(str(src))(ids).logits.flatten(), dim=0)
    assert cosine > 0.98


def test_malicious_pickle_is_not_executed(src, tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    os.remove(src / "model.safetensors")
    with open(src / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Boom()}, f, protocol=2)
    _fails(src, tmp_path, "weights_only", allow_pickle=True)
    assert not (tmp_path / "pwned").exists()


def test_existing_destination_is_kept(src, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert(str(src), str(dst), progress=False)
    assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 1
    assert (dst / "keep.txt").read_text() == "mine"


def test_failed_overwrite_keeps_old_destination(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    (src / "model.safetensors").write_bytes(b"short")
    with pytest.raises(CheckpointError):
        convert(str(src), str(dst), overwrite=True, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    assert leftovers(str(tmp_path), "dst") == []


def test_interrupted_conversion_leaves_nothing(src, tmp_path, monkeypatch):
    from torch_marlin.hf.importers import float_source

    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    original = float_source.QuantizedWeight.from_float  # the dense layout's quantizer
    monkeypatch.setattr(float_source.QuantizedWeight, "from_float", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(tmp_path / "dst"), progress=False)
    assert not (tmp_path / "dst").exists() and leftovers(str(tmp_path), "dst") == []


def test_bad_arguments_name_the_argument(src, tmp_path):
    with pytest.raises(ValueError, match="weight_format"):
        convert(str(src), str(tmp_path / "d"), weight_format="int8")
    with pytest.raises(ValueError, match="group_size"):
        convert(str(src), str(tmp_path / "d"), group_size=48)
    with pytest.raises(ValueError, match="dtype"):
        convert(str(src), str(tmp_path / "d"), dtype="float8")
    with pytest.raises(ValueError, match="quantizer"):
        convert(str(src), str(tmp_path / "d"), quantizer="magic")
    with pytest.raises(ValueError, match="dst must not be src"):
        convert(str(src), str(src / "inside"))


def test_loading_errors(src, tmp_path):
    with pytest.raises(CheckpointError, match="not a torch_marlin checkpoint"):
        from_pretrained(str(src))
    with pytest.raises(CheckpointError, match="directory"):
        from_pretrained(str(tmp_path / "nope"))
    dst = tmp_path / "dst"
    convert(str(src), str(dst), "int4", 32, progress=False)
    with pytest.raises(ValueError, match="device"):
        from_pretrained(str(dst), device="cuda")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"]["group_size"] = 48
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="group_size"):
        from_pretrained(str(dst))
