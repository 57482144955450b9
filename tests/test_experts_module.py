"""MarlinExpertsLinear and MarlinExperts: opcheck, autograd, torch.compile, state_dict
guard, quantize_model on transformers experts modules (found by structure)."""

import warnings

import pytest
import torch
from torch import nn

import torch_marlin as tm
from torch_marlin import formats
from torch_marlin.moe import UnsupportedExperts, experts_structure

from test_experts import random_stack

transformers = pytest.importorskip("transformers")


def test_opcheck():
    for weight_format in formats.WEIGHT_FORMATS:
        q = random_stack(4, 64, 24, weight_format, 32)
        ids = torch.tensor([[0, 3], [3, 1], [2, 0]])
        x = torch.randn(3, 64, requires_grad=True)
        weights = torch.rand(3, 2, requires_grad=True)
        bias = torch.randn(4, 24, requires_grad=True)
        stack = (q.packed, q.scales, q.zeros)
        torch.library.opcheck(torch.ops.marlin.moe_gemm.default, (x, ids, weights, *stack, bias, weight_format, 32))
        torch.library.opcheck(torch.ops.marlin.moe_gemm.default,
                              (torch.randn(3, 2, 64).half(), ids.int(), None, *stack, None, weight_format, 32))
    q = random_stack(4, 64, 24, "int4", 32)
    torch.library.opcheck(torch.ops.marlin._moe_gemm_grad_x.default,
                          (torch.randn(3, 2, 24), ids, q.packed, q.scales, q.zeros, "int4", 32))


def test_gradients_match_float64_reference():
    q = random_stack(5, 64, 24, "uint4", 32)
    b64 = q.dequantize(torch.float64)  # [E, N, K]
    ids = torch.tensor([[0, 3], [3, 1], [2, 3]])
    grad = torch.randn(3, 24, dtype=torch.float64)
    x = torch.randn(3, 64, dtype=torch.float64)
    w = torch.rand(3, 2, dtype=torch.float64)
    bias = torch.randn(5, 24, dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (x, w, bias)]
    y = torch.ops.marlin.moe_gemm(leaves[0], ids, leaves[1], q.packed, q.scales, q.zeros, leaves[2], "uint4", 32)
    y.backward(grad.float())
    # float64 reference through autograd of the plain formula
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    rx, rw, rb = ref_leaves
    y_pairs = torch.einsum("tk,tjnk->tjn", rx, b64[ids]) + rb[ids]
    (rw.unsqueeze(-1) * y_pairs).sum(1).backward(grad)
    for got, ref in zip(leaves, ref_leaves):
        assert torch.allclose(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-5), (got.grad, ref.grad)
    # per-pair x: gradient per row
    xp = torch.randn(3, 2, 64, requires_grad=True)
    torch.ops.marlin.moe_gemm(xp, ids, None, q.packed, q.scales, q.zeros, None, "uint4", 32).sum().backward()
    expected = b64[ids].sum(2)  # d/dx of sum_n (x @ B)[n] = row sums of W
    assert torch.allclose(xp.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_experts_linear_module_and_state_dict_guard(tmp_path):
    from safetensors.torch import load_file, save_file

    w = torch.randn(3, 20, 50)
    bias = torch.randn(3, 20)
    layer = tm.MarlinExpertsLinear.from_float(w, bias, "int4", 32)
    assert (layer.num_experts, layer.in_features, layer.out_features) == (3, 50, 20)
    assert set(layer.state_dict()) == {"packed", "scales", "bias", "_extra_state"}
    assert layer.get_extra_state().tolist() == [2, 2, 32, 50, 3]
    x, ids = torch.randn(4, 50), torch.tensor([[0], [2], [2], [1]])
    y = layer(x, ids)
    wq = layer.dequantize()
    assert torch.allclose(y[:, 0], torch.einsum("tk,tnk->tn", x, wq[ids[:, 0]]) + bias[ids[:, 0]], atol=1e-4)
    save_file(layer.state_dict(), tmp_path / "stack.safetensors")
    fresh = tm.MarlinExpertsLinear(3, 50, 20, weight_format="int4", group_size=32)
    fresh.load_state_dict(load_file(tmp_path / "stack.safetensors"))
    assert torch.equal(fresh(x, ids), y)
    for kwargs, message in [(dict(num_experts=4), r"num_experts=3.*num_experts=4"),
                            (dict(weight_format="fp4"), "weight_format='int4'"),
                            (dict(group_size=64), "group_size=32")]:
        args = dict(num_experts=3, in_features=50, out_features=20, weight_format="int4", group_size=32)
        args.update(kwargs)
        other = tm.MarlinExpertsLinear(**args)
        with pytest.raises((ValueError, RuntimeError), match=message):
            other.load_state_dict(layer.state_dict())
    dense = tm.MarlinLinear(50, 20, weight_format="int4", group_size=32)
    with pytest.raises(ValueError, match="layout"):
        dense.set_extra_state(layer.get_extra_state())
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert layer(x.bfloat16(), ids).dtype == torch.bfloat16
    assert "num_experts=3" in repr(layer) and "bits_per_weight=5.76" in repr(layer)  # K padded 50 -> 64


def tiny_qwen3_moe(**over):
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=5, num_experts_per_tok=2,
                                         **over)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def test_quantize_model_quantizes_experts_by_default_and_patterns_apply():
    model = tiny_qwen3_moe()
    report = tm.quantize_model(model, "fp4", 32, method="absmax")
    assert report.experts_replaced == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[0].mlp.experts, tm.MarlinExperts)
    assert "2 experts modules" in str(report)
    expert_params = 2 * 5 * (2 * 32 * 64 + 64 * 32)
    assert report.bytes_before >= expert_params * 4
    model = tiny_qwen3_moe()
    report = tm.quantize_model(model, "fp4", 32, exclude="layers.1.mlp.experts", method="absmax")
    assert report.experts_replaced == ["model.layers.0.mlp.experts"]
    assert report.experts_skipped == ["model.layers.1.mlp.experts"]
    report = tm.quantize_model(tiny_qwen3_moe(), "fp4", 32, include="*.self_attn.*", method="absmax")
    assert report.experts_replaced == [] and len(report.experts_skipped) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pattern matching only experts modules matches something
        report = tm.quantize_model(tiny_qwen3_moe(), "fp4", 32, exclude="experts", method="absmax")
    assert report.experts_replaced == [] and len(report.experts_skipped) == 2


