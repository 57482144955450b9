// The 2:4 metadata code decision, measured: the sparse CPU GEMV of
// csrc/cpu/sparse24_kernels_impl.h (AVX2 build, one thread) with the layout's
// nibble code (4 bits per block of 4 weights) against a base-6 code (2.67 bits
// per block) in the same kernel, on the same weights. Built and run by
// benchmarks/sparse_metadata_code.py; prints one JSON line per case.
#if !defined(__x86_64__)
#error "x86-64 only (the AVX2 build of the kernels)"
#endif
#pragma GCC target("avx2,fma,f16c")
#define MARLIN_KERNEL_NS bench
#define MARLIN_KERNEL_NAME "bench"
#define MARLIN_KERNEL_AVX2 1
#include "cpu/kernels_impl.h"  // with the 2:4 kernels (cpu/sparse24_kernels_impl.h)

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace marlin {
namespace cpu {
namespace bench {
namespace {

typedef vf v8f;  // the AVX2 build: 8 lanes
typedef vi v8i;
typedef vu v8u;

constexpr int kNibbleOfPattern[6] = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};  // (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)

// Base-6: block j's pattern index (0..5) is digit j % 6 of a 16-bit code
// (6^6 = 46656 < 2^16); a 32-bit word holds 2 codes = 12 blocks = 3 values
// rows. Decoding a row's 4 digits: float floor-divisions by 6 (exact here),
// then a table from pattern index to the nibble the kernel consumes.
struct Base6Metadata {
  static constexpr int kRowsPerWord = 3;
  static constexpr int32_t kFill = 0;
  static inline v8f floor8(v8f x) { return __builtin_ia32_roundps256(x, 9); }  // floor, no exceptions
  static inline v8i positions(v8i m, int part, v8u& bad) {
    const v8i lo = m & 0xFFFF, hi = (v8i)((v8u)m >> 16);
    if (part == 0) bad |= (v8u)((lo > 46655) | (hi > 46655));
    const v8i table = {kNibbleOfPattern[0], kNibbleOfPattern[1], kNibbleOfPattern[2], kNibbleOfPattern[3],
                       kNibbleOfPattern[4], kNibbleOfPattern[5], 0, 0};
    v8i out = {};
    int j = 4 * part;  // first block of this values row
    while (j < 4 * part + 4) {
      const bool high = j >= 6;
      const int e = j % 6, count = std::min(4 * part + 4 - j, 6 - e);
      v8f q = __builtin_convertvector(high ? hi : lo, v8f);
      if (e) q = floor8((q + 0.5f) * (1.0f / float(e == 1 ? 6 : e == 2 ? 36 : e == 3 ? 216 : e == 4 ? 1296 : 7776)));
      for (int i = 0; i < count; ++i, ++j) {
        const v8f next = floor8((q + 0.5f) * (1.0f / 6.0f));
        const v8i digit = __builtin_convertvector(q - next * 6.0f, v8i);
        out |= __builtin_ia32_permvarsi256(table, digit) << (4 * (j - 4 * part));
        q = next;
      }
    }
    return out;
  }
};

// The same density with a table instead of arithmetic: 3 blocks per byte
// (6^3 = 216 codes), 4 bytes = 12 blocks = 3 values rows per word; a values
// row's 4 blocks span 2 bytes, each looked up (vpgatherdd) in a 216-entry
// table of the 3 blocks' nibbles.
struct Base6TableMetadata {
  static constexpr int kRowsPerWord = 3;
  static constexpr int32_t kFill = 0;
  static inline const int32_t* table() {
    static const int32_t* t = [] {
      static int32_t entries[256];
      for (int c = 0; c < 256; ++c)
        entries[c] = c < 216 ? kNibbleOfPattern[c % 6] | kNibbleOfPattern[c / 6 % 6] << 4 |
                                   kNibbleOfPattern[c / 36] << 8
                             : 0;
      return entries;
    }();
    return t;
  }
  static inline v8i lookup(v8i byte) { return (v8i)_mm256_i32gather_epi32(table(), (__m256i)byte, 4); }
  static inline v8i positions(v8i m, int part, v8u& bad) {
    if (part == 0)
      for (int b = 0; b < 4; ++b) bad |= (v8u)((((v8i)((v8u)m >> (8 * b))) & 0xFF) > 215);
    // blocks 4p..4p+3 are in bytes (4p)/3 and (4p+3)/3, starting at block 3 * byte
    const int first = (4 * part) / 3, skip = 4 * part - 3 * first;
    const v8i a = lookup((v8i)((v8u)m >> (8 * first)) & 0xFF), b = lookup((v8i)((v8u)m >> (8 * first + 8)) & 0xFF);
    return (v8i)(((v8u)a >> (4 * skip)) | ((v8u)b << (4 * (3 - skip)))) & 0xFFFF;
  }
};

template <class Meta>
double run(const Sparse24Args& a, int fmt) {
  const auto t0 = std::chrono::steady_clock::now();
  const v8u bad = with_format(fmt, [&]<int F>() { return sparse_gemv_impl<Meta, F, false>(a, 0, a.m, 0, a.n); });
  if (any_lane(bad)) {
    std::fprintf(stderr, "invalid metadata\n");
    std::exit(1);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void one_case(int64_t n, int64_t k, int64_t m, int fmt, int repeats) {
  std::mt19937 rng(1234);
  const int64_t rows = k / 16, blocks = k / 4, groups = k / 128;
  std::vector<int32_t> values(rows * n), nibble_meta(k / 32 * n, 0), base6_meta((rows + 2) / 3 * n, 0);
  std::vector<int32_t> table_meta((rows + 2) / 3 * n, 0);
  std::vector<uint16_t> scales(groups * n, 0x2000), zeros(groups * n, 0x4800);  // fp16 2^-7, 8.0
  std::vector<float> x(m * k), out_nibble(m * n), out_base6(m * n), out_table(m * n);
  for (auto& v : values) v = int32_t(rng());
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) / 1000.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < n; ++c) {
      const int d = int(rng() % 6);
      nibble_meta[(b / 8) * n + c] |= kNibbleOfPattern[d] << (4 * (b % 8));
      int32_t& word = base6_meta[(b / 12) * n + c];
      int power = 1;
      for (int i = 0; i < b % 6; ++i) power *= 6;
      word += int32_t(uint32_t(d * power) << (16 * ((b % 12) / 6)));
      const int byte = int(b % 12) / 3, digit = int(b % 3);
      table_meta[(b / 12) * n + c] += int32_t(uint32_t(d * (digit == 0 ? 1 : digit == 1 ? 6 : 36)) << (8 * byte));
    }
  }
  Sparse24Args a{};
  a.x = x.data();
  a.packed = values.data();
  a.scales = scales.data();
  a.zeros = zeros.data();
  a.m = m;
  a.k = k;
  a.n = n;
  a.groups = groups;
  a.group_rows = 128;
  a.format = fmt;
  std::vector<double> t_nibble, t_base6, t_table, ratio;
  for (int i = 0; i < repeats + 1; ++i) {  // interleaved, the first pair is a warm-up
    a.metadata = nibble_meta.data();
    a.out = out_nibble.data();
    const double tn = run<NibbleMetadata>(a, fmt);
    a.metadata = base6_meta.data();
    a.out = out_base6.data();
    const double tb = run<Base6Metadata>(a, fmt);
    a.metadata = table_meta.data();
    a.out = out_table.data();
    const double tt = run<Base6TableMetadata>(a, fmt);
    if (i == 0) continue;
    t_nibble.push_back(tn);
    t_base6.push_back(tb);
    t_table.push_back(tt);
    ratio.push_back(tb / tn);
  }
  if (out_nibble != out_base6 || out_nibble != out_table) {
    std::fprintf(stderr, "the two codes disagree\n");
    std::exit(1);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const char* names[] = {"fp4", "uint4", "int4"};
  // Minimum times (preemption on a shared machine only adds time) and the median of the pair ratios.
  auto least = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  std::printf("{\"format\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, \"nibble_ms\": %.4f, "
              "\"base6_ms\": %.4f, \"base6_table_ms\": %.4f, \"median_ratio\": %.4f}\n",
              names[fmt], (long long)n, (long long)k, (long long)m, 1e3 * least(t_nibble), 1e3 * least(t_base6),
              1e3 * least(t_table), median(ratio));
  std::fflush(stdout);
}

}  // namespace
}  // namespace bench
}  // namespace cpu
}  // namespace marlin

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 15;
  const bool quick = argc > 2 && std::atoi(argv[2]);
  const long long shapes[3][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}};
  for (int s = 0; s < (quick ? 1 : 3); ++s)
    for (int fmt = 0; fmt < marlin::kNumWeightFormats; ++fmt)
      for (int64_t m : {1, 4})
        marlin::cpu::bench::one_case(shapes[s][0], shapes[s][1], m, fmt, repeats);
  return 0;
}
