// Lockstep rANS decode of the entropy-coded layout (docs/FORMAT.md,
// "Entropy-coded layout"), shared by metal/rans.metal's kernels.
//
// A chunk is 32 output columns (a column block) by up to chunk_k K rows; one
// simdgroup decodes it, lane l = column 32 b + l, one symbol per lane per step
// (step t = K row c * chunk_k + t). The 32 lanes share one word stream: at a
// step the lanes whose state fell below 2^16 take the next words in lane
// order (rank = simd_prefix_exclusive_sum of the need flags), so a step reads
// contiguous words.
//
// Table (threadgroup memory, built by rans_build_table at kernel start): per
// symbol a RansEntry (freq, cum, the symbol's raw values: the value format's
// code value, symbol - 128 for "grid", tcq's two levels), then the bucket bytes
// (metal/rans_common.h). A decode step: slot, bucket byte, entry (two
// threadgroup loads), at most a few walks past symbols of the bucket, the
// state update, the refill.
//
// Bad input cannot raise in a kernel: a chunk whose offsets are out of range,
// whose lanes do not all end in state 2^16 or whose words are not exactly
// consumed is "bad" (RansChunk::finish): the GEMV and GEMM write NaN to all
// its outputs, the decode kernel flags it in its status output (no uint8
// symbol is outside every alphabet: the grid uses 1..255) and the op raises
// (csrc/core/metal_plan_rans.cpp). Reads stay inside
// [word_offsets[chunk], word_offsets[chunk + 1]) and inside every buffer
// whatever the data (a refill past the chunk's words reads nothing).
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_dequant.h"
#include "rans_common.h"

using namespace metal;

// A symbol's table entry: (freq, cum, bits of its raw value as half, bits of
// its second raw value as half: tcq's level in trellis states 2 and 3, else 0).
// 16-bit fields: no shift or mask to unpack them (16-bit register halves are
// instruction sources on Apple GPUs); the raw values of every format, of the
// grid and of tcq are exact in half.
typedef ushort4 RansEntry;

struct RansTable {
  const threadgroup RansEntry* entries;  // [S]
  const threadgroup uchar* buckets;  // [2^rans::bucket_bits(prob_bits)]
  uint prob_bits, shift;             // shift: slot -> bucket
  uint last;                         // S - 1
};

inline uint rans_freq(RansEntry e) { return e.x; }
inline uint rans_cum(RansEntry e) { return e.y; }
inline half rans_raw(RansEntry e) { return as_type<half>(e.z); }

// Value kinds: a symbol's raw values in the table (static raw, raw_alt), the
// group params as format kParams, and a lane's value state: made at each
// chunk's first step (`V values;`), `values.value(s, e)` is the raw value of
// the lane's next symbol s (table entry e) and advances the state.
// RansStateless kinds map a symbol alone to its entry's raw value (no state,
// s unused: the same code as reading the entry).
struct RansStateless {
  static float raw_alt(uint) { return 0.0f; }
  half value(uint, RansEntry e) { return rans_raw(e); }
};

// RansLossless<F>: the codes of value format F (raw values and group params
// exactly as the dense kernels: MarlinFormat<F>). RansGrid: value = symbol -
// 128 times the column's step, no zeros (params as int4's: scale unchanged).
template <WeightFormat F>
struct RansLossless : RansStateless {
  static constexpr constant uint kSymbols = rans::kLosslessSymbols;
  static constexpr constant WeightFormat kParams = F;
  static float raw(uint s) { return float(MarlinFormat<F>::raw_pair(s, 0u).x); }
};

struct RansGrid : RansStateless {
  static constexpr constant uint kSymbols = rans::kGridSymbols;
  static constexpr constant WeightFormat kParams = kInt4;
  static float raw(uint s) { return float(int(s) - rans::kGridOffset); }
};

