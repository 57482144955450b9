// Standalone check of the CPU kernel builds (csrc/cpu) against a float64
// reference written from docs/FORMAT.md, without torch, so that builds for
// other architectures can run under an emulator: tests/test_cpu_kernels.py
// cross-compiles this for aarch64 and runs it under qemu-aarch64.
//
//   check_kernels [--expect-selected BUILD]
//
// Checks every build this CPU runs (gemv and gemm_tile on fp32 x, and on
// bf16 x for builds with bf16 dot products; dequantize_rows exactly; the
// same for the 2:4 entry points, and that they report invalid metadata), prints
// "PASS <build>" or "SKIP <build>: <why>" per build, and exits 1 on any
// mismatch. --expect-selected also checks the automatic choice.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "cpu/activation_q8.h"
#include "cpu/kernel_builds.h"
#include "reference.h"

using namespace marlin::cpu;

namespace {

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {  // xorshift64*
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return uint32_t((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

double bf16_value(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

bool bf16_exact(int format) { return marlin::values_exact_in_bf16(marlin::WeightFormat(format)); }

bool format_has_zeros(int format) { return marlin::has_zeros(marlin::WeightFormat(format)); }

struct Case {
  int format;
  int64_t m, n, k, group_size;  // group_size -1: one group over K
};

struct Problem {
  Case c;
  int64_t groups, group_rows;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scales, zeros, x_bf16;
  std::vector<float> x;
  std::vector<double> w;  // [k, n] dequantized

  explicit Problem(const Case& cs) : c(cs) {
    group_rows = c.group_size == -1 ? c.k : c.group_size;
    groups = c.k / group_rows;
    std::vector<int> codes(c.k * c.n);
    for (int& q : codes) q = next_u32() & 15;
    packed.assign(c.k / 8 * c.n, 0);
    for (int64_t r = 0; r < c.k; ++r)
      for (int64_t j = 0; j < c.n; ++j)
        packed[r / 8 * c.n + j] = int32_t(uint32_t(packed[r / 8 * c.n + j]) | uint32_t(codes[r * c.n + j]) << (4 * (r % 8)));
    // Scales: fp16 normals of either sign in [2^-10, 2); zeros: 0..15 with
    // fraction bits, fp16 subnormals included.
    for (int64_t i = 0; i < groups * c.n; ++i) {
      scales.push_back(uint16_t((next_u32() & 0x8000) | ((5 + next_u32() % 11) << 10) | (next_u32() & 1023)));
      zeros.push_back(uint16_t(next_u32() % 0x4B80));
    }
    for (int64_t i = 0; i < c.m * c.k; ++i) {
      const float v = float(int32_t(next_u32() % 2000001) - 1000000) / 1e6f;
      x.push_back(v);
      uint32_t bits;
      memcpy(&bits, &v, 4);
      x_bf16.push_back(uint16_t(bits >> 16));  // truncated: any bf16 will do
    }
    w.resize(c.k * c.n);
    for (int64_t r = 0; r < c.k; ++r) {
      for (int64_t j = 0; j < c.n; ++j) {
        const int64_t g = r / group_rows;
        const int code = int((uint32_t(packed[r / 8 * c.n + j]) >> (4 * (r % 8))) & 15);
        w[r * c.n + j] = weight_value(c.format, code, half_value(scales[g * c.n + j]), half_value(zeros[g * c.n + j]));
      }
    }
  }

  GemmArgs args() const {
    GemmArgs a{};
    a.packed = packed.data();
    a.scales = scales.data();
    a.zeros = format_has_zeros(c.format) ? zeros.data() : nullptr;
    a.m = c.m;
    a.k = c.k;
    a.n = c.n;
    a.groups = groups;
    a.group_rows = group_rows;
    a.format = c.format;
    return a;
  }
};

#define MARLIN_FORMAT_NAME(name, F, _) #name,
const char* const kFormatNames[] = {MARLIN_FOR_EACH_FORMAT(MARLIN_FORMAT_NAME, )};
#undef MARLIN_FORMAT_NAME
const char* format_name(int f) { return kFormatNames[f]; }

int failures = 0;

void fail(const std::string& what) {
  if (++failures <= 20) printf("FAIL %s\n", what.c_str());
}

// out (fp32) against p's x @ w ([k, n], p.w or a 2:4 weight) in float64: fp32 accumulation error only.
void check_gemm(const Problem& p, const std::vector<double>& w, bool bf16, const std::vector<float>& out,
                const std::string& what) {
  double worst = 0;
  for (int64_t i = 0; i < p.c.m; ++i) {
    for (int64_t j = 0; j < p.c.n; ++j) {
      double ref = 0, magnitude = 0;
      for (int64_t r = 0; r < p.c.k; ++r) {
        const double xv = bf16 ? bf16_value(p.x_bf16[i * p.c.k + r]) : p.x[i * p.c.k + r];
        ref += xv * w[r * p.c.n + j];
        magnitude += fabs(xv * w[r * p.c.n + j]);
      }
      const double err = fabs(out[i * p.c.n + j] - ref), bound = 1e-6 * magnitude + 1e-30;
      if (!(err <= bound) && err / bound > worst) worst = err / bound;
    }
  }
  if (worst > 0) fail(what + ": error up to " + std::to_string(worst) + "x the bound");
}

// What ops.cpp passes: x, and for uint4 fp32 sums of x over each group.
GemmArgs gemm_args(const Problem& p, bool bf16, std::vector<float>& xsum, std::vector<float>& out) {
  GemmArgs a = p.args();
  if (bf16) a.x_bf16 = p.x_bf16.data();
  else a.x = p.x.data();
  if (format_has_zeros(p.c.format)) {
    for (int64_t i = 0; i < p.c.m; ++i)
      for (int64_t g = 0; g < p.groups; ++g) {
        float s = 0;
        for (int64_t r = g * p.group_rows; r < (g + 1) * p.group_rows; ++r)
          s += bf16 ? float(bf16_value(p.x_bf16[i * p.c.k + r])) : p.x[i * p.c.k + r];
        xsum.push_back(s);
      }
    a.xsum = xsum.data();
  }
  out.assign(p.c.m * p.c.n, NAN);
  a.out = out.data();
  return a;
}

// gemv(n0, n1) over uneven column ranges: the kernels must handle any [n0, n1).
template <class Gemv>
void over_gemv_ranges(int64_t n, Gemv&& gemv) {
  for (int64_t n0 = 0; n0 < n;) {
    const int64_t n1 = n0 + kGemvBlockCols * (1 + n0 % 2) < n ? n0 + kGemvBlockCols * (1 + n0 % 2) : n;
    gemv(n0, n1);
    n0 = n1;
  }
}

// gemm_tile(m0, m1, nb, scratch) over every column tile, in several row blocks when M is large.
template <class GemmTile>
void over_gemm_tiles(int64_t m, int64_t n, GemmTile&& gemm_tile) {
  const int64_t rows = m > 20 ? 20 : m;
  std::vector<float> scratch(gemm_scratch_floats(rows));
  for (int64_t m0 = 0; m0 < m; m0 += rows)
    for (int64_t nb = 0; nb < n; nb += kGemmBlockCols) gemm_tile(m0, m0 + rows < m ? m0 + rows : m, nb, scratch.data());
}

void run_gemv(const CpuKernels& kern, const Problem& p, bool bf16, const std::string& what) {
  std::vector<float> out, xsum;
  const GemmArgs a = gemm_args(p, bf16, xsum, out);
  over_gemv_ranges(p.c.n, [&](int64_t n0, int64_t n1) { kern.gemv(a, 0, p.c.m, n0, n1); });
  check_gemm(p, p.w, bf16, out, what + " gemv");
}

// x quantized as ops.cpp does (cpu/activation_q8.h), in `order`: the GemmArgs fields.
struct Q8X {
  std::vector<int32_t> xq;
  std::vector<float> scale, gsum;
  Q8X(const Problem& p, Q8Order order)
      : xq(p.c.m * p.c.k / 4), scale(p.c.m * p.c.k / kQ8Block), gsum(p.c.m * p.groups) {
    quantize_x_q8(p.x.data(), p.c.m, p.c.k, p.group_rows, order, xq.data(), scale.data(), gsum.data());
  }
  void set(GemmArgs& a) const {
    a.q8_x = xq.data();
    a.q8_scale = scale.data();
    a.q8_gsum = gsum.data();
  }
};

// An int8-x GEMV's out against the float64 products of exactly those int8 values and
// scales with the weights w ([k, n]: the dense or the 2:4 weight).
void check_q8(const Problem& p, const std::vector<double>& w, const Q8X& q, Q8Order order,
              const std::vector<float>& out, const std::string& what) {
  const int64_t n = p.c.n, k = p.c.k, blocks = k / kQ8Block;
  const int8_t* bytes = reinterpret_cast<const int8_t*>(q.xq.data());
  double worst = 0;
  for (int64_t i = 0; i < p.c.m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, magnitude = 0;
      for (int64_t r = 0; r < k; ++r) {
        const int64_t pos = order == Q8Order::kNatural ? r : r / 8 * 8 + (r % 2) * 4 + (r % 8) / 2;  // the quads
        const double xv = double(q.scale[i * blocks + r / kQ8Block]) * bytes[i * k + pos];
        ref += xv * w[r * n + j];
        // the terms the kernel sums: values and zeros (offsets) times the scale, apart
        const double s = half_value(p.scales[r / p.group_rows * n + j]);
        magnitude += fabs(xv) * (fabs(w[r * n + j]) + 16 * fabs(s) + fabs(half_value(p.zeros[r / p.group_rows * n + j])));
      }
      const double err = fabs(out[i * n + j] - ref), bound = 1e-6 * magnitude + 1e-30;
      if (!(err <= bound) && err / bound > worst) worst = err / bound;
    }
  }
  if (worst > 0) fail(what + ": error up to " + std::to_string(worst) + "x the bound");
}

void run_gemv_q8(const Q8Kernels& q8, const Problem& p, const std::string& what) {
  const Q8X q(p, Q8Order::kQuads);
  std::vector<float> out(p.c.m * p.c.n, NAN);
  GemmArgs a = p.args();
  q.set(a);
  a.out = out.data();
  over_gemv_ranges(p.c.n, [&](int64_t n0, int64_t n1) { q8.gemv_q8(a, 0, p.c.m, n0, n1); });
  check_q8(p, p.w, q, Q8Order::kQuads, out, what + " gemv_q8");
}

void run_gemm_tile(const CpuKernels& kern, const Problem& p, bool bf16, const std::string& what) {
  std::vector<float> out, xsum;
  const GemmArgs a = gemm_args(p, bf16, xsum, out);
  over_gemm_tiles(p.c.m, p.c.n, [&](int64_t m0, int64_t m1, int64_t nb, float* scratch) {
    kern.gemm_tile(a, m0, m1, nb, scratch);
  });
  check_gemm(p, p.w, bf16, out, what + " gemm_tile");
}

// fp4 / int4: exact (code value x fp16 scale fits fp32); uint4: q - zero rounded to fp32 once.
void run_dequantize(const CpuKernels& kern, const Problem& p, const std::string& what) {
  const GemmArgs a = p.args();
  std::vector<float> tile(kGemmBlockRows * kGemmBlockCols);
  double worst = 0;
  for (int64_t k0 = 0; k0 < p.c.k; k0 += kGemmBlockRows) {
    const int64_t k1 = k0 + kGemmBlockRows < p.c.k ? k0 + kGemmBlockRows : p.c.k;
    for (int64_t nb = 0; nb < p.c.n; nb += kGemmBlockCols) {
      kern.dequantize_rows(a, k0, k1, nb, tile.data());
      for (int64_t r = k0; r < k1; ++r)
        for (int64_t j = nb; j < p.c.n && j < nb + kGemmBlockCols; ++j) {
          const double ref = p.w[r * p.c.n + j], got = tile[(r - k0) * kGemmBlockCols + j - nb];
          const double bound = format_has_zeros(p.c.format) ? ldexp(fabs(ref), -23) : 0.0;
          const double err = fabs(got - ref);
          if (!(err <= bound)) worst = err > worst ? err : worst + 1;
          if (!format_has_zeros(p.c.format) && signbit(got) != signbit(ref)) worst += 1;  // -0 (fp4) stays -0
        }
    }
  }
  if (worst > 0) fail(what + " dequantize_rows: not exact");
}

// ---------------------------------------------------------------------------
// The 2:4 layout (docs/FORMAT.md): in every block of 4 K rows two codes are
// kept at positions pos0 < pos1; values word [r, n] holds nibble j = kept
// weight j / 4 of block j % 4 of K rows 16r..16r+15, metadata word [r / 2, n]
// the nibble pos0 | pos1 << 2 of block b of values row r at bit 16 (r % 2) + 4b.
struct SparseProblem {
  const Problem& d;  // x, scales and zeros are the dense problem's
  std::vector<int32_t> values, metadata;
  std::vector<float> x_of_bf16;  // bf16 x widened: what the op passes beside x_bf16
  std::vector<double> w;         // [k, n] dequantized, pruned weights 0

  explicit SparseProblem(const Problem& dense) : d(dense) {
    const Case& c = d.c;
    values.assign(c.k / 16 * c.n, 0);
    metadata.assign(c.k / 32 * c.n, 0);
    w.assign(c.k * c.n, 0.0);
    static const int kPatterns[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
    for (int64_t blk = 0; blk < c.k / 4; ++blk) {
      const int64_t r = blk / 4, b = blk % 4;
      for (int64_t j = 0; j < c.n; ++j) {
        const int* pat = kPatterns[next_u32() % 6];
        metadata[r / 2 * c.n + j] |= int32_t(uint32_t(pat[0] | pat[1] << 2) << (16 * (r % 2) + 4 * b));
        for (int slot = 0; slot < 2; ++slot) {
          const int code = int(next_u32() & 15);
          values[r * c.n + j] |= int32_t(uint32_t(code) << (4 * (b + 4 * slot)));
          const int64_t row = 4 * blk + pat[slot], g = row / d.group_rows;
          w[row * c.n + j] = weight_value(c.format, code, half_value(d.scales[g * c.n + j]), half_value(d.zeros[g * c.n + j]));
        }
      }
    }
    for (uint16_t b : d.x_bf16) x_of_bf16.push_back(float(bf16_value(b)));
  }

  Sparse24Args args(bool bf16, std::vector<float>& out) const {
    Sparse24Args a{};
    static_cast<GemmArgs&>(a) = d.args();
    a.packed = values.data();
    a.metadata = metadata.data();
    a.x = bf16 ? x_of_bf16.data() : d.x.data();
    if (bf16) a.x_bf16 = d.x_bf16.data();
    out.assign(d.c.m * d.c.n, NAN);
    a.out = out.data();
    return a;
  }
};

void run_sparse(const CpuKernels& kern, const SparseProblem& sp, bool bf16, const std::string& what) {
  const Case& c = sp.d.c;
  std::vector<float> out;
  Sparse24Args a = sp.args(bf16, out);
  uint32_t bad = 0;
  over_gemv_ranges(c.n, [&](int64_t n0, int64_t n1) { bad |= kern.sparse24_gemv(a, 0, c.m, n0, n1); });
  check_gemm(sp.d, sp.w, bf16, out, what + " sparse24_gemv");
  a = sp.args(bf16, out);
  over_gemm_tiles(c.m, c.n, [&](int64_t m0, int64_t m1, int64_t nb, float* scratch) {
    bad |= kern.sparse24_gemm_tile(a, m0, m1, nb, scratch);
  });
  check_gemm(sp.d, sp.w, bf16, out, what + " sparse24_gemm_tile");
  if (bad) fail(what + ": valid metadata reported invalid");
}

// The 2:4 int8-x GEMV (x in K order), and that it reports an invalid metadata word.
void run_sparse_q8(const Q8Kernels& q8, const SparseProblem& sp, const std::string& what) {
  const Problem& p = sp.d;
  const Q8X q(p, Q8Order::kNatural);
  std::vector<float> out;
  Sparse24Args a = sp.args(false, out);
  q.set(a);
  uint32_t bad = 0;
  over_gemv_ranges(p.c.n, [&](int64_t n0, int64_t n1) { bad |= q8.sparse24_gemv_q8(a, 0, p.c.m, n0, n1); });
  check_q8(p, sp.w, q, Q8Order::kNatural, out, what + " sparse24_gemv_q8");
  if (bad) fail(what + " sparse24_gemv_q8: valid metadata reported invalid");
  std::vector<int32_t> broken = sp.metadata;
  broken[broken.size() - 1] = int32_t((uint32_t(broken.back()) & ~0xF0000u) | 0x50000u);  // (1, 1)
  a.metadata = broken.data();
  if (!q8.sparse24_gemv_q8(a, 0, p.c.m, 0, p.c.n)) fail(what + " sparse24_gemv_q8: an invalid metadata word went unreported");
}

// Exact as the dense dequantize; and a metadata word with an invalid pattern
// (equal positions) in the last column is reported by every entry point.
void run_sparse_dequantize(const CpuKernels& kern, const SparseProblem& sp, const std::string& what) {
  const Case& c = sp.d.c;
  std::vector<float> out;
  Sparse24Args a = sp.args(false, out);
  std::vector<float> tile(kGemmBlockRows * kGemmBlockCols);
  double worst = 0;
  for (int64_t k0 = 0; k0 < c.k; k0 += kGemmBlockRows) {
    const int64_t k1 = k0 + kGemmBlockRows < c.k ? k0 + kGemmBlockRows : c.k;
    for (int64_t nb = 0; nb < c.n; nb += kGemmBlockCols) {
      if (kern.sparse24_dequantize_rows(a, k0, k1, nb, tile.data())) worst += 1;
      for (int64_t r = k0; r < k1; ++r)
        for (int64_t j = nb; j < c.n && j < nb + kGemmBlockCols; ++j) {
          const double ref = sp.w[r * c.n + j], got = tile[(r - k0) * kGemmBlockCols + j - nb];
          const double bound = format_has_zeros(c.format) ? ldexp(fabs(ref), -23) : 0.0;
          if (!(fabs(got - ref) <= bound)) worst += 1;
        }
    }
  }
  if (worst > 0) fail(what + " sparse24_dequantize_rows: not exact");
  std::vector<int32_t> broken = sp.metadata;
  const int64_t word = (c.k / 32 - 1) * c.n + c.n - 1;
  broken[word] = int32_t((uint32_t(broken[word]) & ~0xF0000u) | 0x50000u);  // (1, 1)
  a.metadata = broken.data();
  std::vector<float> scratch(gemm_scratch_floats(c.m));
  const uint32_t seen[3] = {kern.sparse24_gemv(a, 0, c.m, 0, c.n),
                            kern.sparse24_gemm_tile(a, 0, c.m, (c.n - 1) / kGemmBlockCols * kGemmBlockCols, scratch.data()),
                            kern.sparse24_dequantize_rows(a, c.k - 32, c.k, (c.n - 1) / kGemmBlockCols * kGemmBlockCols, tile.data())};
  for (uint32_t b : seen)
    if (!b) fail(what + ": an invalid metadata word went unreported");
}

}  // namespace

int main(int argc, char** argv) {
  const char* expect_selected = nullptr;
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "--expect-selected") && i + 1 < argc) expect_selected = argv[++i];

  // M: the gemv register blocks (1..8, 16) and the tile path (17, 33);
  // N: partial strips and vector tails; K / group: every group size, groups
  // longer than a gemv chunk or a gemm tile, and K not a multiple of the tile.
  std::vector<Case> cases;
  for (int f = 0; f < marlin::kNumWeightFormats; ++f) {
    cases.push_back({f, 1, 64, 256, 32});
    cases.push_back({f, 2, 72, 512, 256});
    cases.push_back({f, 3, 130, 256, 16});
    cases.push_back({f, 5, 8, 384, 128});
    cases.push_back({f, 8, 64, 512, 64});
    cases.push_back({f, 13, 65, 200, -1});
    cases.push_back({f, 16, 96, 768, 128});
    cases.push_back({f, 17, 64, 1024, 256});
    cases.push_back({f, 33, 33, 520, -1});
  }
  std::vector<Problem> problems;
  for (const Case& c : cases) problems.emplace_back(c);
  std::vector<SparseProblem> sparse;  // the 2:4 layout needs K a multiple of 32
  for (const Problem& p : problems)
    if (p.c.k % 32 == 0) sparse.emplace_back(p);

  int checked = 0;
  for (const std::string& name : kernel_build_names()) {
    const std::string why = unsupported_reason(name);
    if (!why.empty()) {
      printf("SKIP %s: %s\n", name.c_str(), why.c_str());
      continue;
    }
    const CpuKernels& kern = *find_kernel_build(name);
    const int before = failures;
    int q8_cases = 0;
    // As the ops: int8 x for few rows, where the format and the group size allow it; every
    // int8 dot product of the build that this CPU runs.
    std::string int_dots;
    std::vector<const Q8Kernels*> int8;
    for (const Q8Kernels* const* k = kern.q8; *k; ++k) {
      const std::string why = q8_unsupported_reason(**k);
      if ((*k)->int_dot) int_dots += (int_dots.empty() ? "" : ", ") + std::string((*k)->int_dot) + (why.empty() ? "" : " (skipped: " + why + ")");
      if (why.empty()) int8.push_back(*k);
    }
    auto q8_applies = [&](const Problem& p) {
      return p.c.m <= kGemvMaxRows && p.group_rows % kQ8Block == 0 && kern.gemv_q8_applies(p.c.format);
    };
    for (const Problem& p : problems) {
      for (bool bf16 : {false, true}) {
        // As the ops: bf16 x only to the formats whose values bf16 holds.
        if (bf16 && !(kern.bf16_x && bf16_exact(p.c.format))) continue;
        char what[160];
        snprintf(what, sizeof(what), "%s %s x=%s m=%lld n=%lld k=%lld g=%lld", name.c_str(), format_name(p.c.format),
                 bf16 ? "bf16" : "fp32", (long long)p.c.m, (long long)p.c.n, (long long)p.c.k,
                 (long long)p.c.group_size);
        run_gemv(kern, p, bf16, what);
        run_gemm_tile(kern, p, bf16, what);
      }
      if (q8_applies(p))
        for (const Q8Kernels* q8 : int8) {
          run_gemv_q8(*q8, p, name + " " + q8->int_dot + " " + format_name(p.c.format) + " x=int8 m=" +
                                  std::to_string(p.c.m) + " n=" + std::to_string(p.c.n) + " k=" +
                                  std::to_string(p.c.k) + " g=" + std::to_string(p.c.group_size));
          ++q8_cases;
        }
      run_dequantize(kern, p, name + " " + format_name(p.c.format));
    }
    for (const SparseProblem& sp : sparse) {
      const Case& c = sp.d.c;
      for (bool bf16 : {false, true}) {
        if (bf16 && !(kern.sparse24_bf16_x && bf16_exact(c.format))) continue;
        char what[160];
        snprintf(what, sizeof(what), "%s 2:4 %s x=%s m=%lld n=%lld k=%lld g=%lld", name.c_str(),
                 format_name(c.format), bf16 ? "bf16" : "fp32", (long long)c.m, (long long)c.n, (long long)c.k,
                 (long long)c.group_size);
        run_sparse(kern, sp, bf16, what);
      }
      run_sparse_dequantize(kern, sp, name + " 2:4 " + format_name(c.format));
      if (q8_applies(sp.d))
        for (const Q8Kernels* q8 : int8) {
          run_sparse_q8(*q8, sp, name + " " + q8->int_dot + " 2:4 " + format_name(c.format) + " x=int8 m=" +
                                     std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" +
                                     std::to_string(c.k) + " g=" + std::to_string(c.group_size));
          ++q8_cases;
        }
    }
    printf("%s %s (%zu dense and %zu 2:4 cases; dense %s, 2:4 %s; %d int8-x gemv cases (dense and 2:4), %s)\n",
           failures == before ? "PASS" : "FAIL", name.c_str(), problems.size(), sparse.size(),
           kern.bf16_x ? "fp32 and bf16 x" : "fp32 x", kern.sparse24_bf16_x ? "fp32 and bf16 x" : "fp32 x", q8_cases,
           int_dots.c_str());
    ++checked;
  }

  const KernelSelection selected = select_kernel_build(nullptr);
  printf("selected: %s\n", selected.kernels ? selected.kernels->name : selected.error.c_str());
  if (expect_selected && (!selected.kernels || strcmp(selected.kernels->name, expect_selected)))
    fail(std::string("automatic choice is not ") + expect_selected);
  // Forcing a build this CPU cannot run is an error, not a crash.
  for (const std::string& name : kernel_build_names())
    if (!unsupported_reason(name).empty() && !select_kernel_build(name.c_str()).error.size())
      fail("forcing " + name + " gave no error");
  if (!select_kernel_build("no-such-build").error.size()) fail("an unknown build name gave no error");

  if (!checked) fail("no build ran");
  printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
