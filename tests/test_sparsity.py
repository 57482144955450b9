"""2:4 pruning (magnitude) and MarlinLinear / quantize_model with sparsity="2:4"."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import torch_marlin as tm
from torch_marlin import formats
from torch_marlin.layouts import QuantizedWeight, SparseQuantizedWeight
from torch_marlin.layouts.sparse24 import quantize_sparse, quantize_sparse_reference
from torch_marlin.sparsity import is_2to4, mask_2to4

from test_ops import assert_close_to_reference
from test_quantize_native import BUILDS, hard_weights, kernel_build


def test_mask_keeps_the_two_largest_with_ties_to_the_lower_index():
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.5, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 1.0, -1.0, 2.0, 2.0, 7.0]])
    assert mask_2to4(scores).int().tolist() == [[0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0, 1]]
    big = torch.randn(64, 256)
    mask = mask_2to4(big.abs())
    assert torch.equal(mask.view(64, -1, 4).sum(-1), torch.full((64, 64), 2))
    # the kept pair has the largest magnitudes of each block
    blocks, keep = big.abs().view(64, -1, 4), mask.view(64, -1, 4)
    assert torch.all(blocks.masked_fill(~keep, float("inf")).amin(-1) >= blocks.masked_fill(keep, -1).amax(-1))
    # Against a stable sort (ties keep the lower index first), with every tie pattern of 4
    # scores in 0..3 (256 blocks), signed zeros and infinities.
    ties = torch.cat([torch.cartesian_prod(*[torch.arange(4.0)] * 4).view(1, -1),
                      torch.tensor([[0.0, -0.0, 0.0, -0.0, float("inf"), 1.0, float("inf"), -float("inf")]])], 1)
    for scores in (ties, torch.randint(0, 3, (50, 64)).float(), torch.randn(3, 5, 8)):
        order = scores.reshape(-1, 4).sort(dim=-1, descending=True, stable=True).indices[:, :2]
        expected = torch.zeros(order.shape[0], 4, dtype=torch.bool).scatter_(1, order, True)
        assert torch.equal(mask_2to4(scores), expected.view(scores.shape))


def test_pruning_uses_real_values_not_codes():
    """fp4 codes are sign-magnitude: -6.0 is code 0xF and 0.5 is 0x1, so ranking codes
    would keep the wrong weights. Pruning ranks the float weights."""
    w = torch.tensor([[-6.0, 0.5, 0.25, 4.0] * 8])
    q = quantize_sparse(w, "fp4", -1)
    assert q.mask()[0, :4].tolist() == [True, False, False, True]


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_already_2to4_weight_keeps_exactly_its_pattern(weight_format):
    """A checkpoint trained 2:4 (dense with zeros): no extra pruning, whatever the magnitudes."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(48, 100, dtype=torch.bool)
    for r in range(48):
        for b in range(25):
            mask[r, 4 * b + torch.randperm(4, generator=g)[:2]] = True
    mask[0, :4] = torch.tensor([False, True, False, True])
    w = torch.randn(48, 100, generator=g) * mask
    w[0, :4] = torch.tensor([0.0, 1e-6, 0.0, 1e-6])  # tiny kept weights still win
    assert is_2to4(w) and not is_2to4(torch.randn(4, 8))
    assert is_2to4(torch.tensor([[1.0, 1, 0, 0, 1, 1, 0]])) and not is_2to4(torch.ones(2, 7))  # a partial block
    q = quantize_sparse(w, weight_format, 32)
    assert torch.equal(q.mask(), mask)
    for quantize in (quantize_sparse, quantize_sparse_reference):
        assert torch.equal(quantize(w, weight_format, 32, scores=torch.rand(48, 100)).mask(), mask)
    linear = nn.Linear(100, 48)
    with torch.no_grad():
        linear.weight.copy_(w)
    module = tm.MarlinLinear.from_linear(linear, weight_format, 32, sparsity="2:4")
    assert torch.equal(module.quantized_weight().mask(), mask)


def test_given_mask_is_used_and_checked():
    w = torch.randn(8, 10)
    mask = torch.zeros(8, 10, dtype=torch.bool)
    mask[:, [1, 2, 4, 7]] = True  # last partial block (columns 8, 9): none kept
    q = quantize_sparse(w, "int4", 32, mask=mask)
    assert torch.equal(q.mask(), mask)
    bad = mask.clone()
    bad[3, 0] = True
    with pytest.raises(ValueError, match="mask must keep exactly 2 of every 4 weights along K; row 3, columns 0..3 keep 3"):
        quantize_sparse(w, "int4", 32, mask=bad)
    with pytest.raises(ValueError, match="scores must have the weight's shape"):
        quantize_sparse(w, "int4", 32, scores=torch.ones(8, 12))


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_kept_weights_are_quantized_like_dense(weight_format):
    """The kept weights' error is that of dense quantization at half the group size."""
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    q = quantize_sparse(w, weight_format, 128)
    mask = q.mask()
    assert torch.equal(mask, mask_2to4(w.abs()))
    kept_err = (q.dequantize() - w)[mask].norm() / w[mask].norm()
    dense_err = tm.quantize_weight(w, weight_format, 64).relative_error
    assert kept_err < 1.15 * dense_err
    full = (q.dequantize() - w).norm() / w.norm()
    assert abs(q.relative_error - float(full)) < 1e-4
    assert torch.all(q.dequantize()[~mask] == 0)


