"""SparseGPT and Wanda 2:4 pruning (torch_marlin.sparsegpt): against a float64
reference of the column-by-column update, their objective, existing patterns."""

import math

import pytest
import torch

import torch_marlin
from torch_marlin import formats
from torch_marlin.calibration import output_error
from torch_marlin.sparsegpt import sparsegpt, wanda, wanda_scores
from torch_marlin.layouts.sparse24 import quantize_sparse
from torch_marlin.sparsity import is_2to4, mask_2to4


def _problem(n=24, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(4 * k, k, generator=g, dtype=torch.float64) @ torch.randn(k, k, generator=g, dtype=torch.float64)
    x[:, 5] = 0  # a dead input
    return w, x.t() @ x / x.shape[0]


def reference_prune(w, h, damp):
    """Unblocked float64 SparseGPT without quantization: each block's pair is chosen by
    w^2 / U[c, c]^2 when reached, each column's error goes to all later columns at once."""
    n, k = w.shape
    h = h.clone()
    dead = torch.diagonal(h) <= 0
    mean = float(torch.diagonal(h)[~dead].mean())
    h[dead, dead] = mean
    h += damp * mean * torch.eye(k, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w = w.clone()
    out = torch.zeros_like(w)
    for c in range(k):
        if c % 4 == 0:
            sal = w[:, c:c + 4] ** 2 / torch.diagonal(u)[c:c + 4] ** 2
            keep = mask_2to4(sal)
        d = torch.where(keep[:, c % 4], w[:, c], 0.0)
        out[:, c] = d
        e = (w[:, c] - d) / u[c, c]
        w[:, c:] -= torch.outer(e, u[c, c:])
    return out


def test_lazy_blocks_match_the_unblocked_reference():
    w, h = _problem()
    for block_size in (128, 8):  # one outer block; many blocks and inner blocks
        got = sparsegpt(w, h, None, 32, damp=0.01, block_size=block_size).pruned
        ref = reference_prune(w, h, 0.01)
        assert torch.equal(got != 0, ref != 0)
        assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
@pytest.mark.parametrize("group_size", [16, 128, -1])
def test_sparsegpt_beats_magnitude_and_wanda_on_its_objective(weight_format, group_size):
    w, h = _problem(n=32, k=160, seed=1)
    result = sparsegpt(w, h, weight_format, group_size)
    q = result.qweight
    assert q.in_features == 160 and q.out_features == 32 and q.weight_format == weight_format
    deq = q.dequantize(torch.float64)
    assert torch.equal(deq.float(), result.pruned)  # the packed weight is the computed one
    assert torch.equal(q.mask().view(32, -1, 4).sum(-1), torch.full((32, 40), 2))
    assert math.isclose(result.relative_output_error, output_error(w, deq, h), rel_tol=1e-4)
    magnitude = output_error(w, quantize_sparse(w, weight_format, group_size).dequantize(torch.float64), h)
    wanda_err = wanda(w, h, weight_format, group_size).relative_output_error
    assert result.relative_output_error < 0.8 * magnitude and result.relative_output_error < wanda_err


def test_identity_hessian_is_magnitude_pruning():
    w, _ = _problem(seed=2)
    h = torch.eye(w.shape[1], dtype=torch.float64)
    result = sparsegpt(w, h, None, 32)
    assert torch.equal(result.pruned != 0, mask_2to4(w.abs()))
    assert torch.allclose(result.pruned.double(), w * mask_2to4(w.abs()), atol=1e-6)


def test_wanda_scores_and_mask():
    w, h = _problem(seed=3)
    scores = wanda_scores(w, h)
    assert torch.allclose(scores.double(), w.abs() * torch.diagonal(h).sqrt(), rtol=1e-6)
    result = wanda(w, h, "int4", 32)
    assert torch.equal(result.qweight.mask(), mask_2to4(scores))
    assert torch.equal(wanda(w, h, None).pruned != 0, mask_2to4(scores))


@pytest.mark.parametrize("method", [sparsegpt, wanda])
def test_existing_pattern_is_kept(method):
    w, h = _problem(k=100, seed=4)
    mask = mask_2to4(torch.rand(w.shape[0], 100, generator=torch.Generator().manual_seed(5)))
    sparse = w * mask
    assert is_2to4(sparse)
    result = method(sparse, h, "fp4", 32)
    assert torch.equal(result.qweight.mask(), mask)


def test_bad_input():
    w, h = _problem()
    with pytest.raises(ValueError, match=r"hessian must have shape \[in_features, in_features\] = \[96, 96\]"):
        sparsegpt(w, h[:90, :90])
    with pytest.raises(ValueError, match="weight_format must be one of"):
        sparsegpt(w, h, "nf3")
    with pytest.raises(ValueError, match="damp must be a number"):
        sparsegpt(w, h, damp=-1.0)


# --- quantize_model(sparsity="2:4", method=...) through the calibration engine ------------

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)
        self.head = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.nn.functional.gelu(self.up(x)))))


