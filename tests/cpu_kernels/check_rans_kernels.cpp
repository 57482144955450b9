// Standalone check of the entropy-coded layout's CPU kernels (csrc/cpu/rans_*)
// in every build this CPU runs, without torch, so that the aarch64 builds can
// run under qemu (tests/test_cpu_kernels_aarch64.py). Streams come from the
// spec's reference encoder written here (docs/FORMAT.md); decode_chunk must
// give the codes back exactly, gemv and gemm_tile must match a float64
// dequantize-then-matmul, and a flipped or missing word must be reported by
// every entry point (never a read past the chunk: the words end at a page
// that may not be read). Prints "PASS <build>" / "SKIP <build>: why"; exit 1 on a mismatch.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/kernel_builds.h"
#include "cpu/rans_kernel_args.h"
#include "reference.h"

using namespace marlin::cpu;

namespace {

uint64_t rng_state = 0x2545F4914F6CDD1Dull;
uint32_t next_u32() {  // xorshift64*
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return uint32_t((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}
double uniform() { return next_u32() / 4294967296.0; }

const RansKernels* rans_build(const std::string& name) {
  for (const RansKernels* k : {&avx512_bf16::rans_kernels, &avx512::rans_kernels, &avx2::rans_kernels,
                               &neon_bf16::rans_kernels, &generic::rans_kernels})
    if (k->name && name == k->name) return k;
  return nullptr;
}

uint16_t half_bits(double v) {  // for the small positive scales used here: normal fp16, truncated
  int e;
  const double m = frexp(v, &e);  // v = m 2^e, m in [0.5, 1)
  return uint16_t(((e - 1 + 15) << 10) | (int(m * 2048) & 1023));
}
uint16_t bf16_of(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// The value before the scale of every symbol of codes [k, n]: the grid's s - 128, or
// tcq's trellis level (docs/FORMAT.md), each chunk's lanes from state 0:
// j = 2k - (state >> 1) sign(k), k = s - 128, then state = NEXT[state][k & 1].
std::vector<int> grid_levels(int kind, const std::vector<int>& codes, int64_t k, int64_t n, int64_t chunk_k) {
  static const int next[4][2] = {{0, 2}, {2, 0}, {1, 3}, {3, 1}};
  std::vector<int> level(codes.size());
  std::vector<int> state(n, 0);
  for (int64_t r = 0; r < k; ++r) {
    if (r % chunk_k == 0) state.assign(n, 0);
    for (int64_t j = 0; j < n; ++j) {
      const int q = codes[r * n + j] - 128, sign = (q > 0) - (q < 0);
      level[r * n + j] = kind == kRansGrid ? q : 2 * q - (state[j] >> 1) * sign;
      state[j] = next[state[j]][q & 1];
    }
  }
  return level;
}

struct Streams {
  std::vector<uint16_t> words;
  std::vector<int32_t> offsets;
  std::vector<uint32_t> states;
  std::vector<uint16_t> freqs;
};

// The spec's encoder: per chunk, lanes from 2^16; t = len-1..0, l = 31..0.
Streams encode(const std::vector<int>& codes, int64_t k, int64_t n, int64_t chunk_k, int prob_bits, int symbols) {
  Streams st;
  std::vector<int64_t> counts(symbols, 0);
  for (int c : codes) ++counts[c];
  const int64_t m = int64_t(1) << prob_bits;
  st.freqs.assign(symbols, 0);
  int64_t total = 0, top = 0;
  for (int s = 0; s < symbols; ++s) {
    if (counts[s]) st.freqs[s] = uint16_t(std::max<int64_t>(1, counts[s] * m / int64_t(codes.size())));
    total += st.freqs[s];
    if (st.freqs[s] > st.freqs[top]) top = s;
  }
  st.freqs[top] = uint16_t(st.freqs[top] + (m - total));
  std::vector<uint32_t> cum(symbols + 1, 0);
  for (int s = 0; s < symbols; ++s) cum[s + 1] = cum[s] + st.freqs[s];
  const int64_t blocks = (n + 31) / 32, kchunks = (k + chunk_k - 1) / chunk_k;
  st.offsets.push_back(0);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < kchunks; ++c) {
      const int64_t k0 = c * chunk_k, k1 = std::min(k, k0 + chunk_k);
      uint64_t x[32];
      for (auto& v : x) v = 1u << 16;
      std::vector<uint16_t> emitted;
      for (int64_t t = k1 - 1; t >= k0; --t) {
        for (int l = 31; l >= 0; --l) {
          const int64_t col = b * 32 + l;
          const int s = col < n ? codes[t * n + col] : int(top);  // pad columns: the most frequent symbol
          const uint64_t f = st.freqs[s];
          if (x[l] >= f << (32 - prob_bits)) {
            emitted.push_back(uint16_t(x[l] & 0xFFFF));
            x[l] >>= 16;
          }
          x[l] = ((x[l] / f) << prob_bits) + x[l] % f + cum[s];
        }
      }
      st.words.insert(st.words.end(), emitted.rbegin(), emitted.rend());
      st.offsets.push_back(int32_t(st.words.size()));
      for (uint64_t v : x) st.states.push_back(uint32_t(v));
    }
  }
  return st;
}

// The kernels' arguments for stream st (its words at `words`, its slot table built),
// before x, the scales and the output.
RansArgs stream_args(const Streams& st, const uint16_t* words, const std::vector<uint32_t>& table, int symbols,
                     int kind, int prob_bits, int64_t k, int64_t n, int64_t chunk_k) {
  RansArgs a{};
  a.words = words;
  a.word_offsets = st.offsets.data();
  a.states = st.states.data();
  a.table = table.data();
  a.registers = build_rans_register_table(st.freqs.data(), symbols, prob_bits);
  a.bytes = RansByteLayout(a.registers, prob_bits);
  a.prob_bits = prob_bits;
  a.kind = kind;
  a.k = k;
  a.n = n;
  a.chunk_k = chunk_k;
  a.kchunks = (k + chunk_k - 1) / chunk_k;
  a.blocks = (n + 31) / 32;
  return a;
}

struct Case {
  int kind, prob_bits;
  int64_t m, k, n, chunk_k, group_size;  // group_size -1: one group
  int used = 0;  // codes in [0, used) only, each at least once (0: every symbol possible)
  bool flat = false;  // codes uniform in [0, used): few symbols per bucket, the AVX-512 lookup in registers
  double width = 0;   // peaked codes' width (0: spread / 5)
};

int failures = 0;
// Some split bucket of b counts a run of cums in one step.
bool has_run(const RansByteLayout& b) {
  return std::any_of(b.run_length, b.run_length + b.splits, [](int length) { return length > 0; });
}
// per case run: AVX2's byte tables (more than 16 symbols: their 32-entry tables) and their splits (-1: none)
std::vector<std::pair<bool, int>> case_byte_tables;
int case_byte_runs = 0;  // case runs whose byte tables have a split bucket's run
void fail(const std::string& what) {
  if (failures++ < 20) printf("FAIL %s\n", what.c_str());
}

// One case in one build: decode, gemv (m <= 8) or gemm_tile, and the corruption reports.
void run_case(const std::string& name, const RansKernels& kern, bool bf16_x, const Case& cs) {
  const bool grid = cs.kind == kRansGrid || cs.kind == kRansTcq;  // 256 symbols, one step per column
  const int symbols = grid ? 256 : 16;
  const int64_t k = cs.k, n = cs.n, m = cs.m;
  const int64_t rows = cs.group_size == -1 ? k : cs.group_size, groups = k / rows;
  const bool zeros = marlin::has_zeros(marlin::WeightFormat(cs.kind));
  std::vector<int> codes(k * n);
  const int spread = cs.used ? cs.used : symbols;
  for (int& c : codes) {  // peaked around the middle, or flat
    const double u = cs.flat ? uniform() - 0.5 : uniform() + uniform() + uniform() - 1.5;
    c = std::min(spread - 1, std::max(0, int(spread / 2 + u * (cs.flat ? spread : cs.width ? cs.width : spread / 5))));
  }
  for (int i = 0; i < cs.used; ++i) codes[i * 7] = i;
  std::vector<uint16_t> scales(groups * n), zero(groups * n);
  for (auto& s : scales) s = half_bits(0.001 + 0.02 * uniform());
  for (auto& z : zero) z = half_bits(0.5 + 14 * uniform());
  const std::vector<int> level = grid ? grid_levels(cs.kind, codes, k, n, cs.chunk_k) : std::vector<int>();
  Streams st = encode(codes, k, n, cs.chunk_k, cs.prob_bits, symbols);
  std::vector<uint32_t> table(rans_slot_table_size(cs.prob_bits));
  build_rans_slot_table(st.freqs.data(), symbols, cs.prob_bits, table.data());
  // The words end where a page that may not be read begins: a read past them faults.
  const size_t page = size_t(sysconf(_SC_PAGESIZE)), bytes = st.words.size() * 2;
  const size_t mapped = (bytes + page - 1) / page * page + page;
  char* base = (char*)mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED || mprotect(base + mapped - page, page, PROT_NONE)) {
    fail("mmap");
    return;
  }
  uint16_t* words = (uint16_t*)(base + mapped - page - bytes);
  memcpy(words, st.words.data(), bytes);
  struct Unmap {
    char* p;
    size_t n;
    ~Unmap() { munmap(p, n); }
  } unmap{base, mapped};

  RansArgs a = stream_args(st, words, table, symbols, cs.kind, cs.prob_bits, k, n, cs.chunk_k);
  if (cs.flat && !a.registers.symbols) fail(std::to_string(cs.used) + " flat symbols have no register table");
  case_byte_tables.push_back({a.registers.symbols > 16, a.bytes.fits ? std::min(a.bytes.splits, 2) : -1});
  case_byte_runs += a.bytes.fits && has_run(a.bytes);
  const int64_t chunks = a.blocks * a.kchunks;
  char what[200];
  snprintf(what, sizeof(what), "%s kind=%d p=%d m=%lld k=%lld n=%lld chunk_k=%lld g=%lld x=%s", name.c_str(), cs.kind,
           cs.prob_bits, (long long)m, (long long)k, (long long)n, (long long)cs.chunk_k, (long long)cs.group_size,
           bf16_x ? "bf16" : "fp32");

  std::vector<uint8_t> decoded(k * n);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c / a.kchunks * 32, k0 = c % a.kchunks * cs.chunk_k;
    if (kern.decode_chunk(a, c, decoded.data() + k0 * n + n0, n, std::min<int64_t>(32, n - n0)))
      fail(std::string(what) + ": decode reports a good chunk bad");
  }
  for (int64_t i = 0; i < k * n; ++i)
    if (decoded[i] != codes[i]) {
      fail(std::string(what) + ": decode differs at " + std::to_string(i));
      break;
    }

