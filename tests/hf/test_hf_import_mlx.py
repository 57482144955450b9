"""MLX checkpoints, made with MLX itself (mlx.core.quantize, mx.save_safetensors), imported.

The reference is MLX's own mx.dequantize: where the mapping is exact, our dequantized weight
equals it computed in float32 bit for bit (MLX's bf16/fp16 kernel rounds scale * q before adding
the bias: within one ulp of that). Layers of other bit widths are kept in float equal to MLX's
bf16 result bit for bit, or re-quantized.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from hf_helpers import build_tiny_model, marlin_modules, read_config
from test_hf_quiet_loading import expect_silence
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.errors import CheckpointError

from reference_libs import require

mx = require("mlx.core", "pip install 'mlx[cpu]'")

MX_DTYPES = {torch.bfloat16: mx.bfloat16, torch.float16: mx.float16, torch.float32: mx.float32}


def to_mx(t: torch.Tensor):
    return mx.array(t.float().numpy()).astype(MX_DTYPES[t.dtype])


def to_torch(a) -> torch.Tensor:
    """An MLX array as torch, bits kept (uint32 words as int32's bit pattern)."""
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32)).view(torch.uint32)
    if a.dtype == mx.uint8:
        return torch.from_numpy(np.array(a))
    dtype = {mx.bfloat16: torch.bfloat16, mx.float16: torch.float16, mx.float32: torch.float32}[a.dtype]
    return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)


def make_mlx_checkpoint(tmp_path, arch="llama-tied", dtype=torch.bfloat16, mode="affine", group_size=64, bits=4,
                        overrides=None, global_scale=False, seed=0):
    """An mlx-lm style checkpoint of a tiny model: every linear layer and the embedding quantized
    by mx.quantize (`overrides`: {module: {"bits": ..} or False}), saved by mx.save_safetensors,
    config.json with `quantization` and `quantization_config` as mlx-lm writes them. Returns
    (directory, {module: mx.dequantize of its weight in float32 params}, float model with them)."""
    model = build_tiny_model(arch, seed=seed).to(dtype)
    overrides = overrides or {}
    arrays, refs, float32_refs = {}, {}, {}
    quantized = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    for name, tensor in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module == "lm_head" and model.config.tie_word_embeddings:
            continue  # mlx-lm saves a tied head only as the embedding
        if not name.endswith(".weight") or module not in quantized or overrides.get(module) is False:
            arrays[name] = to_mx(tensor)
            continue
        params = {"mode": mode, "group_size": group_size, "bits": bits, **(overrides.get(module) or {})}
        kwargs = {}
        if params["mode"] == "nvfp4" and global_scale:
            kwargs["global_scale"] = mx.array(float(tensor.float().abs().max()), dtype=mx.float32)
        out = mx.quantize(to_mx(tensor), params["group_size"], params["bits"], mode=params["mode"], **kwargs)
        arrays[name], arrays[f"{module}.scales"] = out[0], out[1]
        biases = out[2] if params["mode"] == "affine" else None
        if biases is not None:
            arrays[f"{module}.biases"] = biases
        if kwargs:
            arrays[f"{module}.global_scale"] = kwargs["global_scale"]
        dq = dict(group_size=params["group_size"], bits=params["bits"], mode=params["mode"], **kwargs)
        refs[module] = to_torch(mx.dequantize(out[0], out[1], biases, **dq))
        wide = (out[1].astype(mx.float32) if params["mode"] == "affine" else out[1])
        wide_biases = None if biases is None else biases.astype(mx.float32)
        float32_refs[module] = to_torch(mx.dequantize(out[0], wide, wide_biases, dtype=mx.float32, **dq))
    path = str(tmp_path / f"mlx-{arch}-{mode}-{bits}-{group_size}")
    os.makedirs(path)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), arrays, metadata={"format": "mlx"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    config = read_config(path)
    quantization = {"group_size": group_size, "bits": bits, "mode": mode, **overrides}
    config["quantization"] = config["quantization_config"] = quantization
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    # The reference model: float32, each quantized weight as MLX dequantizes it, in float32 where
    # torch_marlin holds its parameters exactly and in the model dtype otherwise (kept in float).
    model = model.float().eval()
    with torch.no_grad():
        for module, weight in refs.items():
            exact = module != "model.embed_tokens" and (bits, mode) != (8, "mxfp8") \
                and (overrides.get(module) or {}).get("bits", bits) == 4
            model.get_submodule(module).weight.copy_(float32_refs[module] if exact else weight)
    return path, float32_refs, model


def check_logits(dst, reference, tol=1e-4, generate=True):
    """float32 activations on both sides: the weights are what is compared."""
    model = from_pretrained(dst, dtype=torch.float32)
    ids = torch.arange(24).reshape(2, 12) % reference.config.vocab_size
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
    assert (got - want).abs().max() <= tol * want.abs().max(), float((got - want).abs().max())
    if generate:
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], **kwargs), reference.generate(ids[:1], **kwargs))
    return model


