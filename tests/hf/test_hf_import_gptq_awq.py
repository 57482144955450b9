"""GPTQ and AWQ checkpoints, built here from their published layouts, imported exactly.

The packers and the per-element dequantizers below follow the AutoGPTQ /
GPTQModel and AutoAWQ descriptions and share no code with torch_marlin.
"""

from __future__ import annotations

import pytest
import torch

from hf_helpers import check_imported, nibble, read_config, to_int32, write_quantized_model
from torch_marlin.convert import convert

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]


def _rtn(weight, group_of_row, groups, sym, zero_of=None):
    """Test-local round-to-nearest: integer codes [K, N], scales fp16 [G, N], integer zeros [G, N]."""
    w = weight.t().double()  # [K, N]
    k, n = w.shape
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    codes = torch.empty(k, n, dtype=torch.int64)
    for g in range(groups):
        rows = (group_of_row == g).nonzero().flatten()
        block = w[rows]
        if sym:
            s = (block.abs().amax(0) / 7).clamp_min(1e-4).half()
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-4).half()
            z = torch.round(-lo / s.double()).clamp(0, 15).long()
            if zero_of is not None:
                z = zero_of(g, z)
        scales[g], zeros[g] = s, z
        codes[rows] = torch.clamp(torch.round(block / s.double()) + z, 0, 15).long()
    return codes, scales, zeros


def _gptq_layer(weight, group_size, sym, act_order, v1=True, seed=0):
    n, k = weight.shape
    groups = k // group_size
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group_size  # GPTQ walks K in `perm` order
    else:
        g_idx = torch.arange(k) // group_size
    # Column 3 gets zero point 0 in every group: v1 stores -1 -> nibble 15, read back as 16.
    zero_of = (lambda g, z: torch.where(torch.arange(n) == 3, 0, z)) if not sym else None
    codes, scales, zeros = _rtn(weight, g_idx, groups, sym, zero_of)
    q, z = codes.tolist(), zeros.tolist()
    offset = 1 if v1 else 0
    qweight = [[to_int32(sum(q[8 * r + j][c] << (4 * j) for j in range(8))) for c in range(n)]
               for r in range(k // 8)]
    qzeros = [[to_int32(sum(((z[g][8 * c + j] - offset) & 0xF) << (4 * j) for j in range(8)))
               for c in range(n // 8)] for g in range(groups)]
    tensors = {"qweight": torch.tensor(qweight, dtype=torch.int32),
               "qzeros": torch.tensor(qzeros, dtype=torch.int32),
               "scales": scales, "g_idx": g_idx.to(torch.int32)}
    return tensors, _gptq_dequantize(tensors, v1)


def _gptq_dequantize(t, v1):
    """Per element, as the GPTQ reference kernel: w = s[g] * (q - (zero nibble + 1 for v1))."""
    qweight, qzeros = t["qweight"].tolist(), t["qzeros"].tolist()
    scales, g_idx = t["scales"].double().tolist(), t["g_idx"].tolist()
    k, n = len(qweight) * 8, len(qweight[0])
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = g_idx[kk]
        for nn in range(n):
            q = nibble(qweight[kk // 8][nn], kk % 8)
            zero = nibble(qzeros[g][nn // 8], nn % 8) + (1 if v1 else 0)
            w[nn, kk] = scales[g][nn] * (q - zero)
    return w


@pytest.mark.parametrize("sym,act_order,v1", [(True, False, True), (False, False, True), (False, True, True),
                                              (True, True, False), (False, False, False)])
def test_gptq_import_is_exact(tiny_model_dir, tmp_path, sym, act_order, v1):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "gptq"), str(tmp_path / "q")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act_order, "sym": sym,
          "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    refs = write_quantized_model(float_dir, src, lambda name, w: _gptq_layer(w, 32, sym, act_order, v1), qc)
    summary = convert(src, dst, progress=False)
    assert summary.source_method == "gptq" and summary.layers_converted == len(refs)
    assert summary.notes == []
    modules = read_config(dst)["quantization_config"]["modules"]
    expected_format = "int4" if sym else "uint4"
    assert {m["weight_format"] for m in modules.values()} == {expected_format}
    assert all(m.get("act_order", False) == act_order for m in modules.values())
    check_imported(dst, refs, float_dir)


def test_gptq_autogptq_quantize_config_file(tiny_model_dir, tmp_path):
    """AutoGPTQ keeps its settings in quantize_config.json rather than config.json."""
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "gptq"), str(tmp_path / "q")
    qc = {"bits": 4, "group_size": 64, "desc_act": False, "sym": False}
    refs = write_quantized_model(float_dir, src, lambda name, w: _gptq_layer(w, 64, False, False),
                                 extra_files={"quantize_config.json": qc})
    convert(src, dst, progress=False)
    assert not (tmp_path / "q" / "quantize_config.json").exists()
    check_imported(dst, refs, float_dir)


def _awq_layer(weight, group_size):
    n, k = weight.shape
    groups = k // group_size
    codes, scales, zeros = _rtn(weight, torch.arange(k) // group_size, groups, sym=False)
    q, z = codes.tolist(), zeros.tolist()

    def pack_row(values):
        return [to_int32(sum(values[8 * c + AWQ_ORDER[i]] << (4 * i) for i in range(8))) for c in range(n // 8)]

    tensors = {"qweight": torch.tensor([pack_row(q[kk]) for kk in range(k)], dtype=torch.int32),
               "qzeros": torch.tensor([pack_row(z[g]) for g in range(groups)], dtype=torch.int32),
               "scales": scales}
    return tensors, _awq_dequantize(tensors, group_size)


def _awq_dequantize(t, group_size):
    """Per element: column n lives in word n // 8 at the nibble i with AWQ_ORDER[i] == n % 8."""
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].double().tolist()
    k, n = len(qweight), len(qweight[0]) * 8
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = kk // group_size
        for nn in range(n):
            i = AWQ_ORDER.index(nn % 8)
            q = nibble(qweight[kk][nn // 8], i)
            zero = nibble(qzeros[g][nn // 8], i)
            w[nn, kk] = scales[g][nn] * (q - zero)
    return w


@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_import_is_exact(tiny_model_dir, tmp_path, group_size):
    float_dir = tiny_model_dir("llama")
    src, dst = str(tmp_path / "awq"), str(tmp_path / "q")
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    refs = write_quantized_model(float_dir, src, lambda name, w: _awq_layer(w, group_size), qc)
    summary = convert(src, dst, progress=False)
    assert summary.source_method == "awq" and summary.layers_converted == len(refs)
    assert read_config(dst)["quantization_config"]["group_size"] == group_size
    check_imported(dst, refs, float_dir)


def test_awq_gemv_version_is_refused(tiny_model_dir, tmp_path):
    from torch_marlin.hf.errors import CheckpointError

    float_dir = tiny_model_dir("llama")
    src = str(tmp_path / "awq")
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"}
    write_quantized_model(float_dir, src, lambda name, w: _awq_layer(w, 32), qc)
    with pytest.raises(CheckpointError, match="gemv"):
        convert(src, str(tmp_path / "q"), progress=False)
    assert not (tmp_path / "q").exists()