def assert_same_sparse(fast, ref, context):
    assert torch.equal(fast.metadata, ref.metadata), context
    assert torch.equal(fast.values, ref.values), (context, int((fast.values != ref.values).sum()))
    assert torch.equal(fast.scales.view(torch.int16), ref.scales.view(torch.int16)), context
    assert (fast.zeros is None) == (ref.zeros is None), context
    if ref.zeros is not None:  # by value: a zero point of 0 may be +0 or -0 (test_quantize_native.py)
        assert torch.equal(fast.zeros, ref.zeros), context
    assert (fast.in_features, fast.out_features, fast.group_size) == (ref.in_features, ref.out_features,
                                                                      ref.group_size)
    assert fast.relative_error == pytest.approx(ref.relative_error, rel=1e-5, abs=1e-7), context


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("method", ["mse", "absmax"])
def test_native_quantizer_equals_reference(weight_format, group_size, method):
    """"mse" and "absmax" prune and quantize in C++: bit for bit the values, metadata,
    scales and zeros of the plain-torch path, in every ISA build; odd K (padded), the
    kept groups of 8 of group 16, a given mask, given scores (negative ones: the padding
    scores -1 then beat real ones) and an already 2:4 weight."""
    for dtype, (n, k) in [(torch.float32, (19, 256)), (torch.bfloat16, (12, 200)), (torch.float16, (17, 99))]:
        w = hard_weights(n, k, dtype)
        ref = quantize_sparse_reference(w, weight_format, group_size, method)
        for build in BUILDS:
            with kernel_build(build):
                assert_same_sparse(quantize_sparse(w, weight_format, group_size, method), ref, (build, dtype, k))
    w = hard_weights(16, 70, torch.float32)
    mask = mask_2to4(torch.nn.functional.pad(torch.rand(16, 70), (0, 2), value=-1.0))[:, :70]
    for given in ({"mask": mask}, {"scores": torch.rand(16, 70) * w.abs()}, {"scores": -torch.rand(16, 70)}):
        assert_same_sparse(quantize_sparse(w, weight_format, group_size, method, **given),
                           quantize_sparse_reference(w, weight_format, group_size, method, **given), given)
    sparse, scores = w * mask, torch.rand(16, 70)  # already 2:4: its pattern whatever the scores
    assert_same_sparse(quantize_sparse(sparse, weight_format, group_size, method, scores=scores),
                       quantize_sparse_reference(sparse, weight_format, group_size, method, scores=scores), "2:4")


def test_nan_or_inf_is_an_error_on_both_paths():
    w, scores = torch.randn(40, 64), torch.rand(40, 64)
    for quantize in (quantize_sparse, quantize_sparse_reference):
        with pytest.raises(ValueError, match="weight contains NaN or Inf"):
            quantize(w.index_fill(0, torch.tensor([21]), float("nan")), "fp4", 32)
        with pytest.raises(ValueError, match="scores contain NaN or Inf"):
            quantize(w, "fp4", 32, scores=scores.index_fill(1, torch.tensor([7]), float("inf")))


def test_registered_quantizers_quantize_kept_weights_in_python():
    calls = []

    def mine(groups, weight_format, group_size):
        calls.append(groups.shape)
        return tm.quantize._QUANTIZERS["mse"](groups, weight_format, group_size)

    tm.register_quantizer("mine", mine)
    try:
        w = torch.randn(8, 64)
        assert_same_sparse(quantize_sparse(w, "int4", 32, "mine"), quantize_sparse(w, "int4", 32), "mine")
        assert calls == [(8, 2, 16)]
    finally:
        del tm.quantize._QUANTIZERS["mine"]


