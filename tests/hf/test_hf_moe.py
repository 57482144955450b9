"""Mixture-of-experts models end to end: tiny random models of five architectures built
from configs (no download) are converted (float, gpt-oss MXFP4, per-expert GPTQ and
compressed-tensors) and loaded with torch_marlin.from_pretrained and transformers'
AutoModelForCausalLM; logits and greedy generation must match the same model holding
the dequantized weights in float."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import torch_marlin as tm
from hf_helpers import VOCAB, read_config
from torch_marlin.cli import main as cli_main
from torch_marlin.convert import convert
from torch_marlin.hf import MarlinConfig, from_pretrained

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
ARCHS = {
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=5,
                                                  num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, head_dim=16, intermediate_size=64,
                                                     moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2),
    "olmoe": lambda: transformers.OlmoeConfig(**_COMMON, intermediate_size=32, num_experts=5, num_experts_per_tok=2),
    # transposed stacks, biases, interleaved gate/up, clamped SwiGLU
    "gpt_oss": lambda: transformers.GptOssConfig(**_COMMON, head_dim=16, intermediate_size=32, num_local_experts=5,
                                                 num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"]),
    # shared experts, a dense first layer, grouped routing, MLA attention
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=32,
                                                         n_routed_experts=6, num_experts_per_tok=2, n_group=2,
                                                         topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                                         q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                         qk_nope_head_dim=8, v_head_dim=16),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A saved tiny float model per architecture (transformers' own save format)."""
    cache = {}

    def make(arch):
        if arch not in cache:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
            with torch.no_grad():  # gpt-oss initializes expert biases to zero: make them count
                for name, p in model.named_parameters():
                    if name.endswith("_bias"):
                        p.normal_(0, 0.02)
            path = str(tmp_path_factory.mktemp(arch))
            model.save_pretrained(path)
            cache[arch] = path
        return cache[arch]

    return make


