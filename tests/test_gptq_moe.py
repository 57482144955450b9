"""GPTQ for expert stacks (torch_marlin.moe_gptq): each expert's update against a float64
reference built from the routing by hand (an expert without tokens, one with fewer tokens
than K), padding left out, act-order refused, quantize_model on a routed model, and
per-expert nn.Linear models through the dense path."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import torch_marlin as tm
from torch_marlin import formats
from torch_marlin.calibration import ModuleCall
from torch_marlin.gptq import gptq_quantize
from torch_marlin.layouts.dense import quantize_weight
from torch_marlin.moe_gptq import calibrate_experts

from test_gptq import correlated_inputs

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 4, 2


def experts_module(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K)
        module = Qwen3MoeExperts(config)
    else:  # transposed stacks, biases, interleaved gate/up, clamped SwiGLU
        config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                           num_experts_per_tok=TOP_K)
        module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02 if p.dim() == 2 else 0.3)
    return module.eval()


def routing(tokens: int, seed: int = 0) -> torch.Tensor:
    """top-2 expert ids [T, 2]: expert 0 never chosen, expert 1 by 5 tokens (< K = 32)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.full((tokens,), 2), torch.full((tokens,), 3)], 1)
    flip = torch.rand(tokens, generator=g) < 0.5
    ids[flip] = ids[flip].flip(1)
    ids[:5, 1] = 1
    return ids


def gate_reference(kind: str, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The gating written out from the models' code."""
    if kind == "qwen3_moe":
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
    gate, up = h[..., ::2].clamp(max=module.limit), h[..., 1::2].clamp(-module.limit, module.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * module.alpha))


def reference_stacks(kind, module, x, ids, weight_format, group_size):
    """Per expert, from the routing read token by token, in float64: the first stack by GPTQ on
    the routed rows' Hessian, down_proj on the rows through the quantized first stack and the
    gating; shrunk toward the diagonal below K rows, round to nearest without rows."""
    transposed = kind == "gpt_oss"
    stacks = {}
    for param in ("gate_up_proj", "down_proj"):
        w = getattr(module, param).detach()
        stacks[param] = (w.transpose(1, 2) if transposed else w).float()
    out = {"gate_up_proj": [], "down_proj": []}
    for e in range(EXPERTS):
        rows = [x[t] for t in range(x.shape[0]) if e in ids[t].tolist()]
        inputs = torch.stack(rows).double() if rows else None
        for param in ("gate_up_proj", "down_proj"):
            w = stacks[param][e]
            if inputs is None:
                out[param].append(quantize_weight(w, weight_format, group_size, "mse").dequantize(torch.float64))
                continue
            n, k = inputs.shape
            h = inputs.t() @ inputs / n
            if n < k:
                h = (n / k) * h + (1 - n / k) * torch.diag(torch.diagonal(h))
            q = gptq_quantize(w, h, weight_format, group_size).qweight.dequantize(torch.float64)
            out[param].append(q)
            if param == "gate_up_proj":
                pre = inputs @ q.t()
                if transposed:
                    pre = pre + module.gate_up_proj_bias[e].double()
                inputs = gate_reference(kind, module, pre)
    return out


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_per_expert_update_matches_float64_reference(kind, weight_format):
    module = experts_module(kind)
    tokens, group_size = 96, 16
    x = correlated_inputs(tokens, HIDDEN)
    ids = routing(tokens)
    weights = torch.full((tokens, TOP_K), 0.5)
    # A second batch whose padded positions all go to expert 0: they must not count.
    pad_x = correlated_inputs(8, HIDDEN, seed=1)
    pad_ids = torch.tensor([[2, 3]] * 4 + [[0, 1]] * 4)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]]) != 0  # as the engine hands it on
    calls = [ModuleCall((x, ids, weights), {}, None), ModuleCall((pad_x, pad_ids, weights[:8]), {}, mask)]
    quantized, errors, totals = calibrate_experts(module, calls, weight_format, group_size)
    all_x, all_ids = torch.cat([x, pad_x[:4]]), torch.cat([ids, pad_ids[:4]])
    want = reference_stacks(kind, module, all_x, all_ids, weight_format, group_size)
    for param, stack in quantized.stacks().items():
        got = stack.quantized_weight()
        for e in range(EXPERTS):
            assert torch.equal(got.expert(e).dequantize(torch.float64), want[param][e]), (param, e)
        assert [entry.rule for entry in errors[param]] == ["rtn", "gptq-shrunk", "gptq", "gptq"]
        assert [entry.tokens for entry in errors[param]] == [0, 5] + [int((all_ids == e).any(-1).sum()) for e in (2, 3)]
        assert math.isnan(errors[param][0].rtn)
        rtn, gptq = totals[param]
        assert gptq < rtn, (param, totals[param])
        for entry in errors[param][2:]:  # full-rank experts: better than round to nearest on their tokens
            assert entry.gptq < entry.rtn
    if kind == "gpt_oss":
        assert torch.equal(quantized.gate_up_proj.bias, module.gate_up_proj_bias)