  std::vector<float> x(m * k), xsum(m * groups, 0.f);
  std::vector<uint16_t> xb(m * k);
  for (int64_t i = 0; i < m * k; ++i) {
    xb[i] = bf16_of(float(uniform() * 2 - 1));
    x[i] = bf16_value(xb[i]);  // the same numbers either way
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) xsum[i * groups + j / rows] += x[i * k + j];
  a.gemm.x = bf16_x ? nullptr : x.data();
  a.gemm.x_bf16 = bf16_x ? xb.data() : nullptr;
  a.gemm.xsum = zeros ? xsum.data() : nullptr;
  a.gemm.scales = scales.data();
  a.gemm.zeros = zeros ? zero.data() : nullptr;
  a.gemm.m = m;
  a.gemm.k = k;
  a.gemm.n = n;
  a.gemm.groups = groups;
  a.gemm.group_rows = rows;
  a.gemm.format = cs.kind;
  std::vector<float> out(m * n);
  a.gemm.out = out.data();
  const int64_t ld = a.blocks * 32;
  std::vector<float> part(m * ld);
  auto run = [&]() -> uint32_t {
    if (m <= kGemvMaxRows) {
      const uint32_t bad = kern.gemv(a, 0, m, 0, a.blocks, 0, a.kchunks, part.data(), ld);
      for (int64_t i = 0; i < m; ++i) memcpy(out.data() + i * n, part.data() + i * ld, n * sizeof(float));
      return bad;
    }
    std::vector<float> scratch(kRansGemmCols / kGemmBlockCols * gemm_scratch_floats(m));
    uint32_t bad = 0;
    for (int64_t nb = 0; nb < n; nb += kRansGemmCols) bad |= kern.gemm_tile(a, 0, m, nb, scratch.data());
    return bad;
  };
  if (run()) fail(std::string(what) + ": gemm reports a good stream bad");
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, magnitude = 0;
      for (int64_t r = 0; r < k; ++r) {
        const int64_t g = r / rows;
        const double s = half_value(scales[g * n + j]), z = half_value(zero[g * n + j]);
        const double w = grid ? level[r * n + j] * s : weight_value(cs.kind, codes[r * n + j], s, z);
        ref += double(x[i * k + r]) * w;
        magnitude += fabs(double(x[i * k + r]) * w);
      }
      if (!(fabs(out[i * n + j] - ref) <= 1e-5 * magnitude + 1e-30)) {
        fail(std::string(what) + ": gemm out[" + std::to_string(i) + ", " + std::to_string(j) + "] = " +
             std::to_string(out[i * n + j]) + ", expected " + std::to_string(ref));
        return;
      }
    }
  }

  // Corruptions: a bit flipped in one chunk's words, then the last chunk cut short.
  // (Equal freqs of a power-of-two count code raw bits: every stream is well formed.)
  if (cs.flat && (cs.used & (cs.used - 1)) == 0) return;
  const int64_t c = chunks / 2, w0 = st.offsets[c], w1 = st.offsets[c + 1];
  if (w1 > w0) {
    words[(w0 + w1) / 2] ^= 1 << 3;
    if (!kern.decode_chunk(a, c, decoded.data(), n, 1)) fail(std::string(what) + ": a flipped word went unreported by decode");
    if (!run()) fail(std::string(what) + ": a flipped word went unreported by gemm");
    words[(w0 + w1) / 2] ^= 1 << 3;
  }
  if (st.words.size() >= 3) {
    a.words = words + 3;  // every chunk's words shift by 3: the stream still ends at the guard page
    for (int64_t i = 0; i <= chunks; ++i) st.offsets[i] = std::max(0, st.offsets[i] - 3);
    if (!run()) fail(std::string(what) + ": a truncated stream went unreported");
  }
}

