// The portable build of the quantizer (csrc/cpu/quantize_impl.h) as a program,
// so tests/test_quantize_native.py can run it on another CPU (aarch64 under
// qemu) and compare with the Python reference.
//
//   quantize_portable IN OUT N K PADDED_K GROUP_LEN FORMAT ROUNDS RATIO...
//
// IN holds float32 [N, K]; OUT receives packed int32 [PADDED_K / 8, N], then
// scales fp16 [G, N], then (FORMAT 1, uint4) zeros fp16 [G, N].
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/quantize_args.h"

int main(int argc, char** argv) {
  using namespace marlin::cpu;
  if (argc < 10) return 2;
  const int64_t n = atoll(argv[3]), k = atoll(argv[4]), padded_k = atoll(argv[5]), len = atoll(argv[6]);
  std::vector<float> w(n * k), ratios;
  for (int i = 9; i < argc; ++i) ratios.push_back(strtof(argv[i], nullptr));
  FILE* in = fopen(argv[1], "rb");
  if (!in || fread(w.data(), sizeof(float), w.size(), in) != w.size()) return 3;
  fclose(in);
  const int64_t groups = padded_k / len;
  std::vector<int32_t> packed(padded_k / 8 * n);
  std::vector<uint16_t> scales(groups * n), zeros(groups * n);
  QuantizeArgs a{};
  a.weight = w.data();
  a.row_stride = k;
  a.n = n;
  a.k = k;
  a.padded_k = padded_k;
  a.group_len = len;
  a.source = kSourceFloat32;
  a.format = atoi(argv[7]);
  a.ratios = ratios.data();
  a.num_ratios = int64_t(ratios.size());
  a.rounds = atoll(argv[8]);
  a.packed = packed.data();
  a.scales = scales.data();
  a.zeros = marlin::has_zeros(marlin::WeightFormat(a.format)) ? zeros.data() : nullptr;
  std::vector<float> scratch(generic::quantize_scratch_floats(a) + 16);
  float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  for (int64_t n0 = 0; n0 < n; n0 += kQuantizeBlockRows) {
    const QuantizeSums sums = generic::quantize_rows(a, n0, n0 + kQuantizeBlockRows < n ? n0 + kQuantizeBlockRows : n, aligned);
    if (sums.bad_row >= 0) return 4;
  }
  FILE* out = fopen(argv[2], "wb");
  fwrite(packed.data(), sizeof(int32_t), packed.size(), out);
  fwrite(scales.data(), sizeof(uint16_t), scales.size(), out);
  if (a.zeros) fwrite(zeros.data(), sizeof(uint16_t), zeros.size(), out);
  fclose(out);
  return 0;
}
