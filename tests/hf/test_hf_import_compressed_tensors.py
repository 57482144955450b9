"""compressed-tensors `pack-quantized` int4 checkpoints, built from the published layout.

weight_packed int32 [N, K/8]: nibble i of word [n, c] is k = 8c+i, storing q + 8
for the signed code q; asymmetric zero points are packed the same way along N
([N/8, G]); w = (q - zp) * scale.
"""

from __future__ import annotations

import pytest
import torch

from hf_helpers import check_imported, nibble, read_config, to_int32, write_quantized_model
from torch_marlin.convert import convert
from torch_marlin.hf.errors import CheckpointError


def _ct_layer(weight, group_size, sym, scale_dtype=torch.float16, shape_dtype=torch.int64):
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    groups = k // gs
    w = weight.double().reshape(n, groups, gs)
    if sym:
        s = (w.abs().amax(-1) / 7.5).clamp_min(1e-4)
        zp = torch.zeros(n, groups, dtype=torch.int64)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-4)
        zp = (torch.round(-lo / s) - 8).clamp(-8, 7).long()
    s = s.to(scale_dtype)
    q = torch.clamp(torch.round(w / s.double().unsqueeze(-1)) + zp.unsqueeze(-1), -8, 7).long().reshape(n, k)
    qs, zs = q.tolist(), zp.tolist()
    packed = [[to_int32(sum((qs[r][8 * c + i] + 8) << (4 * i) for i in range(8))) for c in range(k // 8)]
              for r in range(n)]
    tensors = {"weight_packed": torch.tensor(packed, dtype=torch.int32), "weight_scale": s,
               "weight_shape": torch.tensor([n, k], dtype=shape_dtype)}
    if not sym:
        tensors["weight_zero_point"] = torch.tensor(
            [[to_int32(sum((zs[8 * r + i][g] + 8) << (4 * i) for i in range(8))) for g in range(groups)]
             for r in range(n // 8)], dtype=torch.int32)
    return tensors, _ct_dequantize(tensors, gs, sym)


def _ct_dequantize(t, group_size, sym):
    """Per element: w[n, k] = scale[n, g] * ((nibble - 8) - zp[n, g])."""
    packed, scales = t["weight_packed"].tolist(), t["weight_scale"].double().tolist()
    n, k = (int(v) for v in t["weight_shape"].tolist())
    zp_words = None if sym else t["weight_zero_point"].tolist()
    w = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for kk in range(k):
            g = kk // group_size
            q = nibble(packed[r][kk // 8], kk % 8) - 8
            zp = 0 if sym else nibble(zp_words[r // 8][g], r % 8) - 8
            w[r, kk] = scales[r][g] * (q - zp)
    return w


def _config(sym, strategy, group_size):
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


@pytest.mark.parametrize("sym,strategy,group_size,scale_dtype,shape_dtype", [
    (True, "group", 32, torch.float16, torch.int64),
    (False, "group", 64, torch.bfloat16, torch.int32),
    (True, "channel", -1, torch.bfloat16, torch.int32),
    (False, "channel", -1, torch.float16, torch.int64),
])
def test_pack_quantized_import_is_exact(tiny_model_dir, tmp_path, sym, strategy, group_size, scale_dtype,
                                        shape_dtype):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "ct"), str(tmp_path / "q")
    refs = write_quantized_model(float_dir, src, lambda name, w: _ct_layer(w, group_size, sym, scale_dtype,
                                                                           shape_dtype),
                                 _config(sym, strategy, group_size))
    summary = convert(src, dst, progress=False)
    assert summary.source_method == "compressed-tensors" and summary.layers_converted == len(refs)
    assert summary.notes == []  # bf16 scales of this size are exact in fp16
    formats = {m["weight_format"] for m in read_config(dst)["quantization_config"]["modules"].values()}
    assert formats == {"int4" if sym else "uint4"}
    check_imported(dst, refs, float_dir)


def test_scales_not_representable_in_fp16_are_reported(tiny_model_dir, tmp_path):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "ct"), str(tmp_path / "q")

    def layer(name, w):
        tensors, _ = _ct_layer(w, 32, True, torch.float32)
        tensors["weight_scale"] = tensors["weight_scale"] * (1 + 1e-5)  # needs more than fp16's 11 bits
        return tensors, _ct_dequantize(tensors, 32, True)

    refs = write_quantized_model(float_dir, src, layer, _config(True, "group", 32))
    with pytest.warns(UserWarning, match="not exactly representable in fp16"):
        summary = convert(src, dst, progress=False)
    assert len(summary.notes) == len(refs)
    assert "not exactly representable" in str(summary)
    from torch_marlin.hf import from_pretrained

    model = from_pretrained(dst)
    for name, ref in refs.items():
        got = model.get_submodule(name).dequantize(torch.float64)
        assert torch.allclose(got, ref, rtol=2 ** -11, atol=0)  # one fp16 rounding of the scale


def test_scale_outside_fp16_range_is_an_error(tiny_model_dir, tmp_path):
    float_dir = tiny_model_dir("llama")
    src = str(tmp_path / "ct")

    def layer(name, w):
        tensors, ref = _ct_layer(w, 32, True, torch.float32)
        tensors["weight_scale"][0, 0] = 1e6
        return tensors, ref

    write_quantized_model(float_dir, src, layer, _config(True, "group", 32))
    with pytest.raises(CheckpointError, match="fp16 range"):
        convert(src, str(tmp_path / "q"), progress=False)
    assert not (tmp_path / "q").exists()


def test_weight_shape_mismatch_is_an_error(tiny_model_dir, tmp_path):
    float_dir = tiny_model_dir("llama")
    src = str(tmp_path / "ct")

    def layer(name, w):
        tensors, ref = _ct_layer(w, 32, True)
        tensors["weight_shape"] = torch.tensor([w.shape[0], w.shape[1] + 32])
        return tensors, ref

    write_quantized_model(float_dir, src, layer, _config(True, "group", 32))
    with pytest.raises(CheckpointError, match="shape"):
        convert(src, str(tmp_path / "q"), progress=False)
    assert not (tmp_path / "q").exists()
