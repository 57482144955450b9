// marlin_sparse24_dequant_<fmt>_<dt>: metal/sparse24_dequant.h.
#include "sparse24_dequant.h"

#define MARLIN_SPARSE24_DEQUANT(dt, T, Tname, fmt, F)                                      \
  template [[host_name("marlin_sparse24_dequant_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_sparse24_dequant<T, F>) marlin_sparse24_dequant<T, F>;
#define MARLIN_SPARSE24_DEQUANT_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_SPARSE24_DEQUANT, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_SPARSE24_DEQUANT_DTYPES, )