def test_act_order_is_refused_for_stacks_except_with_one_group():
    module = experts_module("qwen3_moe")
    x = correlated_inputs(64, HIDDEN)
    calls = [ModuleCall((x, routing(64), torch.ones(64, TOP_K)), {}, None)]
    with pytest.raises(ValueError, match="act_order=True cannot be used for expert stacks"):
        calibrate_experts(module, calls, "int4", 16, act_order=True)
    quantized, _, _ = calibrate_experts(module, calls, "int4", -1, act_order=True)  # order is free
    assert quantized.gate_up_proj.quantized_weight().group_size == -1


def tiny_moe(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    else:
        config = transformers.Qwen3MoeConfig(**common, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                                             num_experts=4, num_experts_per_tok=2)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_quantize_model_calibrates_stacks_sequentially_and_can_keep_rtn():
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = tiny_moe("mixtral")
    report = tm.quantize_model(model, "int4", 16, method="gptq", calibration=batches, exclude=["lm_head"])
    stacks = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    assert sorted(report.expert_errors) == sorted(stacks)
    assert report.experts_replaced == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(name in report.output_errors for name in stacks)
    routed = sum(entry.tokens for entry in report.expert_errors[stacks[0]])
    assert routed == 2 * 3 * 2 * 16  # top-2 of every token (batches without padding)
    assert "per expert: experts" in str(report)
    assert isinstance(model.model.layers[1].mlp.experts, tm.MarlinExperts)

    # Later stacks were calibrated on the model with the earlier ones quantized: the kept
    # inputs of layer 1's experts are those of the partially quantized model.
    keep_rtn = tiny_moe("mixtral")
    report_rtn = tm.quantize_model(keep_rtn, "int4", 16, method="gptq", calibration=batches, exclude=["lm_head"],
                                   calibrate_experts=False)
    assert not report_rtn.expert_errors and report_rtn.experts_replaced == report.experts_replaced
    reference = tiny_moe("mixtral")
    for name in report.experts_replaced:
        source = reference.get_submodule(name)
        for param, stack in keep_rtn.get_submodule(name).stacks().items():
            want = tm.quantize_experts(getattr(source, param).detach(), "int4", 16, "mse")
            assert torch.equal(stack.quantized_weight().dequantize(), want.dequantize())
        assert not torch.equal(model.get_submodule(name).down_proj.quantized_weight().dequantize(),
                               keep_rtn.get_submodule(name).down_proj.quantized_weight().dequantize())

    with pytest.raises(ValueError, match="act_order=True cannot be used for expert stacks"):
        tm.quantize_model(tiny_moe("qwen3_moe"), "int4", 16, method="gptq", calibration=batches, act_order=True)
    untouched = tiny_moe("qwen3_moe")
    tm.quantize_model(untouched, "int4", 16, method="gptq", calibration=batches, act_order=True,
                      calibrate_experts=False)  # the old behaviour: act-order for linear layers only
    with pytest.raises(ValueError, match="calibrate_experts is an option of method='gptq'"):
        tm.quantize_model(tiny_moe("qwen3_moe"), "int4", 16, method="sparsegpt", sparsity="2:4",
                          calibration=batches, calibrate_experts=False)


class ExpertMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class PerExpertLinearMoe(nn.Module):
    """An older checkpoint's MoE: a router and a ModuleList of per-expert nn.Linear MLPs, each
    called on the tokens routed to it (top-1), as Mixtral's first transformers code did."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.ModuleList(ExpertMlp() for _ in range(EXPERTS))

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (ids == e).nonzero().squeeze(1)
            if rows.numel():
                out[rows] = expert(x[rows])
        return out


def test_per_expert_linear_models_calibrate_each_expert_on_its_tokens():
    """Per-expert nn.Linear experts go through the dense engine: each expert's layer gets the
    Hessian of exactly the rows the model routed to it; an expert never chosen is rounded to
    nearest and listed as unreached."""
    torch.manual_seed(0)
    model = PerExpertLinearMoe()
    with torch.no_grad():
        model.router.bias[3] = -1e4  # expert 3 is never chosen
    x = correlated_inputs(200, HIDDEN)
    ids = model.router(x).argmax(-1)
    weights = {e: model.experts[e].up.weight.detach().clone() for e in range(EXPERTS)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tm.quantize_model(model, "int4", 16, method="gptq", calibration=[x], exclude=["router"])
    assert report.unreached == ["experts.3.up", "experts.3.down"]
    assert any("never called on the calibration data" in str(w.message) for w in caught)
    for e in range(3):
        rows = x[ids == e].float()
        h = (rows.t() @ rows).double() / rows.shape[0]
        want = gptq_quantize(weights[e], h, "int4", 16).qweight.dequantize()
        assert torch.equal(model.experts[e].up.quantized_weight().dequantize(), want), e
