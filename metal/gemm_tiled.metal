// marlin_gemm_tiled_<fmt>_<dt> (metal/marlin_gemm_tiled.h).
#include "marlin_gemm_tiled.h"

#define MARLIN_TILED(dt, T, Tname, fmt, F)                                          \
  template [[host_name("marlin_gemm_tiled_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_gemm_tiled<T, F>) marlin_gemm_tiled<T, F>;
#define MARLIN_TILED_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_TILED, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_TILED_DTYPES, )
