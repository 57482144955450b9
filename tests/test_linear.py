"""MarlinLinear, quantized_linear, quantize_model: behaviour as an nn.Linear drop-in."""

import warnings

import pytest
import torch
from torch import nn

import torch_marlin as tm
from torch_marlin import formats

from test_ops import assert_close_to_reference


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
@pytest.mark.parametrize("in_features, out_features", [(1, 1), (3, 5), (100, 7), (129, 33), (1000, 31)])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_any_linear_shape(weight_format, in_features, out_features, group_size):
    linear = nn.Linear(in_features, out_features)
    q = tm.MarlinLinear.from_linear(linear, weight_format, group_size)
    assert (q.in_features, q.out_features) == (in_features, out_features)
    w64 = q.quantized_weight().dequantize(torch.float64)
    assert w64.shape == (out_features, in_features)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, in_features).to(dtype)
        y = q(x)
        assert y.shape == (2, 3, out_features) and y.dtype == dtype
        assert_close_to_reference(y.view(6, -1), x.view(6, -1), w64.t(), linear.bias.detach().to(dtype))


def test_quantized_output_is_close_to_float_linear():
    linear = nn.Linear(512, 256)
    x = torch.randn(16, 512)
    for fmt, bound in (("fp4", 0.12), ("uint4", 0.11), ("int4", 0.11)):
        q = tm.MarlinLinear.from_linear(linear, fmt, 64)
        with torch.no_grad():
            rel = float((q(x) - linear(x)).norm() / linear(x).norm())
        assert rel < bound, (fmt, rel)


def test_functional_form_matches_module():
    linear = nn.Linear(64, 24)
    module = tm.MarlinLinear.from_linear(linear, "int4", 32)
    x = torch.randn(5, 64)
    assert torch.equal(tm.quantized_linear(x, module.quantized_weight(), module.bias), module(x))


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_state_dict_and_safetensors_roundtrip(tmp_path, weight_format):
    from safetensors.torch import load_file, save_file

    linear = nn.Linear(100, 40)
    q = tm.MarlinLinear.from_linear(linear, weight_format, 32)
    expected_keys = {"packed", "scales", "bias", "_extra_state"} | ({"zeros"} if formats.has_zeros(weight_format) else set())
    assert set(q.state_dict()) == expected_keys
    save_file(q.state_dict(), tmp_path / "layer.safetensors")
    fresh = tm.MarlinLinear(100, 40, weight_format=weight_format, group_size=32)
    fresh.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, 100)
    assert torch.equal(fresh(x), q(x))
    wrong = tm.MarlinLinear(100, 40, weight_format=weight_format, group_size=64)
    with pytest.raises(ValueError, match="group_size=32.*group_size=64"):
        wrong.load_state_dict(q.state_dict())


def test_state_dict_of_another_format_is_refused():
    """fp4 and int4 weights have identical shapes: only the saved layout tells them apart."""
    q = tm.MarlinLinear.from_linear(nn.Linear(64, 8), "fp4", 32)
    state = q.state_dict()
    for kwargs, message in [(dict(weight_format="int4", group_size=32), "weight_format='fp4'"),
                            (dict(weight_format="fp4", group_size=32, in_features=60), "in_features=64")]:
        in_features = kwargs.pop("in_features", 64)
        other = tm.MarlinLinear(in_features, 8, **kwargs)
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="_extra_state"):
        q.load_state_dict({**state, "_extra_state": torch.tensor([1.0])})


def test_dtype_casts_keep_fp16_scales():
    q = tm.MarlinLinear.from_linear(nn.Linear(64, 8), "uint4", 32)
    before = q.scales.clone()
    q.to(torch.bfloat16)
    assert q.scales.dtype == torch.float16 and q.zeros.dtype == torch.float16 and torch.equal(q.scales, before)
    assert q.bias.dtype == torch.bfloat16 and q.packed.dtype == torch.int32
    q.float().half()
    assert q.scales.dtype == torch.float16
    assert q(torch.randn(2, 64, dtype=torch.float16)).dtype == torch.float16
    q.to("meta")
    assert q.scales.device.type == "meta" and q.scales.dtype == torch.float16


def test_extra_repr():
    q = tm.MarlinLinear.from_linear(nn.Linear(256, 64), "fp4", 128)
    text = repr(q)
    assert "in_features=256" in text and "weight_format=fp4" in text and "group_size=128" in text
    assert "bits_per_weight=4.12" in text  # 4 bits + one fp16 scale per 128


def test_input_gradient_matches_reference():
    linear = nn.Linear(96, 40)
    q = tm.MarlinLinear.from_linear(linear, "fp4", 32)
    w = q.quantized_weight().dequantize(torch.float64)
    x = torch.randn(4, 96, dtype=torch.float64)
    grad_out = torch.randn(4, 40, dtype=torch.float64)
    xq = x.float().requires_grad_()
    q(xq).backward(grad_out.float())
    expected = grad_out @ w
    assert torch.allclose(xq.grad.double(), expected, rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in q.parameters())


