// A whole decode step of a Llama-family model (batch 1) in C++, as llama.cpp runs
// a token as one graph: embedding row, per layer RMSNorm, q/k/v GEMVs, RoPE,
// attention over an fp32 KV cache, o GEMV, residual, RMSNorm, gate/up GEMVs,
// SiLU * up, down GEMV, residual; final norm and the head. The linears are dense
// packed weights (MarlinLinear buffers, held without copies) run by the selected
// kernel build's entry points directly: no dispatcher, checks or allocation per
// GEMV. Everything is validated once while the engine is put together
// (torch_marlin/cpu_decoder.py builds it from a transformers model; docs/CPU.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/kernel_args.h"
#include "cpu/thread_team.h"

namespace marlin {
namespace cpu {

// One dense quantized linear of the engine: its tensors (kept alive), kernel
// arguments (x and out are set per call) and whether its GEMV takes int8 x.
struct EngineLinear {
  std::string module;
  at::Tensor packed, scales, zeros, bias;  // zeros, bias may be undefined
  GemmArgs args;
  bool q8 = false;
  float* out = nullptr;  // its output buffer [n]
};

// x blocks of int8 (or group sums of fp32 x) for one group size.
struct PreparedInput {
  int64_t group_rows;
  std::vector<int32_t> q8_x;
  std::vector<float> q8_scale, sums;  // sums: q8 group sums, or fp32 x sums (uint4 on float x)
};

// Linears that read the same input (q|k|v, gate|up, or one alone): x is prepared
// once for all of them and their work is split over the threads in one phase.
struct GemvGroup {
  std::vector<int> linears;        // indices into DecodeEngine::linears_
  const float* x = nullptr;        // input buffer [padded K]
  std::vector<int64_t> first_col;  // per member: its first column among the group's columns
  int64_t cols = 0;
  std::vector<PreparedInput> q8, xsum;  // per distinct group size needing them
  bool same_k = true;  // every member has the same padded K and group size (K can be split)
};

class DecodeEngine : public torch::CustomClassHolder {
 public:
  // The model's shape: [hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, max_length].
  DecodeEngine(std::vector<int64_t> shape, double rms_eps);

  // Float parameters (float32, CPU, contiguous): "embedding" [vocab, hidden], "final_norm" [hidden],
  // "inv_freq" [head_dim / 2] (RoPE frequencies), "input_norm" / "post_norm" of `layer` [hidden],
  // "head" [vocab, hidden] (a float head, e.g. tied to the embedding). `module` names it in errors.
  void set_float(std::string role, int64_t layer, std::string module, at::Tensor t);
  // A dense quantized linear: role q, k, v, o, gate, up, down (of `layer`) or head; its bias [n] float32.
  void set_linear(std::string role, int64_t layer, std::string module, at::Tensor packed, at::Tensor scales,
                  c10::optional<at::Tensor> zeros, c10::optional<at::Tensor> bias, std::string weight_format,
                  int64_t group_size, int64_t in_features);
  // Checks that every piece was given; allocates the buffers and the KV cache.
  void finish();

  void reset();            // empties the KV cache
  int64_t position();  // tokens in the cache
  // Runs `token` at the next position; returns the logits [vocab] float32.
  at::Tensor step(int64_t token);
  // The kernel build its GEMVs run.
  std::string kernel_build();
  // For benchmarks: time every GEMV group with the clock "cpu" (process CPU time) or
  // "wall", or "" for none; gemv_seconds() is the total so far.
  void time_gemvs(std::string clock);
  double gemv_seconds();

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    int q = -1, k = -1, v = -1, o = -1, gate = -1, up = -1, down = -1;  // indices into linears_
  };
  int64_t& linear_slot(const std::string& role, int64_t layer);
  int64_t expected_in(const std::string& role) const;
  int64_t expected_out(const std::string& role) const;
  void check_ready() const;
  GemvGroup make_group(std::vector<int> members, const float* x);
  // The token on thread t of n (the caller is 0), the others running it alongside
  // on team_ and meeting it at sync().
  void run_token(int t, int n, bool int8);
  void sync(int n);
  void prepare(GemvGroup& g, int t, int n, bool int8);  // thread t's share of x's int8 blocks / sums
  void gemv(GemvGroup& g, int t, int n, bool int8);     // thread t's share of its K rows or columns
  void attention(int64_t layer, int t, int n);          // thread t's share of the KV heads

  int64_t hidden_, intermediate_, layers_, heads_, kv_heads_, head_dim_, vocab_, max_length_;
  float eps_;
  const CpuKernels* kern_ = nullptr;
  bool finished_ = false;
  int64_t pos_ = 0;
  int timing_clock_ = -1;  // a clock_gettime clock id, or -1
  double gemv_seconds_ = 0;
  at::Tensor embedding_, final_norm_, inv_freq_, float_head_;
  std::vector<Layer> layer_;
  std::vector<int64_t> slots_;  // per (layer, role) and the head: index into linears_ or -1
  std::vector<EngineLinear> linears_;
  std::vector<GemvGroup> groups_;  // per layer: qkv, o, gate_up, down; then the head
  // Buffers (fp32): residual h; inputs of the GEMVs, padded to their K with zeros.
  std::vector<float> h_, x_attn_, x_o_, x_mlp_, x_down_, x_head_, q_, k_, v_, o_, gate_, up_, down_;
  std::vector<float> cache_;   // [layers][2 (k, v)][kv_heads][max_length][head_dim]
  std::vector<float> scores_;  // [heads][max_length]
  std::vector<float> cos_, sin_;  // RoPE at the current position [head_dim / 2]
  // The GEMVs' per-column sums (GemmArgs::scratch), gemv_scratch_floats(widest_)
  // per thread (allocated when the thread count changes).
  std::vector<float> scratch_;
  std::vector<float> partial_;  // K split: per thread, its partial sums of a group's columns [widest_]
  int64_t widest_ = 0;          // columns of the widest group
  std::unique_ptr<ThreadTeam> team_;  // at::get_num_threads() - 1 workers, made at the first step that needs them
  std::mutex step_mutex_;             // one step at a time: the buffers are shared
};

}  // namespace cpu
}  // namespace marlin
