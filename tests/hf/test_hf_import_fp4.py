"""MXFP4 (gpt-oss, compressed-tensors) and NVFP4 (modelopt, compressed-tensors) checkpoints,
from their layouts.

All store E2M1 codes two per byte, low nibble = even element, along K.
MXFP4: E8M0 exponents e (scale 2^(e-127)) per 32 values; gpt-oss `_blocks` [N, K/32, 16] +
`_scales`, compressed-tensors `mxfp4-pack-quantized` `weight_packed` [N, K/2] + `weight_scale`.
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


# Each flavor's tensor names (E2M1 bytes, E8M0 exponents) and config.json quantization_config.
_MXFP4_NAMES = {"gpt-oss": ("weight_blocks", "weight_scales"),
                "compressed-tensors": ("weight_packed", "weight_scale")}
_MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                  "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}


def _ct_mxfp4_config(weights=_MXFP4_WEIGHTS, activations=None):
    """llm-compressor's MXFP4A16 preset (activations=None) or MXFP4 (dynamic FP4 activations)."""
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


_MXFP4_CONFIGS = {"gpt-oss": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
                  "compressed-tensors": _ct_mxfp4_config()}
_MXFP4_ACTIVATIONS = dict(_MXFP4_WEIGHTS, dynamic=True)


