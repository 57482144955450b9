// Vector adds per cycle this core gives the process now (benchmarks/core_probe.py says why):
// 8 independent vpaddd chains against 1 dependent one of the same count, so the clock cancels
// out. About 3.5 on Zen 3 with the core to ourselves, about 2 when another tenant's thread shares
// it. x86-64 with AVX2 only; compiled by core_probe.py, included by rans_fill.cpp.
#include <time.h>

static double core_probe_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CORE_PROBE_CHAIN "vpaddd %%ymm1, %%ymm0, %%ymm0\n"
#define CORE_PROBE_SIDE(r) "vpaddd %%ymm1, %%ymm" #r ", %%ymm" #r "\n"

#ifdef __cplusplus
extern "C"
#endif
double core_probe(void) {
  const long n = 300000;
  const double t0 = core_probe_seconds();
  for (long i = 0; i < n; ++i)
    __asm__ volatile(CORE_PROBE_CHAIN CORE_PROBE_CHAIN CORE_PROBE_CHAIN CORE_PROBE_CHAIN CORE_PROBE_CHAIN
                     CORE_PROBE_CHAIN CORE_PROBE_CHAIN CORE_PROBE_CHAIN ::: "xmm0");
  const double t1 = core_probe_seconds();
  for (long i = 0; i < n; ++i)
    __asm__ volatile(CORE_PROBE_SIDE(2) CORE_PROBE_SIDE(3) CORE_PROBE_SIDE(4) CORE_PROBE_SIDE(5) CORE_PROBE_SIDE(6)
                     CORE_PROBE_SIDE(7) CORE_PROBE_SIDE(8) CORE_PROBE_SIDE(9) ::: "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",
                     "xmm7", "xmm8", "xmm9");
  return (t1 - t0) / (core_probe_seconds() - t1);
}
