"""The whole-token CPU decode engine (torch_marlin.CpuDecoder, csrc/cpu/decode_engine.cpp)
against transformers' own forward of the same model, with the same MarlinLinear modules:
logits of every step, greedy generate, and the refusals."""

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import torch_marlin  # noqa: E402
from torch_marlin import CpuDecoder  # noqa: E402

PROMPT = [3, 17, 42, 5, 99, 7]


def tiny_model(kind="llama", quantize=dict(weight_format="int4", group_size=32), **overrides):
    """A random transformers model in float32 with its linears quantized by quantize_model."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5)
    base.update(overrides)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig}[kind](**base)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights of a trained model's scale, biases and norms not trivial
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
            elif "bias" in name:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.5, 1.5)
    if quantize is not None:
        torch_marlin.quantize_model(model, **quantize)
    return model


@torch.inference_mode()
def reference_logits(model, tokens):
    """transformers' own decode with its KV cache, one token per call: logits per step."""
    past, out = None, []
    for t in tokens:
        res = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = res.past_key_values
        out.append(res.logits[0, -1].float())
    return out


def assert_close_logits(ours, ref, rel):
    scale = ref.abs().max()
    torch.testing.assert_close(ours, ref, rtol=0, atol=rel * float(scale))


CASES = {
    "llama-gqa-int4-g32": dict(kind="llama"),
    "llama-mha-uint4-g128-padded-k": dict(kind="llama", hidden_size=96, num_attention_heads=6,
                                          num_key_value_heads=6, intermediate_size=160,
                                          quantize=dict(weight_format="uint4", group_size=128)),
    "qwen2-biases-fp4-g32": dict(kind="qwen2", quantize=dict(weight_format="fp4", group_size=32)),
    "llama-tied-head-quantized": dict(kind="llama", tie_word_embeddings=True),
    "llama-tied-head-float": dict(kind="llama", tie_word_embeddings=True,
                                  quantize=dict(weight_format="int4", group_size=32, exclude=["lm_head"])),
    "llama-nf4-g64-attention-bias": dict(kind="llama", attention_bias=True, mlp_bias=True,
                                         quantize=dict(weight_format="nf4", group_size=64)),
    "llama-linear-rope-affine-g16": dict(kind="llama", rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                            rope_theta=500.0),
                                         quantize=dict(weight_format="affine", group_size=16)),
    "mistral-no-window": dict(kind="mistral", sliding_window=None),
}


