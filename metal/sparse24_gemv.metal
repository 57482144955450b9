// marlin_sparse24_gemv_<fmt>_<dt>_m<MR>: metal/sparse24_gemv.h.
#include "sparse24_gemv.h"

#define MARLIN_SPARSE24_GEMV(MR, dt, T, fmt, F)                                                 \
  template [[host_name("marlin_sparse24_gemv_" #fmt "_" #dt "_m" #MR)]] [[kernel]] decltype( \
      marlin_sparse24_gemv<T, F, MR>) marlin_sparse24_gemv<T, F, MR>;
#define MARLIN_SPARSE24_GEMV_ROWS(dt, T, Tname, fmt, F) MARLIN_FOR_EACH_GEMV_ROWS(MARLIN_SPARSE24_GEMV, dt, T, fmt, F)
#define MARLIN_SPARSE24_GEMV_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_SPARSE24_GEMV_ROWS, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_SPARSE24_GEMV_DTYPES, )
