"""The entropy-coded layout (RansQuantizedWeight) and its quantizers: lossless coding of
dense weights, the rate-controlled grid (quantize_model(bits=), from_linear(bits=)),
state_dict round trips and bad input."""

import copy

import pytest
import torch
from torch import nn

import torch_marlin as tm
from reference import tcq_levels_one_by_one
from torch_marlin import formats, rans
from torch_marlin.layouts import QuantizedWeight, RansQuantizedWeight
from torch_marlin.layouts.rans import has_ops

FORMATS = ["fp4", "uint4", "int4", "nf4", "affine"]


def _model(seed=0):
    """Layers with bell-shaped weights (as trained ones are; nn.Linear's uniform init is not)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256), nn.GELU(), nn.Linear(256, 100))
    with torch.no_grad():
        for layer in model[::2]:
            layer.weight.copy_(torch.distributions.Laplace(0.0, 0.03).sample(layer.weight.shape))
    return model


def _grid_bits(model, names):
    layers = [model.get_submodule(n).quantized_weight() for n in names]
    return sum(8 * q.nbytes for q in layers) / sum(q.num_weights for q in layers)


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("group_size", [32, -1])
def test_lossless_coding_gives_the_dense_codes_and_results(weight_format, group_size):
    torch.manual_seed(1)
    linear = nn.Linear(100, 45)  # K not a multiple of chunk_k or of the group, N not of 32
    dense = tm.MarlinLinear.from_linear(linear, weight_format, group_size)
    q = dense.quantized_weight()
    coded = RansQuantizedWeight.from_dense(q, chunk_k=64 if group_size == 32 else 32)
    codes = formats.unpack_codes(q.packed)[:100]
    assert torch.equal(coded.symbols(), codes)
    assert torch.equal(coded.dequantize(torch.float64), q.dequantize(torch.float64))
    assert torch.equal(coded.weight(), q.weight())
    module = tm.MarlinLinear.from_quantized(coded, dense.bias.detach())
    x = torch.randn(40, 100)
    if has_ops():  # the op's arithmetic contract is the dense op's
        assert torch.equal(module(x), dense(x))
    else:
        torch.testing.assert_close(module(x), dense(x), rtol=1e-5, atol=1e-5)
    assert coded.nbytes == sum(t.numel() * t.element_size() for t in coded.tensors().values())


@pytest.mark.skipif(not has_ops(), reason="this build has no rans ops")
def test_lossless_gemv_equals_the_dense_gemv():
    torch.manual_seed(1)
    dense = tm.MarlinLinear.from_linear(nn.Linear(128, 45), "fp4", 32)
    coded = RansQuantizedWeight.from_dense(dense.quantized_weight(), chunk_k=64)  # two chunks along K
    module = tm.MarlinLinear.from_quantized(coded, dense.bias.detach())
    x = torch.randn(1, 128)
    assert torch.equal(module(x), dense(x))


@pytest.mark.parametrize("kind,number", [("grid", 64), ("tcq", 65)])
def test_state_dict_round_trip_and_guard(kind, number):
    torch.manual_seed(2)
    linear = nn.Linear(64, 40)
    module = tm.MarlinLinear.from_linear(linear, kind, -1, bits=4.0)
    assert module.weight_format == kind and module.group_size == -1
    fresh = tm.MarlinLinear(64, 40, True, kind, -1, layout=RansQuantizedWeight)
    assert fresh.words.numel() == 0
    fresh.load_state_dict(module.state_dict())  # takes the saved stream's length
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), module(x))
    assert fresh.get_extra_state().tolist() == [4, number, -1, 64, 64, rans.DEFAULT_PROB_BITS]
    other = tm.MarlinLinear(64, 40, True, kind, -1, layout=RansQuantizedWeight, prob_bits=14)
    with pytest.raises(ValueError, match="prob_bits=12"):
        other.load_state_dict(module.state_dict())
    wrong_kind = tm.MarlinLinear(64, 40, True, "tcq" if kind == "grid" else "grid", -1, layout=RansQuantizedWeight)
    with pytest.raises(ValueError, match=repr(kind)):
        wrong_kind.load_state_dict(module.state_dict())
    dense = tm.MarlinLinear(64, 40, True, "fp4", 32)
    with pytest.raises(ValueError, match="layout='rans'"):
        dense.load_state_dict(module.state_dict(), strict=False)


def test_loading_a_corrupt_stream_is_refused():
    torch.manual_seed(3)
    module = tm.MarlinLinear.from_linear(nn.Linear(64, 40), "grid", -1, bits=4.0)
    state = module.state_dict()
    state["freqs"] = state["freqs"].clone()
    state["freqs"][128] += 1
    fresh = tm.MarlinLinear(64, 40, True, "grid", -1, layout=RansQuantizedWeight)
    with pytest.raises(ValueError, match="freqs must sum to 2\\^prob_bits"):
        fresh.load_state_dict(state)
    state = module.state_dict()
    state["word_offsets"] = state["word_offsets"].clone()
    state["word_offsets"][-1] = state["words"].numel() + 5
    with pytest.raises(ValueError, match="word_offsets"):
        tm.MarlinLinear(64, 40, True, "grid", -1, layout=RansQuantizedWeight).load_state_dict(state)
    state = module.state_dict()
    state["words"] = state["words"][:-1].clone()  # truncated: decoding finds it
    fresh = tm.MarlinLinear(64, 40, True, "grid", -1, layout=RansQuantizedWeight)
    with pytest.raises(ValueError):
        fresh.load_state_dict(state)
        fresh(torch.randn(1, 64))


@pytest.mark.parametrize("bits", [4.125, 3.125])
@pytest.mark.parametrize("kind", ["tcq", "grid"])
def test_quantize_model_bits_meets_the_target(bits, kind):
    model = _model()
    x = torch.randn(16, 256)
    ref = model(x)
    report = tm.quantize_model(model, bits=bits, **({} if kind == "tcq" else {"weight_format": "grid",
                                                                            "group_size": -1}))
    names = ["0", "2", "4"]
    assert report.replaced == names
    assert _grid_bits(model, names) <= bits
    assert _grid_bits(model, names) > bits - 0.1  # the budget is used, not wasted
    assert set(report.bits_per_layer) == set(names) and "bits per weight per layer" in str(report)
    for name in names:  # the reported error is the weight's
        layer = model.get_submodule(name)
        assert layer.quantized_weight().weight_format == kind  # tcq: the default of round to nearest
        w = _model().get_submodule(name).weight
        err = float((layer.dequantize() - w.detach()).norm() / w.detach().norm())
        assert abs(err - report.relative_errors[name]) < 1e-4
    # Better than the fixed 4-bit format of the same size (int4 g128: 4.125 bits per weight).
    if bits >= 4.125:
        dense = _model()
        tm.quantize_model(dense, "int4", 128)
        with torch.no_grad():
            assert (model(x) - ref).norm() < (dense(x) - ref).norm()


@pytest.mark.parametrize("kind", ["tcq", "grid"])
def test_chunk_k_is_at_most_k_rounded_up(kind):
    """quantize_model(chunk_k=...) is the longest chunk: layers with a smaller K get one chunk
    of K rounded up to 32 (the kernels refuse longer ones), and the model runs."""
    model = _model()
    report = tm.quantize_model(model, kind, -1, bits=3.5, chunk_k=1024)
    for name in report.replaced:
        q = model.get_submodule(name).quantized_weight()
        assert q.chunk_k == -(-q.in_features // 32) * 32
    assert model(torch.randn(2, 256)).shape == (2, 100)


def test_grid_round_to_nearest_on_the_steps():
    """Without rate-aware rounding every code is the nearest grid point of its weight."""
    torch.manual_seed(4)
    linear = nn.Linear(128, 64)
    module = tm.MarlinLinear.from_linear(linear, "grid", -1, bits=3.5)
    q = module.quantized_weight()
    steps = q.scales.float()[0]
    sym = q.symbols().long() - 128
    expected = torch.round(linear.weight.detach().t() / steps).clamp(-127, 127)
    assert torch.equal(sym, expected.long())


@pytest.mark.parametrize("bits", [4.125, 3.125])
def test_refitted_steps_lower_the_error_at_the_same_size(bits, monkeypatch):
    """Round to nearest refits each row's step to its codes by least squares and rounds
    again (the grid's cells have their centroids nearer 0 than their centres): at the
    same budget the weights are closer than with the rms-proportional steps alone."""
    from torch_marlin import rans_quantize

    def error_and_bits():
        model, reference = _model(), _model()
        tm.quantize_model(model, "grid", -1, bits=bits)
        names = ["0", "2", "4"]
        err2 = sum(float((model.get_submodule(n).dequantize() - reference.get_submodule(n).weight.detach())
                         .pow(2).sum()) for n in names)
        norm2 = sum(float(reference.get_submodule(n).weight.detach().pow(2).sum()) for n in names)
        return (err2 / norm2) ** 0.5, _grid_bits(model, names)

    refitted, refitted_bits = error_and_bits()
    monkeypatch.setattr(rans_quantize, "REFIT_STEPS", 0)
    proportional, proportional_bits = error_and_bits()
    assert refitted_bits <= bits and proportional_bits <= bits
    assert refitted < proportional


def test_refitted_steps_never_lose_on_a_tight_budget(monkeypatch):
    """A small layer whose table and states take most of the budget: chasing the finer
    refitted steps ends on a much coarser grid, so the plain steps are kept."""
    from torch_marlin import rans_quantize

    def error():
        torch.manual_seed(3)
        return tm.MarlinLinear.from_linear(nn.Linear(64, 40), "grid", -1, bits=4.0).quantization_error

    refitted = error()
    monkeypatch.setattr(rans_quantize, "REFIT_STEPS", 0)
    assert refitted <= error()


def test_gptq_on_the_grid_beats_round_to_nearest_on_its_hessian():
    linear = _model(5)[0]
    x = torch.randn(2048, 256) @ torch.randn(256, 256)  # correlated inputs
    h = x.t() @ x / x.shape[0]
    rtn = tm.MarlinLinear.from_linear(linear, "grid", -1, bits=3.5)
    gptq = tm.MarlinLinear.from_linear(linear, method="gptq", hessian=h, bits=3.5)
    w = linear.weight.detach()
    out_err = lambda m: float(((m.dequantize() - w) @ x.t()).norm() / (w @ x.t()).norm())
    assert _grid_bits(gptq, [""]) <= 3.5
    assert out_err(gptq) < 0.8 * out_err(rtn)


def test_quantize_model_gptq_bits():
    model = _model()
    calibration = [torch.randn(64, 256) for _ in range(8)]
    report = tm.quantize_model(model, bits=3.5, method="gptq", calibration=calibration)
    assert _grid_bits(model, report.replaced) <= 3.5
    assert set(report.output_errors) == set(report.replaced)
    # GPTQ has no trellis search: it quantizes onto the scalar grid.
    assert all(model.get_submodule(n).quantized_weight().weight_format == "grid" for n in report.replaced)


def test_lossless_entropy_code_model():
    model, dense = _model(), _model()
    tm.quantize_model(dense, "int4", 32)
    report = tm.quantize_model(model, "int4", 32, entropy_code=True)
    x = torch.randn(4, 256)
    for name in report.replaced:
        coded = model.get_submodule(name).quantized_weight()
        assert isinstance(coded, RansQuantizedWeight)
        ref = dense.get_submodule(name).quantized_weight()
        assert torch.equal(coded.dequantize(torch.float64), ref.dequantize(torch.float64))
    torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits must be a number of bits per weight"):
        tm.quantize_model(_model(), bits=0.5)
    with pytest.raises(ValueError, match="bits must be"):
        tm.MarlinLinear.from_linear(nn.Linear(32, 32), bits=float("nan"))
    with pytest.raises(ValueError, match="bits= selects the grid"):
        tm.quantize_model(_model(), "int4", 32, bits=3.5)
    with pytest.raises(ValueError, match="exclude each other"):
        tm.quantize_model(_model(), bits=3.5, entropy_code=True)
    with pytest.raises(ValueError, match="group_size must be -1 for weight_format='grid'"):
        tm.MarlinLinear(32, 32, True, "grid", 128, layout=RansQuantizedWeight)
    with pytest.raises(ValueError, match="weight_format must be one of"):
        tm.MarlinLinear(32, 32, True, "grid", -1)  # the dense layout has no grid
    with pytest.raises(ValueError, match="method must be 'rtn'"):
        tm.MarlinLinear.from_linear(nn.Linear(32, 32), method="absmax", bits=3.5)
    with pytest.raises(ValueError, match="hessian"):
        tm.MarlinLinear.from_linear(nn.Linear(32, 32), method="gptq", bits=3.5)
    with pytest.raises(ValueError, match="chunk_k must be a positive multiple of 32"):
        tm.quantize_model(_model(), bits=3.5, chunk_k=100)
    with pytest.raises(ValueError, match="prob_bits must be an integer"):
        tm.quantize_model(_model(), bits=3.5, prob_bits=16)
    with pytest.raises(ValueError, match="weighting must be one of"):
        tm.quantize_model(_model(), bits=3.5, weighting="sizes")
    with pytest.raises(ValueError, match="row_power must be"):
        tm.quantize_model(_model(), bits=3.5, row_power=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'act_ordr'"):
        tm.quantize_model(_model(), bits=3.5, act_ordr=True)
    with pytest.raises(ValueError, match="made by the rate-controlled quantizer"):
        RansQuantizedWeight.from_float(torch.randn(8, 32), "grid", -1)
    with pytest.raises(ValueError, match="group_size must be -1 for weight_format='tcq'"):
        tm.MarlinLinear(32, 32, True, "tcq", 128, layout=RansQuantizedWeight)
    with pytest.raises(ValueError, match="made by the rate-controlled quantizer"):
        RansQuantizedWeight.from_float(torch.randn(8, 32), "tcq", -1)
    with pytest.raises(ValueError, match="weight_format='tcq' is made by round to nearest"):
        tm.MarlinLinear.from_linear(nn.Linear(32, 32), "tcq", -1, method="gptq", hessian=torch.eye(32), bits=3.5)
    with pytest.raises(ValueError, match="weight_format='tcq' is made by round to nearest"):
        tm.quantize_model(_model(), "tcq", -1, bits=3.5, method="gptq", calibration=[torch.randn(4, 256)])
    with pytest.raises(ValueError, match="bits= selects the grid"):
        tm.quantize_model(_model(), "tcq", 128, bits=3.5)
    symbols = torch.full((64, 32), 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zeros must be None for weight_format='tcq'"):
        RansQuantizedWeight.from_codes(symbols, torch.ones(1, 32, dtype=torch.float16),
                                       torch.zeros(1, 32, dtype=torch.float16), "tcq", -1)
    with pytest.raises(ValueError, match="group_size must be -1 for weight_format='tcq'"):
        RansQuantizedWeight.from_codes(symbols, torch.ones(2, 32, dtype=torch.float16), None, "tcq", 32)
    with pytest.raises(ValueError, match="chunk_k must be a multiple of group_size"):
        RansQuantizedWeight.from_dense(tm.MarlinLinear.from_linear(nn.Linear(256, 32), "fp4", 128)
                                       .quantized_weight(), chunk_k=96)


def test_expert_stacks_are_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with pytest.raises(ValueError, match="expert stacks are not entropy-coded.*model.layers.0.mlp.experts"):
        tm.quantize_model(model, bits=3.5)
    report = tm.quantize_model(model, bits=3.5, exclude=["experts", "lm_head"])
    assert "model.layers.0.self_attn.q_proj" in report.replaced


@pytest.mark.skipif(not has_ops(), reason="this build has no rans ops")
def test_opcheck_autograd_and_compile():
    module = tm.MarlinLinear.from_linear(_model(6)[0], "grid", -1, bits=4.0)
    q = module.quantized_weight()
    x = torch.randn(3, 256, requires_grad=True)
    args = (x, q.words, q.word_offsets, q.states, q.freqs, q.scales, None, module.bias.detach(), "grid", 256,
            q.chunk_k, q.prob_bits, -1)
    torch.library.opcheck(torch.ops.marlin.rans_gemm, args)
    y = module(x)
    y.square().sum().backward()
    w = module.dequantize()
    expected = (2 * (x.detach() @ w.t() + module.bias.detach())) @ w
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-4)
    compiled = torch.compile(module, fullgraph=True)
    assert torch.equal(compiled(x.detach()), module(x.detach()))


# --- the trellis-coded grid ("tcq") ------------------------------------------------------------

def _tcq_weight(k=100, n=45, chunk_k=32, seed=7):
    """A tcq weight from random symbols: K not a multiple of chunk_k, N not of 32."""
    gen = torch.Generator().manual_seed(seed)
    symbols = (128 + torch.randn(k, n, generator=gen) * 12).round().clamp(0, 255).to(torch.uint8)
    symbols[0, 0], symbols[1, 1] = 0, 255
    steps = (0.01 + torch.rand(1, n, generator=gen) * 0.02).half()
    return symbols, steps, RansQuantizedWeight.from_codes(symbols, steps, None, "tcq", -1, chunk_k)


def test_tcq_weight_is_the_trellis_levels_times_the_steps():
    symbols, steps, q = _tcq_weight()
    assert q.weight_format == "tcq" and q.freqs.shape == (256,) and q.zeros is None
    assert torch.equal(q.symbols(), symbols)
    expected = (torch.tensor(tcq_levels_one_by_one(symbols.tolist(), 32)).double() * steps.double()).t()
    assert torch.equal(q.dequantize(torch.float64), expected)
    assert torch.equal(q.weight(), expected.float())  # levels and fp16 steps are exact in fp32
    module = tm.MarlinLinear.from_quantized(q, torch.randn(45))
    x = torch.randn(5, 100)
    torch.testing.assert_close(module(x), x @ expected.float().t() + module.bias, rtol=1e-5, atol=1e-5)
    # The grid's reading of the same symbols differs: the trellis is not a relabelling.
    grid = RansQuantizedWeight.from_codes(symbols, steps, None, "grid", -1, 32)
    assert not torch.equal(grid.dequantize(torch.float64), expected)


@pytest.mark.skipif(not has_ops(), reason="built without the C++ ops")
def test_tcq_op_equals_the_reference_and_autograd():
    _, _, q = _tcq_weight(k=256, n=70, chunk_k=64)
    module = tm.MarlinLinear.from_quantized(q, torch.randn(70))
    x = torch.randn(3, 256, requires_grad=True)
    args = (x, q.words, q.word_offsets, q.states, q.freqs, q.scales, None, module.bias.detach(), "tcq", 256,
            q.chunk_k, q.prob_bits, -1)
    w = q.dequantize()
    torch.testing.assert_close(torch.ops.marlin.rans_gemm(*args), x.detach() @ w.t() + module.bias.detach(),
                               rtol=1e-4, atol=1e-4)
    torch.library.opcheck(torch.ops.marlin.rans_gemm, args)
    module(x).square().sum().backward()
    expected = (2 * (x.detach() @ w.t() + module.bias.detach())) @ w
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-4)


def test_tcq_search_beats_the_grid_at_the_same_size():
    """The trellis search at the same budget: a smaller weight error than the scalar grid,
    and its codes decode (through the layout) to the weight it reports."""
    linear = _model(8)[2]
    w = linear.weight.detach()
    errors = {}
    for kind in ("grid", "tcq"):
        module = tm.MarlinLinear.from_linear(linear, kind, -1, bits=3.5)
        assert _grid_bits(module, [""]) <= 3.5
        errors[kind] = float((module.dequantize() - w).norm() / w.norm())
        assert abs(errors[kind] - module.quantization_error) < 1e-5
    assert errors["tcq"] < 0.95 * errors["grid"]


def test_rate_aware_trellis_search_meets_the_budget(monkeypatch):
    """The rate-aware search (off by default) takes its own codes, stays within the budget
    and reports the error of the weight it decodes to."""
    from torch_marlin import rans_quantize

    linear = _model(10)[0]
    plain = tm.MarlinLinear.from_linear(linear, "tcq", -1, bits=3.0)
    monkeypatch.setattr(rans_quantize, "TCQ_LAMBDA", 0.3)
    aware = tm.MarlinLinear.from_linear(linear, "tcq", -1, bits=3.0)
    assert _grid_bits(aware, [""]) <= 3.0
    w = linear.weight.detach()
    assert abs(float((aware.dequantize() - w).norm() / w.norm()) - aware.quantization_error) < 1e-5
    assert not torch.equal(aware.quantized_weight().symbols(), plain.quantized_weight().symbols())


def test_tcq_fills_a_small_budget():
    """At 2 bits a 100 x 45 layer's table and states take most of the budget, and the size
    hardly moves with the step once most codes are 0: the step search still fills it."""
    torch.manual_seed(0)
    module = tm.MarlinLinear.from_linear(nn.Linear(100, 45), "tcq", -1, bits=2.0)
    assert 1.8 < _grid_bits(module, [""]) <= 2.0  # the table, states and steps alone take 1.55
    assert module.quantization_error < 0.95


@pytest.mark.parametrize("kind", ["tcq", "grid"])
def test_an_all_zero_weight_codes_to_zeros(kind):
    linear = nn.Linear(64, 40)
    with torch.no_grad():
        linear.weight.zero_()
    module = tm.MarlinLinear.from_linear(linear, kind, -1, bits=4.0)
    assert _grid_bits(module, [""]) <= 4.0
    assert torch.equal(module.dequantize(), torch.zeros(40, 64)) and module.quantization_error == 0


def test_trellis_search_is_the_best_path():
    """On short rows the Viterbi search finds the path of least cost among all code
    sequences near the weights (exhaustive: 5 codes around y / 2 per step)."""
    import itertools

    from torch_marlin import rans_quantize

    torch.manual_seed(9)
    y = torch.randn(4, 5) * 5
    bits = torch.rand(256) * 8
    for lam, table in ((0.0, None), (0.3, bits)):
        codes = rans_quantize.trellis_search(y, 32, lam, table)
        for row in range(y.shape[0]):
            def cost(ks):
                sym = torch.tensor(ks).unsqueeze(1) + 128
                levels = torch.tensor(tcq_levels_one_by_one(sym.tolist(), 32))[:, 0]
                rate = 0.0 if table is None else lam * float(table[sym[:, 0]].sum())
                return float((y[row] - levels).square().sum()) + rate
            near = [range(int(torch.floor(v / 2)) - 2, int(torch.floor(v / 2)) + 3) for v in y[row]]
            best = min(cost(list(ks)) for ks in itertools.product(*near))
            assert cost(codes[row].tolist()) == pytest.approx(best, rel=1e-5)