def _case(name):
    return tiny_model(**CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_step_logits_equal_transformers(name):
    model = _case(name)
    if name == "llama-tied-head-float":
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    decoder = CpuDecoder(model)
    ref = reference_logits(model, PROMPT)
    for i, t in enumerate(PROMPT):
        assert decoder.position == i
        assert_close_logits(decoder.step(t), ref[i], 1e-4)
    decoder.reset()  # the cache starts over
    assert decoder.position == 0
    assert_close_logits(decoder.step(PROMPT[0]), ref[0], 1e-4)


def int8_tie_distance(x):
    """How close x [K] (fp32) comes to a rounding tie of its int8 blocks (activation_q8.h's
    rule, xq = round(x / (max |x| / 127)) per 32 values), in int8 steps: near 0, one rounding of
    the fp32 x (another order of the norm's sum) can move one int8 code by one."""
    x = torch.cat([x, x.new_zeros(-x.numel() % 32)]).reshape(-1, 32).double()
    dx = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(dx == 0, 0, x / dx)
    return float(((q - q.floor()) - 0.5).abs().min())


@torch.inference_mode()
def int8_reference(model, tokens):
    """reference_logits under cpu_int8_activations(True), and per step the closest any
    MarlinLinear's x came to an int8 rounding tie."""
    ties, hooks = [float("inf")], []

    def record(module, args):
        ties[-1] = min(ties[-1], int8_tie_distance(args[0].reshape(-1).float()))

    for module in model.modules():
        if isinstance(module, torch_marlin.MarlinLinear):
            hooks.append(module.register_forward_pre_hook(record))
    past, out = None, []
    try:
        with torch_marlin.cpu_int8_activations(True):
            for t in tokens:
                res = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                out.append(res.logits[0, -1].float())
                ties.append(float("inf"))
    finally:
        for h in hooks:
            h.remove()
    return out, ties[:-1]


@pytest.mark.parametrize("name", ["llama-gqa-int4-g32", "llama-mha-uint4-g128-padded-k", "qwen2-biases-fp4-g32",
                                  "llama-nf4-g64-attention-bias"])
def test_int8_step_logits_equal_transformers_under_int8(name):
    """int8 x: against the model run under cpu_int8_activations(True). Both quantize the
    same x (ours once for q/k/v and gate/up) to the same int8 blocks, except where an x
    lies within fp32 rounding of a tie (3e-5 of an int8 step: our norms sum in another
    order than torch's): such a step may differ by one int8 step of one value, a looser
    bound, for at most one step of the prompt here."""
    model = _case(name)
    decoder = CpuDecoder(model)
    ref, ties = int8_reference(model, PROMPT)
    with torch_marlin.cpu_int8_activations(True):
        ours = [decoder.step(t) for t in PROMPT]
    float_ref = reference_logits(model, PROMPT)
    for o, r, f, tie in zip(ours, ref, float_ref, ties):
        assert_close_logits(o, r, 1e-4 if tie > 3e-5 else 5e-3)
        if name != "llama-nf4-g64-attention-bias":  # nf4 keeps float x: then int8 changes nothing
            assert (r - f).abs().max() > 4 * (o - r).abs().max()  # the int8 path is the one compared
    assert sum(tie <= 3e-5 for tie in ties) <= 1  # the tight bound holds for the other steps


@pytest.mark.parametrize("name", ["llama-gqa-int4-g32", "qwen2-biases-fp4-g32", "llama-tied-head-quantized"])
def test_greedy_generate_equals_transformers(name):
    model = _case(name)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
    decoder = CpuDecoder(model)
    assert decoder.generate(PROMPT, 10) == ref
    assert decoder.generate(torch.tensor([PROMPT]), 10) == ref  # again, from a reset cache


@pytest.mark.parametrize("threads", [1, 2])
def test_wide_layers_split_over_threads(threads):
    """Layers wide enough that a GEMV group is several column blocks per thread."""
    model = _wide_model()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decoder = CpuDecoder(model)
        for int8 in (False, True):
            ref, _ = int8_reference(model, PROMPT[:3]) if int8 else (reference_logits(model, PROMPT[:3]), None)
            decoder.reset()
            with torch_marlin.cpu_int8_activations(int8):
                for t, r in zip(PROMPT[:3], ref):
                    assert_close_logits(decoder.step(t), r, 1e-4)
    finally:
        torch.set_num_threads(before)


def _wide_model():
    return tiny_model(hidden_size=256, intermediate_size=1024, vocab_size=2304, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32)


def _steps_at(decoder, threads, int8):
    """The decoder's logits of PROMPT[:4] with `threads` torch threads (the engine's team)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decoder.reset()
        with torch_marlin.cpu_int8_activations(int8):
            return [decoder.step(t) for t in PROMPT[:4]]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("int8", [False, True])
def test_logits_are_deterministic_for_each_thread_count(int8):
    """Each thread count gives the same bits every time (the work is split the same way
    each token), 1, 2 and 3 threads (more than the machine may have) agree closely (narrow
    GEMVs split K at several threads: partial sums added in another order), and changing
    the count between steps makes a new team. With int8 x, a step where some x lies within
    fp32 rounding of an int8 tie (as in test_int8_step_logits_equal_transformers_under_int8)
    may round it the other way at another count: one int8 step of one value, which moved
    this model's logits by 1% of the largest (the avx2 build at one thread, step 4)."""
    model = _wide_model()
    decoder = CpuDecoder(model)
    one = _steps_at(decoder, 1, int8)
    ties = int8_reference(model, PROMPT[:4])[1] if int8 else [float("inf")] * 4
    assert sum(tie <= 3e-5 for tie in ties) <= 1  # the tight bound holds for the other steps
    for threads in (2, 3, 2, 1):
        ours = _steps_at(decoder, threads, int8)
        again = _steps_at(decoder, threads, int8)
        for o, a, ref, tie in zip(ours, again, one, ties):
            assert torch.equal(o, a), threads
            assert_close_logits(o, ref, 1e-5 if not int8 else 1e-3 if tie > 3e-5 else 2e-2)


def test_engine_runs_from_other_threads_and_is_destroyed_cleanly():
    """A step called from another Python thread, and two threads stepping one engine
    (serialized): no hang, the same logits; then the engine (with its team of
    threads) is dropped and a new one works."""
    import threading

    model = _wide_model()
    decoder = CpuDecoder(model)
    ref = _steps_at(decoder, 2, False)
    decoder.reset()
    out, errors = [], []

    def run():
        try:
            out.append([decoder.step(t) for t in PROMPT[:4]])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and not errors
    for ours, r in zip(out[0], ref):
        assert_close_logits(ours, r, 1e-5)
    decoder.reset()
    workers = [threading.Thread(target=lambda: [decoder.step(t) for t in PROMPT[:2]]) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers) and decoder.position == 4
    del decoder
    import gc

    gc.collect()
    assert torch.equal(_steps_at(CpuDecoder(model), 2, False)[0], ref[0])  # the same thread count


def test_cache_full_and_bad_tokens_are_errors():
    decoder = CpuDecoder(tiny_model(), max_length=3)
    with pytest.raises(ValueError, match=r"token must be in \[0, 128\), got 128"):
        decoder.step(128)
    for t in PROMPT[:3]:
        decoder.step(t)
    with pytest.raises(ValueError, match="holds max_length = 3 tokens and is full"):
        decoder.step(1)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        decoder.generate(PROMPT, 2)
    with pytest.raises(TypeError, match="token_id must be an int"):
        decoder.step(1.5)


@pytest.mark.parametrize("make, message", [
    (lambda: tiny_model(quantize=None),
     "model.layers.0.self_attn.q_proj must be a MarlinLinear with the dense layout .* got Linear"),
    (lambda: tiny_model(quantize=dict(weight_format="int4", group_size=32, fuse_projections=True)),
     "model.layers.0.self_attn.q_proj must be a MarlinLinear with the dense layout .* got ProjectionSlice"),
    (lambda: tiny_model(quantize=dict(weight_format="int4", group_size=32, sparsity="2:4")),
     "q_proj must be a MarlinLinear with the dense layout .* with layout 'sparse24'"),
    (lambda: tiny_model(hidden_act="gelu"), "hidden_act 'silu'.*got hidden_act='gelu'"),
    (lambda: tiny_model(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     "RoPE types default, linear, llama3; got rope_type='dynamic'"),
    (lambda: tiny_model(kind="mistral", sliding_window=16), "sliding_window=16; give max_length <= 16 .got 64"),
    (lambda: tiny_model(kind="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0),
     "sliding_window=8"),
    (lambda: tiny_model().to(torch.bfloat16), "float32 models: model.embed_tokens.weight is torch.bfloat16"),
])
def test_refusals_name_what_is_unsupported(make, message):
    with pytest.raises(ValueError, match=message):
        CpuDecoder(make())


def test_other_architectures_are_refused():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="model types llama, mistral, qwen2; got model_type='gpt2'"):
        CpuDecoder(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(TypeError, match="transformers \\*ForCausalLM model, got Linear"):
        CpuDecoder(nn.Linear(2, 2))


def test_sliding_window_within_max_length_is_accepted():
    model = tiny_model(kind="mistral", sliding_window=16)
    decoder = CpuDecoder(model, max_length=16)
    ref = reference_logits(model, PROMPT)
    for t, r in zip(PROMPT, ref):
        assert_close_logits(decoder.step(t), r, 1e-4)


def test_engine_validates_each_piece_naming_it():
    """The C++ class itself: wrong shapes, dtypes, roles and missing pieces are clear errors."""
    model = tiny_model()
    q = model.model.layers[0].self_attn.q_proj.quantized_weight()
    engine = torch.classes.marlin.CpuDecodeEngine([64, 128, 2, 4, 2, 16, 128, 64], 1e-5)
    with pytest.raises(ValueError, match=r"my.k_proj must have out_features = 32 \(k\), got 64"):
        engine.set_linear("k", 0, "my.k_proj", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match="my.down_proj must have in_features = 128 .down., got in_features 64"):
        engine.set_linear("down", 0, "my.down_proj", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match="my.q_proj: group_size must be one of"):
        engine.set_linear("q", 0, "my.q_proj", q.packed, q.scales, None, None, "int4", 33, 64)
    with pytest.raises(ValueError, match="role must be one of q, k, v, o, gate, up, down, head; got 'x'"):
        engine.set_linear("x", 0, "my.x", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
        engine.set_linear("q", 2, "my.q_proj", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match="my.q_proj.bias must be float32, got Half"):
        engine.set_linear("q", 0, "my.q_proj", q.packed, q.scales, None, torch.zeros(64).half(), "int4", 32, 64)
    with pytest.raises(ValueError, match=r"my.norm must have shape \[64\], got \[63\]"):
        engine.set_float("final_norm", 0, "my.norm", torch.ones(63))
    with pytest.raises(RuntimeError, match="call finish.. before running it"):
        engine.step(0)
    engine.set_linear("q", 0, "my.q_proj", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match="my.q_proj: the q linear of this layer was already given"):
        engine.set_linear("q", 0, "my.q_proj", q.packed, q.scales, None, None, "int4", 32, 64)
    with pytest.raises(ValueError, match="the embedding was not given"):
        engine.finish()
    with pytest.raises(ValueError, match="heads = 4 must be a multiple of kv_heads = 3"):
        torch.classes.marlin.CpuDecodeEngine([64, 128, 2, 4, 3, 16, 128, 64], 1e-5)


# The engine's numeric tests, rerun under each kernel build this CPU runs (a process chooses one).
BUILD_TESTS = ["test_step_logits_equal_transformers", "test_int8_step_logits_equal_transformers_under_int8"]


def cpu_kernels():
    return json.loads(torch.ops.marlin._cpu_kernels())


@pytest.mark.parametrize("build", list(cpu_kernels()["builds"]))
def test_every_kernel_build(build, rerun_under_build):
    rerun_under_build(build, "test_cpu_decoder.py", [__file__, "-k", " or ".join(BUILD_TESTS)])