_PEAK_GROWTH = """
import json, torch, torch_marlin
from torch_marlin.layouts.sparse24 import quantize_sparse
from torch_marlin.sparsity import is_2to4
torch.set_num_threads(1)
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
def crude(groups, weight_format, group_size):  # a Python quantizer: the reference path
    return (groups.view(torch.int32) >> 19).to(torch.uint8) & 15, groups.abs().amax(-1).half(), None
torch_marlin.register_quantizer("crude", crude)
w = torch.randn(8192, 4096).bfloat16()
calls = {"absmax": lambda w: quantize_sparse(w, "fp4", 128, "absmax"), "is_2to4": is_2to4,
         "crude": lambda w: quantize_sparse(w, "fp4", 128, "crude")}  # the largest last: freed memory may stay
growth = {}
for name, call in calls.items():
    call(w[:64])  # load everything once
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    call(w)
    growth[name] = (status("VmHWM") - before) / w.numel()
print(json.dumps(growth))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_stays_near_the_result():
    """Magnitude 2:4 of a 1B model through a Python quantizer once peaked 2.4 GiB above
    dense: is_2to4 (the converter asks it of every layer) and pack_kept each took ~10
    bytes of temporaries per weight of the whole weight (its 262M-weight tied head).
    Both go by row blocks now: what remains is the result (0.4 bytes per weight), the
    kept codes and positions (1 byte) and one block's scratch. The C++ path holds only
    the result."""
    result = subprocess.run([sys.executable, "-c", _PEAK_GROWTH], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    growth = json.loads(result.stdout)  # bytes per weight
    assert growth["crude"] < 5.0 and growth["is_2to4"] < 2.0, growth  # 12.7 and ~10 before
    assert growth["absmax"] < 1.0, growth


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
@pytest.mark.parametrize("in_features, out_features", [(1, 1), (3, 5), (100, 7), (129, 33)])
@pytest.mark.parametrize("group_size", [16, 128, -1])
def test_marlin_linear_any_shape(weight_format, in_features, out_features, group_size):
    linear = nn.Linear(in_features, out_features)
    q = tm.MarlinLinear.from_linear(linear, weight_format, group_size, sparsity="2:4")
    assert q.layout is SparseQuantizedWeight and "layout=sparse24" in repr(q)
    w64 = q.quantized_weight().dequantize(torch.float64)
    assert w64.shape == (out_features, in_features)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, in_features).to(dtype)
        y = q(x)
        assert y.shape == (2, 3, out_features) and y.dtype == dtype
        assert_close_to_reference(y.view(6, -1), x.view(6, -1), w64.t(), linear.bias.detach().to(dtype))


def test_state_dict_roundtrip_and_guards(tmp_path):
    from safetensors.torch import load_file, save_file

    linear = nn.Linear(100, 40)
    q = tm.MarlinLinear.from_linear(linear, "uint4", 32, sparsity="2:4")
    assert set(q.state_dict()) == {"values", "metadata", "scales", "zeros", "bias", "_extra_state"}
    assert q.state_dict()["_extra_state"].tolist() == [3, 1, 32, 100]
    save_file(q.state_dict(), tmp_path / "layer.safetensors")
    fresh = tm.MarlinLinear(100, 40, weight_format="uint4", group_size=32, sparsity="2:4")
    fresh.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, 100)
    assert torch.equal(fresh(x), q(x))
    dense = tm.MarlinLinear(100, 40, weight_format="uint4", group_size=32)
    with pytest.raises(Exception):
        dense.load_state_dict(q.state_dict())
    state = q.state_dict()
    state["metadata"] = state["metadata"].clone()
    state["metadata"][0, 0] = 0x44444445  # nibble 0: positions (1, 1)
    with pytest.raises(ValueError, match=r"metadata has an invalid 2:4 pattern: word \[0, 0\] nibble 0"):
        fresh.load_state_dict(state)


def test_sparsity_argument_errors():
    with pytest.raises(ValueError, match=r"sparsity must be None or one of \['2:4'\], got '4:8'"):
        tm.MarlinLinear(64, 8, sparsity="4:8")
    with pytest.raises(ValueError, match="sparsity must be None or one of"):
        tm.MarlinLinear.from_linear(nn.Linear(64, 8), sparsity="50%")
    with pytest.raises(ValueError, match="layout=QuantizedWeight and sparsity='2:4' disagree"):
        tm.MarlinLinear(64, 8, layout=QuantizedWeight, sparsity="2:4")
    with pytest.raises(ValueError, match="sparsity must be None or one of"):
        tm.quantize_model(nn.Sequential(nn.Linear(64, 8)), sparsity="2:8")
    assert tm.MarlinLinear(64, 8, layout=SparseQuantizedWeight, sparsity="2:4").layout is SparseQuantizedWeight


def test_fresh_module_has_valid_metadata():
    q = tm.MarlinLinear(70, 9, sparsity="2:4")
    assert torch.equal(q(torch.randn(2, 70)), torch.zeros(2, 9))


def test_quantize_model_magnitude():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(8, 64)
    report = tm.quantize_model(model, "fp4", 32, sparsity="2:4", exclude="2")
    assert report.replaced == ["0"] and report.skipped == ["2"]
    assert isinstance(model[0], tm.MarlinLinear) and model[0].layout is SparseQuantizedWeight
    assert isinstance(model[2], nn.Linear)
    assert model(x).shape == (8, 32)
    with pytest.raises(ValueError, match="method must be one of"):
        tm.quantize_model(nn.Sequential(nn.Linear(64, 8)), sparsity="2:4", method="random")