// RansTcq (weight_format "tcq"): the grid's symbols through a 4-state
// trellis per lane, state sigma = 0 at each chunk's first step. With k = s -
// 128 the value is j = 2k in states 0, 1 (raw) and 2k - sign(k) in states 2, 3
// (raw_alt), times the column's step; then sigma = (sigma >> 1) | (((sigma ^
// s) & 1) << 1). sigma is held as its two bits, hi = sigma >> 1 (selects the
// level) and lo = sigma & 1: the update is hi' = (lo ^ s) & 1, lo' = hi.
struct RansTcq {
  static constexpr constant uint kSymbols = rans::kGridSymbols;
  static constexpr constant WeightFormat kParams = kInt4;
  static float raw(uint s) { return float(2 * (int(s) - rans::kGridOffset)); }
  static float raw_alt(uint s) {
    const int k = int(s) - rans::kGridOffset;
    return float(2 * k - (k > 0 ? 1 : k < 0 ? -1 : 0));
  }
  uint hi = 0, lo = 0;
  half value(uint s, RansEntry e) {
    const ushort bits = hi != 0u ? e.w : e.z;
    const uint was_hi = hi;
    hi = (lo ^ s) & 1u;
    lo = was_hi;
    return as_type<half>(bits);
  }
};

// Builds the table of V's S symbols from freqs (uint16 [S]) into `mem`
// (rans::table_bytes(S) bytes) with all `threads` threads of the threadgroup,
// then a threadgroup barrier. Simdgroup 0 makes the entries (a running prefix
// sum), every thread then the buckets by binary search over the cums.
// Corrupt freqs (validated at load, not here) give a wrong table, never an
// access outside it.
template <typename V>
inline RansTable rans_build_table(threadgroup RansEntry* mem, const device ushort* freqs, uint prob_bits, uint tid,
                                  uint threads, uint sg, uint lane) {
  constexpr uint S = V::kSymbols;
  threadgroup uchar* buckets = (threadgroup uchar*)(mem + S);
  if (sg == 0) {
    uint carry = 0;
    for (uint base = 0; base < S; base += rans::kLanes) {
      const uint s = base + lane;
      const uint f = s < S ? uint(freqs[s]) : 0u;  // S = 16: half a simdgroup
      const uint cum = carry + simd_prefix_exclusive_sum(f);
      if (s < S)
        mem[s] = RansEntry(ushort(f), ushort(cum), as_type<ushort>(half(V::raw(s))),
                           as_type<ushort>(half(V::raw_alt(s))));
      carry += simd_sum(f);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint bucket_bits = uint(rans::bucket_bits(int(prob_bits)));
  const uint shift = prob_bits - bucket_bits;
  for (uint b = tid; b < (1u << bucket_bits); b += threads) {
    // the last symbol whose cum is <= the bucket's first slot
    const uint slot = b << shift;
    uint lo = 0, hi = S;  // cum(lo) <= slot (cum(0) = 0), cum(hi) > slot or hi = S
    while (hi - lo > 1) {
      const uint mid = (lo + hi) / 2;
      if (rans_cum(mem[mid]) <= slot)
        lo = mid;
      else
        hi = mid;
    }
    buckets[b] = uchar(lo);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return RansTable{mem, buckets, prob_bits, shift, S - 1};
}

// The decode state of one lane of one chunk.
struct RansChunk {
  const device ushort* words;
  uint x;         // this lane's state
  uint ptr, end;  // the chunk's next word and end (the same in every lane)
  bool bad;       // offsets out of range, or a refill past the chunk's words

  // Chunk `chunk` of a stream of n_words words; lane `lane`.
  static RansChunk start(const device ushort* words, const device int* word_offsets, const device uint* states,
                         uint n_words, uint chunk, uint lane) {
    RansChunk c;
    c.words = words;
    c.x = states[ulong(chunk) * rans::kLanes + lane];
    const int begin = word_offsets[chunk], end = word_offsets[chunk + 1];
    c.bad = !(begin >= 0 && begin <= end && uint(end) <= n_words);
    c.ptr = c.bad ? 0u : uint(begin);
    c.end = c.bad ? 0u : uint(end);  // a bad chunk reads no word
    return c;
  }

  // One step: this lane's next symbol; its table entry in `e`. All 32 lanes
  // call it together (the refill hand-out is a simdgroup prefix sum).
  uint next(thread const RansTable& t, thread RansEntry& e) {
    const uint slot = x & ((1u << t.prob_bits) - 1u);
    uint s;
    if (t.shift == 0) {  // uniform; one slot per bucket: the bucket's symbol is the slot's
      s = t.buckets[slot];
      e = t.entries[s];
    } else {
      s = t.buckets[slot >> t.shift];
      e = t.entries[s];
      while (slot - rans_cum(e) >= rans_freq(e) && s < t.last) e = t.entries[++s];
    }
    x = rans_freq(e) * (x >> t.prob_bits) + slot - rans_cum(e);
    const uint need = x < rans::kStateLow ? 1u : 0u;
    const uint i = ptr + simd_prefix_exclusive_sum(need);
    if (need != 0) {
      const bool in_chunk = i < end;
      // x < 2^16: (x << 16) | word, assembled from two 16-bit halves
      x = as_type<uint>(ushort2(in_chunk ? words[i] : ushort(0), ushort(x)));
      bad = bad || !in_chunk;
    }
    ptr += simd_sum(need);
    return s;
  }

  // After the chunk's last step: whether the chunk is bad (the same in every lane).
  bool finish() const { return simd_any(bad || x != rans::kStateLow || ptr != end); }
};

// A chunk's place: column block b, K chunk c, K rows [k0, k0 + len).
struct RansChunkPos {
  uint b, c, k0, len;
};

inline RansChunkPos rans_chunk_pos(uint chunk, uint K, uint chunk_k) {
  const uint n_kchunks = (K + chunk_k - 1) / chunk_k;
  RansChunkPos p;
  p.b = chunk / n_kchunks;
  p.c = chunk % n_kchunks;
  p.k0 = p.c * chunk_k;
  p.len = min(K, p.k0 + chunk_k) - p.k0;
  return p;
}

// Decode kernel: symbols [K, N] (uint8) and status [chunks] (1 for a bad
// chunk, whose symbols are garbage, else 0). Threadgroup g holds chunks
// rans::kChunkSimdgroups g .. + rans::kChunkSimdgroups - 1, round-robin over the
// simdgroups it gets (the bridge may launch fewer).
template <typename V>
[[kernel]] void rans_decode(const device ushort* words [[buffer(0)]],
                            const device int* word_offsets [[buffer(1)]],
                            const device uint* states [[buffer(2)]],
                            const device ushort* freqs [[buffer(3)]],
                            device uchar* out [[buffer(4)]],
                            device uint* status [[buffer(5)]],
                            constant uint& N [[buffer(6)]],
                            constant uint& K [[buffer(7)]],
                            constant uint& chunk_k [[buffer(8)]],
                            constant uint& prob_bits [[buffer(9)]],
                            constant uint& n_words [[buffer(10)]],
                            constant uint& n_chunks [[buffer(11)]],
                            threadgroup RansEntry* table_mem [[threadgroup(0)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const RansTable table = rans_build_table<V>(table_mem, freqs, prob_bits, tid, nsg * kSimdWidth, sg, lane);
  const uint first = tgid.x * rans::kChunkSimdgroups, last = min(n_chunks, first + rans::kChunkSimdgroups);
  for (uint chunk = first + sg; chunk < last; chunk += nsg) {
    const RansChunkPos pos = rans_chunk_pos(chunk, K, chunk_k);
    const uint n = pos.b * rans::kLanes + lane;
    RansChunk dec = RansChunk::start(words, word_offsets, states, n_words, chunk, lane);
    device uchar* o = out + ulong(pos.k0) * N + n;
    for (uint t = 0; t < pos.len; ++t, o += N) {
      RansEntry e;
      const uint s = dec.next(table, e);
      if (n < N) *o = uchar(s);
    }
    const bool bad = dec.finish();
    if (lane == 0) status[chunk] = bad ? 1u : 0u;
  }
}
