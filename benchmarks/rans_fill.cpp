// The entropy-coded layout's tile GEMM split into its parts: gemm_tile of the
// CPU kernels (csrc/cpu/rans_kernels_impl.h) over all of N with no rows of x
// (the tile fill, the decode, alone) and with M rows (fill and micro-kernels),
// without torch; process CPU time, one thread, median and minimum of 9 (avx2-vs-base: median of 15
// alternated passes of each, and of their ratios). Streams come from
// the spec's reference encoder of tests/cpu_kernels/check_rans_kernels.cpp
// (included, its main renamed): a 16-symbol stream peaked around the middle
// (fp4 lossless-like) or a 256-symbol grid stream (tcq: the same stream
// through the trellis): peaked, or `gauss`, bench_rans.py's Gaussian, or `t6`, Student's t
// (about 116 symbols at 4096 x 4096, 0.25% of the weights past the 30 most likely: a real
// layer's heavier tails; the slot table on AVX2). Built and run by
// benchmarks/bench_rans_fill.py; prints one JSON line per case.
#define main check_rans_kernels_main
#include "check_rans_kernels.cpp"
#undef main

#include <time.h>

#if defined(__x86_64__)
#include "core_probe.c"  // avx2-vs-base probes around each pair; bench_rans_fill.py labels them (core_probe.py)
#else
static double core_probe() { return 0; }
#endif

// bench_rans_fill.py --against REV links REV's avx2 kernels in under this name (absent: null).
namespace marlin::cpu::avx2_base {
extern const RansKernels rans_kernels __attribute__((weak));
}