// The AVX-512 builds' register table (rans_kernel_args.h) against the slot's
// symbol by cums, for every slot of random tables: a scalar model of the
// kernel's search (bucket, split bucket, binary search). Returns the tables'
// (levels, split bits) seen, so that the caller can ask for each variant.
std::vector<std::pair<int, int>> check_register_tables() {
  std::vector<std::pair<int, int>> seen;
  for (int trial = 0; trial < 3000; ++trial) {
    const int prob_bits = 10 + trial % 6, symbols = 1 + int(next_u32() % 72), m = 1 << prob_bits;
    // A few large frequencies among runs of tiny ones (the tails of quantized weights).
    std::vector<uint16_t> freqs(256, 0);
    const int offset = int(next_u32() % (256 - symbols + 1));
    int total = 0;
    for (int s = 0; s < symbols; ++s) {
      const int f = next_u32() % 3 == 0 ? 1 + int(next_u32() % (m / 8)) : 1 + int(next_u32() % 3);
      freqs[offset + s] = uint16_t(std::min(f, m - total - (symbols - 1 - s)));
      total += freqs[offset + s];
    }
    freqs[offset + int(next_u32() % symbols)] += uint16_t(m - total);
    const RansRegisterTable t = build_rans_register_table(freqs.data(), 256, prob_bits);
    if (!t.symbols) {
      seen.push_back({-1, 0});
      continue;
    }
    seen.push_back({t.levels, t.split_bits});
    bool split = false;  // the kernels skip the split table without has_split
    for (uint16_t b : t.bucket) split |= b >= kRansRegisterSymbols;
    if (split != t.has_split) fail("register table: has_split " + std::to_string(t.has_split) + " with split " + std::to_string(split));
    std::vector<int> cum(257, 0);
    for (int s = 0; s < 256; ++s) cum[s + 1] = cum[s] + freqs[s];
    const int bucket_shift = prob_bits - kRansBucketBits, split_shift = bucket_shift - t.split_bits;
    for (int slot = 0; slot < m; ++slot) {
      int index = t.bucket[slot >> bucket_shift];
      if (index >= kRansRegisterSymbols) index = t.split[(slot >> split_shift) & 63];
      for (int half = (1 << t.levels) >> 1; half; half >>= 1)
        if (t.cum[index + half] <= slot) index += half;
      const int s = t.sym[index];
      if (!(cum[s] <= slot && slot < cum[s + 1] && t.cum[index] == cum[s] && t.freq[index] == freqs[s])) {
        fail("register table: slot " + std::to_string(slot) + " of prob_bits " + std::to_string(prob_bits) +
             " finds symbol " + std::to_string(s));
        break;
      }
    }
  }
  return seen;
}

