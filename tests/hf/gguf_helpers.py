"""Tiny GGUF files written with the gguf package, as llama.cpp's convert_hf_to_gguf.py lays them out.

Block types the gguf package can quantize (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, F16, BF16) are made
by its numpy quantizers; the others (Q4_K, Q6_K, IQ4_NL) are random block bytes with a chosen
scale range: every bit pattern of the block is then a valid block of that type, and gguf's
dequantize is the reference for what it means.
"""

from __future__ import annotations

import numpy as np
import torch

from reference_libs import require

gguf = require("gguf", "pip install gguf")
T = gguf.GGMLQuantizationType


def build_k_quant_model(seed: int = 0):
    """A tiny Llama whose every K is a multiple of 256, the K-quants' block (hf_helpers' models have K = 64)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q_proj / k_proj rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def random_blocks(qtype, rows: int, k: int, rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """Random bytes for a tensor [rows, k] of `qtype`, with the fp16 block scales set to
    random values in [0, scale) (Q4_K: d and dmin; Q6_K: d at the end; IQ4_NL: d)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // values, nbytes), dtype=np.uint8)
    halves = lambda n: (rng.random((rows, k // values, n)) * scale).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == T.Q4_K:
        blocks[..., 0:4] = halves(2)
    elif qtype == T.Q6_K:
        blocks[..., -2:] = halves(1)
    elif qtype == T.IQ4_NL:
        blocks[..., 0:2] = halves(1)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def write_gguf(path: str, model, types, rng=None, tokenizer: bool = True):
    """Write HF model `model` (Llama or Qwen2) as a GGUF file. `types(hf_name, weight) -> qtype`
    picks each 2-D weight's type (1-D tensors are F32). Returns {hf_name: weight [N, K] the
    file holds, as gguf's dequantize gives it, in the model's row order}."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    rng = rng or np.random.default_rng(0)
    config = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[config.model_type]
    hf_to_gguf = {v: k for k, v in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if tokenizer:
        _add_tokenizer(writer, config.vocab_size)
    else:
        writer.add_vocab_size(config.vocab_size)
    refs = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = tensor.detach().float().numpy()
        gguf_name = hf_to_gguf[name]
        permuted = arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name)
        if permuted:
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            weight = llama_cpp_permute(weight, config.num_attention_heads, heads)
        qtype = T.F32 if weight.ndim == 1 else types(name, weight)
        if qtype in (T.Q4_K, T.Q6_K, T.IQ4_NL):
            data = random_blocks(qtype, weight.shape[0], weight.shape[1], rng)
        elif qtype == T.F32:
            data = weight
        else:
            data = gguf.quants.quantize(weight, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        stored = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
        if permuted:  # back to the model's order: transformers' reverse permutation
            stored = llama_cpp_permute_inverse(stored, config.num_attention_heads, heads)
        refs[name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return refs


def llama_cpp_permute_inverse(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_tokenizer(writer, vocab_size: int) -> None:
    """A SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, then pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(vocab_size - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(vocab_size - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (vocab_size - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