def reference_with_dequantized_weights(float_dir, quantized):
    """The float model of `float_dir` holding the weights `quantized` dequantizes to."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, tm.MarlinExperts):
                target = reference.get_submodule(name)
                for param, stack in module.stacks().items():
                    w = stack.quantized_weight().dequantize()  # [E, out, in], float64 reference path
                    getattr(target, param).copy_(w.transpose(1, 2) if module.structure.is_transposed else w)
                    if stack.bias is not None:
                        getattr(target, f"{param}_bias").copy_(stack.bias)
            elif isinstance(module, tm.MarlinLinear):
                reference.get_submodule(name).weight.copy_(module.quantized_weight().dequantize())
    return reference


def check_against_reference(model, reference):
    ids = torch.arange(2 * 12).reshape(2, 12) % VOCAB
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 2e-5 * want.abs().max(), float((got - want).abs().max())
    prompt = ids[:1, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def experts_of(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, tm.MarlinExperts)}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_convert_and_load_float_moe(arch, moe_dir, tmp_path):
    src, dst = moe_dir(arch), str(tmp_path / "q")
    summary = convert(src, dst, "fp4", 32, quantizer="absmax", progress=False)
    experts_layers = [i for i in range(2) if not (arch == "deepseek_v3" and i == 0)]
    assert summary.stacks_converted == 2 * len(experts_layers)
    table = read_config(dst)["quantization_config"]["modules"]
    stack = table[f"model.layers.{experts_layers[0]}.mlp.experts.gate_up_proj"]
    assert stack["layout"] == "experts" and stack["num_experts"] > 1
    model = from_pretrained(dst)
    assert sorted(experts_of(model)) == [f"model.layers.{i}.mlp.experts" for i in experts_layers]
    assert not any(p.dim() == 3 for p in model.parameters())  # no float expert stack left
    check_against_reference(model, reference_with_dequantized_weights(src, model))
    auto = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert sorted(experts_of(auto)) == sorted(experts_of(model))
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, model(ids).logits)


def test_loading_never_materializes_float_experts(moe_dir, tmp_path, monkeypatch):
    src, dst = moe_dir("qwen3_moe"), str(tmp_path / "q")
    convert(src, dst, "int4", 32, quantizer="absmax", progress=False)
    import torch_marlin.hf.modules as modules

    seen = []

    class Checked(tm.MarlinExperts):
        def __init__(self, source, *args, **kwargs):
            seen.append({p.device.type for p in source.parameters()})
            super().__init__(source, *args, **kwargs)

    monkeypatch.setattr(modules, "MarlinExperts", Checked)
    model = from_pretrained(dst)
    assert seen == [{"meta"}, {"meta"}]  # replaced before any float expert weight was loaded
    assert all(b.device.type == "cpu" for b in model.buffers())


def test_quantize_on_load_and_save_pretrained_roundtrip(moe_dir, tmp_path):
    src = moe_dir("mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, quantization_config=MarlinConfig(weight_format="uint4", group_size=32, quantizer="absmax")).eval()
    assert len(experts_of(model)) == 2
    model.save_pretrained(tmp_path / "q")
    table = read_config(tmp_path / "q")["quantization_config"]["modules"]
    assert table["model.layers.1.mlp.experts.down_proj"]["layout"] == "experts"
    again = from_pretrained(str(tmp_path / "q"))
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_exclude_keeps_experts_in_float(moe_dir, tmp_path):
    src, dst = moe_dir("qwen3_moe"), str(tmp_path / "q")
    summary = convert(src, dst, "fp4", 32, quantizer="absmax", exclude=["model.layers.1.mlp.experts"],
                      progress=False)
    assert summary.stacks_converted == 2
    assert "model.layers.1.mlp.experts.gate_up_proj" in summary.layers_in_float
    model = from_pretrained(dst)
    assert sorted(experts_of(model)) == ["model.layers.0.mlp.experts"]
    check_against_reference(model, reference_with_dequantized_weights(src, model))


# --- quantized sources ----------------------------------------------------------------

def _rewrite(src, dst, replace, quantization_config):
    """Copy the float checkpoint `src` to `dst` with tensors replaced: replace(key, tensor)
    returns {key: tensor} to write instead (or None to keep the tensor)."""
    state = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key, tensor in state.items():
        new = replace(key, tensor)
        out.update({key: tensor} if new is None else new)
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    config = read_config(src)
    config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def test_gpt_oss_mxfp4_experts_import_exactly(moe_dir, tmp_path):
    """`<param>_blocks` [E, N, K/32, 16] / `_scales` [E, N, K/32]: dequantized weights equal
    transformers' own MXFP4 dequantization (convert_moe_packed_tensors), bit for bit."""
    from test_hf_import_fp4 import _mxfp4_layer
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, mx, dst = moe_dir("gpt_oss"), str(tmp_path / "mx"), str(tmp_path / "q")
    blocks = {}

    def replace(key, tensor):
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        per_expert = [_mxfp4_layer(w.t().float())[0] for w in tensor]  # [E, in, out] -> W_e [out, in]
        b = torch.stack([t["weight_blocks"] for t in per_expert])
        s = torch.stack([t["weight_scales"] for t in per_expert])
        blocks[key] = (b, s)
        return {f"{key}_blocks": b, f"{key}_scales": s}

    _rewrite(src, mx, replace, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]})
    summary = convert(mx, dst, progress=False)
    assert summary.stacks_converted == 4 and summary.formats == {"fp4/g32": 4}
    model = from_pretrained(dst)
    for key, (b, s) in blocks.items():
        module, _, param = key.rpartition(".")
        got = model.get_submodule(module).stacks()[param].quantized_weight().dequantize()  # [E, out, in]
        want = convert_moe_packed_tensors(b, s, dtype=torch.float32)  # gpt-oss's [E, in, out]
        assert torch.equal(got.transpose(1, 2), want), key
    check_against_reference(model, reference_with_dequantized_weights(src, model))


def _per_expert_source(src, dst, make_layer, quantization_config):
    """The per-expert linear layers of `src` (`experts.{i}.<proj>.weight`) in a quantized format."""
    refs = {}

    def replace(key, tensor):
        if ".experts." not in key or not key.endswith(".weight") or tensor.dim() != 2:
            return None
        module = key[: -len(".weight")]
        tensors, refs[module] = make_layer(tensor.float())
        return {f"{module}.{suffix}": t for suffix, t in tensors.items()}

    _rewrite(src, dst, replace, quantization_config)
    return refs


@pytest.mark.parametrize("source", ["gptq", "awq", "compressed-tensors"])
def test_per_expert_quantized_layers_are_stacked_exactly(source, moe_dir, tmp_path):
    """GPTQ / AWQ / compressed-tensors MoE checkpoints quantize each expert's gate/up/down as
    a linear layer: they are concatenated (gate|up) and stacked without requantization."""
    from test_hf_import_compressed_tensors import _config as ct_config, _ct_layer
    from test_hf_import_gptq_awq import _awq_layer, _gptq_layer

    src, qdir, dst = moe_dir("qwen3_moe"), str(tmp_path / "src"), str(tmp_path / "q")
    if source == "gptq":
        config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
        refs = _per_expert_source(src, qdir, lambda w: _gptq_layer(w, 32, sym=False, act_order=False), config)
    elif source == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
        refs = _per_expert_source(src, qdir, lambda w: _awq_layer(w, 32), config)
    else:
        refs = _per_expert_source(src, qdir, lambda w: _ct_layer(w, 32, sym=True), ct_config(True, "group", 32))
    convert(qdir, dst, progress=False)
    model = from_pretrained(dst)
    for name, experts in experts_of(model).items():
        for e in range(experts.structure.num_experts):
            gate_up = experts.gate_up_proj.quantized_weight().expert(e).dequantize(torch.float64)
            want = torch.cat([refs[f"{name}.{e}.gate_proj"], refs[f"{name}.{e}.up_proj"]])
            assert torch.equal(gate_up, want.double())
            down = experts.down_proj.quantized_weight().expert(e).dequantize(torch.float64)
            assert torch.equal(down, refs[f"{name}.{e}.down_proj"].double())
    check_against_reference(model, reference_with_dequantized_weights(src, model))


