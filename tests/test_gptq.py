"""GPTQ: the per-layer update against a plain float64 reference, act-order layouts through the
real kernels, sequential calibration on plain modules, bad input, determinism."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin import formats
from torch_marlin.calibration import CalibrationError
from torch_marlin.calibration import output_error
from torch_marlin.gptq import _inverse_cholesky, _Problem, _weighted_search, gptq_quantize
from torch_marlin.linear import PermutedInputMarlinLinear

from reference import weight_one_by_one

FORMATS = formats.WEIGHT_FORMATS


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated features of very different scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g) @ mix + 0.2 * torch.randn(rows, k, generator=g)
    return x * torch.linspace(0.1, 3.0, k)[torch.randperm(k, generator=g)]


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return (x.double().t() @ x.double()) / x.shape[0]


# --- float64 reference: textbook GPTQ, one column at a time ------------------------------

def representable(weight_format: str, scale: torch.Tensor, zero=None) -> torch.Tensor:
    """Every weight a row can hold [N, 16], from the per-element decode of tests/reference.py."""
    return torch.tensor([[weight_one_by_one(code, s, None if zero is None else float(zero[row]), weight_format)
                          for code in range(16)] for row, s in enumerate(scale.tolist())], dtype=torch.float64)


def nearest(w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Nearest of each row's representable values [N, 16] to w [N], by exhaustive search."""
    best = (values - w.unsqueeze(-1)).abs().argmin(-1, keepdim=True)
    return values.gather(-1, best).squeeze(-1)


def reference_gptq(w, h, weight_format, group_size, damp, act_order=False):
    """Plain GPTQ in float64 with the same scale chooser; returns the dequantized weight
    [N, K] in the original column order and the quantization order."""
    n, k = w.shape
    w, h = w.double().clone(), h.double().clone()
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = diag[~dead].mean()
    mean = torch.diagonal(h)[~dead].mean() if (~dead).any() else 1.0
    h = h + damp * mean * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    cost = torch.diagonal(u) ** -2
    gs = k if group_size == -1 else group_size
    q = torch.zeros_like(w)
    for j in range(k):
        if j % gs == 0:
            scale, zero = _weighted_search(w[:, j:j + gs], cost[j:j + gs].float(), weight_format)
            values = representable(weight_format, scale.double(), None if zero is None else zero.double())
        q[:, j] = nearest(w[:, j], values)
        e = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= e.unsqueeze(1) * u[j, j:].unsqueeze(0)
    restored = torch.empty_like(q)
    restored[:, order] = q
    return restored


