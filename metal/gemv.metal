// marlin_gemv_<fmt>_<dt> (metal/marlin_gemv.h); rows, group size and K split
// are function constants.
#include "marlin_gemv.h"

#define MARLIN_GEMV(dt, T, Tname, fmt, F)                                       \
  template [[host_name("marlin_gemv_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_gemv<T, F>) marlin_gemv<T, F>;
#define MARLIN_GEMV_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_GEMV, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_GEMV_DTYPES, )
