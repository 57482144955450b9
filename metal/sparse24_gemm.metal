// marlin_sparse24_gemm_<fmt>_<dt>_tm{32,64}: metal/sparse24_gemm.h.
#include "sparse24_gemm.h"

#define MARLIN_SPARSE24_GEMM(dt, T, fmt, F, TM)                                                 \
  template [[host_name("marlin_sparse24_gemm_" #fmt "_" #dt "_tm" #TM)]] [[kernel]] decltype( \
      marlin_sparse24_gemm<T, F, TM>) marlin_sparse24_gemm<T, F, TM>;
#define MARLIN_SPARSE24_GEMM_TILES(dt, T, Tname, fmt, F) \
  MARLIN_SPARSE24_GEMM(dt, T, fmt, F, 32) MARLIN_SPARSE24_GEMM(dt, T, fmt, F, 64)
#define MARLIN_SPARSE24_GEMM_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_SPARSE24_GEMM_TILES, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_SPARSE24_GEMM_DTYPES, )
