// marlin_gemv_<fmt>_<dt>_m<MR> (metal/marlin_gemv.h) for M <= MR rows of x;
// group size and K split are function constants.
#include "marlin_gemv.h"

#define MARLIN_GEMV(MR, dt, T, fmt, F)                                                \
  template [[host_name("marlin_gemv_" #fmt "_" #dt "_m" #MR)]] [[kernel]] decltype( \
      marlin_gemv<T, F, MR>) marlin_gemv<T, F, MR>;
#define MARLIN_GEMV_ROWS(dt, T, Tname, fmt, F) MARLIN_FOR_EACH_GEMV_ROWS(MARLIN_GEMV, dt, T, fmt, F)
#define MARLIN_GEMV_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_GEMV_ROWS, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_GEMV_DTYPES, )