def test_unsupported_experts_class_is_left_in_float_with_a_warning(tmp_path):
    """An experts class without transformers' experts interface (here Llama 4's) keeps its
    float weights; the converter says so and names it."""
    config = transformers.Llama4TextConfig(**_COMMON, head_dim=16, intermediate_size=32, intermediate_size_mlp=64,
                                           num_local_experts=3, num_experts_per_tok=1, moe_layers=[0, 1])
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    with pytest.warns(UserWarning, match="Llama4TextExperts"):
        report = tm.quantize_model(model, "fp4", 32, method="absmax")
    assert len(report.experts_unsupported) == 2 and not report.experts_replaced


# --- bad input ------------------------------------------------------------------------

def test_checkpoint_errors_name_the_stack(moe_dir, tmp_path):
    from torch_marlin.hf.errors import CheckpointError

    src = moe_dir("qwen3_moe")
    # a per-expert checkpoint that lacks one expert's layer
    missing = str(tmp_path / "missing")
    _rewrite(src, missing, lambda key, t: {} if ".experts.3.up_proj." in key and "layers.0" in key else None, None)
    with open(os.path.join(missing, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(missing, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.gate_up_proj: the checkpoint lacks expert 3"):
        convert(missing, str(tmp_path / "q1"), "fp4", 32, quantizer="absmax", progress=False)
    # a converted checkpoint whose table disagrees with the model on the number of experts
    dst = str(tmp_path / "q2")
    convert(src, dst, "fp4", 32, quantizer="absmax", progress=False)
    config = read_config(dst)
    config["quantization_config"]["modules"]["model.layers.1.mlp.experts.down_proj"]["num_experts"] = 5
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"experts.down_proj: checkpoint has 5 experts .* model expects 6"):
        from_pretrained(dst)


def test_mxfp4_stack_with_another_number_of_experts_is_refused(moe_dir, tmp_path):
    from test_hf_import_fp4 import _mxfp4_layer
    from torch_marlin.hf.errors import CheckpointError

    src, mx = moe_dir("gpt_oss"), str(tmp_path / "mx")

    def replace(key, tensor):
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        per_expert = [_mxfp4_layer(w.t().float())[0] for w in tensor[:4]]  # one expert short
        return {f"{key}_blocks": torch.stack([t["weight_blocks"] for t in per_expert]),
                f"{key}_scales": torch.stack([t["weight_scales"] for t in per_expert])}

    _rewrite(src, mx, replace, {"quant_method": "mxfp4"})
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj: tensors give 4 experts .* the config describes 5"):
        convert(mx, str(tmp_path / "q"), progress=False)


# --- --sparsity, calibrated conversion, --exclude and a missing transformers ---------------

def assert_stacks_round_to_nearest(model, float_dir, group_size, quantizer):
    """Every expert stack of `model` is dense and holds exactly the round-to-nearest codes
    of the float model's stack (quantize_experts)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    experts = experts_of(model)
    assert experts
    for name, module in experts.items():
        for param, stack in module.stacks().items():
            want = tm.quantize_experts(getattr(reference.get_submodule(name), param).detach(), "fp4", group_size,
                                       quantizer)
            got = stack.quantized_weight()
            assert type(got) is type(want) and torch.equal(got.dequantize(), want.dequantize()), f"{name}.{param}"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_sparsity_stores_expert_stacks_dense(arch, moe_dir, tmp_path, capsys):
    """--sparsity 2:4 used to crash in _stack_parts; expert stacks have no 2:4 layout, so
    they are quantized dense (as quantize_model does) and the summary says so."""
    src, dst = moe_dir(arch), str(tmp_path / "q")
    assert cli_main(["convert", src, dst, "--sparsity", "2:4", "--group-size", "32", "--quantizer", "absmax",
                     "--no-progress"]) == 0
    assert "4 expert stacks stored dense: the expert-stack layout has no 2:4 form" in capsys.readouterr().out
    table = read_config(dst)["quantization_config"]["modules"]
    stacks = {name for name, entry in table.items() if entry.get("layout") == "experts"}
    assert len(stacks) == 4 and not any("sparsity" in table[name] for name in stacks)
    assert all(entry["sparsity"] == "2:4" for name, entry in table.items() if name not in stacks)
    model = from_pretrained(dst)
    assert_stacks_round_to_nearest(model, src, 32, "absmax")
    check_against_reference(model, reference_with_dequantized_weights(src, model))


def test_exclude_matching_one_stack_keeps_the_whole_experts_module(moe_dir, tmp_path):
    """Loading replaces an experts module with all its stacks quantized: excluding one stack
    (here every down_proj) used to write a checkpoint that failed to load."""
    src, dst = moe_dir("qwen3_moe"), str(tmp_path / "q")
    summary = convert(src, dst, "fp4", 32, quantizer="absmax", exclude=["down_proj"], progress=False)
    assert summary.stacks_converted == 0
    assert {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")} <= set(
        summary.layers_in_float)
    model = from_pretrained(dst)
    assert not experts_of(model)
    check_against_reference(model, reference_with_dequantized_weights(src, model))


@pytest.fixture
def moe_with_tokenizer(moe_dir, tmp_path):
    from test_hf_gptq import tiny_tokenizer

    path = str(tmp_path / "src")
    shutil.copytree(moe_dir("qwen3_moe"), path)
    tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("method,extra,quantized_layers", [
    ("gptq", ["--exclude", "model.layers.1.mlp.experts.down_proj", "--experts-rtn"], [0]),
    ("sparsegpt", ["--sparsity", "2:4"], [0, 1])])
def test_calibrated_conversion_quantizes_expert_stacks(moe_with_tokenizer, tmp_path, capsys, method, extra,
                                                       quantized_layers):
    """--method gptq / sparsegpt used to leave the expert stacks in float: with sparsegpt (and
    gptq --experts-rtn) they are quantized with round to nearest (dense), counted in the
    summary and listed in the config (GPTQ per expert: tests/hf/test_hf_moe_gptq.py)."""
    from test_hf_gptq import TEXTS, write_jsonl

    src, dst = moe_with_tokenizer, str(tmp_path / "q")
    data = write_jsonl(tmp_path / "cal.jsonl", TEXTS * 3)
    assert cli_main(["convert", src, dst, "--method", method, "--calibration", data, "--calibration-samples", "24",
                     "--calibration-length", "16", "--group-size", "32", *extra]) == 0
    out = capsys.readouterr().out
    stacks = 2 * len(quantized_layers)
    assert f"8 linear layers and {stacks} expert stacks (round to nearest) quantized" in out
    excluded = [f"model.layers.1.mlp.experts.{p}" for p in ("down_proj", "gate_up_proj")] if stacks == 2 else []
    assert f"; {1 + len(excluded)} left in float" in out
    qc = read_config(dst)["quantization_config"]
    assert sorted(name for name, entry in qc["modules"].items() if entry.get("layout") == "experts") == [
        f"model.layers.{i}.mlp.experts.{p}" for i in quantized_layers for p in ("down_proj", "gate_up_proj")]
    assert qc["modules_to_not_convert"] == ["lm_head"] + excluded
    model = from_pretrained(dst)
    assert sorted(experts_of(model)) == [f"model.layers.{i}.mlp.experts" for i in quantized_layers]
    assert_stacks_round_to_nearest(model, src, 32, "mse")
    check_against_reference(model, reference_with_dequantized_weights(src, model))


_BLOCK_TRANSFORMERS = '''
import sys

class _NoTransformers:
    """As if transformers were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTransformers())
'''


def test_without_transformers_moe_conversion_says_so_and_writes_nothing(moe_with_tokenizer, tmp_path):
    """Without the hf extra the streaming converter used to write an MoE checkpoint that
    does not load (per-expert layers listed as linear layers) and --method gptq ended in a
    ModuleNotFoundError: both are now an `error:` naming the install command."""
    from hf_helpers import leftovers
    from test_hf_gptq import TEXTS, write_jsonl

    blocker = tmp_path / "no_transformers"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCK_TRANSFORMERS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker)] + [p for p in sys.path if p]))
    data = write_jsonl(tmp_path / "cal.jsonl", TEXTS)
    dst = tmp_path / "q"
    for extra in ([], ["--method", "gptq", "--calibration", data]):
        run = subprocess.run([sys.executable, "-m", "torch_marlin.cli", "convert", moe_with_tokenizer, str(dst),
                              "--no-progress", *extra], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.stderr.startswith("error: ") and "Traceback" not in run.stderr, run.stderr
        assert "needs transformers, which is not installed" in run.stderr, run.stderr
        assert "pip install 'torch_marlin[hf]'" in run.stderr
        assert not dst.exists() and leftovers(str(tmp_path), "q") == []