@pytest.mark.parametrize("arch,dtype,group_size", [("llama-tied", torch.bfloat16, 64), ("qwen2", torch.float16, 32),
                                                   ("llama", torch.bfloat16, 32)])
def test_affine_4bit_imports_exactly(tmp_path, arch, dtype, group_size):
    src, refs, reference = make_mlx_checkpoint(tmp_path, arch, dtype, "affine", group_size)
    dst = str(tmp_path / "out")
    summary = convert(src, dst, progress=False)
    assert not summary.notes
    check_logits(dst, reference)
    model = from_pretrained(dst)
    layers = marlin_modules(model)
    linears = {m for m in refs if m != "model.embed_tokens"}
    assert set(layers) == linears
    for name, module in layers.items():
        assert module.weight_format == "affine" and module.group_size == group_size
        assert torch.equal(module.dequantize(torch.float32), refs[name]), name
    # The quantized embedding is kept in float, equal to mx.dequantize in the model dtype.
    from safetensors import safe_open

    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == dtype
    assert torch.equal(embedding.float(), reference.model.embed_tokens.weight)
    assert "exact" in str(summary) and "kept float" in str(summary)
    assert "quantization" not in read_config(dst)


@pytest.mark.parametrize("mode,group_size,global_scale", [("mxfp4", 32, False), ("nvfp4", 16, False),
                                                          ("nvfp4", 16, True)])
def test_fp4_modes_import_as_fp4(tmp_path, mode, group_size, global_scale):
    src, refs, reference = make_mlx_checkpoint(tmp_path, "llama", torch.bfloat16, mode, group_size,
                                               global_scale=global_scale)
    dst = str(tmp_path / "out")
    summary = convert(src, dst, progress=False)
    model = from_pretrained(dst)
    for name, module in marlin_modules(model).items():
        assert module.weight_format == "fp4" and module.group_size == group_size
        got, want = module.dequantize(torch.float32), refs[name]
        if global_scale:  # e4m3 * global / 2688 rounded once to fp16: relative 2^-11 of each weight
            assert ((got - want).abs() <= want.abs() * 2.0 ** -11).all(), name
        else:
            assert torch.equal(got, want), name
    check_logits(dst, reference, tol=4e-3 if global_scale else 1e-4, generate=not global_scale)
    assert ("within bound" in str(summary)) == global_scale


def test_other_bit_widths_kept_float_or_requantized(tmp_path):
    overrides = {"model.layers.0.mlp.down_proj": {"bits": 8}, "model.layers.1.self_attn.v_proj": {"bits": 3},
                 "model.layers.1.mlp.gate_proj": {"mode": "mxfp8", "bits": 8, "group_size": 32},
                 "model.layers.0.self_attn.k_proj": {"bits": 6, "group_size": 32},
                 "model.layers.1.mlp.up_proj": False}
    src, refs, reference = make_mlx_checkpoint(tmp_path, "llama-tied", torch.bfloat16, overrides=overrides)
    dst = str(tmp_path / "float")
    summary = convert(src, dst, progress=False)
    check_logits(dst, reference)
    model = from_pretrained(dst)
    assert "model.layers.0.mlp.down_proj" not in marlin_modules(model)
    assert "model.layers.1.mlp.up_proj" not in marlin_modules(model)
    # Kept float: MLX's own bf16 dequantization, bit for bit.
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.gate_proj",
                 "model.layers.0.self_attn.k_proj"):
        assert torch.equal(model.get_submodule(name).weight.float(), reference.get_submodule(name).weight)
    text = str(summary)
    assert "kept float" in text and "model.layers.0.mlp.down_proj" in text
    dst2 = str(tmp_path / "requantized")
    summary = convert(src, dst2, weight_format="int4", group_size=32, requantize=True, progress=False)
    layers = marlin_modules(from_pretrained(dst2))
    assert layers["model.layers.0.mlp.down_proj"].weight_format == "int4"
    assert layers["model.layers.0.mlp.down_proj"].group_size == 32
    assert "model.layers.1.mlp.up_proj" not in layers  # float in the source: stays float
    assert "re-quantized" in str(summary)


