// marlin_reduce_<dt> (metal/marlin_reduce.h): the K split's reduction.
#include "marlin_reduce.h"

#define MARLIN_REDUCE(dt, T, Tname, _)                                                 \
  template [[host_name("marlin_reduce_" #dt)]] [[kernel]] decltype(marlin_reduce<T>) \
      marlin_reduce<T>;
MARLIN_FOR_EACH_DTYPE(MARLIN_REDUCE, )
