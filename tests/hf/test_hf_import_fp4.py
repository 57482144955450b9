"""MXFP4 (gpt-oss) and NVFP4 (modelopt, compressed-tensors) checkpoints, from their layouts.

All store E2M1 codes two per byte, low nibble = even element, along K.
MXFP4: `_blocks` [N, K/32, 16] + E8M0 `_scales` (2^(e-127)) per 32.
NVFP4: fp8 e4m3 scale per 16 times a per-tensor fp32 scale (modelopt
`weight_scale_2`), or divided by it (compressed-tensors `weight_global_scale`).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_helpers import E2M1, check_imported, read_config, write_quantized_model
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.hf.errors import CheckpointError

_MAGNITUDES = torch.tensor(E2M1[:8], dtype=torch.float64)


def _nearest_codes(x):
    """Nearest E2M1 code of each value (test-local rounding, ties to the lower magnitude)."""
    mag = (x.abs().unsqueeze(-1) - _MAGNITUDES).abs().argmin(-1)
    return (mag + 8 * ((x < 0) & (mag > 0)).long()).tolist()


def _pack_pairs(codes_row):
    return [codes_row[2 * i] | (codes_row[2 * i + 1] << 4) for i in range(len(codes_row) // 2)]


def _unpack_pair(byte, which):
    return (byte >> 4) if which else (byte & 0xF)


# --- MXFP4 -------------------------------------------------------------------------------

def _exponent(block_absmax):
    """E8M0 exponent whose power of two lets the block's largest value fit in E2M1 (max 6)."""
    return min(254, max(0, math.ceil(math.log2(max(block_absmax, 1e-30) / 6)) + 127))


