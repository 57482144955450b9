// The whole-token CPU decode engine (csrc/cpu/decode_engine.h; registered as the
// custom class torch.classes.marlin.CpuDecodeEngine in csrc/registration.cpp).
#include "cpu/decode_engine.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mv.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>

#include "core/checks.h"
#include "cpu/activation_q8.h"
#include "cpu/ops.h"

namespace marlin {
namespace cpu {
namespace {

const char* const kRoles[] = {"q", "k", "v", "o", "gate", "up", "down"};
constexpr int64_t kSplitKCols = 2048;  // DecodeEngine::gemv
constexpr int64_t kRolesPerLayer = 7;

int role_index(const std::string& role) {
  for (int i = 0; i < kRolesPerLayer; ++i)
    if (role == kRoles[i]) return i;
  return role == "head" ? int(kRolesPerLayer) : -1;
}

void check_float_tensor(const std::string& module, const at::Tensor& t, std::vector<int64_t> shape) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), module, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, module, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes().vec() == shape, module, " must have shape ", at::IntArrayRef(shape), ", got ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), module, " must be contiguous");
}

// The engine's own loops run once per token, outside the kernel builds: GCC
// compiles them for AVX-512 and AVX2 too and picks one at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MARLIN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// No fused multiply-adds where the dense op's own code (compiled without them) must be matched bit for bit.
#define MARLIN_SEPARATE_ROUNDING __attribute__((optimize("fp-contract=off")))
#define MARLIN_FLATTEN __attribute__((flatten))  // the template it calls compiled for the clone's target
#else
#define MARLIN_FLATTEN
#define MARLIN_CLONES
#define MARLIN_SEPARATE_ROUNDING
#endif

// sum a[i] * b[i], in 16 partial sums (vectors) instead of one chain. Inline, not
// a clone of its own: attention calls it per cached position (an indirect call
// through the clone's resolver each time), and in its callers' clones it is
// compiled for their target.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < 16; ++j) sum += part[j];
  return sum;
}

// out = weight * (x / rms(x)), as transformers' LlamaRMSNorm in float32.
MARLIN_CLONES MARLIN_FLATTEN void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  const float inv = 1.f / std::sqrt(float(double(dot(x, x, n)) / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// exp(x) within 1 ulp (checked against double exp on every float of the range),
// as Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a polynomial for exp(r). No
// libm call, so that SiLU's loop vectorizes (std::exp was 0.8% of a token at
// one thread). x is clamped to [-87, 88], where exp(x) is a normal float.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;           // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out = silu(gate) * up.
MARLIN_CLONES void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + exp_clamped(-gate[i])) * up[i];
}

// x (one row, k values) as int8 blocks (activation_q8.h): the dense op's blocks, bit for bit.
MARLIN_CLONES MARLIN_SEPARATE_ROUNDING MARLIN_FLATTEN
void quantize_row_q8(const float* x, int64_t k, int64_t group_rows, int32_t* q8_x, float* scale, float* gsum) {
  quantize_x_q8(x, 1, k, group_rows, Q8Order::kQuads, q8_x, scale, gsum);
}

// One head's attention over `len` cached positions: scores in s, output in out.
MARLIN_CLONES MARLIN_FLATTEN void attend(const float* q, const float* keys, const float* values, int64_t len, int64_t head_dim,
                          float scale, float* s, float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = dot(q, keys + t * head_dim, head_dim) * scale;
    top = std::max(top, s[t]);
  }
  float total = 0.f;
  for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - top));
  std::fill(out, out + head_dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float p = s[t] / total;
    const float* v = values + t * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) out[d] += p * v[d];
  }
}

