// marlin_dequant_<fmt>_<dt> (metal/marlin_dequantize.h).
#include "marlin_dequantize.h"

#define MARLIN_DEQUANT(dt, T, Tname, fmt, F)                                        \
  template [[host_name("marlin_dequant_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_dequant<T, F>) marlin_dequant<T, F>;
#define MARLIN_DEQUANT_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_DEQUANT, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_DEQUANT_DTYPES, )