// The AVX2 builds' byte tables (RansByteLayout) against the slot's symbol by
// cums, for every slot of random tables: a scalar model of the kernel's
// lookup (bucket's first index, its table compares, a split bucket's
// compares and run). Returns the layouts seen: -1 (no byte tables) or the
// splits (3: 3 or more), and 4 for a table with a run.
std::vector<int> check_byte_tables() {
  std::vector<int> seen;
  for (int trial = 0; trial < 3000; ++trial) {
    const int prob_bits = 10 + trial % 3, m = 1 << prob_bits;  // the register table's, up to the byte tables' 12
    const int symbols = 1 + int(next_u32() % std::min(40, m));
    std::vector<uint16_t> freqs(256, 0);
    const int offset = int(next_u32() % (256 - symbols + 1));
    int total = 0;
    for (int s = 0; s < symbols; ++s) {  // large frequencies among runs of tiny ones, or (one in 3) flat
      const int f = trial % 3 == 0 ? m / symbols
                    : next_u32() % 3 == 0 ? 1 + int(next_u32() % std::max(1, m / 8)) : 1 + int(next_u32() % 3);
      freqs[offset + s] = uint16_t(std::max(1, std::min(f, m - total - (symbols - 1 - s))));
      total += freqs[offset + s];
    }
    freqs[offset + int(next_u32() % symbols)] += uint16_t(m - total);
    const RansRegisterTable t = build_rans_register_table(freqs.data(), 256, prob_bits);
    const RansByteLayout b(t, prob_bits);
    seen.push_back(b.fits ? std::min(b.splits, 3) : -1);
    if (!b.fits) continue;
    if (has_run(b)) seen.push_back(4);
    if (b.boundaries > kRansByteBoundaries) fail("byte tables: " + std::to_string(b.boundaries) + " boundaries");
    const int shift = prob_bits - 5;
    for (int slot = 0; slot < m; ++slot) {
      const int bucket = slot >> shift, low = slot & ((1 << shift) - 1);
      const int s = int(std::find(b.split_bucket, b.split_bucket + b.splits, bucket) - b.split_bucket);
      const bool split = s < b.splits;
      if (!split && b.count[bucket] > b.boundaries)
        fail("byte tables: bucket " + std::to_string(bucket) + " has more cums than the tables but is not split");
      int index = b.first[bucket];
      for (int j = 0; j < b.boundaries; ++j) index += low > (j < b.count[bucket] ? b.inside[bucket][j] : 127);
      for (int j = b.boundaries; j < b.count[bucket] && split; ++j) index += low > b.inside[bucket][j];
      if (split) index += std::min(std::max(low - b.run_start[s], 0), int(b.run_length[s]));
      if (!(index < t.symbols && t.cum[index] <= slot && slot < t.cum[index] + t.freq[index])) {
        fail("byte tables: slot " + std::to_string(slot) + " of prob_bits " + std::to_string(prob_bits) + " finds index " +
             std::to_string(index));
        break;
      }
    }
  }
  return seen;
}

}  // namespace