def _mxfp4_layer(weight):
    n, k = weight.shape
    w = weight.double().reshape(n, k // 32, 32)
    exps = [[_exponent(float(b.abs().max())) for b in row] for row in w]
    scale = torch.tensor(exps, dtype=torch.float64).sub(127).exp2()
    codes = _nearest_codes(w / scale.unsqueeze(-1))
    blocks = [[_pack_pairs(codes[r][b]) for b in range(k // 32)] for r in range(n)]
    tensors = {"weight_blocks": torch.tensor(blocks, dtype=torch.uint8),
               "weight_scales": torch.tensor(exps, dtype=torch.uint8)}
    return tensors, _mxfp4_dequantize(tensors)


def _mxfp4_dequantize(t):
    """Per element: value k of row n is in block k // 32, byte (k % 32) // 2, nibble k % 2."""
    blocks, exps = t["weight_blocks"].tolist(), t["weight_scales"].tolist()
    n, nb = len(blocks), len(blocks[0])
    w = torch.empty(n, nb * 32, dtype=torch.float64)
    for r in range(n):
        for k in range(nb * 32):
            code = _unpack_pair(blocks[r][k // 32][(k % 32) // 2], k % 2)
            w[r, k] = E2M1[code] * 2.0 ** (exps[r][k // 32] - 127)
    return w


def test_mxfp4_import_is_exact(tiny_model_dir, tmp_path):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "mx"), str(tmp_path / "q")
    refs = write_quantized_model(float_dir, src, lambda name, w: _mxfp4_layer(w),
                                 {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    summary = convert(src, dst, progress=False)
    assert summary.source_method == "mxfp4" and summary.notes == []
    assert summary.bits_per_weight == pytest.approx(4.5)
    modules = read_config(dst)["quantization_config"]["modules"]
    assert {(m["weight_format"], m["group_size"]) for m in modules.values()} == {("fp4", 32)}
    check_imported(dst, refs, float_dir)


def test_mxfp4_exponent_beyond_fp16_is_an_error(tiny_model_dir, tmp_path):
    src = str(tmp_path / "mx")

    def layer(name, w):
        tensors, ref = _mxfp4_layer(w)
        tensors["weight_scales"][0, 0] = 127 + 16  # 2^16 > fp16 max
        return tensors, ref

    write_quantized_model(tiny_model_dir("llama"), src, layer, {"quant_method": "mxfp4"})
    with pytest.raises(CheckpointError, match="fp16 range"):
        convert(src, str(tmp_path / "q"), progress=False)
    assert not (tmp_path / "q").exists()


def test_mxfp4_underflow_is_reported(tiny_model_dir, tmp_path):
    src, dst = str(tmp_path / "mx"), str(tmp_path / "q")

    def layer(name, w):
        tensors, _ = _mxfp4_layer(w)
        tensors["weight_scales"][0, 0] = 127 - 40  # 2^-40: below fp16's smallest subnormal
        return tensors, _mxfp4_dequantize(tensors)

    write_quantized_model(tiny_model_dir("llama"), src, layer, {"quant_method": "mxfp4"})
    with pytest.warns(UserWarning, match="underflow"):
        summary = convert(src, dst, progress=False)
    assert summary.notes and "underflow" in str(summary)


def test_mxfp4_expert_stacks_are_refused(tiny_model_dir, tmp_path):
    src = str(tmp_path / "mx")

    def layer(name, w):
        tensors, ref = _mxfp4_layer(w)
        return {"weight_blocks": tensors["weight_blocks"].unsqueeze(0),
                "weight_scales": tensors["weight_scales"].unsqueeze(0)}, ref

    write_quantized_model(tiny_model_dir("llama"), src, layer, {"quant_method": "mxfp4"})
    with pytest.raises(CheckpointError, match="expert"):
        convert(src, str(tmp_path / "q"), progress=False)


# --- NVFP4 -------------------------------------------------------------------------------

def _nvfp4_layer(weight, global_scale, reciprocal):
    """`global_scale` is the value stored on disk (modelopt multiplies, compressed-tensors divides)."""
    n, k = weight.shape
    w = weight.double().reshape(n, k // 16, 16)
    per_tensor = 1 / global_scale if reciprocal else global_scale
    block = (w.abs().amax(-1) / 6 / per_tensor).clamp(2 ** -6, 448).to(torch.float8_e4m3fn)
    scale = block.double() * per_tensor
    codes = _nearest_codes(w / scale.unsqueeze(-1)).copy()
    packed = [_pack_pairs(sum(codes[r], [])) for r in range(n)]
    name = "weight_packed" if reciprocal else "weight"
    tensors = {name: torch.tensor(packed, dtype=torch.uint8), "weight_scale": block,
               ("weight_global_scale" if reciprocal else "weight_scale_2"):
                   torch.tensor([global_scale] if reciprocal else global_scale, dtype=torch.float32),
               ("input_global_scale" if reciprocal else "input_scale"): torch.tensor(1.0)}
    return tensors, _nvfp4_dequantize(tensors, reciprocal)


def _nvfp4_dequantize(t, reciprocal):
    """Per element: E2M1(code) * float(fp8 block scale) (* or /) the fp32 tensor scale."""
    packed = t["weight_packed" if reciprocal else "weight"].tolist()
    blocks = t["weight_scale"].double().tolist()
    g = float(t["weight_global_scale" if reciprocal else "weight_scale_2"].reshape(()))
    n, k = len(packed), len(packed[0]) * 2
    w = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for kk in range(k):
            code = _unpack_pair(packed[r][kk // 2], kk % 2)
            scale = blocks[r][kk // 16] / g if reciprocal else blocks[r][kk // 16] * g
            w[r, kk] = E2M1[code] * scale
    return w


_MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                    "exclude_modules": ["lm_head"]}
_CT_NVFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}}},
    "ignore": ["lm_head"]}


@pytest.mark.parametrize("flavor", ["modelopt", "modelopt-file", "compressed-tensors"])
def test_nvfp4_import_is_exact(tiny_model_dir, tmp_path, flavor):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "nv"), str(tmp_path / "q")
    reciprocal = flavor == "compressed-tensors"
    global_scale = 8.0 if reciprocal else 0.125  # a power of two: every folded scale is exact
    if flavor == "modelopt-file":  # modelopt's own hf_quant_config.json instead of config.json
        extra = {"hf_quant_config.json": {"producer": {"name": "modelopt"}, "quantization": _MODELOPT_CONFIG}}
        qc = None
    else:
        extra, qc = None, (_CT_NVFP4_CONFIG if reciprocal else _MODELOPT_CONFIG)
    refs = write_quantized_model(float_dir, src, lambda name, w: _nvfp4_layer(w, global_scale, reciprocal), qc,
                                 extra_files=extra)
    summary = convert(src, dst, progress=False)
    assert summary.notes == []
    modules = read_config(dst)["quantization_config"]["modules"]
    assert {(m["weight_format"], m["group_size"]) for m in modules.values()} == {("fp4", 16)}
    check_imported(dst, refs, float_dir)


@pytest.mark.parametrize("reciprocal", [False, True])
def test_nvfp4_inexact_tensor_scale_is_reported_and_bounded(tiny_model_dir, tmp_path, reciprocal):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "nv"), str(tmp_path / "q")
    refs = write_quantized_model(float_dir, src, lambda name, w: _nvfp4_layer(w, 0.3, reciprocal),
                                 _CT_NVFP4_CONFIG if reciprocal else _MODELOPT_CONFIG)
    with pytest.warns(UserWarning, match="not exactly representable in fp16"):
        summary = convert(src, dst, progress=False)
    assert len(summary.notes) == len(refs)
    model = from_pretrained(dst)
    for name, ref in refs.items():
        got = model.get_submodule(name).dequantize(torch.float64)
        assert torch.allclose(got, ref, rtol=2 ** -11, atol=0)


def test_cli_prints_the_inexact_scale_warnings(tiny_model_dir, tmp_path, capsys):
    from torch_marlin.cli import main

    src, dst = str(tmp_path / "nv"), str(tmp_path / "q")
    write_quantized_model(tiny_model_dir("llama"), src, lambda name, w: _nvfp4_layer(w, 0.3, False), _MODELOPT_CONFIG)
    assert main(["convert", src, dst, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "14 warnings" in out and "not exactly representable in fp16" in out
