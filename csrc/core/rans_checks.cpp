#include "core/rans_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace marlin {
namespace {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, const char* dtype_name,
                  const at::Tensor& words) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype_name, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == words.device(), name, " must be on the same device as words (", words.device(),
              "), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Where chunk c sits, for messages.
std::string chunk_name(const RansShape& s, int64_t c) {
  return "chunk " + std::to_string(c) + " (column block " + std::to_string(c / s.kchunks) + ", K chunk " +
         std::to_string(c % s.kchunks) + ")";
}

}  // namespace

RansShape check_rans_streams(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                             const at::Tensor& freqs, int64_t K, int64_t N, int64_t chunk_k, int64_t prob_bits) {
  TORCH_CHECK_VALUE(K >= 1, "K must be >= 1, got ", K);
  TORCH_CHECK_VALUE(N >= 1, "N must be >= 1, got ", N);
  const int64_t k_padded = (K + kRansLanes - 1) / kRansLanes * kRansLanes;
  TORCH_CHECK_VALUE(chunk_k >= kRansLanes && chunk_k % kRansLanes == 0 && chunk_k <= k_padded,
                    "chunk_k must be a multiple of 32 in [32, K rounded up to 32 = ", k_padded, "], got ", chunk_k);
  TORCH_CHECK_VALUE(prob_bits >= kRansMinProbBits && prob_bits <= kRansMaxProbBits, "prob_bits must be in [",
                    kRansMinProbBits, ", ", kRansMaxProbBits, "], got ", prob_bits);
  RansShape s{};
  s.k = K;
  s.n = N;
  s.chunk_k = chunk_k;
  s.kchunks = (K + chunk_k - 1) / chunk_k;
  s.blocks = (N + kRansLanes - 1) / kRansLanes;
  s.chunks = s.blocks * s.kchunks;
  s.prob_bits = prob_bits;

  TORCH_CHECK(words.scalar_type() == at::kShort, "words must be int16 (uint16 bit patterns), got ",
              words.scalar_type());
  TORCH_CHECK(words.dim() == 1, "words must be 1-D [W], got shape ", words.sizes());
  TORCH_CHECK(words.is_contiguous(), "words must be contiguous");
  check_tensor(word_offsets, "word_offsets", at::kInt, "int32", words);
  TORCH_CHECK_VALUE(word_offsets.dim() == 1 && word_offsets.size(0) == s.chunks + 1,
                    "word_offsets must have shape [chunks + 1] = [", s.chunks + 1, "] (", s.blocks,
                    " column blocks x ", s.kchunks, " K chunks), got ", word_offsets.sizes());
  check_tensor(states, "states", at::kInt, "int32 (uint32 bit patterns)", words);
  TORCH_CHECK_VALUE(states.dim() == 2 && states.size(0) == s.chunks && states.size(1) == kRansLanes,
                    "states must have shape [chunks, 32] = [", s.chunks, ", 32], got ", states.sizes());
  check_tensor(freqs, "freqs", at::kShort, "int16 (uint16 bit patterns)", words);
  TORCH_CHECK_VALUE(freqs.dim() == 1 && (freqs.size(0) == kRansLosslessSymbols || freqs.size(0) == kRansGridSymbols),
                    "freqs must have shape [16] (a lossless format's codes) or [256] (grid), got ", freqs.sizes());
  s.symbols = freqs.size(0);
  return s;
}

void check_rans_contents(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                         const at::Tensor& freqs, const RansShape& s) {
  const at::Tensor f = freqs.cpu(), o = word_offsets.cpu(), st = states.cpu();
  const uint16_t* fp = reinterpret_cast<const uint16_t*>(f.data_ptr<int16_t>());
  int64_t total = 0;
  for (int64_t i = 0; i < s.symbols; ++i) total += fp[i];
  TORCH_CHECK_VALUE(total == (int64_t(1) << s.prob_bits), "freqs must sum to 2^prob_bits = ",
                    int64_t(1) << s.prob_bits, ", got ", total);
  const int32_t* op = o.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(op[0] == 0, "word_offsets[0] must be 0, got ", op[0]);
  for (int64_t c = 0; c < s.chunks; ++c)
    TORCH_CHECK_VALUE(op[c + 1] >= op[c], "word_offsets must not decrease: word_offsets[", c + 1, "] = ", op[c + 1],
                      " < word_offsets[", c, "] = ", op[c]);
  TORCH_CHECK_VALUE(op[s.chunks] <= words.numel(), "word_offsets[-1] must be <= words.numel() = ", words.numel(),
                    ", got ", op[s.chunks], " (truncated words?)");
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(st.data_ptr<int32_t>());
  for (int64_t i = 0; i < st.numel(); ++i)
    TORCH_CHECK_VALUE(sp[i] >= kRansStateLow, "states must be in [2^16, 2^32) as uint32, got ", sp[i], " at [",
                      i / kRansLanes, ", ", i % kRansLanes, "]");
}