int main() {
  {
    const std::vector<int> seen = check_byte_tables();
    for (int variant : {-1, 0, 1, 2, 3, 4})
      if (std::find(seen.begin(), seen.end(), variant) == seen.end())
        fail("no random table had byte tables with " + std::to_string(variant) +
             " splits (-1: none, 3: 3 or more, 4: a run)");
  }
  {
    const std::vector<std::pair<int, int>> seen = check_register_tables();
    for (std::pair<int, int> variant : {std::pair<int, int>{-1, 0}, {0, 4}, {1, 4}, {2, 4}, {1, 5}, {2, 5}, {1, 6}, {2, 6}})
      if (std::find(seen.begin(), seen.end(), variant) == seen.end())
        fail("no random table had register lookup levels " + std::to_string(variant.first) + ", split bits " +
             std::to_string(variant.second));
  }
  std::vector<Case> cases;
  std::vector<int> kinds = {kRansGrid, kRansTcq};
  for (int f = 0; f < marlin::kNumWeightFormats; ++f) kinds.push_back(f);
  for (int kind : kinds) {
    const bool grid = kind == kRansGrid || kind == kRansTcq;
    cases.push_back({kind, 12, 1, 200, 70, 64, grid ? -1 : -1});
    cases.push_back({kind, 12, 2, 192, 70, 64, grid ? -1 : 32});
    cases.push_back({kind, 14, 3, 256, 33, 96, grid ? -1 : 32});
    cases.push_back({kind, 12, 8, 128, 96, 128, -1});
    cases.push_back({kind, 15, 17, 320, 65, 128, grid ? -1 : 64});
  }
  // The grid with as many symbols as AVX-512 looks up in registers, and one more;
  // flat codes, whose lookup is in registers (and fewer: a bucket search of 0 to 2 halvings).
  for (int used : {kRansRegisterSymbols, kRansRegisterSymbols + 1}) {
    cases.push_back({kRansGrid, 12, 1, 200, 70, 64, -1, used});
    cases.push_back({kRansGrid, 12, 9, 256, 65, 128, -1, used});
  }
  // Peaked grids of at most 32 symbols: AVX2's byte tables with split buckets (their tails):
  // 9 and 12 symbols split 1 and 2 with runs of 3 (16-entry tables), 21 and 24 of width 7 and 8
  // split 1 and 2 without runs, 28 split 2 with runs of 6-7 (32-entry tables).
  for (auto [used, width] : {std::pair<int, double>{9, 0}, {12, 0}, {21, 7}, {24, 8}, {28, 0}}) {
    cases.push_back({kRansGrid, 12, 1, 256, 70, 64, -1, used, false, width});
    cases.push_back({kRansGrid, 12, 33, 256, 97, 128, -1, used, false, width});
    cases.push_back({kRansTcq, 12, 5, 256, 65, 128, -1, used, false, width});
  }
  for (int used : {kRansRegisterSymbols, 24, 7}) {
    cases.push_back({kRansGrid, 12, 2, 256, 70, 64, -1, used, true});
    cases.push_back({kRansGrid, 10, 12, 256, 97, 128, -1, used, true});
  }
  // tcq: several K chunks (the trellis restarts in each), a short last one, every M class;
  // chunk_k 96: the tile GEMM's tiles of 256 rows end inside a chunk (its states carry over).
  for (int64_t m : {1, 4, 8, 9, 32, 64, 65})
    cases.push_back({kRansTcq, 12, m, 300, 45, 96, -1});
  cases.push_back({kRansTcq, 12, 3, 256, 70, 64, -1, kRansRegisterSymbols, true});
  cases.push_back({kRansTcq, 12, 12, 256, 97, 128, -1, 24, true});
  cases.push_back({0, 12, 1, 256, 70, 64, 64, 15, true});
  cases.push_back({0, 12, 16, 256, 70, 96, 64, 15, true});
  for (const std::string& name : kernel_build_names()) {
    const std::string why = unsupported_reason(name);
    if (!why.empty()) {
      printf("SKIP %s: %s\n", name.c_str(), why.c_str());
      continue;
    }
    const RansKernels* kern = rans_build(name);
    const int before = failures;
    if (!kern) {
      fail(name + ": no rans kernels");
      continue;
    }
    int checked = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& cs = cases[i];
      for (bool bf16 : {false, true}) {
        rng_state = 0x2545F4914F6CDD1Dull + 0x9E3779B97F4A7C15ull * (2 * i + bf16);  // every build: the same streams
        // As the op: bf16 x for builds with bf16 dot products, values exact in bf16, even K.
        const bool exact = marlin::values_exact_in_bf16(marlin::WeightFormat(cs.kind));
        if (bf16 && !(find_kernel_build(name)->bf16_x && exact && cs.k % 2 == 0)) continue;
        run_case(name, *kern, bf16, cs);
        ++checked;
      }
    }
    printf("%s %s (%d rans cases)\n", failures == before ? "PASS" : "FAIL", name.c_str(), checked);
  }
  for (bool wide : {false, true})  // the cases reach every path of AVX2's lookup
    for (int splits : {-1, 0, 1, 2}) {
      const auto seen = std::find(case_byte_tables.begin(), case_byte_tables.end(), std::pair<bool, int>{wide, splits});
      if (!case_byte_tables.empty() && seen == case_byte_tables.end())
        fail(std::string("no case had ") + (wide ? "17-32" : "at most 16") + " symbols and byte tables with " +
             std::to_string(splits) + " splits (-1: none)");
    }
  if (!case_byte_tables.empty() && !case_byte_runs) fail("no case had byte tables with a split bucket's run");
  printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
