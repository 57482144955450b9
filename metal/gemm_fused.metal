// marlin_gemm_fused_<fmt>_<dt>_tm{32,64} (metal/marlin_gemm_fused.h).
#include "marlin_gemm_fused.h"

#define MARLIN_FUSED(dt, T, fmt, F, TM)                                                  \
  template [[host_name("marlin_gemm_fused_" #fmt "_" #dt "_tm" #TM)]] [[kernel]] decltype( \
      marlin_gemm_fused<T, F, TM>) marlin_gemm_fused<T, F, TM>;
#define MARLIN_FUSED_TILES(dt, T, Tname, fmt, F) MARLIN_FUSED(dt, T, fmt, F, 32) MARLIN_FUSED(dt, T, fmt, F, 64)
#define MARLIN_FUSED_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_FUSED_TILES, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_FUSED_DTYPES, )