// Rotary embedding of one head's vector [head_dim], the halves rotated
// (transformers' rotate_half): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void rope(float* v, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * cos[i] - x2 * sin[i];
    v[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

double seconds(int clock) {
  timespec t;
  clock_gettime(clock, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

}  // namespace

DecodeEngine::DecodeEngine(std::vector<int64_t> shape, double rms_eps) {
  TORCH_CHECK_VALUE(shape.size() == 8,
                    "CpuDecodeEngine shape must be [hidden, intermediate, layers, heads, kv_heads, head_dim, "
                    "vocab, max_length], got ", shape.size(), " values");
  const char* names[] = {"hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "max_length"};
  for (int i = 0; i < 8; ++i) TORCH_CHECK_VALUE(shape[i] > 0, names[i], " must be positive, got ", shape[i]);
  hidden_ = shape[0], intermediate_ = shape[1], layers_ = shape[2], heads_ = shape[3], kv_heads_ = shape[4];
  head_dim_ = shape[5], vocab_ = shape[6], max_length_ = shape[7];
  TORCH_CHECK_VALUE(heads_ % kv_heads_ == 0, "heads = ", heads_, " must be a multiple of kv_heads = ", kv_heads_);
  TORCH_CHECK_VALUE(head_dim_ % 2 == 0, "head_dim must be even (rotary halves), got ", head_dim_);
  TORCH_CHECK_VALUE(rms_eps > 0, "rms_eps must be positive, got ", rms_eps);
  eps_ = float(rms_eps);
  kern_ = &kernels();
  layer_.resize(layers_);
  slots_.assign(layers_ * kRolesPerLayer + 1, -1);
}

int64_t DecodeEngine::expected_in(const std::string& role) const {
  if (role == "o") return heads_ * head_dim_;
  if (role == "down") return intermediate_;
  return hidden_;
}

int64_t DecodeEngine::expected_out(const std::string& role) const {
  if (role == "q") return heads_ * head_dim_;
  if (role == "k" || role == "v") return kv_heads_ * head_dim_;
  if (role == "gate" || role == "up") return intermediate_;
  if (role == "head") return vocab_;
  return hidden_;  // o, down
}

int64_t& DecodeEngine::linear_slot(const std::string& role, int64_t layer) {
  const int r = role_index(role);
  TORCH_CHECK_VALUE(r >= 0, "role must be one of q, k, v, o, gate, up, down, head; got '", role, "'");
  if (r == kRolesPerLayer) return slots_[layers_ * kRolesPerLayer];
  TORCH_CHECK_VALUE(layer >= 0 && layer < layers_, "layer must be in [0, ", layers_, "), got ", layer);
  return slots_[layer * kRolesPerLayer + r];
}

void DecodeEngine::set_float(std::string role, int64_t layer, std::string module, at::Tensor t) {
  TORCH_CHECK(!finished_, "CpuDecodeEngine: set_float after finish()");
  if (role == "embedding") {
    check_float_tensor(module, t, {vocab_, hidden_});
    embedding_ = t;
  } else if (role == "final_norm") {
    check_float_tensor(module, t, {hidden_});
    final_norm_ = t;
  } else if (role == "inv_freq") {
    check_float_tensor(module, t, {head_dim_ / 2});
    inv_freq_ = t;
  } else if (role == "head") {
    check_float_tensor(module, t, {vocab_, hidden_});
    TORCH_CHECK_VALUE(linear_slot("head", 0) < 0, module, ": the head was already given as a quantized linear");
    float_head_ = t;
  } else if (role == "input_norm" || role == "post_norm") {
    TORCH_CHECK_VALUE(layer >= 0 && layer < layers_, "layer must be in [0, ", layers_, "), got ", layer);
    check_float_tensor(module, t, {hidden_});
    (role == "input_norm" ? layer_[layer].input_norm : layer_[layer].post_norm) = t;
  } else {
    TORCH_CHECK_VALUE(false, "role must be one of embedding, final_norm, inv_freq, head, input_norm, post_norm; got '",
                      role, "'");
  }
}

void DecodeEngine::set_linear(std::string role, int64_t layer, std::string module, at::Tensor packed,
                              at::Tensor scales, c10::optional<at::Tensor> zeros, c10::optional<at::Tensor> bias,
                              std::string weight_format, int64_t group_size, int64_t in_features) {
  TORCH_CHECK(!finished_, "CpuDecodeEngine: set_linear after finish()");
  int64_t& slot = linear_slot(role, layer);
  TORCH_CHECK_VALUE(slot < 0, module, ": the ", role, " linear of this layer was already given");
  TORCH_CHECK_VALUE(role != "head" || !float_head_.defined(), module, ": the head was already given as float");
  QuantizedShape s;
  try {
    s = check_quantized(packed, scales, zeros, weight_format, group_size);
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, module, ": ", e.what_without_backtrace());
  }
  TORCH_CHECK_VALUE(packed.device().is_cpu(), module, ": packed must be a CPU tensor, got ", packed.device());
  const int64_t in = expected_in(role), out = expected_out(role);
  TORCH_CHECK_VALUE(in_features == in && s.k >= in && s.k - in < std::max<int64_t>(s.group_rows, 8),
                    module, " must have in_features = ", in, " (", role, "), got in_features ", in_features,
                    " with packed K ", s.k);
  TORCH_CHECK_VALUE(s.n == out, module, " must have out_features = ", out, " (", role, "), got ", s.n);
  EngineLinear l;
  l.module = module;
  l.packed = packed;
  l.scales = scales;
  if (zeros) l.zeros = *zeros;
  if (bias) {
    check_float_tensor(module + ".bias", *bias, {out});
    l.bias = *bias;
  }
  l.args = make_args(packed, scales, zeros, s);
  l.args.m = 1;
  l.q8 = s.group_rows % kQ8Block == 0 && kern_->gemv_q8_applies(int(s.format));
  slot = int64_t(linears_.size());
  linears_.push_back(std::move(l));
}

GemvGroup DecodeEngine::make_group(std::vector<int> members, const float* x) {
  GemvGroup g;
  g.linears = std::move(members);
  g.x = x;
  auto prepared = [](std::vector<PreparedInput>& list, int64_t group_rows, int64_t k, bool q8) {
    for (const PreparedInput& p : list)
      if (p.group_rows == group_rows) return;
    PreparedInput p;
    p.group_rows = group_rows;
    if (q8) {
      p.q8_x.assign(k / 4, 0);
      p.q8_scale.assign(k / kQ8Block, 0.f);
    }
    p.sums.assign(k / group_rows, 0.f);
    list.push_back(std::move(p));
  };
  for (int i : g.linears) {
    const GemmArgs& a = linears_[i].args;
    g.first_col.push_back(g.cols);
    g.cols += a.n;
    if (linears_[i].q8) prepared(g.q8, a.group_rows, a.k, true);
    if (has_zeros(WeightFormat(a.format))) prepared(g.xsum, a.group_rows, a.k, false);
    const GemmArgs& first = linears_[g.linears[0]].args;
    g.same_k = g.same_k && a.k == first.k && a.group_rows == first.group_rows;
  }
  return g;
}

void DecodeEngine::finish() {
  TORCH_CHECK(!finished_, "CpuDecodeEngine: finish() called twice");
  TORCH_CHECK_VALUE(embedding_.defined(), "CpuDecodeEngine: the embedding was not given");
  TORCH_CHECK_VALUE(final_norm_.defined(), "CpuDecodeEngine: the final norm was not given");
  TORCH_CHECK_VALUE(inv_freq_.defined(), "CpuDecodeEngine: the rotary inv_freq was not given");
  TORCH_CHECK_VALUE(float_head_.defined() || slots_[layers_ * kRolesPerLayer] >= 0,
                    "CpuDecodeEngine: the head was not given");
  for (int64_t l = 0; l < layers_; ++l) {
    Layer& L = layer_[l];
    TORCH_CHECK_VALUE(L.input_norm.defined() && L.post_norm.defined(), "CpuDecodeEngine: layer ", l,
                      " is missing its input_norm or post_norm");
    int* fields[] = {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down};
    for (int r = 0; r < kRolesPerLayer; ++r) {
      *fields[r] = int(slots_[l * kRolesPerLayer + r]);
      TORCH_CHECK_VALUE(*fields[r] >= 0, "CpuDecodeEngine: layer ", l, " is missing its ", kRoles[r], " linear");
    }
  }
  // Each GEMV input buffer holds the largest padded K that reads it, zeros past the real K.
  auto padded_k = [&](std::initializer_list<int> roles, int64_t k) {
    for (int64_t l = 0; l < layers_; ++l)
      for (int r : roles) k = std::max(k, linears_[slots_[l * kRolesPerLayer + r]].args.k);
    return k;
  };
  h_.assign(hidden_, 0.f);
  x_attn_.assign(padded_k({0, 1, 2}, hidden_), 0.f);
  x_o_.assign(padded_k({3}, heads_ * head_dim_), 0.f);
  x_mlp_.assign(padded_k({4, 5}, hidden_), 0.f);
  x_down_.assign(padded_k({6}, intermediate_), 0.f);
  x_head_.assign(float_head_.defined() ? hidden_ : linears_[slots_[layers_ * kRolesPerLayer]].args.k, 0.f);
  q_.assign(heads_ * head_dim_, 0.f);
  k_.assign(kv_heads_ * head_dim_, 0.f);
  v_.assign(kv_heads_ * head_dim_, 0.f);
  o_.assign(hidden_, 0.f);
  gate_.assign(intermediate_, 0.f);
  up_.assign(intermediate_, 0.f);
  down_.assign(hidden_, 0.f);
  cache_.assign(layers_ * 2 * kv_heads_ * max_length_ * head_dim_, 0.f);
  scores_.assign(heads_ * max_length_, 0.f);
  cos_.assign(head_dim_ / 2, 0.f);
  sin_.assign(head_dim_ / 2, 0.f);
  for (int64_t l = 0; l < layers_; ++l) {
    Layer& L = layer_[l];
    linears_[L.q].out = q_.data(), linears_[L.k].out = k_.data(), linears_[L.v].out = v_.data();
    linears_[L.o].out = o_.data();
    linears_[L.gate].out = gate_.data(), linears_[L.up].out = up_.data();
    linears_[L.down].out = down_.data();
    groups_.push_back(make_group({L.q, L.k, L.v}, x_attn_.data()));
    groups_.push_back(make_group({L.o}, x_o_.data()));
    groups_.push_back(make_group({L.gate, L.up}, x_mlp_.data()));
    groups_.push_back(make_group({L.down}, x_down_.data()));
  }
  if (!float_head_.defined()) groups_.push_back(make_group({int(slots_[layers_ * kRolesPerLayer])}, x_head_.data()));
  widest_ = 0;
  for (GemvGroup& g : groups_) {
    widest_ = std::max(widest_, g.cols);
    for (int i : g.linears) {  // x, out and the prepared x (none of them moves from now on)
      GemmArgs& a = linears_[i].args;
      a.x = g.x;
      a.out = linears_[i].out;
      for (PreparedInput& p : g.q8)
        if (p.group_rows == a.group_rows)
          a.q8_x = p.q8_x.data(), a.q8_scale = p.q8_scale.data(), a.q8_gsum = p.sums.data();
      for (PreparedInput& p : g.xsum)
        if (p.group_rows == a.group_rows) a.xsum = p.sums.data();
    }
  }
  scratch_.assign(gemv_scratch_floats(widest_), 0.f);
  finished_ = true;
}

void DecodeEngine::check_ready() const {
  TORCH_CHECK(finished_, "CpuDecodeEngine: call finish() before running it");
}

void DecodeEngine::reset() {
  check_ready();
  std::lock_guard<std::mutex> lock(step_mutex_);
  pos_ = 0;
}

int64_t DecodeEngine::position() { return pos_; }

std::string DecodeEngine::kernel_build() { return kern_->name; }

void DecodeEngine::time_gemvs(std::string clock) {
  TORCH_CHECK_VALUE(clock.empty() || clock == "cpu" || clock == "wall", "clock must be \"cpu\", \"wall\" or \"\", got \"",
                    clock, "\"");
  timing_clock_ = clock.empty() ? -1 : clock == "cpu" ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC;
}

double DecodeEngine::gemv_seconds() { return gemv_seconds_; }

namespace {

// Thread t's part [first, last) of `units` in a team of n: the same for every token.
std::pair<int64_t, int64_t> share(int64_t units, int t, int n) { return {units * t / n, units * (t + 1) / n}; }

}  // namespace

void DecodeEngine::sync(int n) {
  if (n > 1) team_->barrier();
}

// Thread t's share of the group's x, as whole groups of rows: int8 blocks, or the
// group sums uint4 needs on fp32 x.
void DecodeEngine::prepare(GemvGroup& g, int t, int n, bool int8) {
  if (int8)
    for (PreparedInput& p : g.q8) {
      const auto [g0, g1] = share(int64_t(p.sums.size()), t, n);
      const int64_t r0 = g0 * p.group_rows;
      quantize_row_q8(g.x + r0, (g1 - g0) * p.group_rows, p.group_rows, p.q8_x.data() + r0 / 4,
                      p.q8_scale.data() + r0 / kQ8Block, p.sums.data() + g0);
    }
  for (PreparedInput& p : g.xsum) {
    const auto [g0, g1] = share(int64_t(p.sums.size()), t, n);
    for (int64_t i = g0; i < g1; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < p.group_rows; ++j) s += g.x[i * p.group_rows + j];
      p.sums[i] = s;
    }
  }
}

// Thread t's part of the group's GEMVs. Narrow groups (at most kSplitKCols
// columns per thread) split K: each thread reads one contiguous range of word
// rows over all columns into its own partial sums, added in thread order after
// a barrier; measured at two threads, quiet machine, on bench_llamacpp's model
// (q|k|v, o and down split K): 6.05-6.20 against 6.26-6.63 ms per token, where
// a column share is a 4 KiB piece of every word row. Wider groups give each
// thread one contiguous share of all members' columns in whole blocks of
// kGemvBlockCols (fewer, longer weight streams).
void DecodeEngine::gemv(GemvGroup& g, int t, int n, bool int8) {
  const Q8Kernels* q8 = int8 ? &q8_kernels() : nullptr;  // the int8 dot product the ops chose
  float* scratch = scratch_.data() + t * gemv_scratch_floats(widest_);  // the thread's own
  auto run = [&](const EngineLinear& l, const GemmArgs& a, int64_t n0, int64_t n1) {
    if (int8 && l.q8)
      q8->gemv_q8(a, 0, 1, n0, n1);
    else
      kern_->gemv(a, 0, 1, n0, n1);
  };
  if (n > 1 && g.same_k && g.cols <= kSplitKCols * n) {
    float* partial = partial_.data() + t * widest_;
    const GemmArgs& first = linears_[g.linears[0]].args;
    const auto [g0, g1] = share(first.k / first.group_rows, t, n);  // whole groups of K rows
    for (size_t m = 0; m < g.linears.size(); ++m) {
      const EngineLinear& l = linears_[g.linears[m]];
      GemmArgs a = l.args;
      const int64_t k0 = g0 * a.group_rows;
      a.k = (g1 - g0) * a.group_rows;
      a.groups = g1 - g0;
      a.packed += k0 / 8 * a.n;
      a.scales += g0 * a.n;
      if (a.zeros) a.zeros += g0 * a.n;
      a.x += k0;
      if (a.xsum) a.xsum += g0;
      if (a.q8_x) a.q8_x += k0 / 4, a.q8_scale += k0 / kQ8Block, a.q8_gsum += g0;
      a.out = partial + g.first_col[m];
      a.scratch = scratch;
      if (a.k > 0)
        run(l, a, 0, a.n);
      else
        std::fill(a.out, a.out + a.n, 0.f);
    }
    sync(n);
    const auto [c0, c1] = share(g.cols, t, n);  // the sums of the thread's columns
    for (size_t m = 0; m < g.linears.size(); ++m) {
      const EngineLinear& l = linears_[g.linears[m]];
      const int64_t first_col = g.first_col[m];
      const float* b = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
      for (int64_t c = std::max(c0, first_col); c < std::min(c1, first_col + l.args.n); ++c) {
        float sum = partial_[c];
        for (int u = 1; u < n; ++u) sum += partial_[u * widest_ + c];
        l.out[c - first_col] = b ? sum + b[c - first_col] : sum;
      }
    }
    return;
  }
  const auto [b0, b1] = share((g.cols + kGemvBlockCols - 1) / kGemvBlockCols, t, n);
  const int64_t c0 = b0 * kGemvBlockCols, c1 = std::min(g.cols, b1 * kGemvBlockCols);
  for (size_t m = 0; m < g.linears.size(); ++m) {
    const EngineLinear& l = linears_[g.linears[m]];
    const int64_t n0 = std::max(c0, g.first_col[m]) - g.first_col[m];
    const int64_t n1 = std::min(c1, g.first_col[m] + l.args.n) - g.first_col[m];
    if (n0 >= n1) continue;
    GemmArgs a = l.args;
    a.scratch = scratch;
    run(l, a, n0, n1);
    if (l.bias.defined()) {
      const float* b = l.bias.data_ptr<float>();
      for (int64_t c = n0; c < n1; ++c) l.out[c] += b[c];
    }
  }
}

// Thread t's share of the KV heads: RoPE of their k and of their query heads, k
// and v into the cache, and those query heads' attention over positions 0..pos_
// (GQA), output into x_o_.
void DecodeEngine::attention(int64_t layer, int t, int n) {
  const int64_t len = pos_ + 1, group = heads_ / kv_heads_;
  const float scale = float(1.0 / std::sqrt(double(head_dim_)));
  float* keys = cache_.data() + layer * 2 * kv_heads_ * max_length_ * head_dim_;
  float* values = keys + kv_heads_ * max_length_ * head_dim_;
  const auto [j0, j1] = share(kv_heads_, t, n);
  for (int64_t j = j0; j < j1; ++j) {
    float* key = keys + (j * max_length_ + pos_) * head_dim_;
    rope(k_.data() + j * head_dim_, head_dim_, cos_.data(), sin_.data());
    std::memcpy(key, k_.data() + j * head_dim_, head_dim_ * sizeof(float));
    std::memcpy(values + (j * max_length_ + pos_) * head_dim_, v_.data() + j * head_dim_, head_dim_ * sizeof(float));
    for (int64_t h = j * group; h < (j + 1) * group; ++h) {
      rope(q_.data() + h * head_dim_, head_dim_, cos_.data(), sin_.data());
      attend(q_.data() + h * head_dim_, keys + j * max_length_ * head_dim_, values + j * max_length_ * head_dim_, len,
             head_dim_, scale, scores_.data() + h * max_length_, x_o_.data() + h * head_dim_);
    }
  }
}

// Phases, each split over the threads, with a barrier (sync) wherever the next
// one reads what other threads wrote; the small serial parts (norms, residuals)
// run on thread 0.
void DecodeEngine::run_token(int t, int n, bool int8) {
  double start = 0;
  auto gemvs = [&](GemvGroup& g) {  // prepare x, then the GEMVs; timed on thread 0
    if (t == 0 && timing_clock_ >= 0) start = seconds(timing_clock_);
    prepare(g, t, n, int8);
    sync(n);
    gemv(g, t, n, int8);
    sync(n);
    if (t == 0 && timing_clock_ >= 0) gemv_seconds_ += seconds(timing_clock_) - start;
  };
  if (t == 0)
    for (int64_t i = 0; i < head_dim_ / 2; ++i) {
      const float angle = float(pos_) * inv_freq_.data_ptr<float>()[i];
      cos_[i] = std::cos(angle), sin_[i] = std::sin(angle);
    }
  for (int64_t l = 0; l < layers_; ++l) {
    const Layer& L = layer_[l];
    if (t == 0) rms_norm(h_.data(), L.input_norm.data_ptr<float>(), hidden_, eps_, x_attn_.data());
    sync(n);
    gemvs(groups_[4 * l]);
    attention(l, t, n);
    sync(n);
    gemvs(groups_[4 * l + 1]);
    if (t == 0) {
      for (int64_t i = 0; i < hidden_; ++i) h_[i] += o_[i];
      rms_norm(h_.data(), L.post_norm.data_ptr<float>(), hidden_, eps_, x_mlp_.data());
    }
    sync(n);
    gemvs(groups_[4 * l + 2]);
    {
      const auto [c0, c1] = share(intermediate_, t, n);
      silu_mul(gate_.data() + c0, up_.data() + c0, c1 - c0, x_down_.data() + c0);
    }
    sync(n);
    gemvs(groups_[4 * l + 3]);
    if (t == 0)
      for (int64_t i = 0; i < hidden_; ++i) h_[i] += down_[i];
  }
  if (t == 0) rms_norm(h_.data(), final_norm_.data_ptr<float>(), hidden_, eps_, x_head_.data());
  sync(n);
  if (!float_head_.defined()) gemvs(groups_.back());
}

at::Tensor DecodeEngine::step(int64_t token) {
  check_ready();
  TORCH_CHECK_VALUE(token >= 0 && token < vocab_, "token must be in [0, ", vocab_, "), got ", token);
  std::lock_guard<std::mutex> lock(step_mutex_);
  TORCH_CHECK_VALUE(pos_ < max_length_, "CpuDecodeEngine: the KV cache holds max_length = ", max_length_,
                    " tokens and is full; reset() it or build the decoder with a larger max_length");
  const bool int8 = int8_activations();
  std::memcpy(h_.data(), embedding_.data_ptr<float>() + token * hidden_, hidden_ * sizeof(float));
  at::Tensor logits = at::empty({vocab_}, embedding_.options());
  if (!float_head_.defined()) {
    EngineLinear& head = linears_[groups_.back().linears[0]];
    head.out = head.args.out = logits.data_ptr<float>();
  }
  const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  if (threads == 1) {
    run_token(0, 1, int8);
  } else {
    if (!team_ || team_->size() != threads) {
      team_.reset();  // its workers joined before new ones start
      team_ = std::make_unique<ThreadTeam>(threads);
      scratch_.assign(threads * gemv_scratch_floats(widest_), 0.f);
      partial_.assign(threads * widest_, 0.f);
    }
    team_->run([&](int t) { run_token(t, threads, int8); });
  }
  if (float_head_.defined())
    at::mv_out(logits, float_head_, at::from_blob(x_head_.data(), {hidden_}, embedding_.options()));
  ++pos_;
  return logits;
}

}  // namespace cpu
}  // namespace marlin
