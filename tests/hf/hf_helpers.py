"""Helpers shared by the Hugging Face tests (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os

import torch
import transformers

import torch_marlin

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny_config(arch: str):
    """Tiny decoder configs; each architecture keeps its own quirks (GPT-2 Conv1D, Gemma tying)."""
    if arch == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if arch == "llama-tied":
        return transformers.LlamaConfig(tie_word_embeddings=True, **_COMMON)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_COMMON)
    if arch == "mistral":
        return transformers.MistralConfig(**_COMMON)
    if arch == "phi":
        return transformers.PhiConfig(**_COMMON)
    if arch == "gemma":
        return transformers.GemmaConfig(head_dim=16, **_COMMON)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=0, eos_token_id=0)
    raise ValueError(arch)


def build_tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def load_float(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def marlin_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch_marlin.MarlinLinear)}


def leftovers(parent: str, name: str):
    """Temporary files/directories a conversion left next to its destination."""
    return [e for e in os.listdir(parent) if e.startswith(f".{name}.")]


# --- building already-quantized checkpoints (GPTQ, AWQ, ...) in tests ------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def to_int32(word: int) -> int:
    """A 32-bit pattern as the signed int32 torch stores."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def write_quantized_model(float_dir: str, dst: str, make_layer, quantization_config=None, extra_files=None,
                          skip=("lm_head",)):
    """Save the float model of `float_dir` with each nn.Linear (but `skip`) replaced by the
    tensors `make_layer(name, weight [N, K]) -> ({suffix: tensor}, reference weight [N, K])`
    returns. Uses the safetensors library itself. Returns {name: reference weight}."""
    from safetensors.torch import save_file

    model = load_float(float_dir)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    refs = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and name not in skip:
            layer, reference = make_layer(name, module.weight.detach().float())
            del state[f"{name}.weight"]
            state.update({f"{name}.{suffix}": t.contiguous() for suffix, t in layer.items()})
            refs[name] = reference
    os.makedirs(dst, exist_ok=True)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = read_config(float_dir)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for name, content in (extra_files or {}).items():
        with open(os.path.join(dst, name), "w") as f:
            json.dump(content, f)
    return refs


def check_imported(dst: str, refs: dict, float_dir: str, input_perms=None):
    """The converted checkpoint in `dst` loads, every quantized layer dequantizes exactly to
    its reference, and logits match the float model carrying the reference weights."""
    from torch_marlin.hf import from_pretrained

    model = from_pretrained(dst)
    layers = marlin_modules(model)
    assert set(layers) == set(refs)
    for name, module in layers.items():
        got = module.dequantize(torch.float32)
        want = refs[name].float()
        perm = getattr(module, "input_perm", None)
        if perm is not None:
            want = want[:, perm.long()]
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max()}"
    reference = load_float(float_dir)
    with torch.no_grad():
        for name, weight in refs.items():
            reference.get_submodule(name).weight.copy_(weight)
        ids = torch.arange(24).reshape(2, 12) % VOCAB
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    return model