@pytest.mark.parametrize("loader", ["AutoModelForCausalLM", "from_pretrained"])
def test_imported_mlx_checkpoint_loads_silently(tmp_path, capfd, loader):
    src, _, _ = make_mlx_checkpoint(tmp_path)
    dst = str(tmp_path / "out")
    convert(src, dst, progress=False)
    load = transformers.AutoModelForCausalLM.from_pretrained if loader != "from_pretrained" else from_pretrained
    with expect_silence(capfd):
        load(dst)


def test_bf16_scales_beyond_fp16_fall_back_to_float(tmp_path):
    src, refs, _ = make_mlx_checkpoint(tmp_path, "llama", torch.bfloat16)
    from safetensors.torch import load_file, save_file

    path = os.path.join(src, "model.safetensors")
    state = load_file(path)
    name = "model.layers.0.self_attn.o_proj"
    state[f"{name}.scales"] = state[f"{name}.scales"] * 2.0 ** 30  # beyond fp16's range (bf16's is fp32's)
    save_file(state, path, metadata={"format": "mlx"})
    with pytest.warns(UserWarning, match="kept in float.*o_proj"):
        summary = convert(src, str(tmp_path / "out"), progress=False)
    assert name not in marlin_modules(from_pretrained(str(tmp_path / "out")))
    assert any("o_proj" in note for note in summary.notes)


def test_inconsistent_mlx_tensors_are_an_error_naming_the_tensor(tmp_path):
    src, _, _ = make_mlx_checkpoint(tmp_path, "llama")
    config = read_config(src)
    config["quantization"]["bits"] = 8  # the tensors are 4-bit
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"lm_head: weight \[96, 8\] and scales \[96, 1\] do not fit 8-bit"):
        convert(src, str(tmp_path / "out"), progress=False)
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".out")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mlx_lm_convert_output_imports(tmp_path, dtype):
    """A checkpoint written by mlx-lm's own convert (quantize=True): bf16 scales import exactly,
    float32 ones within 2^-11 (15 |scale| + |bias|) per weight."""
    convert_mlx = require("mlx_lm", "pip install mlx-lm").convert
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = str(tmp_path / "hf")
    build_tiny_model("llama-tied").save_pretrained(hf)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 96)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(hf)
    src = str(tmp_path / "mlx")
    convert_mlx(hf, mlx_path=src, quantize=True, q_group_size=32, q_bits=4, dtype=dtype)
    dst = str(tmp_path / "out")
    summary = convert(src, dst, progress=False)
    layers = marlin_modules(from_pretrained(dst))
    assert len(layers) == 14 and ("within bound" in str(summary)) == (dtype == "float32")
    arrays = mx.load(os.path.join(src, "model.safetensors"))  # MLX's own reader
    for name, layer in layers.items():
        wq, scales, biases = (arrays[f"{name}.{t}"] for t in ("weight", "scales", "biases"))
        want = to_torch(mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32,
                                      bits=4, dtype=mx.float32))
        got = layer.dequantize(torch.float32)
        if dtype == "bfloat16":
            assert torch.equal(got, want), name
        else:
            s, b = (to_torch(a).repeat_interleave(32, 1).abs() for a in (scales, biases))
            assert ((got - want).abs() <= 2.0 ** -11 * (15 * s + b) + 2.0 ** -24).all(), name