def test_torch_compile_fullgraph_on_a_tiny_moe_model():
    model = tiny_qwen3_moe()
    tm.quantize_model(model, "int4", 32, method="absmax")
    ids = torch.randint(0, 96, (2, 6))
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(ids).logits, expected)
        block = model.model.layers[0].mlp  # the MoE block, through inductor
        hidden = torch.randn(2, 6, 64)
        out, ref = torch.compile(block, fullgraph=True)(hidden), block(hidden)
        out, ref = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_unknown_experts_classes_stay_float_with_a_warning():
    class HandRolledExperts(nn.Module):  # 3-D stacks but its own forward: not something to guess at
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(4, 8, 16))
            self.w2 = nn.Parameter(torch.randn(4, 16, 8))

        def forward(self, x):
            return x

    model = nn.Sequential(nn.Linear(16, 16), HandRolledExperts(), nn.Conv1d(4, 4, 3))  # a conv is no expert
    with pytest.warns(UserWarning, match="HandRolledExperts"):
        report = tm.quantize_model(model, "fp4", 32, method="absmax")
    assert report.replaced == ["0"] and list(report.experts_unsupported) == ["1"]
    assert isinstance(model[1], HandRolledExperts)
    with pytest.raises(UnsupportedExperts, match="its forward is its own"):
        experts_structure(model[1])


def test_a_gate_that_needs_the_weights_is_refused():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class PeekingExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(3, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(3, 8, 8))

        def _apply_gate(self, gate_up):  # reads a weight stack: cannot run on the quantized module
            return gate_up[..., :8] * self.gate_up_proj.mean()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    config = transformers.PretrainedConfig()
    config._experts_implementation = "eager"
    model = nn.Sequential(PeekingExperts(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tm.quantize_model(model, "fp4", 32, method="absmax")
    assert "0" in report.experts_unsupported and "gating does not run" in report.experts_unsupported["0"]
    assert any("PeekingExperts" in str(w.message) for w in caught)


def test_experts_bad_input_is_named():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class MismatchedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(3, 8, 8))  # E differs from gate_up_proj's
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    with pytest.raises(UnsupportedExperts, match="down_proj has 3 experts, gate_up_proj has 4"):
        experts_structure(MismatchedExperts(transformers.PretrainedConfig()))
    model = tiny_qwen3_moe()
    tm.quantize_model(model, "int4", 32, method="absmax")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 64)
    with pytest.raises(IndexError, match=r"expert_ids must lie in \[0, E\) = \[0, 5\)"):
        experts(x, torch.tensor([[0, 5], [1, 2], [3, 4]]), torch.rand(3, 2))
    with pytest.raises(RuntimeError, match="topk_weights must have expert_ids' shape"):
        experts.down_proj(torch.randn(3, 2, 32), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 3))
    with pytest.raises(RuntimeError, match="expert_ids must be int32 or int64"):
        experts(x, torch.zeros(3, 2), torch.rand(3, 2))
    with pytest.raises(ValueError, match=r"x must have shape \[T, in_features=64\]"):
        experts.gate_up_proj(torch.randn(3, 60), torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize("variant", ["no gate, post-expert norm", "transposed with bias"])
def test_marlin_experts_match_transformers_implementations(variant):
    """Any @use_experts_implementation class: MarlinExperts computes what transformers'
    own experts implementations compute on the same module holding the dequantized weights."""
    import copy

    from transformers.integrations.moe import use_experts_implementation

    no_gate = variant.startswith("no gate")

    @use_experts_implementation(has_gate=not no_gate, has_post_expert_norm=no_gate, is_transposed=not no_gate,
                                has_bias=not no_gate)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            e, h, i = 5, 64, 32
            first = (e, h, i if no_gate else 2 * i) if not no_gate else (e, i, h)
            self.register_parameter("up_proj" if no_gate else "gate_up_proj", nn.Parameter(torch.randn(first) * 0.1))
            self.down_proj = nn.Parameter(torch.randn((e, h, i) if no_gate else (e, i, h)) * 0.1)
            if not no_gate:
                self.gate_up_proj_bias = nn.Parameter(torch.randn(e, 2 * i) * 0.1)
                self.down_proj_bias = nn.Parameter(torch.randn(e, h) * 0.1)
            else:
                self.post_expert_norm = nn.LayerNorm(h)
            self.act_fn = nn.GELU()
            self.num_experts = e

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    config = transformers.PretrainedConfig()
    source = Experts(config)
    marlin = tm.MarlinExperts.from_float(source, "int4", 32, method="absmax")
    reference = copy.deepcopy(source)
    with torch.no_grad():
        for name, stack in marlin.stacks().items():
            w = stack.dequantize()
            getattr(reference, name).copy_(w.transpose(1, 2) if marlin.structure.is_transposed else w)
    x = torch.randn(7, 64)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 2), -1)
    with torch.no_grad():
        got = marlin(x, ids, weights)
        for impl in ("batched_mm", "grouped_mm"):
            reference.config._experts_implementation = impl
            want = reference(x, ids, weights)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (impl, (got - want).abs().max())
