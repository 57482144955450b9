"""CpuDecoder: greedy decode of a quantized Llama-family model, one token per C++ call.

transformers runs a decode step as ~30 Python module calls per layer group around
the GEMVs; on the CPU that Python is a sixth of the token. CpuDecoder hands the
model's weights (MarlinLinear buffers, without copies) to the C++ engine
torch.classes.marlin.CpuDecodeEngine (csrc/cpu/decode_engine.h), which runs the
whole step as llama.cpp does: embedding row, per layer RMSNorm, q/k/v GEMVs,
RoPE, attention over its own float32 KV cache, o GEMV, residual, RMSNorm,
gate/up GEMVs, SiLU * up, down GEMV, residual; final norm and head. Batch 1;
the prompt is fed one token at a time (prefill of long prompts belongs to the
model's own forward, which runs them as matrix products). docs/CPU.md has the
limits and the measurements.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from .layouts.dense import QuantizedWeight
from .linear import MarlinLinear

# model_type -> whether its q/k/v projections carry biases by design (Qwen2); the others
# may have them through config.attention_bias, and every linear's bias is taken as it is.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE types whose only effect is a fixed inv_freq (scaling 1 on cos/sin), which the engine takes as given.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_LINEARS = (("self_attn", "q_proj", "q"), ("self_attn", "k_proj", "k"), ("self_attn", "v_proj", "v"),
                 ("self_attn", "o_proj", "o"), ("mlp", "gate_proj", "gate"), ("mlp", "up_proj", "up"),
                 ("mlp", "down_proj", "down"))


class CpuDecoder:
    """Decode state of one quantized transformers model on the CPU (batch 1).

    model: a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM in float32 on the
    CPU whose decoder linears are MarlinLinear with the dense layout
    (torch_marlin.quantize_model, without fuse_projections); the head may be a
    MarlinLinear or a float nn.Linear (e.g. tied to the embedding).
    max_length: tokens the KV cache holds (default: the config's
    max_position_embeddings, at most 4096).

    GEMVs take int8 activations when torch_marlin.cpu_int8_activations() is on at
    the time of the step, as MarlinLinear does. The engine reads the model's
    tensors: keep the model alive and do not change its weights while decoding."""

    def __init__(self, model: nn.Module, max_length: Optional[int] = None) -> None:
        config = getattr(model, "config", None)
        if config is None or not isinstance(model, nn.Module):
            raise TypeError(f"CpuDecoder needs a transformers *ForCausalLM model, got {type(model).__name__}")
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"CpuDecoder runs model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                             f"got model_type={model_type!r} ({type(model).__name__})")
        if not hasattr(model, "model") or not hasattr(model, "lm_head"):
            raise TypeError(f"CpuDecoder needs the *ForCausalLM model (with .model and .lm_head), "
                            f"got {type(model).__name__}")
        if max_length is None:
            max_length = min(int(config.max_position_embeddings), 4096)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        _check_config(config, max_length)
        base = model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = list(base.layers)
        shape = [config.hidden_size, config.intermediate_size, len(layers), heads, kv_heads, head_dim,
                 config.vocab_size, max_length]
        rotary = base.rotary_emb
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise ValueError(f"CpuDecoder: model.model.rotary_emb.attention_scaling must be 1.0, "
                             f"got {rotary.attention_scaling}")
        engine = torch.classes.marlin.CpuDecodeEngine(shape, float(_rms_eps(base.norm, "model.norm")))
        engine.set_float("embedding", 0, "model.embed_tokens.weight", _float_param(base.embed_tokens.weight,
                                                                                    "model.embed_tokens.weight"))
        engine.set_float("final_norm", 0, "model.norm.weight", _float_param(base.norm.weight, "model.norm.weight"))
        engine.set_float("inv_freq", 0, "model.rotary_emb.inv_freq",
                         _float_param(rotary.inv_freq, "model.rotary_emb.inv_freq"))
        for i, layer in enumerate(layers):
            prefix = f"model.layers.{i}"
            for norm, role in (("input_layernorm", "input_norm"), ("post_attention_layernorm", "post_norm")):
                module = getattr(layer, norm)
                if float(_rms_eps(module, f"{prefix}.{norm}")) != float(_rms_eps(base.norm, "model.norm")):
                    raise ValueError(f"CpuDecoder: {prefix}.{norm} has another epsilon than model.norm")
                engine.set_float(role, i, f"{prefix}.{norm}.weight",
                                 _float_param(module.weight, f"{prefix}.{norm}.weight"))
            for parent, name, role in LAYER_LINEARS:
                _set_linear(engine, role, i, f"{prefix}.{parent}.{name}", getattr(getattr(layer, parent), name))
        head = model.lm_head
        if isinstance(head, MarlinLinear):
            _set_linear(engine, "head", 0, "lm_head", head)
        elif type(head) is nn.Linear and head.bias is None:
            engine.set_float("head", 0, "lm_head.weight", _float_param(head.weight, "lm_head.weight"))
        else:
            raise ValueError(f"CpuDecoder: lm_head must be a MarlinLinear (dense layout) or an nn.Linear without "
                             f"bias, got {_describe(head)}")
        engine.finish()
        self.engine = engine
        self.model_type = model_type
        self.max_length = max_length
        self.kernel_build = engine.kernel_build()

    def reset(self) -> None:
        """Empties the KV cache (the next step is position 0)."""
        self.engine.reset()

    @property
    def position(self) -> int:
        """Tokens in the KV cache."""
        return self.engine.position()

    def step(self, token_id: int) -> torch.Tensor:
        """Runs one token at the next position; its logits [vocab] (float32)."""
        if isinstance(token_id, torch.Tensor) and token_id.numel() == 1:
            token_id = int(token_id)
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise TypeError(f"token_id must be an int, got {token_id!r}")
        return self.engine.step(token_id)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> List[int]:
        """Greedy decode from an empty cache: the prompt fed token by token, then
        max_new_tokens argmax tokens (returned, without the prompt)."""
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
                prompt_ids = prompt_ids[0]
            if prompt_ids.dim() != 1:
                raise ValueError(f"prompt_ids must be 1-D (or [1, T]), got shape {list(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if len(prompt_ids) + max_new_tokens > self.max_length + 1:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the KV cache "
                             f"(max_length={self.max_length}); build CpuDecoder with a larger max_length")
        self.reset()
        logits = None
        for token in prompt_ids:
            logits = self.step(token)
        out = []
        for i in range(max_new_tokens):
            token = int(torch.argmax(logits))
            out.append(token)
            if i + 1 < max_new_tokens:
                logits = self.step(token)
        return out


def _describe(module: nn.Module) -> str:
    if isinstance(module, MarlinLinear):
        return f"{type(module).__name__} with layout {module.layout.LAYOUT!r}"
    return type(module).__name__


def _check_config(config, max_length: int) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"CpuDecoder runs the SwiGLU MLP (hidden_act 'silu'), got hidden_act={act!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"CpuDecoder implements RoPE types {', '.join(SUPPORTED_ROPE_TYPES)}; "
                         f"got rope_type={rope_type!r}")
    if float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ValueError("CpuDecoder rotates whole heads; got partial_rotary_factor "
                         f"{rope.get('partial_rotary_factor', getattr(config, 'partial_rotary_factor', None))}")
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        window is not None and config.model_type == "mistral")
    if sliding and window is not None and max_length > window:
        raise ValueError(f"CpuDecoder attends to the whole cache, not a sliding window: the model has "
                         f"sliding_window={window}; give max_length <= {window} (got {max_length})")


def _rms_eps(module: nn.Module, name: str) -> float:
    if not type(module).__name__.endswith("RMSNorm") or not hasattr(module, "variance_epsilon"):
        raise ValueError(f"CpuDecoder: {name} must be an RMSNorm, got {type(module).__name__}")
    return module.variance_epsilon


def _float_param(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"CpuDecoder runs on the CPU: {name} is on {t.device}")
    if t.dtype != torch.float32:
        raise ValueError(f"CpuDecoder runs float32 models: {name} is {t.dtype} (call model.float() first)")
    return t.detach().contiguous()


def _set_linear(engine, role: str, layer: int, name: str, module: nn.Module) -> None:
    if type(module) is not MarlinLinear or module.layout is not QuantizedWeight:
        raise ValueError(f"CpuDecoder: {name} must be a MarlinLinear with the dense layout "
                         f"(torch_marlin.quantize_model without fuse_projections / sparsity / bits), "
                         f"got {_describe(module)}")
    q = module.quantized_weight()
    bias = None if module.bias is None else _float_param(module.bias, f"{name}.bias")
    engine.set_linear(role, layer, name, q.packed, q.scales, q.zeros, bias, q.weight_format, q.group_size,
                      q.in_features)
