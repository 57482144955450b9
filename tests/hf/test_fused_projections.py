"""Fused projections (torch_marlin.fused_projections): q|k|v and gate|up quantized as one wider weight,
by quantize_model(fuse_projections=True) and from_pretrained(fuse_projections=True), against the
separate layers: the same codes and scales, bit-identical outputs on the CPU."""

import copy

import pytest
import torch

import torch_marlin
from torch_marlin.fused_projections import FusedProjection, ProjectionSlice
from torch_marlin.hf.converter import convert

from hf_helpers import VOCAB, build_tiny_model


def quantized_pair(arch, fmt="fp4", group_size=32):
    model = build_tiny_model(arch)
    separate, fused = copy.deepcopy(model), copy.deepcopy(model)
    torch_marlin.quantize_model(separate, fmt, group_size, exclude="lm_head")
    report = torch_marlin.quantize_model(fused, fmt, group_size, exclude="lm_head", fuse_projections=True)
    return separate, fused, report


@pytest.mark.parametrize("arch, fmt", [("llama", "fp4"), ("qwen2", "uint4")])  # qwen2: q/k/v with bias
def test_fused_model_is_bit_identical_to_the_separate_layers(arch, fmt):
    separate, fused, report = quantized_pair(arch, fmt)
    assert report.fused == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")]
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedProjection) and isinstance(attn.k_proj, ProjectionSlice)
    # the same codes and scales, side by side
    ref = separate.model.layers[0].self_attn
    for name in ("packed", "scales"):
        assert torch.equal(getattr(attn.qkv_proj.linear, name),
                           torch.cat([getattr(getattr(ref, m), name) for m in ("q_proj", "k_proj", "v_proj")], 1))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, separate(ids).logits)  # prefill
        assert torch.equal(fused(ids[:1, :1]).logits, separate(ids[:1, :1]).logits)  # decode, M = 1
    with torch.inference_mode():  # inference tensors have no version counter
        assert torch.equal(fused(ids).logits, separate(ids).logits)
    # the fused weight is stored once: no tensors under the members
    keys = fused.state_dict().keys()
    assert not any(".q_proj." in k or ".up_proj." in k for k in keys)
    assert "model.layers.0.mlp.gate_up_proj.linear.packed" in keys


def test_member_outputs_follow_their_input():
    """A member called alone, twice, on another input, or after an in-place change gives its own
    layer's result: the fused output is reused only for the same, unchanged input."""
    separate, fused, _ = quantized_pair("llama")
    mlp, ref = fused.model.layers[0].mlp, separate.model.layers[0].mlp
    gen = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(mlp.gate_proj(x1), ref.gate_proj(x1))
        assert torch.equal(mlp.up_proj(x2), ref.up_proj(x2))
        assert torch.equal(mlp.up_proj(x2), ref.up_proj(x2))
        assert torch.equal(mlp.gate_proj(x1), ref.gate_proj(x1))
        x1.mul_(2)
        assert torch.equal(mlp.up_proj(x1), ref.up_proj(x1))
        assert torch.equal(mlp.gate_up_proj(x1), torch.cat([ref.gate_proj(x1), ref.up_proj(x1)], -1))


def test_state_dict_round_trip_and_fusing_a_loaded_model():
    separate, fused, _ = quantized_pair("llama")
    # a fused model loads a fused state dict
    other = quantized_pair("llama")[1]
    for p in other.model.layers[0].mlp.gate_up_proj.linear.buffers():
        p.zero_()
    other.load_state_dict(fused.state_dict())
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, separate(ids).logits)
        # fusing after loading a per-layer model: the same model
        loaded = quantized_pair("llama")[0]
        loaded.load_state_dict(separate.state_dict())
        assert len(torch_marlin.fuse_projections(loaded)) == 4
        assert torch.equal(loaded(ids).logits, separate(ids).logits)
        assert torch_marlin.fuse_projections(loaded) == []  # already fused