def test_lora_adapter_trains_through_quantized_layers():
    # The adapter sits on the first layer, so its gradient must flow back
    # through the second, quantized layer.
    torch.manual_seed(0)
    base1 = tm.MarlinLinear.from_linear(nn.Linear(32, 32), "int4", 32)
    base2 = tm.MarlinLinear.from_linear(nn.Linear(32, 16), "fp4", 32)
    lora_a, lora_b = nn.Linear(32, 4, bias=False), nn.Linear(4, 32, bias=False)
    nn.init.zeros_(lora_b.weight)
    delta = torch.randn(32, 2) @ torch.randn(2, 32) * 0.2  # a rank-2 change the adapter can learn
    x = torch.randn(512, 32)
    with torch.no_grad():
        target = base2(torch.relu(base1(x) + x @ delta.t()))
    opt = torch.optim.Adam(list(lora_a.parameters()) + list(lora_b.parameters()), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = ((base2(torch.relu(base1(x) + lora_b(lora_a(x)))) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert lora_a.weight.grad is not None and lora_a.weight.grad.abs().sum() > 0
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])


class SmallModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.act = nn.GELU()
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10, bias=False)

    def forward(self, x):
        return self.head(x + self.down(self.act(self.up(x))))


def test_quantize_model_include_exclude_and_report():
    model = SmallModel()
    report = tm.quantize_model(model, "uint4", 32, exclude=["head"])
    assert report.replaced == ["up", "down"] and report.skipped == ["head"]
    assert isinstance(model.up, tm.MarlinLinear) and type(model.head) is nn.Linear
    float_bytes = ((64 * 128 + 128) + (128 * 64 + 64)) * 4  # weights + biases of up and down
    assert report.bytes_before == float_bytes
    assert report.bytes_after < float_bytes / 4 and report.bytes_saved == report.bytes_before - report.bytes_after
    assert set(report.relative_errors) == {"up", "down"}
    only = SmallModel()
    assert tm.quantize_model(only, include="do*").replaced == ["down"]


def test_patterns_that_match_nothing_are_warned_about():
    with pytest.warns(UserWarning) as caught:
        report = tm.quantize_model(SmallModel(), "fp4", 64, include=["up", "mlp.*"], exclude=["haed"])
    assert report.replaced == ["up"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "include pattern 'mlp.*' matches no linear layer" in messages[0]
    assert "exclude pattern 'haed' matches no linear layer" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tm.quantize_model(SmallModel(), "fp4", 64, include=["*"], exclude=["head", "do*"])  # all match


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.ReLU())],
                         ids=["sequential", "no-linear-layers"])
@pytest.mark.parametrize("argument, message", [
    ({"group_size": 100}, r"group_size must be one of \(16, 32, 64, 128, 256, -1\), got 100"),
    ({"weight_format": "nf3"}, r"weight_format must be one of \('fp4', 'uint4', 'int4', 'nf4', 'affine'\), got 'nf3'"),
    ({"method": "bogus"}, r"method must be one of \('mse', 'absmax', 'gptq'\), or with sparsity='2:4' one of "
                          r"\('magnitude', 'wanda', 'sparsegpt', 'mse', 'absmax'\); got 'bogus'"),
])
def test_quantize_model_checks_arguments_before_any_layer(model, argument, message):
    """Not "0: group_size ...": the error is about the argument, not the first layer (named "0"
    in an nn.Sequential), and it comes even when there is no layer to quantize."""
    with pytest.raises(ValueError, match="^" + message):
        tm.quantize_model(model, **argument)


def test_from_linear_lists_every_method():
    with pytest.raises(ValueError, match=r"one of \('mse', 'absmax', 'gptq'\), or with sparsity='2:4' one of "
                                         r"\('magnitude', 'wanda', 'sparsegpt', 'mse', 'absmax'\); got 'bogus'"):
        tm.MarlinLinear.from_linear(nn.Linear(64, 8), method="bogus")


def test_torch_compile_fullgraph():
    model = SmallModel()
    tm.quantize_model(model, "fp4", 64)
    x = torch.randn(3, 64)
    expected = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), expected)
    compiled_inductor = torch.compile(model, fullgraph=True)
    assert torch.allclose(compiled_inductor(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, error, message", [
    (lambda: tm.MarlinLinear(0, 4), ValueError, "in_features must be a positive int"),
    (lambda: tm.MarlinLinear(4, 4, weight_format="q4"), ValueError, "weight_format"),
    (lambda: tm.MarlinLinear(4, 4, group_size=100), ValueError, "group_size"),
    (lambda: tm.MarlinLinear.from_linear(nn.Conv1d(2, 2, 1)), TypeError, "nn.Linear"),
    (lambda: tm.MarlinLinear.from_linear(nn.Linear(8, 4), "int4", 32)(torch.randn(2, 9)), ValueError, r"in_features=8"),
    (lambda: tm.quantize_model("model"), TypeError, "nn.Module"),
    (lambda: tm.quantize_model(SmallModel(), exclude=[1]), TypeError, "exclude"),
    (lambda: tm.quantized_linear(torch.randn(2, 8), torch.randn(4, 8)), TypeError, "QuantizedWeight"),
])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