namespace {
double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s BUILD|avx2-vs-base fp4|grid|tcq M [N=K] [grid spread=12 | gauss | t6]\n", argv[0]);
    return 2;
  }
  // avx2-vs-base: the avx2 kernels against the baseline ones linked in as avx2_base, alternated
  // pass by pass in this process (a VM's phases move both alike)
  const bool against = std::string(argv[1]) == "avx2-vs-base";
  const std::string build = against ? "avx2" : argv[1], kind_name = argv[2];
  const RansKernels* base = against ? &marlin::cpu::avx2_base::rans_kernels : nullptr;
  if (against && !base) {
    printf("{\"build\": \"%s\", \"skipped\": \"no baseline linked in\"}\n", argv[1]);
    return 0;
  }
  const int64_t m = atoll(argv[3]), n = argc > 4 ? atoll(argv[4]) : 4096, k = n, chunk_k = 1024;
  const double spread = argc > 5 ? atof(argv[5]) : 12;  // 12: 36 symbols; 9: 27
  // gauss: bench_rans.py's grid, a Gaussian on a step of 0.35 sigma (31 symbols, tails of frequency 1)
  const bool gauss = argc > 5 && std::string(argv[5]) == "gauss";
  const bool t6 = argc > 5 && std::string(argv[5]) == "t6";
  const RansKernels* kern = rans_build(build);
  const std::string why = unsupported_reason(build);
  if (!kern || !why.empty()) {
    printf("{\"build\": \"%s\", \"skipped\": \"%s\"}\n", build.c_str(), kern ? why.c_str() : "not compiled");
    return 0;
  }
  const bool grid = kind_name == "grid" || kind_name == "tcq";  // tcq: the grid's stream through the trellis
  const int kind = kind_name == "tcq" ? kRansTcq : grid ? kRansGrid : int(marlin::kFp4);
  const int symbols = grid ? 256 : 16, prob_bits = 12;
  std::vector<int> codes(k * n);
  auto normal = [] { return sqrt(-2 * log(1 - uniform())) * cos(6.283185307179586 * uniform()); };  // (Box-Muller)
  for (int& c : codes) {
    const double u = uniform() + uniform() + uniform() - 1.5;
    c = grid ? std::min(255, std::max(0, int(128 + u * spread))) : std::min(15, std::max(0, int(8 + u * 6)));
    if (grid && t6) {  // Student's t with 6 degrees of freedom, times 3: a real layer's heavier tails
      double z[7];
      for (double& v : z) v = normal();
      const double chi = z[1] * z[1] + z[2] * z[2] + z[3] * z[3] + z[4] * z[4] + z[5] * z[5] + z[6] * z[6];
      c = 128 + std::min(60, std::max(-60, int(lround(3 * z[0] / sqrt(chi / 6)))));
    } else if (grid && gauss) {
      c = 128 + std::min(127, std::max(-127, int(lround(normal() / 0.35))));
    }
  }
  Streams st = encode(codes, k, n, chunk_k, prob_bits, symbols);
  std::vector<uint32_t> table(rans_slot_table_size(prob_bits));
  build_rans_slot_table(st.freqs.data(), symbols, prob_bits, table.data());
  RansArgs a = stream_args(st, st.words.data(), table, symbols, kind, prob_bits, k, n, chunk_k);
  const int64_t group_rows = grid ? k : 128, groups = k / group_rows;
  std::vector<uint16_t> scales(groups * n, half_bits(0.01)), xb(m * k, bf16_of(0.5f));
  std::vector<float> x(m * k, 0.5f), out(m * n);
  const bool bf16_x = build.find("bf16") != std::string::npos;  // as the op gives bf16 x to these builds
  a.gemm.x = bf16_x ? nullptr : x.data();
  a.gemm.x_bf16 = bf16_x ? xb.data() : nullptr;
  a.gemm.scales = scales.data();
  a.gemm.m = m;
  a.gemm.k = k;
  a.gemm.n = n;
  a.gemm.groups = groups;
  a.gemm.group_rows = group_rows;
  a.gemm.format = kind;
  a.gemm.out = out.data();
  std::vector<float> scratch(kRansGemmCols / kGemmBlockCols * gemm_scratch_floats(m));
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  double ms[2], min_ms[2], base_ms[2], ratio[2];
  std::string pairs[2];  // avx2-vs-base: each pair's ratio and probe, as JSON lists
  for (int part = 0; part < 2; ++part) {
    const int64_t rows = part ? m : 0;
    std::vector<double> t, tb, r_pair, probes;
    uint32_t bad = 0;
    auto pass = [&](const RansKernels* k) {
      const double start = cpu_seconds();
      for (int64_t nb = 0; nb < n; nb += kRansGemmCols) bad |= k->gemm_tile(a, 0, rows, nb, scratch.data());
      return (cpu_seconds() - start) * 1e3;
    };
    for (int r = 0; r < (against ? 15 : 9); ++r) {
      if (!against) {
        t.push_back(pass(kern));
        continue;
      }
      const double before = core_probe();
      const double first = pass(r % 2 ? base : kern), second = pass(r % 2 ? kern : base);  // each goes first in turn
      t.push_back(r % 2 ? second : first), tb.push_back(r % 2 ? first : second);
      r_pair.push_back(t.back() / tb.back());
      probes.push_back((before + core_probe()) / 2);
    }
    for (size_t i = 0; i < r_pair.size(); ++i) {
      char item[64];
      snprintf(item, sizeof(item), "%s[%.4f, %.3f]", i ? ", " : "", r_pair[i], probes[i]);
      pairs[part] += item;
    }
    if (bad) fail("a well-formed stream reported bad");
    ms[part] = median(t);
    min_ms[part] = *std::min_element(t.begin(), t.end());  // (on a VM whose neighbours come and go the median can switch modes)
    base_ms[part] = against ? median(tb) : 0;
    ratio[part] = against ? median(r_pair) : 0;
  }
  if (against) {
    printf("{\"build\": \"avx2-vs-base\", \"weights\": \"%s\", \"m\": %lld, \"fill_ms\": %.3f, \"base_fill_ms\": %.3f, "
           "\"fill_ratio\": %.3f, \"gemm_ms\": %.3f, \"base_gemm_ms\": %.3f, \"gemm_ratio\": %.3f, "
           "\"fill_pairs\": [%s], \"gemm_pairs\": [%s]}\n",
           kind_name.c_str(), (long long)m, ms[0], base_ms[0], ratio[0], ms[1], base_ms[1], ratio[1], pairs[0].c_str(),
           pairs[1].c_str());
    return failures ? 1 : 0;
  }
  printf("{\"build\": \"%s\", \"weights\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, \"levels\": %d, "
         "\"split\": %d, \"symbols\": %d, \"byte_splits\": %d, \"fill_ms\": %.3f, \"gemm_ms\": %.3f, \"fill_min_ms\": %.3f, \"gemm_min_ms\": %.3f}\n",
         build.c_str(), kind_name.c_str(), (long long)n, (long long)k, (long long)m, a.registers.levels,
         int(a.registers.has_split), a.registers.symbols, a.bytes.fits ? a.bytes.splits : -1, ms[0], ms[1], min_ms[0], min_ms[1]);
  return failures ? 1 : 0;
}