RansGemmShape check_rans_gemm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& word_offsets,
                              const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                              const std::string& weight_format, int64_t K, int64_t chunk_k, int64_t prob_bits,
                              int64_t group_size) {
  RansGemmShape r{};
  const bool tcq = weight_format == "tcq";
  r.grid = tcq || weight_format == "grid";
  std::string names;
  bool known = r.grid;
  for (int i = 0; i < kNumWeightFormats; ++i) {
    const char* name = weight_format_name(WeightFormat(i));
    known |= weight_format == name;
    names += std::string(i ? ", '" : "'") + name + "'";
  }
  TORCH_CHECK_VALUE(known, "weight_format must be 'grid', 'tcq' or a value format (", names, "), got '", weight_format, "'");
  TORCH_CHECK(scales.dim() == 2, "scales must be 2-D [", r.grid ? "1" : "K/group_size", ", N], got shape ",
              scales.sizes());
  const int64_t n = scales.size(1);
  r.streams = check_rans_streams(words, word_offsets, states, freqs, K, n, chunk_k, prob_bits);
  const int64_t symbols = r.grid ? kRansGridSymbols : kRansLosslessSymbols;
  TORCH_CHECK_VALUE(r.streams.symbols == symbols, "freqs must have shape [", symbols, "] for weight_format='",
                    weight_format, "', got ", freqs.sizes());
  if (r.grid) {
    TORCH_CHECK_VALUE(group_size == K || group_size == -1,
                      "group_size must be K = ", K, " (or -1) for weight_format='", weight_format,
                      "' (one step per column), got ", group_size);
    TORCH_CHECK_VALUE(!zeros.has_value(), "zeros must be None for weight_format='", weight_format, "'");
    // One group, no zeros: the grid's numbers (csrc/cpu/rans_kernel_args.h) have no zeros.
    r.groups = check_groups(tcq ? kRansTcqFormat : kRansGridFormat, K, scales, "scales", "the argument K", scales, zeros, weight_format, -1);
  } else {
    const WeightFormat format = parse_weight_format(weight_format);
    check_group_size(group_size);
    // G = ceil(K / group_size): the last group may be short (K is not padded).
    const int64_t rows = group_size == -1 ? K : group_size, k_groups = (K + rows - 1) / rows * rows;
    r.groups = check_groups(format, k_groups, scales, "scales", "the argument K", scales, zeros, weight_format,
                            group_size);
    r.groups.k = K;
    TORCH_CHECK_VALUE(group_size == -1 || group_size == K || chunk_k % group_size == 0,
                      "chunk_k = ", chunk_k, " must be a multiple of group_size = ", group_size,
                      " (or group_size K or -1): a chunk holds whole groups");
  }
  check_gemm_inputs(x, bias, words, r.groups, "words", "the argument K");
  return r;
}

void throw_bad_rans_chunk(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                          const at::Tensor& freqs, const RansShape& s) {
  const at::Tensor w = words.cpu(), o = word_offsets.cpu(), st = states.cpu(), f = freqs.cpu();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<int16_t>());
  const int32_t* op = o.data_ptr<int32_t>();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(st.data_ptr<int32_t>());
  const uint16_t* fp = reinterpret_cast<const uint16_t*>(f.data_ptr<int16_t>());
  const uint32_t mask = (1u << s.prob_bits) - 1;
  std::vector<uint32_t> cum(s.symbols + 1, 0);
  for (int64_t i = 0; i < s.symbols; ++i) cum[i + 1] = cum[i] + fp[i];
  std::vector<uint16_t> symbol(mask + 1);
  for (int64_t i = 0; i < s.symbols; ++i)
    for (uint32_t slot = cum[i]; slot < cum[i + 1]; ++slot) symbol[slot] = uint16_t(i);
  for (int64_t c = 0; c < s.chunks; ++c) {
    uint32_t x[kRansLanes];
    for (int l = 0; l < kRansLanes; ++l) x[l] = sp[c * kRansLanes + l];
    int64_t ptr = op[c];
    const int64_t end = op[c + 1], k0 = (c % s.kchunks) * s.chunk_k;
    const int64_t len = std::min(s.chunk_k, s.k - k0);
    for (int64_t t = 0; t < len; ++t) {
      for (int l = 0; l < kRansLanes; ++l) {
        const uint32_t slot = x[l] & mask, sym = symbol[slot];
        x[l] = fp[sym] * (x[l] >> s.prob_bits) + slot - cum[sym];
        if (x[l] >= kRansStateLow) continue;
        TORCH_CHECK_VALUE(ptr < end, "corrupted rans stream: ", chunk_name(s, c), " needs a word past its end (",
                          end - op[c], " words, word_offsets[", c + 1, "] = ", end, ") at K row ", k0 + t,
                          ", lane ", l, " (truncated words or a damaged stream or table)");
        x[l] = (x[l] << 16) | wp[ptr++];
      }
    }
    TORCH_CHECK_VALUE(ptr == end, "corrupted rans stream: ", chunk_name(s, c), " decoded with ", ptr - op[c],
                      " of its ", end - op[c], " words (a damaged stream, table or word_offsets)");
    for (int l = 0; l < kRansLanes; ++l)
      TORCH_CHECK_VALUE(x[l] == kRansStateLow, "corrupted rans stream: ", chunk_name(s, c), " lane ", l,
                        " ends in state ", x[l], ", expected 65536 (a damaged stream, table or states)");
  }
  TORCH_CHECK(false, "internal error: the kernels reported a corrupted rans stream that this check does not find");
}

}  // namespace marlin
