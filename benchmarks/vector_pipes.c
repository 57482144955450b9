/* Which vector instructions of the rans decode can issue beside the
   micro-kernels' dot products (docs/CPU.md, "Overlap"): cycles per loop
   iteration of 16 independent vdpbf16ps, of 8 instructions of one kind, and
   of both together; last, 8 each of a shift, an add and a permute at once.
   Cycles from process CPU time at the clock a chain of dependent adds
   measures (1 cycle each). x86-64 with AVX-512 BF16 only:

     gcc -O2 benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes
*/
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#include <stdio.h>
#include <time.h>

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERATIONS 20000000L
#define DOT(r) "vdpbf16ps %%zmm16, %%zmm17, %%zmm" #r "\n"
#define DOTS16 DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7) \
               DOT(8) DOT(9) DOT(10) DOT(11) DOT(12) DOT(13) DOT(14) DOT(15)
/* 8 of a kind on zmm24-31, each its own chain across iterations (latency hidden) */
#define EIGHT(op) op(24) op(25) op(26) op(27) op(28) op(29) op(30) op(31)
#define SHIFT(r) "vpsrld $3, %%zmm" #r ", %%zmm" #r "\n"
#define ADD(r) "vpaddd %%zmm18, %%zmm" #r ", %%zmm" #r "\n"
#define AND(r) "vpandd %%zmm18, %%zmm" #r ", %%zmm" #r "\n"
#define PERM(r) "vpermi2w %%zmm20, %%zmm21, %%zmm" #r "\n"
#define MUL(r) "vpmulld %%zmm18, %%zmm" #r ", %%zmm" #r "\n"
#define BLEND(r) "vpblendmw %%zmm18, %%zmm" #r ", %%zmm" #r "%{%%k1%}\n"
#define CMP(r) "vpcmpud $1, %%zmm18, %%zmm" #r ", %%k2\n vpaddd %%zmm19, %%zmm" #r ", %%zmm" #r "%{%%k2%}\n"
#define EXPAND(r) "vpexpandd %%zmm19, %%zmm" #r "%{%%k1%}\n"
#define LOAD(r) "vmovdqu64 " #r " * 64 - 1536(%0), %%zmm" #r "\n" /* 8 cache lines of buffer */
#define STORE(r) "vmovdqu64 %%zmm" #r ", " #r " * 64 - 1536(%0)\n"
#define MIX(r) SHIFT(r) ADD(r) PERM(r)

#define CLOBBERED "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
  "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"
/* The operands (zmm16-21 zero, k1 a lane mask), set before each timed loop:
   the printf between loops may use any vector register. */
#define SET_OPERANDS()                                                                          \
  __asm__ volatile("vpxord %%zmm16, %%zmm16, %%zmm16\n vpxord %%zmm17, %%zmm17, %%zmm17\n"      \
                   "vpxord %%zmm18, %%zmm18, %%zmm18\n vpxord %%zmm19, %%zmm19, %%zmm19\n"      \
                   "vpxord %%zmm20, %%zmm20, %%zmm20\n vpxord %%zmm21, %%zmm21, %%zmm21\n"      \
                   "movl $0x5555, %%eax\n kmovd %%eax, %%k1\n" ::: "eax", "k1", "xmm16", "xmm17", \
                   "xmm18", "xmm19", "xmm20", "xmm21")
#define TIME(body) ({ \
  SET_OPERANDS(); \
  const double t0 = cpu_seconds(); \
  for (long i = 0; i < ITERATIONS; ++i) __asm__ volatile(body ::"r"(buffer) : "memory", "k2", CLOBBERED); \
  (cpu_seconds() - t0) / ITERATIONS; })

static char buffer[512] __attribute__((aligned(64)));

int main(void) {
  const double t_add = ({
    const double t0 = cpu_seconds();
    long v = 0;
    for (long i = 0; i < ITERATIONS; ++i)
      __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                       : "+r"(v));
    (cpu_seconds() - t0) / ITERATIONS / 8;
  });
  const double dots = TIME(DOTS16) / t_add;
  printf("clock %.2f GHz; 16 vdpbf16ps: %.2f cycles\n\n", 1e-9 / t_add, dots);
  printf("| 8 of | cycles alone | with 16 vdpbf16ps | added to the dot products |\n| --- | ---: | ---: | ---: |\n");
#define ROW(name, op)                                                                  \
  {                                                                                    \
    const double alone = TIME(EIGHT(op)) / t_add, both = TIME(DOTS16 EIGHT(op)) / t_add; \
    printf("| %s | %.2f | %.2f | %.2f |\n", name, alone, both, both - dots);          \
  }
  ROW("vpsrld", SHIFT)
  ROW("vpaddd", ADD)
  ROW("vpandd", AND)
  ROW("vpermi2w", PERM)
  ROW("vpmulld", MUL)
  ROW("vpblendmw", BLEND)
  ROW("vpcmpud + masked vpaddd", CMP)
  ROW("vpexpandd", EXPAND)
  ROW("vmovdqu64 loads", LOAD)
  ROW("vmovdqu64 stores", STORE)
  ROW("vpsrld + vpaddd + vpermi2w (24)", MIX)
  return 0;
}
