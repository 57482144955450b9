// marlin_sparse24_gemv_<fmt>_<dt>_m{1,4,8}: metal/sparse24_gemv.h.
#include "sparse24_gemv.h"

#define MARLIN_SPARSE24_GEMV(dt, T, fmt, F, MR)                                                 \
  template [[host_name("marlin_sparse24_gemv_" #fmt "_" #dt "_m" #MR)]] [[kernel]] decltype( \
      marlin_sparse24_gemv<T, F, MR>) marlin_sparse24_gemv<T, F, MR>;
#define MARLIN_SPARSE24_GEMV_ROWS(dt, T, Tname, fmt, F) \
  MARLIN_SPARSE24_GEMV(dt, T, fmt, F, 1) MARLIN_SPARSE24_GEMV(dt, T, fmt, F, 4) MARLIN_SPARSE24_GEMV(dt, T, fmt, F, 8)
#define MARLIN_SPARSE24_GEMV_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_SPARSE24_GEMV_ROWS, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_SPARSE24_GEMV_DTYPES, )
