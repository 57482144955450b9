// The entropy-coded layout's kernels (metal/rans_{decode,gemv,gemm}.h):
// rans_decode_s{16,256}, rans_gemv_<fmt>_<dt> and rans_gemm_<fmt>_<dt> for
// every value format (lossless: its 4-bit codes), "grid" (256 symbols) and
// "tcq" (the grid's symbols through a trellis).
#include "rans_gemm.h"
#include "rans_gemv.h"

#define RANS_KERNEL(kernel, name, ...)                                                               \
  template [[host_name(name)]] [[kernel]] decltype(kernel<__VA_ARGS__>) kernel<__VA_ARGS__>;
#define RANS_MATMULS(dt, T, Tname, fmt, V)                 \
  RANS_KERNEL(rans_gemv, "rans_gemv_" #fmt "_" #dt, T, V) \
  RANS_KERNEL(rans_gemm, "rans_gemm_" #fmt "_" #dt, T, V)
#define RANS_LOSSLESS(fmt, F, _) MARLIN_FOR_EACH_DTYPE(RANS_MATMULS, fmt, RansLossless<F>)
MARLIN_FOR_EACH_FORMAT(RANS_LOSSLESS, )
MARLIN_FOR_EACH_DTYPE(RANS_MATMULS, grid, RansGrid)
MARLIN_FOR_EACH_DTYPE(RANS_MATMULS, tcq, RansTcq)
RANS_KERNEL(rans_decode, "rans_decode_s16", RansLossless<kUint4>)
RANS_KERNEL(rans_decode, "rans_decode_s256", RansGrid)