def _mxfp4_layer(weight, flavor="gpt-oss"):
    """gpt-oss: blocks [N, K/32, 16]; compressed-tensors: the row's pairs packed flat, [N, K/2]."""
    n, k = weight.shape
    w = weight.double().reshape(n, k // 32, 32)
    exps = [[_exponent(float(b.abs().max())) for b in row] for row in w]
    scale = torch.tensor(exps, dtype=torch.float64).sub(127).exp2()
    codes = _nearest_codes(w / scale.unsqueeze(-1))
    if flavor == "gpt-oss":
        packed = [[_pack_pairs(codes[r][b]) for b in range(k // 32)] for r in range(n)]
    else:
        packed = [_pack_pairs(sum(codes[r], [])) for r in range(n)]
    values, scales = _MXFP4_NAMES[flavor]
    tensors = {values: torch.tensor(packed, dtype=torch.uint8), scales: torch.tensor(exps, dtype=torch.uint8)}
    return tensors, _mxfp4_dequantize(tensors, flavor)


def _mxfp4_dequantize(t, flavor="gpt-oss"):
    """Per element: E2M1(code) * 2^(e - 127); gpt-oss value k of row n is in block k // 32,
    byte (k % 32) // 2, compressed-tensors in byte k // 2; nibble k % 2 (low first) for both."""
    values, scales = _MXFP4_NAMES[flavor]
    packed, exps = t[values].tolist(), t[scales].tolist()
    n, k = len(exps), len(exps[0]) * 32
    w = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for kk in range(k):
            byte = packed[r][kk // 32][(kk % 32) // 2] if flavor == "gpt-oss" else packed[r][kk // 2]
            w[r, kk] = E2M1[_unpack_pair(byte, kk % 2)] * 2.0 ** (exps[r][kk // 32] - 127)
    return w


@pytest.mark.parametrize("flavor,config", [
    ("gpt-oss", _MXFP4_CONFIGS["gpt-oss"]),
    ("compressed-tensors", _ct_mxfp4_config()),
    ("compressed-tensors", _ct_mxfp4_config(activations=_MXFP4_ACTIVATIONS)),
], ids=["gpt-oss", "compressed-tensors-MXFP4A16", "compressed-tensors-MXFP4"])
def test_mxfp4_import_is_exact(tiny_model_dir, tmp_path, flavor, config):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "mx"), str(tmp_path / "q")
    refs = write_quantized_model(float_dir, src, lambda name, w: _mxfp4_layer(w, flavor), config)
    summary = convert(src, dst, progress=False)
    assert summary.source_method == config["quant_method"] and summary.notes == []
    assert summary.bits_per_weight == pytest.approx(4.5)
    modules = read_config(dst)["quantization_config"]["modules"]
    assert {(m["weight_format"], m["group_size"]) for m in modules.values()} == {("fp4", 32)}
    check_imported(dst, refs, float_dir)


def _with_exponents(flavor, **exponents):
    """make_layer for write_quantized_model: row 0's first groups get the given exponents."""
    def layer(name, w):
        tensors, _ = _mxfp4_layer(w, flavor)
        for group, e in exponents.items():
            tensors[_MXFP4_NAMES[flavor][1]][0, int(group[1:])] = e
        return tensors, _mxfp4_dequantize(tensors, flavor)

    return layer


@pytest.mark.parametrize("flavor", sorted(_MXFP4_NAMES))
def test_mxfp4_exponents_in_the_fp16_range_are_exact(tiny_model_dir, tmp_path, flavor):
    src, dst = str(tmp_path / "mx"), str(tmp_path / "q")
    # 2^15 is fp16's largest power of two, 2^-24 its smallest subnormal.
    refs = write_quantized_model(tiny_model_dir("llama"), src, _with_exponents(flavor, g0=127 + 15, g1=127 - 24),
                                 _MXFP4_CONFIGS[flavor])
    assert convert(src, dst, progress=False).notes == []
    model = from_pretrained(dst)
    for name, ref in refs.items():
        assert torch.equal(model.get_submodule(name).dequantize(torch.float64), ref)


@pytest.mark.parametrize("flavor", sorted(_MXFP4_NAMES))
def test_mxfp4_exponent_beyond_fp16_is_an_error(tiny_model_dir, tmp_path, flavor):
    src = str(tmp_path / "mx")
    write_quantized_model(tiny_model_dir("llama"), src, _with_exponents(flavor, g0=127 + 16),  # 2^16 > fp16 max
                          _MXFP4_CONFIGS[flavor])
    with pytest.raises(CheckpointError, match="fp16 range"):
        convert(src, str(tmp_path / "q"), progress=False)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("flavor", sorted(_MXFP4_NAMES))
def test_mxfp4_nan_exponent_is_an_error(tiny_model_dir, tmp_path, flavor):
    src = str(tmp_path / "mx")
    write_quantized_model(tiny_model_dir("llama"), src, _with_exponents(flavor, g1=255), _MXFP4_CONFIGS[flavor])
    with pytest.raises(CheckpointError, match="NaN"):
        convert(src, str(tmp_path / "q"), progress=False)


@pytest.mark.parametrize("flavor", sorted(_MXFP4_NAMES))
def test_mxfp4_underflow_is_reported(tiny_model_dir, tmp_path, flavor):
    src, dst = str(tmp_path / "mx"), str(tmp_path / "q")
    write_quantized_model(tiny_model_dir("llama"), src, _with_exponents(flavor, g0=127 - 40),  # below 2^-24
                          _MXFP4_CONFIGS[flavor])
    with pytest.warns(UserWarning, match="underflow"):
        summary = convert(src, dst, progress=False)
    assert summary.notes and "underflow" in str(summary)


@pytest.mark.parametrize("change", [{"group_size": 16}, {"type": "int"}, {"num_bits": 8}, {"symmetric": False}])
def test_compressed_tensors_mxfp4_other_args_are_refused(tiny_model_dir, tmp_path, change):
    src = str(tmp_path / "mx")
    write_quantized_model(tiny_model_dir("llama"), src, lambda name, w: _mxfp4_layer(w, "compressed-tensors"),
                          _ct_mxfp4_config(dict(_MXFP4_WEIGHTS, **change)))
    with pytest.raises(CheckpointError, match="not symmetric FP4 group 32"):
        convert(src, str(tmp_path / "q"), progress=False)


def test_compressed_tensors_mxfp4_scale_shape_is_checked(tiny_model_dir, tmp_path):
    src = str(tmp_path / "mx")

    def layer(name, w):
        tensors, ref = _mxfp4_layer(w, "compressed-tensors")
        tensors["weight_scale"] = tensors["weight_scale"][:, :1].contiguous()
        return tensors, ref

    write_quantized_model(tiny_model_dir("llama"), src, layer, _ct_mxfp4_config())
    with pytest.raises(CheckpointError, match="weight_scale.*shape"):
        convert(src, str(tmp_path / "q"), progress=False)


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