def mlp_and_data(seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(640, 64, generator=g) @ (torch.randn(64, 64, generator=g) / 8) * torch.logspace(-1, 1, 64)
    return Mlp().eval(), [x[i:i + 64] for i in range(0, 512, 64)], x[512:]


def _hessian(inputs):
    h = torch.zeros(inputs[0].shape[1], inputs[0].shape[1])
    for x in inputs:
        h.addmm_(x.t(), x)
    return h.double() / sum(x.shape[0] for x in inputs)


def _relative_error(model, reference, x):
    with torch.no_grad():
        want = reference(x)
        return float((model(x) - want).norm() / want.norm())


@pytest.mark.parametrize("method", ["sparsegpt", "wanda"])
def test_quantize_model_is_sequential(method):
    """The second layer is pruned on the Hessian of inputs computed through the already
    pruned-and-quantized first layer."""
    model, batches, _ = mlp_and_data(seed=5)
    original = mlp_and_data(seed=5)[0]
    report = torch_marlin.quantize_model(model, "int4", 32, include=["up", "down"], sparsity="2:4", method=method,
                                         calibration=batches)
    assert report.replaced == ["up", "down"] and type(model.head) is torch.nn.Linear
    prune = sparsegpt if method == "sparsegpt" else wanda
    up = prune(original.up.weight, _hessian(batches), "int4", 32).qweight
    assert torch.equal(up.values, model.up.values) and torch.equal(up.metadata, model.up.metadata)
    assert torch.equal(up.scales, model.up.scales)
    with torch.no_grad():
        mid = [torch.nn.functional.gelu(model.up(x)) for x in batches]
    down = prune(original.down.weight, _hessian(mid), "int4", 32).qweight
    assert torch.equal(down.values, model.down.values) and torch.equal(down.metadata, model.down.metadata)
    for name in report.replaced:
        magnitude, calibrated = report.output_errors[name]
        assert calibrated < magnitude, name
    assert "up: " in str(report) and "magnitude 2:4 ->" in str(report)


def test_sparsegpt_beats_magnitude_on_held_out_inputs():
    model, batches, held_out = mlp_and_data()
    reference, magnitude = mlp_and_data()[0], mlp_and_data()[0]
    torch_marlin.quantize_model(magnitude, "fp4", 32, sparsity="2:4")
    torch_marlin.quantize_model(model, "fp4", 32, sparsity="2:4", method="sparsegpt", calibration=batches)
    for layer in (model.up, model.down, model.head):
        assert layer.quantized_weight().SPARSITY == "2:4"
    assert _relative_error(model, reference, held_out) < 0.7 * _relative_error(magnitude, reference, held_out)


def test_from_linear_with_a_hessian():
    model, batches, _ = mlp_and_data(seed=2)
    h = _hessian(batches)
    module = torch_marlin.MarlinLinear.from_linear(model.up, "uint4", 64, method="sparsegpt", hessian=h,
                                                   sparsity="2:4")
    want = sparsegpt(model.up.weight, h, "uint4", 64).qweight
    assert torch.equal(module.values, want.values) and torch.equal(module.zeros, want.zeros)
    module = torch_marlin.MarlinLinear.from_linear(model.up, "fp4", 64, method="wanda", hessian=h, sparsity="2:4")
    assert torch.equal(module.quantized_weight().mask(), mask_2to4(wanda_scores(model.up.weight, h)))


def test_bad_sparse_methods():
    from torch_marlin.calibration import CalibrationError

    model, batches, _ = mlp_and_data()
    with pytest.raises(CalibrationError, match="needs calibration data"):
        torch_marlin.quantize_model(model, sparsity="2:4", method="sparsegpt")
    with pytest.raises(ValueError, match="method must be one of .*'sparsegpt'.* with sparsity='2:4', got 'gptq'"):
        torch_marlin.quantize_model(model, sparsity="2:4", method="gptq", calibration=batches)
    with pytest.raises(ValueError, match="sparsity"):
        torch_marlin.quantize_model(model, sparsity="1:4", method="sparsegpt", calibration=batches)
    with pytest.raises(ValueError, match="only used by method='gptq'"):
        torch_marlin.quantize_model(model, sparsity="2:4", method="magnitude", calibration=batches)
    with pytest.raises(ValueError, match="needs hessian=H"):
        torch_marlin.MarlinLinear.from_linear(model.up, method="sparsegpt", sparsity="2:4")
    with pytest.raises(ValueError, match="sparsity='2:4'"):
        torch_marlin.MarlinLinear.from_linear(model.up, method="wanda", hessian=_hessian(batches))
    assert all(type(m) is torch.nn.Linear for m in (model.up, model.down, model.head))