def implementation(w, h, weight_format, group_size, damp, act_order=False, block=16):
    """The implementation's first GPTQ pass (no refinement), run in float64."""
    k = w.shape[1]
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    w, h = w.double()[:, order], h.double()[order][:, order]
    u, _, added = _inverse_cholesky(h, damp)
    gs = k if group_size == -1 else group_size
    problem = _Problem(w, h, u, torch.diagonal(u).pow(-2).float(), weight_format, gs, block, added)
    sol = problem.run(None)
    values = formats.code_values(sol.codes, weight_format).double()
    groups = torch.arange(k) // gs
    zeros = None if sol.zeros is None else sol.zeros.double()[:, groups]
    q = formats.value_format(weight_format).weights(values, sol.scales.double()[:, groups], zeros)
    # The pass's loss (from its scaled errors) is the objective itself.
    assert sol.loss == pytest.approx(problem.loss_of(q), rel=1e-9)
    restored = torch.empty_like(q)
    restored[:, order] = q
    return restored


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("group_size,act_order", [(16, False), (32, True), (-1, False), (-1, True)])
def test_update_matches_float64_reference(weight_format, group_size, act_order):
    n, k = 12, 64
    w = torch.randn(n, k, dtype=torch.float64)
    x = correlated_inputs(256, k)
    x[:, 5] = 0  # a dead input column
    h = hessian_of(x)
    want = reference_gptq(w, h, weight_format, group_size, 0.01, act_order)
    got = implementation(w, h, weight_format, group_size, 0.01, act_order, block=16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_float32_path_close_to_reference_and_better_than_rtn(weight_format):
    n, k = 32, 128
    w = torch.randn(n, k)
    h = hessian_of(correlated_inputs(1024, k, seed=1))
    result = gptq_quantize(w, h, weight_format, 32, refine_rounds=0)
    got = result.qweight.dequantize(torch.float64)
    want = reference_gptq(w, h, weight_format, 32, 0.01)
    # float32 vs float64 arithmetic may flip a rounding close to a tie; the codes must still
    # agree almost everywhere and the objective must be the same to a fraction of a percent.
    assert (got == want).double().mean() > 0.98
    e_got, e_want = output_error(w, got, h), output_error(w, want, h)
    assert abs(e_got - e_want) < 0.01 * e_want
    assert result.relative_output_error == pytest.approx(e_got, rel=1e-4)  # float32 figure
    rtn = torch_marlin.quantize_weight(w, weight_format, 32)
    assert e_got < 0.9 * output_error(w, rtn.dequantize(), h)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_scale_refit_is_the_least_squares_solution(weight_format):
    """Refit scales (and zeros) for fixed codes equal an independent weighted least-squares
    solve on the explicit design matrix, up to the fp16 rounding of the stored values."""
    n, k, gs = 6, 64, 16
    w = torch.randn(n, k, dtype=torch.float64)
    h = hessian_of(correlated_inputs(512, k, seed=2))
    u, _, added = _inverse_cholesky(h, 0.01)
    problem = _Problem(w.float(), h, u, torch.diagonal(u).pow(-2).float(), weight_format, gs, 16, added)
    first = problem.run(None)
    refit = problem.refit_scales(first)
    assert refit.loss <= first.loss
    # Losses computed without the product are the objective: to float64 rounding in a float64
    # problem; in float32 (the library's path) the pass's K rank-1 updates and sums carry float32
    # rounding whose size depends on the GEMM's thread blocking (1.6e-5 seen with 2 threads).
    problem64 = _Problem(w, h, u, torch.diagonal(u).pow(-2).float(), weight_format, gs, 16, added)
    first64 = problem64.run(None)
    for prob, sols, rel in ((problem64, (first64, problem64.refit_scales(first64)), 1e-9),
                            (problem, (first, refit), 1e-4)):
        for sol in sols:
            values = formats.code_values(sol.codes, weight_format).to(prob.w.dtype)
            groups = torch.arange(k) // gs
            zeros = None if sol.zeros is None else sol.zeros.to(prob.w.dtype)[:, groups]
            weights = formats.value_format(weight_format).weights(values, sol.scales.to(prob.w.dtype)[:, groups], zeros)
            assert sol.loss == pytest.approx(prob.loss_of(weights), rel=rel)
    chol = torch.linalg.cholesky(h)
    values = formats.code_values(first.codes, weight_format).double()
    groups = torch.arange(k) // gs
    for row in range(n):
        design = torch.zeros(k, k // gs, dtype=torch.float64)
        design[torch.arange(k), groups] = values[row]
        if formats.has_zeros(weight_format):  # w = s q + c per group, zero = -c / s (affine: bias = c)
            ones = torch.zeros(k, k // gs, dtype=torch.float64)
            ones[torch.arange(k), groups] = 1
            design = torch.cat([design, ones], 1)
        solution = torch.linalg.lstsq(chol.t() @ design, chol.t() @ w[row]).solution
        scales = solution[: k // gs]
        torch.testing.assert_close(refit.scales[row].double(), scales.half().double(), rtol=2e-3, atol=0)
        if formats.has_zeros(weight_format):
            c = solution[k // gs:]
            zeros = c if formats.value_format(weight_format).bias else -c / refit.scales[row].double()
            torch.testing.assert_close(refit.zeros[row].double(), zeros, rtol=2e-3, atol=2e-3)


def test_identity_hessian_is_round_to_nearest():
    """With uncorrelated inputs there is no error to move: every column is rounded alone."""
    w = torch.randn(16, 64)
    result = gptq_quantize(w, torch.eye(64), "int4", 32, refine_rounds=0)
    q = result.qweight
    scales = q.scales.float().repeat_interleave(32, 0).t()
    rounded = torch.round(w / scales).clamp(-8, 7) * scales
    assert torch.equal(q.dequantize(), rounded)


# --- act-order layout through the real kernels -------------------------------------------

@pytest.mark.parametrize("weight_format", FORMATS)
def test_act_order_layout_is_valid_for_the_kernels(weight_format):
    torch.manual_seed(0)
    k, n = 200, 48  # K padded to 256 for group 128
    linear = nn.Linear(k, n)
    x = correlated_inputs(512, k, seed=3)
    h = hessian_of(x)
    module = torch_marlin.MarlinLinear.from_linear(linear, weight_format, 64, method="gptq", hessian=h,
                                                   act_order=True)
    assert type(module) is PermutedInputMarlinLinear
    perm = module.input_perm.long()
    assert torch.equal(perm, torch.argsort(torch.diagonal(h), descending=True, stable=True))
    # Stored weight (K in act order, groups contiguous) through the real GEMM op...
    probe = torch.randn(5, k)
    q = module.quantized_weight()
    padded = torch.nn.functional.pad(probe[:, perm], (0, q.padded_in_features - k))
    via_op = torch.ops.marlin.gemm(padded, q.packed, q.scales, q.zeros, None, weight_format, 64)
    # ...equals x @ W^T with the dequantized weight put back in the original column order.
    dense = torch.empty(n, k, dtype=torch.float64)
    dense[:, perm] = formats.dequantize_reference(q.packed, q.scales, q.zeros, weight_format, 64,
                                                  torch.float64)[:k].t()
    want = probe.double() @ dense.t()
    torch.testing.assert_close(via_op.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(module(probe).double(), want + linear.bias.double(), rtol=1e-4, atol=1e-4)
    # And it is a better quantization of this layer than the same without act-order.
    plain = torch_marlin.MarlinLinear.from_linear(linear, weight_format, 64, method="gptq", hessian=h)
    assert module.output_error < plain.output_error * 1.05


def test_act_order_with_one_group_keeps_the_plain_layout():
    linear = nn.Linear(96, 32)
    h = hessian_of(correlated_inputs(400, 96, seed=4))
    module = torch_marlin.MarlinLinear.from_linear(linear, "fp4", -1, method="gptq", hessian=h, act_order=True)
    assert type(module) is torch_marlin.MarlinLinear
    assert output_error(linear.weight, module.dequantize(), h) == pytest.approx(module.output_error, rel=1e-4)


# --- sequential calibration on plain modules ---------------------------------------------

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.nn.functional.gelu(self.up(x)))))


def mlp_and_data(seed=0):
    torch.manual_seed(seed)
    model = Mlp().eval()
    x = correlated_inputs(640, 64, seed=seed)
    return model, [x[i:i + 64] for i in range(0, 512, 64)], x[512:]


def relative_output_error(model, reference, x):
    with torch.no_grad():
        want = reference(x)
        return float((model(x) - want).norm() / want.norm())


@pytest.mark.parametrize("weight_format", FORMATS)
def test_quantize_model_gptq_beats_round_to_nearest_on_held_out_inputs(weight_format):
    model, batches, held_out = mlp_and_data()
    reference = mlp_and_data()[0]
    rtn = mlp_and_data()[0]
    torch_marlin.quantize_model(rtn, weight_format, 32)
    report = torch_marlin.quantize_model(model, weight_format, 32, method="gptq", calibration=batches)
    assert report.replaced == ["up", "down", "head"]
    assert all(isinstance(model.get_submodule(n), torch_marlin.MarlinLinear) for n in report.replaced)
    for name, (before, after) in report.output_errors.items():
        assert after < before, name
    assert relative_output_error(model, reference, held_out) < 0.8 * relative_output_error(rtn, reference, held_out)
    assert "up: " in str(report) and "->" in str(report)


def test_later_layers_see_the_quantized_earlier_ones():
    """quantize_model's second layer equals from_linear on the Hessian of inputs computed
    through the already quantized first layer."""
    model, batches, _ = mlp_and_data(seed=5)
    original = mlp_and_data(seed=5)[0]
    torch_marlin.quantize_model(model, "int4", 32, include=["up", "down"], method="gptq", calibration=batches)

    def hessian(inputs):
        h = torch.zeros(inputs[0].shape[1], inputs[0].shape[1])
        for x in inputs:
            h.addmm_(x.t(), x)
        return h.double() / sum(x.shape[0] for x in inputs)

    up = torch_marlin.MarlinLinear.from_linear(original.up, "int4", 32, method="gptq", hessian=hessian(batches))
    assert torch.equal(up.packed, model.up.packed) and torch.equal(up.scales, model.up.scales)
    with torch.no_grad():
        mid = [torch.nn.functional.gelu(torch.nn.functional.linear(x, up.dequantize(), up.bias)) for x in batches]
    down = torch_marlin.MarlinLinear.from_linear(original.down, "int4", 32, method="gptq", hessian=hessian(mid))
    assert torch.equal(down.packed, model.down.packed) and torch.equal(down.scales, model.down.scales)
    assert type(model.head) is nn.Linear


class SharedInput(nn.Module):
    """q/k/v-style siblings on one input, a layer used twice per forward, a dict input."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.twice = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)

    def forward(self, x, attention_mask=None, use_unused=False):
        y = self.q(x) + self.k(x) * self.v(x)
        y = self.twice(self.twice(y))
        return self.unused(y) if use_unused else y


def test_siblings_repeated_layers_padding_and_unreached_layers():
    torch.manual_seed(0)
    model = SharedInput().eval()
    reference = SharedInput().eval()
    reference.load_state_dict(model.state_dict())
    x = correlated_inputs(6 * 16, 32, seed=6).view(6, 16, 32)
    mask = torch.ones(6, 16, dtype=torch.long)
    mask[:, 12:] = 0
    padded = x.clone()
    padded[:, 12:] = 1e4  # padding that must not count
    batches = [{"x": padded[i:i + 2], "attention_mask": mask[i:i + 2]} for i in range(0, 6, 2)]
    with pytest.warns(UserWarning, match="never called on the calibration data.*unused"):
        report = torch_marlin.quantize_model(model, "fp4", 32, method="gptq", calibration=batches)
    assert report.replaced[:4] == ["q", "k", "v", "twice"] and report.unreached == ["unused"]
    assert set(report.output_errors) == {"q", "k", "v", "twice"}
    # q, k, v share one Hessian: the same as quantizing each alone on the unpadded rows
    # (accumulated like the engine does, batch by batch in float32).
    h = torch.zeros(32, 32)
    for i in range(0, 6, 2):
        rows = x[i:i + 2, :12].reshape(-1, 32)
        h.addmm_(rows.t(), rows)
    h = h.double() / (6 * 12)
    for name in ("q", "k", "v"):
        alone = torch_marlin.MarlinLinear.from_linear(reference.get_submodule(name), "fp4", 32, method="gptq",
                                                      hessian=h)
        assert torch.equal(model.get_submodule(name).packed, alone.packed), name
        assert torch.equal(model.get_submodule(name).scales, alone.scales), name
    # The unreached layer is round to nearest (mse), as documented.
    mse = torch_marlin.MarlinLinear.from_linear(reference.unused, "fp4", 32)
    assert torch.equal(model.unused.packed, mse.packed)
    assert "never reached" in str(report)


def test_deterministic():
    results = []
    for _ in range(2):
        model, batches, _ = mlp_and_data(seed=7)
        torch_marlin.quantize_model(model, "uint4", 32, method="gptq", calibration=iter(batches), act_order=True)
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    assert results[0].keys() == results[1].keys()
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


# --- bad input ----------------------------------------------------------------------------

def test_bad_calibration_inputs():
    model, batches, _ = mlp_and_data()
    for empty in ([], iter([]), (b for b in [])):
        with pytest.raises(CalibrationError, match="calibration is empty"):
            torch_marlin.quantize_model(model, method="gptq", calibration=empty)
    with pytest.raises(CalibrationError, match="needs calibration data"):
        torch_marlin.quantize_model(model, method="gptq")
    with pytest.raises(CalibrationError, match="single Tensor.*wrap it in a list"):
        torch_marlin.quantize_model(model, method="gptq", calibration=batches[0])
    with pytest.raises(CalibrationError, match="batch 1 must be a Tensor, a tuple or a dict.*str"):
        torch_marlin.quantize_model(model, method="gptq", calibration=[batches[0], "text"])
    with pytest.raises(CalibrationError, match="rejected calibration batch 1: RuntimeError"):
        torch_marlin.quantize_model(model, method="gptq", calibration=[batches[0], torch.randn(4, 63)])
    bad = batches[1].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="layer 'up' received NaN or Inf inputs in calibration batch 1"):
        torch_marlin.quantize_model(model, method="gptq", calibration=[batches[0], bad])
    exploding = nn.Sequential(nn.Linear(64, 64), nn.Softplus(beta=-1e-40), nn.Linear(64, 8))  # finite in, Inf out
    with pytest.raises(CalibrationError, match="layer '2' received NaN or Inf inputs in calibration batch 0"):
        torch_marlin.quantize_model(exploding, method="gptq", calibration=[batches[0]])
    # Nothing was replaced by the failed attempts.
    assert all(type(m) is nn.Linear for m in (model.up, model.down, model.head))
    with pytest.raises(ValueError, match="only used by method='gptq'"):
        torch_marlin.quantize_model(model, calibration=batches)
    with pytest.raises(ValueError, match="only used by method='gptq'"):
        torch_marlin.quantize_model(model, act_order=True)


def test_bad_gptq_arguments():
    linear = nn.Linear(64, 16)
    h = torch.eye(64)
    with pytest.raises(ValueError, match="needs hessian=H"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq")
    with pytest.raises(ValueError, match=r"hessian must have shape \[in_features, in_features\] = \[64, 64\]"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq", hessian=torch.eye(32))
    with pytest.raises(ValueError, match="hessian contains NaN or Inf"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq", hessian=h * float("inf"))
    with pytest.raises(TypeError, match="hessian must be a floating-point tensor"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq", hessian=torch.eye(64, dtype=torch.long))
    with pytest.raises(ValueError, match="damp must be a number in"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq", hessian=h, damp=-1)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        torch_marlin.MarlinLinear.from_linear(linear, method="gptq", hessian=h, block_size=0)
    with pytest.raises(ValueError, match="group_size must be one of"):
        torch_marlin.MarlinLinear.from_linear(linear, "fp4", 48, method="gptq", hessian=h)
    with pytest.raises(ValueError, match="only used by method='gptq'"):
        torch_marlin.MarlinLinear.from_linear(linear, hessian=h)
    model, batches, _ = mlp_and_data()
    with pytest.raises(ValueError, match="weight_format must be one of"):
        torch_marlin.quantize_model(model, "fp8", method="gptq", calibration=batches)


def test_singular_hessian_gets_more_damping():
    linear = nn.Linear(32, 8)
    x = torch.randn(4, 32)  # rank 4: H is singular, damp=0 cannot be factored
    h = x.t() @ x
    module = torch_marlin.MarlinLinear.from_linear(linear, "int4", 32, method="gptq", hessian=h, damp=0.0)
    assert module.damp > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_marlin.MarlinLinear.from_linear(linear, "int4", 32, method="gptq", hessian=torch.zeros(32, 32))


class Stack(nn.Module):
    """Blocks in an nn.ModuleList, chained (x = block(x)) or parallel (sum of block(x))."""

    def __init__(self, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(3))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        if self.parallel:
            return self.head(sum(block(x) for block in self.blocks))
        for block in self.blocks:
            x = x + block(x)  # the block's output feeds the next only through this sum
        return self.head(x)


class Chained(Stack):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("cls,parallel,blocks", [(Chained, False, "blocks"), (Stack, False, None),
                                                 (Stack, True, None)])
def test_blocks_are_used_only_when_verified(monkeypatch, cls, parallel, blocks):
    from torch_marlin import calibration as engine

    original = engine.quantize_sequentially
    results = []
    for use_blocks in (True, False):
        seen = []

        def spy(*args, use_blocks=use_blocks, **kwargs):
            stats = original(*args, use_blocks=use_blocks, **kwargs)
            seen.append(stats.blocks)
            return stats
        monkeypatch.setattr(engine, "quantize_sequentially", spy)
        torch.manual_seed(0)
        model = cls(parallel).eval()
        x = correlated_inputs(256, 32, seed=8)
        torch_marlin.quantize_model(model, "fp4", 32, method="gptq", calibration=[x[:128], x[128:]])
        results.append(model.state_dict())
        assert seen == [blocks if use_blocks else None]
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key