def test_from_pretrained_fuses_a_converted_checkpoint(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "q")
    convert(tiny_model_dir("llama"), dst, "int4", 32)
    plain = torch_marlin.from_pretrained(dst)
    fused = torch_marlin.from_pretrained(dst, fuse_projections=True)
    assert isinstance(fused.model.layers[1].mlp.gate_up_proj, FusedProjection)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, plain(ids).logits)
    with pytest.raises(TypeError, match="fuse_projections must be a bool"):
        torch_marlin.from_pretrained(dst, fuse_projections="yes")


def test_groups_that_cannot_fuse_stay_separate():
    model = build_tiny_model("llama")
    torch_marlin.quantize_model(model, "fp4", 32, exclude=["k_proj", "lm_head"], fuse_projections=True)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "qkv_proj") and type(attn.q_proj) is torch_marlin.MarlinLinear  # k_proj in float
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, FusedProjection)
    with pytest.raises(TypeError, match="fuse_projections must be a bool"):
        torch_marlin.quantize_model(build_tiny_model("llama"), fuse_projections=1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        torch_marlin.fuse_projections("model")


@pytest.mark.parametrize("m", [1, 12])  # the GEMV and the fused GEMM
def test_fused_weight_on_the_metal_kernels(m):
    """On Metal the fused projection is a wider dense weight: the plan's kernels on the emulator give the
    separate layers' outputs side by side (within the kernels' fp32 tolerance)."""
    from torch_marlin.testing import run_metal

    separate, fused, _ = quantized_pair("qwen2", "int4")
    qkv = fused.model.layers[0].self_attn.qkv_proj.linear
    ref_attn = separate.model.layers[0].self_attn
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(4))
    w = qkv.quantized_weight()
    out = run_metal("gemm", x, w.packed, w.scales, w.zeros, qkv.bias, w.weight_format, w.group_size)
    with torch.no_grad():
        ref = torch.cat([getattr(ref_attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")], -1)
    assert ((out - ref).abs().max() / ref.abs().max()) <= 2e-5


def test_converter_option_fuses_on_load(tiny_model_dir, tmp_path):
    """`torch-marlin convert --fuse-projections` marks the checkpoint (tensors stay per layer); loading it,
    through torch_marlin.from_pretrained or transformers' own from_pretrained, fuses."""
    import json

    import transformers

    from torch_marlin.cli import main

    src = tiny_model_dir("qwen2")
    plain, marked = str(tmp_path / "plain"), str(tmp_path / "marked")
    assert main(["convert", src, plain, "--format", "uint4", "--group-size", "32", "--no-progress"]) == 0
    assert main(["convert", src, marked, "--format", "uint4", "--group-size", "32", "--no-progress",
                 "--fuse-projections"]) == 0
    with open(f"{marked}/config.json") as f:
        assert json.load(f)["quantization_config"]["fuse_projections"] is True
    reference = torch_marlin.from_pretrained(plain)
    assert isinstance(reference.model.layers[0].self_attn.q_proj, torch_marlin.MarlinLinear)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    for model in (torch_marlin.from_pretrained(marked),
                  transformers.AutoModelForCausalLM.from_pretrained(marked).eval()):
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedProjection)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
    assert main(["convert", src, str(tmp_path / "x"), "--fuse-projections", "--method", "gptq",
                 "--calibration", "c.txt"]) == 2


def test_a_fused_model_is_not_saved_as_a_broken_checkpoint(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "q")
    convert(tiny_model_dir("llama"), dst, "fp4", 32)
    for fuse in (True, False):
        model = torch_marlin.from_pretrained(dst, fuse_projections=fuse)
        if fuse:
            with pytest.raises(ValueError, match="not serializable"), pytest.warns(UserWarning, match="fused"):
                model.save_pretrained(str(tmp_path / "fused"))
        else:
            model.save_pretrained(str(tmp_path / "plain"))
