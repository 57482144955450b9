// Shared ABI between the mslsim runtime, generated kernel thunks and Python (ctypes).
#pragma once
#include <stdint.h>

#define MSLSIM_ABI_VERSION 4

namespace mslsim {

struct ThreadCtx {
  uint32_t tpig[3], tpitg[3], tgpig[3], tptg[3], tgpg[3], tpg[3];
  uint32_t tiitg, tiisg, sgiitg, tpsg, sgptg;
  void** bufs;    // indexed by [[buffer(n)]]
  void** tgbufs;  // indexed by [[threadgroup(n)]]
};

// One lane's contribution to a simdgroup collective.  The completing call
// receives the participating lanes (in lane order) and writes every out.
struct Coll {
  void (*fn)(Coll* const* lanes, int n);
  int lane;
  long long p0;
  const void* in;
  void* out;
  const void* a;
  const void* b;
  const void* c;
  void* d;
};

// Keep in sync with _LaunchArgs in __init__.py
struct LaunchArgs {
  void (*thunk)(ThreadCtx*);
  uint32_t grid[3];
  uint32_t tg[3];
  int32_t nbuf;
  int32_t buf_index[32];
  void* buf_ptr[32];
  uint64_t buf_size[32];
  int32_t buf_readonly[32];
  uint64_t tg_dyn_size[32];
  uint64_t seed;
  int32_t inorder;
  int32_t nworkers;
  uint64_t stack_size;
  uint64_t timeout_ms;  // 0: none
  int32_t check_races;  // threadgroup-memory race detection (kernels built with -fsanitize=thread hooks)
};

// The race-checked memory lives in one pool: [lo, lo + span) holds every
// worker's threadgroup memory and the writable device buffers of the launches.
// The kernel library's access hooks (prelude.h) test an address against it and
// call mslsim_race_access only for that memory.
struct RaceRange {
  uintptr_t lo;
  uintptr_t span;
};

// mem_flags bits the race detector uses (as in metal_lib.h's enum mem_flags).
enum : uint32_t { MEM_DEVICE = 1, MEM_THREADGROUP = 2 };

struct LaunchStats {
  uint64_t barriers;
  uint64_t threadgroup_memory;
  uint64_t threadgroups;
};

}  // namespace mslsim

extern "C" {
void mslsim_tg_barrier(uint32_t mem_flags, const char* file, int line);
void mslsim_simd_collective(mslsim::Coll* c, const char* file, int line);
void mslsim_yield(void);
int mslsim_lane(void);
[[noreturn]] void mslsim_fail(const char* msg, const char* file, int line);
void* mslsim_tg_alloc(const void* key, unsigned long size, unsigned long align, const char* file, int line);
extern mslsim::RaceRange mslsim_race_range;
void mslsim_race_access(uintptr_t addr, unsigned long size, int is_write, void* pc);
}
