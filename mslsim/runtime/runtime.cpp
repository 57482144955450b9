// mslsim runtime: fibers, threadgroup scheduler, rendezvous, guarded buffers.
// Built once into libmslsim_rt.so (cached) and loaded RTLD_GLOBAL before any
// kernel library, which resolves the mslsim_* symbols below against it.
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <condition_variable>
#include <chrono>
#include <pthread.h>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <dlfcn.h>
#include <sys/mman.h>
#if defined(__APPLE__)
#include <sys/ucontext.h>  // <ucontext.h> is an error on macOS without _XOPEN_SOURCE
#else
#include <ucontext.h>
#endif
#include <unistd.h>

#include "../include/mslsim/abi.h"

using namespace mslsim;

// ---------------------------------------------------------------- context switch
extern "C" void mslsim_ctx_switch(void** save_sp, void* new_sp);
extern "C" void mslsim_fiber_entry();

#if defined(__APPLE__)
#define MSLSIM_SYM(x) "_" #x
#else
#define MSLSIM_SYM(x) #x
#endif

#if defined(__x86_64__)
asm(R"(
.text
.globl )" MSLSIM_SYM(mslsim_ctx_switch) R"(
)" MSLSIM_SYM(mslsim_ctx_switch) R"(:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.globl )" MSLSIM_SYM(mslsim_fiber_entry) R"(
)" MSLSIM_SYM(mslsim_fiber_entry) R"(:
  movq %r12, %rdi
  callq *%r13
  ud2
)");
#elif defined(__aarch64__)
asm(R"(
.text
.globl )" MSLSIM_SYM(mslsim_ctx_switch) R"(
.p2align 2
)" MSLSIM_SYM(mslsim_ctx_switch) R"(:
  sub sp, sp, #176
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mrs x9, fpcr
  str x9, [sp, #160]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldr x9, [sp, #160]
  msr fpcr, x9
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #176
  ret
.globl )" MSLSIM_SYM(mslsim_fiber_entry) R"(
.p2align 2
)" MSLSIM_SYM(mslsim_fiber_entry) R"(:
  mov x0, x19
  blr x20
  brk #0
)");
#else
#error "mslsim: unsupported architecture (x86-64 and aarch64 only)"
#endif

namespace {

enum FState { F_RUN = 0, F_SIMD = 1, F_TG = 2, F_DONE = 3, F_YIELD = 4 };

struct Worker;

// Memory spaces of the race detector: each is ordered by its own barriers (mem_flags).
enum Space { S_THREADGROUP = 0, S_DEVICE = 1, S_COUNT = 2 };
inline uint32_t space_flag(int space) { return space == S_DEVICE ? MEM_DEVICE : MEM_THREADGROUP; }

struct Fiber {
  void* sp = nullptr;
  // Race detection: vector clocks over the lanes of this simdgroup, per memory space. The device clock is
  // the threadgroup one (vc[S_THREADGROUP]) until a simdgroup_barrier orders one space only (clocks_split).
  uint32_t vc[S_COUNT][32];
  bool clocks_split = false;
  uint32_t barrier_flags = 0;  // mem_flags of the threadgroup_barrier it waits at
  // Race detection: this thread's last checked access since it last ran after other threads (fibers switch
  // only at barriers, collectives and yields, which clear it). Its bytes' shadow then holds nothing newer.
  uintptr_t last_addr = 0;
  size_t last_size = 0;
  bool last_write = false;
  char* mem = nullptr;     // mmap base (guard page first)
  size_t memsize = 0;
  int tid = 0, sg = 0, lane = 0;
  int state = F_RUN;
  const char* file = nullptr;
  int line = 0;
  Coll* coll = nullptr;
  ThreadCtx ctx;
  Worker* w = nullptr;
};

struct Guarded {
  int index = -1;
  char* region = nullptr;  // mmap base
  size_t region_size = 0;
  char* data = nullptr;    // start of buffer inside region
  size_t size = 0;
  bool readonly = false;
  bool pooled = false;     // region carved out of the race-checked device pool
  void* user = nullptr;
};

struct Launch;

// ------------------------------------------------------- race detection state
// One access to a byte of threadgroup memory: barrier interval (phase), thread,
// the thread's own simdgroup clock at the time and the code offset (pc).
struct Access {
  uint32_t phase;
  uint16_t tid;
  uint16_t pad;
  uint32_t clk;
  uint32_t pc;
};
// Shadow of one byte: the last write and up to two reads (by different threads) since.
struct Cell {
  Access w;
  Access r[2];
};

// Shadow of the device pool for one worker's threadgroup: chunks of kDevChunk bytes' cells, allocated
// on first access and recycled at the start of every threadgroup (device races are checked within a
// threadgroup only, so the shadow never outlives one).
struct DevShadow {
  Cell** table = nullptr;          // chunk index in the device pool -> cells (nullptr: not touched)
  std::vector<uint32_t> used;      // chunk indices set in table
  std::vector<Cell*> spare;        // recycled chunks
};

// A threadgroup-memory arena of the pool, its shadow and the worker's device shadow (persistent across
// launches). phase[space] counts barrier intervals of that memory space.
struct Slot {
  bool used = false;
  Worker* owner = nullptr;
  Cell* shadow = nullptr;
  DevShadow dev;
  uint32_t phase[S_COUNT] = {0, 0};
};

struct TgDecl {
  const void* key;
  size_t off, size;
  const char* file;
  int line;
};

struct Worker {
  Launch* L = nullptr;
  std::vector<Fiber> fibers;
  void* sched_sp = nullptr;
  Fiber* cur = nullptr;
  char* arena = nullptr;
  size_t arena_used = 0, arena_hwm = 0, arena_dyn = 0;
  std::vector<TgDecl> tg_static;
  int slot = -1;           // pool slot of the arena (-1: private arena, not race checked)
  bool race = false;       // race detection on for this launch and arena
  Cell* shadow = nullptr;
  DevShadow* dev = nullptr;
  uint32_t* phase = nullptr;  // [S_COUNT]
  void* tgbufs[32];
  uint64_t rng = 0;
  bool failed = false;
  std::string error;
  uint64_t barriers = 0;
  uint32_t tg_mem_max = 0;
  char* altstack = nullptr;
  uint32_t tgpos[3];
};

struct Launch {
  const LaunchArgs* a;
  std::vector<Guarded> bufs;
  void* bufptr[32];
  std::atomic<uint64_t> next{0};
  std::atomic<bool> abort{false};
  std::mutex err_mu;
  std::string error;
  uint64_t ntg = 0;
  size_t stack_size = 0;
  std::mutex done_mu;
  std::condition_variable done_cv;
  int done = 0;
  std::atomic<bool> timed_out{false};
  uintptr_t lib_base = 0;  // kernel library: code offsets of race reports
  std::string lib_name;
};

thread_local Worker* t_worker = nullptr;
thread_local bool t_in_fiber = false;

const size_t kPage = 4096;
const size_t kGuard = 64 * 1024;

std::mutex g_stack_mu;
std::vector<std::pair<char*, size_t>> g_stacks;  // free fiber stacks

char* alloc_stack(size_t size, size_t* memsize) {
  size_t total = size + kPage;
  {
    std::lock_guard<std::mutex> lk(g_stack_mu);
    for (size_t i = 0; i < g_stacks.size(); ++i) {
      if (g_stacks[i].second == total) {
        char* p = g_stacks[i].first;
        g_stacks[i] = g_stacks.back();
        g_stacks.pop_back();
        *memsize = total;
        return p;
      }
    }
  }
#if defined(MAP_NORESERVE)
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
#else
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
#endif
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, kPage, PROT_NONE);
  *memsize = total;
  return (char*)p;
}

void free_stack(char* p, size_t memsize) {
  std::lock_guard<std::mutex> lk(g_stack_mu);
  if (g_stacks.size() < 8192) g_stacks.emplace_back(p, memsize);
  else munmap(p, memsize);
}

// ------------------------------------------------------------ arena pool
// Threadgroup memory: 32 KiB usable + 32 KiB slack (small overruns do not
// fault) + a guard page per worker, all workers' arenas in one pool, followed
// by the device pool that holds the launches' writable buffers, so the race
// hooks of the kernel library need one range test per memory access.
const size_t kArenaUse = 32768;
const size_t kArenaSlot = 2 * 32768 + kPage;
const int kPoolSlots = 128;
const size_t kArenaPool = kPoolSlots * kArenaSlot;
const size_t kDevPool = size_t(16) << 30;  // address space for writable buffers (larger ones: not race checked)
const size_t kDevChunk = 1024;             // device bytes per shadow chunk
const size_t kDevChunksPerThreadgroup = 16384;  // shadow of at most 16 MiB of device memory per threadgroup
std::mutex g_pool_mu;
char* g_pool = nullptr;
char* g_dev_pool = nullptr;
std::vector<std::pair<size_t, size_t>> g_dev_free;  // free (offset, size) ranges of the device pool, sorted
Slot g_slots[kPoolSlots];

// Reserve the pool (once; under g_pool_mu). false if the address space could not be reserved.
bool ensure_pool() {
  if (!g_pool) {
    void* p = mmap(nullptr, kArenaPool + kDevPool, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    g_pool = p == MAP_FAILED ? (char*)-1 : (char*)p;
    if (p != MAP_FAILED) {
      g_dev_pool = g_pool + kArenaPool;
      g_dev_free.assign(1, {0, kDevPool});
      mslsim_race_range = RaceRange{(uintptr_t)p, kArenaPool + kDevPool};
    }
  }
  return g_pool != (char*)-1;
}

// A region of the device pool (first fit), or nullptr.
char* dev_pool_alloc(size_t size) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!ensure_pool()) return nullptr;
  for (auto& r : g_dev_free) {
    if (r.second < size) continue;
    char* p = g_dev_pool + r.first;
    r.first += size;
    r.second -= size;
    return p;
  }
  return nullptr;
}

void dev_pool_free(char* p, size_t size) {
  // drop the pages and make the range inaccessible again
  mmap(p, size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  std::lock_guard<std::mutex> lk(g_pool_mu);
  size_t off = p - g_dev_pool;
  auto it = std::lower_bound(g_dev_free.begin(), g_dev_free.end(), std::make_pair(off, size_t(0)));
  it = g_dev_free.insert(it, {off, size});
  if (it + 1 != g_dev_free.end() && it->first + it->second == (it + 1)->first) {
    it->second += (it + 1)->second;
    g_dev_free.erase(it + 1);
  }
  if (it != g_dev_free.begin() && (it - 1)->first + (it - 1)->second == it->first) {
    (it - 1)->second += it->second;
    g_dev_free.erase(it);
  }
}

void acquire_arena(Worker* w) {
  {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    ensure_pool();
    for (int i = 0; g_pool != (char*)-1 && i < kPoolSlots; ++i) {
      Slot& sl = g_slots[i];
      if (sl.used) continue;
      if (!sl.shadow) {
        void* sh = mmap(nullptr, kArenaUse * sizeof(Cell), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (sh == MAP_FAILED) break;
        sl.shadow = (Cell*)sh;
      }
      if (!sl.dev.table) {
        void* t = mmap(nullptr, kDevPool / kDevChunk * sizeof(Cell*), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (t == MAP_FAILED) break;
        sl.dev.table = (Cell**)t;
      }
      sl.used = true;
      sl.owner = w;
      w->slot = i;
      w->arena = g_pool + i * kArenaSlot;
      w->shadow = sl.shadow;
      w->dev = &sl.dev;
      w->phase = sl.phase;
      break;
    }
  }
  if (w->slot >= 0) {
    mprotect(w->arena, 2 * 32768, PROT_READ | PROT_WRITE);
  } else {  // pool exhausted: a private arena, not race checked
    w->arena = (char*)mmap(nullptr, kArenaSlot, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(w->arena + 2 * 32768, kPage, PROT_NONE);
  }
  memset(w->arena, 0xFF, 2 * 32768);
}

void release_arena(Worker* w) {
  if (w->slot < 0) {
    munmap(w->arena, kArenaSlot);
    return;
  }
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_slots[w->slot].used = false;
  g_slots[w->slot].owner = nullptr;
}

// A new barrier interval of one memory space: every earlier access of the threadgroup to that memory
// is ordered before what follows.
void new_phase(Worker* w, int space) {
  if (++w->phase[space] != 0) return;
  if (space == S_THREADGROUP) {
    memset(w->shadow, 0, kArenaUse * sizeof(Cell));
  } else {
    for (Cell* c : w->dev->spare) memset(c, 0, kDevChunk * sizeof(Cell));
    for (uint32_t i : w->dev->used) memset(w->dev->table[i], 0, kDevChunk * sizeof(Cell));
  }
  w->phase[space] = 1;
}

// The memory spaces whose barrier intervals end at a barrier with these mem_flags.
void new_phases(Worker* w, uint32_t mem_flags) {
  for (int space = 0; space < S_COUNT; ++space)
    if (mem_flags & space_flag(space)) new_phase(w, space);
}

// A new threadgroup: nothing of the previous one is visible any more; its device shadow is recycled.
void start_race_threadgroup(Worker* w) {
  DevShadow& d = *w->dev;
  for (uint32_t i : d.used) {
    d.spare.push_back(d.table[i]);
    d.table[i] = nullptr;
  }
  d.used.clear();
  new_phases(w, MEM_THREADGROUP | MEM_DEVICE);
}

// The vector clock of a lane for accesses to a memory space.
inline uint32_t* space_clock(Fiber* f, int space) {
  return f->vc[space == S_DEVICE && f->clocks_split ? S_DEVICE : S_THREADGROUP];
}

// Lanes that took part in one simd collective / simdgroup_barrier are ordered, in the memory spaces of
// mem_flags: join their clocks. While no lane has split clocks, a sync of both spaces is one join.
void race_sync(std::vector<Fiber*>& lanes, uint32_t mem_flags) {
  mem_flags &= MEM_THREADGROUP | MEM_DEVICE;
  if (!mem_flags) return;
  bool split = mem_flags != (MEM_THREADGROUP | MEM_DEVICE);
  for (Fiber* g : lanes) split |= g->clocks_split;
  if (split)
    for (Fiber* g : lanes)
      if (!g->clocks_split) {
        memcpy(g->vc[S_DEVICE], g->vc[S_THREADGROUP], sizeof g->vc[S_DEVICE]);
        g->clocks_split = true;
      }
  for (int space = 0; space < (split ? S_COUNT : 1); ++space) {
    if (split && !(mem_flags & space_flag(space))) continue;
    uint32_t j[32] = {0};
    for (Fiber* g : lanes)
      for (int k = 0; k < 32; ++k) j[k] = std::max(j[k], g->vc[space][k]);
    for (Fiber* g : lanes) {
      memcpy(g->vc[space], j, sizeof j);
      g->vc[space][g->lane]++;
    }
  }
}

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string fmt_site(const char* file, int line) {
  if (!file) return "<unknown>";
  return std::string(file) + ":" + std::to_string(line);
}

std::string thread_desc(const Worker* w, const Fiber* f) {
  char b[160];
  snprintf(b, sizeof b, "thread %d (simdgroup %d lane %d) of threadgroup (%u,%u,%u)", f->tid, f->sg, f->lane,
           w->tgpos[0], w->tgpos[1], w->tgpos[2]);
  return b;
}

void fail(Worker* w, const std::string& msg) {
  if (!w->failed) {
    w->failed = true;
    w->error = msg;
  }
}

extern "C" void mslsim_fiber_main(Fiber* f) {
  Worker* w = f->w;
  t_in_fiber = true;
  w->L->a->thunk(&f->ctx);
  t_in_fiber = false;
  f->state = F_DONE;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  abort();  // never resumed
}

void prepare_fiber(Fiber* f) {
  char* top = f->mem + f->memsize;
  uintptr_t t = ((uintptr_t)top) & ~(uintptr_t)15;
  t -= 16;
#if defined(__x86_64__)
  uint64_t* sp = (uint64_t*)(t - 64);
  uint32_t mx;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(mx));
  asm volatile("fnstcw %0" : "=m"(cw));
  uint32_t ctl[2] = {mx, cw};
  memcpy(&sp[0], ctl, 8);
  sp[1] = 0;                        // r15
  sp[2] = 0;                        // r14
  sp[3] = (uint64_t)&mslsim_fiber_main;  // r13
  sp[4] = (uint64_t)f;              // r12
  sp[5] = 0;                        // rbx
  sp[6] = 0;                        // rbp
  sp[7] = (uint64_t)&mslsim_fiber_entry;
  f->sp = sp;
#elif defined(__aarch64__)
  uint64_t* sp = (uint64_t*)(t - 176);
  memset(sp, 0, 176);
  sp[0] = (uint64_t)f;                       // x19
  sp[1] = (uint64_t)&mslsim_fiber_main;      // x20
  sp[11] = (uint64_t)&mslsim_fiber_entry;    // x30
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  sp[20] = fpcr;
  f->sp = sp;
#endif
}

// ------------------------------------------------------------- rendezvous logic
struct TGState {
  std::vector<Fiber*> runq;
  std::vector<int> live_sg, blocked_sg;
  int live = 0, blocked_tg = 0, nsg = 0;
  std::vector<Coll*> tmp;
  std::vector<Fiber*> tmpf;
};

void push_run(Worker*, TGState& s, Fiber* f) {
  f->state = F_RUN;
  s.runq.push_back(f);
}

void check_sg(Worker* w, TGState& s, int sg) {
  if (s.blocked_sg[sg] != s.live_sg[sg] || s.live_sg[sg] == 0) return;
  const int tpsg = 32;
  int base = sg * tpsg;
  int n = (int)w->fibers.size();
  // group the lanes blocked in simd collectives by call site
  char done[32] = {0};
  for (int l = 0; l < tpsg && base + l < n; ++l) {
    Fiber* f = &w->fibers[base + l];
    if (f->state != F_SIMD || done[l]) continue;
    s.tmp.clear();
    s.tmpf.clear();
    for (int m = l; m < tpsg && base + m < n; ++m) {
      Fiber* g = &w->fibers[base + m];
      if (g->state == F_SIMD && !done[m] && g->line == f->line && g->file == f->file &&
          g->coll->fn == f->coll->fn) {
        done[m] = 1;
        s.tmp.push_back(g->coll);
        s.tmpf.push_back(g);
      }
    }
    if (f->coll->fn) f->coll->fn(s.tmp.data(), (int)s.tmp.size());
    // a simd collective orders all memory among its lanes; a simdgroup_barrier (no fn) what its flags name
    if (w->race) race_sync(s.tmpf, f->coll->fn ? MEM_THREADGROUP | MEM_DEVICE : (uint32_t)f->coll->p0);
    s.blocked_sg[sg] -= (int)s.tmpf.size();
    for (Fiber* g : s.tmpf) push_run(w, s, g);
  }
}

void check_tg(Worker* w, TGState& s) {
  if (s.live == 0 || s.blocked_tg != s.live) return;
  // every live thread waits at a threadgroup barrier
  Fiber* first = nullptr;
  uint32_t mem_flags = ~0u;  // the memory all of them order
  for (auto& f : w->fibers) {
    if (f.state != F_TG) continue;
    mem_flags &= f.barrier_flags;
    if (!first) first = &f;
    else if (f.line != first->line || f.file != first->file) {
      fail(w, "barrier divergence: " + thread_desc(w, first) + " waits at threadgroup_barrier at " +
                  fmt_site(first->file, first->line) + " but " + thread_desc(w, &f) +
                  " waits at threadgroup_barrier at " + fmt_site(f.file, f.line));
      return;
    }
  }
  w->barriers++;
  if (w->race) new_phases(w, mem_flags);
  for (auto& f : w->fibers)
    if (f.state == F_TG) {
      s.blocked_sg[f.sg]--;
      push_run(w, s, &f);
    }
  s.blocked_tg = 0;
}

void run_threadgroup(Worker* w, uint64_t linear) {
  Launch* L = w->L;
  const LaunchArgs* a = L->a;
  uint32_t gx = a->grid[0], gy = a->grid[1];
  uint32_t p[3] = {(uint32_t)(linear % gx), (uint32_t)((linear / gx) % gy), (uint32_t)(linear / ((uint64_t)gx * gy))};
  memcpy(w->tgpos, p, sizeof p);
  uint32_t tx = a->tg[0], ty = a->tg[1], tz = a->tg[2];
  int n = (int)(tx * ty * tz);
  int nsg = (n + 31) / 32;

  // threadgroup memory: poison what was used before, allocate dynamic args
  if (w->arena_hwm) memset(w->arena, 0xFF, w->arena_hwm);
  w->arena_used = 0;
  w->tg_static.clear();
  for (int i = 0; i < 32; ++i) {
    w->tgbufs[i] = nullptr;
    if (a->tg_dyn_size[i]) {
      w->tgbufs[i] = w->arena + w->arena_used;
      w->arena_used += (a->tg_dyn_size[i] + 15) & ~(uint64_t)15;
    }
  }
  w->arena_dyn = w->arena_used;
  w->arena_hwm = w->arena_used;
  if (w->race) start_race_threadgroup(w);
  w->rng = a->seed * 0x2545F4914F6CDD1Dull + linear * 0x9E3779B97F4A7C15ull + 1;

  TGState s;
  s.nsg = nsg;
  s.live = n;
  s.live_sg.assign(nsg, 0);
  s.blocked_sg.assign(nsg, 0);
  s.runq.reserve(n);
  for (int t = 0; t < n; ++t) {
    Fiber* f = &w->fibers[t];
    f->tid = t;
    f->sg = t / 32;
    f->lane = t % 32;
    f->w = w;
    f->state = F_RUN;
    f->coll = nullptr;
    f->file = nullptr;
    f->line = 0;
    f->last_size = 0;
    memset(f->vc, 0, sizeof f->vc);
    for (int space = 0; space < S_COUNT; ++space) f->vc[space][f->lane] = 1;
    f->clocks_split = false;
    ThreadCtx& c = f->ctx;
    uint32_t lx = t % tx, ly = (t / tx) % ty, lz = t / (tx * ty);
    uint32_t lp[3] = {lx, ly, lz};
    for (int d = 0; d < 3; ++d) {
      c.tpitg[d] = lp[d];
      c.tgpig[d] = p[d];
      c.tptg[d] = a->tg[d];
      c.tgpg[d] = a->grid[d];
      c.tpg[d] = a->grid[d] * a->tg[d];
      c.tpig[d] = p[d] * a->tg[d] + lp[d];
    }
    c.tiitg = t;
    c.tiisg = t % 32;
    c.sgiitg = t / 32;
    c.tpsg = 32;
    c.sgptg = nsg;
    c.bufs = L->bufptr;
    c.tgbufs = w->tgbufs;
    s.live_sg[t / 32]++;
    prepare_fiber(f);
    s.runq.push_back(f);
  }
  const bool inorder = a->inorder != 0;
  size_t head = 0;  // FIFO head for in-order mode
  uint64_t spins = 0;  // consecutive yields without any other progress
  while (!w->failed) {
    Fiber* f;
    if (inorder) {
      if (head >= s.runq.size()) {
        s.runq.clear();
        head = 0;
        break;
      }
      f = s.runq[head++];
      if (head > 4096 && head * 2 > s.runq.size()) {
        s.runq.erase(s.runq.begin(), s.runq.begin() + head);
        head = 0;
      }
    } else {
      if (s.runq.empty()) break;
      size_t i = splitmix(w->rng) % s.runq.size();
      f = s.runq[i];
      s.runq[i] = s.runq.back();
      s.runq.pop_back();
    }
    w->cur = f;
    mslsim_ctx_switch(&w->sched_sp, f->sp);
    w->cur = nullptr;
    if (w->failed) break;
    if (f->state != F_YIELD) spins = 0;
    switch (f->state) {
      case F_DONE:
        s.live--;
        s.live_sg[f->sg]--;
        check_sg(w, s, f->sg);
        check_tg(w, s);
        break;
      case F_SIMD:
        s.blocked_sg[f->sg]++;
        check_sg(w, s, f->sg);
        break;
      case F_TG:
        s.blocked_sg[f->sg]++;
        s.blocked_tg++;
        check_sg(w, s, f->sg);
        check_tg(w, s);
        break;
      case F_YIELD:
        push_run(w, s, f);
        if (++spins > 20000000ull) {
          fail(w, "livelock: threads keep spinning on atomics without progress (e.g. " + thread_desc(w, f) +
                      " waits for a value no thread of this threadgroup will write)");
        }
        break;
      default:
        fail(w, "internal error: fiber in unexpected state");
    }
    if (L->abort.load(std::memory_order_relaxed)) {
      fail(w, "");
      break;
    }
  }
  if (!w->failed && s.live > 0) {
    std::string m = "deadlock: no thread can make progress; waiting threads:";
    int shown = 0;
    for (auto& f : w->fibers) {
      if ((f.state == F_SIMD || f.state == F_TG) && f.tid < n && shown < 6) {
        m += "\n  " + thread_desc(w, &f) + (f.state == F_TG ? " at threadgroup_barrier " : " at simd collective ") +
             fmt_site(f.file, f.line);
        shown++;
      }
    }
    fail(w, m);
  }
  uint32_t used = (uint32_t)w->arena_hwm;
  if (used > w->tg_mem_max) w->tg_mem_max = used;
}

void worker_main(Launch* L, Worker* w) {
  t_worker = w;
  stack_t ss, old;
  ss.ss_sp = w->altstack;
  ss.ss_size = 256 * 1024;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old);
  const LaunchArgs* a = L->a;
  int n = (int)(a->tg[0] * a->tg[1] * a->tg[2]);
  w->fibers.resize(n);
  bool ok = true;
  for (int i = 0; i < n; ++i) {
    w->fibers[i].mem = alloc_stack(L->stack_size, &w->fibers[i].memsize);
    if (!w->fibers[i].mem) ok = false;
  }
  if (!ok) {
    fail(w, "could not allocate fiber stacks");
  }
  acquire_arena(w);
  w->race = a->check_races != 0 && w->slot >= 0;
  while (ok && !L->abort.load()) {
    uint64_t i = L->next.fetch_add(1);
    if (i >= L->ntg) break;
    run_threadgroup(w, i);
    if (w->failed) {
      if (!w->error.empty()) {
        std::lock_guard<std::mutex> lk(L->err_mu);
        if (L->error.empty()) L->error = w->error;
      }
      L->abort = true;
      break;
    }
  }
  if (L->timed_out.load()) {
    // a fiber may have been interrupted anywhere: do not reuse its stack
    for (auto& f : w->fibers)
      if (f.mem) munmap(f.mem, f.memsize);
  } else {
    for (auto& f : w->fibers)
      if (f.mem) free_stack(f.mem, f.memsize);
  }
  w->fibers.clear();
  release_arena(w);
  ss.ss_flags = SS_DISABLE;
  sigaltstack(&ss, nullptr);
  t_worker = nullptr;
  std::lock_guard<std::mutex> lk(L->done_mu);
  L->done++;
  L->done_cv.notify_all();
}

// ------------------------------------------------------------------ SIGSEGV
struct sigaction g_old_segv, g_old_bus, g_old_fpe;

void chain(int sig, siginfo_t* si, void* uc) {
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGFPE ? &g_old_fpe : &g_old_bus;
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction) old->sa_sigaction(sig, si, uc);
    return;
  }
  if (old->sa_handler == SIG_IGN) return;
  if (old->sa_handler == SIG_DFL || old->sa_handler == nullptr) {
    signal(sig, SIG_DFL);
    return;  // re-executes the faulting instruction -> default action
  }
  old->sa_handler(sig);
}

void on_fault(int sig, siginfo_t* si, void* ucv) {
  Worker* w = t_worker;
  if (!w || !t_in_fiber || !w->cur) {
    chain(sig, si, ucv);
    return;
  }
  char* addr = (char*)si->si_addr;
  int is_write = -1;
#if defined(__x86_64__) && defined(__linux__)
  ucontext_t* uc = (ucontext_t*)ucv;
  is_write = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#elif defined(__x86_64__) && defined(__APPLE__)
  ucontext_t* uc = (ucontext_t*)ucv;
  is_write = (uc->uc_mcontext->__es.__err & 2) ? 1 : 0;
#elif defined(__aarch64__) && defined(__APPLE__)
  ucontext_t* uc = (ucontext_t*)ucv;
  is_write = (uc->uc_mcontext->__es.__esr & (1u << 6)) ? 1 : 0;
#endif
  const char* rw = is_write == 1 ? "write" : is_write == 0 ? "read" : "access";
  void* pc = nullptr;
#if defined(__x86_64__) && defined(__linux__)
  pc = (void*)((ucontext_t*)ucv)->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__) && defined(__linux__)
  pc = (void*)((ucontext_t*)ucv)->uc_mcontext.pc;
#elif defined(__x86_64__) && defined(__APPLE__)
  pc = (void*)((ucontext_t*)ucv)->uc_mcontext->__ss.__rip;
#elif defined(__aarch64__) && defined(__APPLE__)
  pc = (void*)((ucontext_t*)ucv)->uc_mcontext->__ss.__pc;
#endif
  std::string pctag;
  Dl_info di;
  if (pc && dladdr(pc, &di) && di.dli_fname) {
    char b[64];
    snprintf(b, sizeof b, "+0x%lx]", (unsigned long)((char*)pc - (char*)di.dli_fbase));
    pctag = std::string(" [pc ") + di.dli_fname + b;
  }
  Fiber* f = w->cur;
  std::string where = thread_desc(w, f);
  std::string msg;
  for (auto& g : w->L->bufs) {
    if (sig == SIGFPE) break;
    if (addr >= g.region && addr < g.region + g.region_size) {
      long long off = (long long)(addr - g.data);
      char b[320];
      if (addr >= g.data && addr < g.data + g.size)
        snprintf(b, sizeof b, "write to read-only (constant / const device) buffer(%d) at byte offset %lld (size %zu bytes)",
                 g.index, off, g.size);
      else
        snprintf(b, sizeof b, "out-of-bounds %s of buffer(%d) at byte offset %lld (buffer size %zu bytes)", rw,
                 g.index, off, g.size);
      msg = b;
      break;
    }
  }
  if (sig == SIGFPE) {
    msg = "arithmetic exception (integer division or remainder by zero, or INT_MIN / -1)";
  }
  if (msg.empty()) {
    if (addr < f->mem + kPage && addr + (64u << 20) >= f->mem) {
      char b[200];
      snprintf(b, sizeof b, "fiber stack overflow: the kernel needs more than %zu KiB of thread stack "
               "(raise launch(stack_size=...) or TORCH_MARLIN_MSLSIM_STACK)", (f->memsize - kPage) / 1024);
      msg = b;
    } else if (addr >= w->arena && addr < w->arena + kArenaSlot) {
      msg = std::string("out-of-bounds ") + rw + " of threadgroup memory";
    } else {
      char b[200];
      snprintf(b, sizeof b, "invalid memory %s at address %p (not inside any bound buffer)", rw, (void*)addr);
      msg = b;
    }
  }
  fail(w, msg + " by " + where + pctag);
  t_in_fiber = false;
  // abandon the fiber: jump back to the scheduler (never returns here)
  mslsim_ctx_switch(&f->sp, w->sched_sp);
}

int timeout_signal() {
#if defined(SIGRTMIN)
  return SIGRTMIN + 7;
#else
  return SIGUSR2;
#endif
}

void on_timeout(int, siginfo_t*, void*) {
  Worker* w = t_worker;
  if (!w || !t_in_fiber || !w->cur || !w->L->timed_out.load()) return;
  Fiber* f = w->cur;
  fail(w, "timeout: the launch did not finish within its time limit (" + thread_desc(w, f) +
              " was still running; infinite loop?)");
  t_in_fiber = false;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
}

void install_handlers();
std::mutex g_sig_mu;

// (Re)install the fault handlers if somebody replaced them since (e.g. faulthandler.enable()).
void ensure_handlers() {
  std::lock_guard<std::mutex> lk(g_sig_mu);
  struct sigaction cur;
  sigaction(SIGSEGV, nullptr, &cur);
  bool ours = (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_fault;
  if (!ours) install_handlers();
}

void install_handlers() {
  {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_timeout;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(timeout_signal(), &sa, nullptr);
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGFPE, &sa, &g_old_fpe);
}

bool setup_buffers(Launch* L, std::string& err) {
  const LaunchArgs* a = L->a;
  for (int i = 0; i < 32; ++i) L->bufptr[i] = nullptr;
  for (int i = 0; i < a->nbuf; ++i) {
    Guarded g;
    g.index = a->buf_index[i];
    g.size = a->buf_size[i];
    g.readonly = a->buf_readonly[i] != 0;
    g.user = a->buf_ptr[i];
    size_t body = (g.size + kPage - 1) / kPage * kPage;
    if (body == 0) body = kPage;
    g.region_size = kGuard + body + kGuard;
    // writable buffers go to the race-checked device pool (read-only ones cannot race)
    g.region = g.readonly || !a->check_races ? nullptr : dev_pool_alloc(g.region_size);
    g.pooled = g.region != nullptr;
    if (!g.region) {
      void* r = mmap(nullptr, g.region_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (r == MAP_FAILED) {
        err = "mmap failed for buffer(" + std::to_string(g.index) + ")";
        return false;
      }
      g.region = (char*)r;
    }
    char* bodyp = g.region + kGuard;
    mprotect(bodyp, body, PROT_READ | PROT_WRITE);
    g.data = bodyp + body - g.size;  // end of buffer abuts the upper guard
    if (g.size) memcpy(g.data, g.user, g.size);
    if (g.readonly) mprotect(bodyp, body, PROT_READ);
    L->bufptr[g.index] = g.data;
    L->bufs.push_back(g);
  }
  return true;
}

void teardown_buffers(Launch* L) {
  for (auto& g : L->bufs) {
    if (!g.readonly && g.size) memcpy(g.user, g.data, g.size);
    if (g.pooled) dev_pool_free(g.region, g.region_size);
    else munmap(g.region, g.region_size);
  }
  L->bufs.clear();
}

}  // namespace

// ------------------------------------------------------------- exported API
extern "C" {

int mslsim_launch(const LaunchArgs* a, char* errbuf, int errlen, LaunchStats* stats) {
  ensure_handlers();
  Launch L;
  L.a = a;
  L.ntg = (uint64_t)a->grid[0] * a->grid[1] * a->grid[2];
  L.stack_size = a->stack_size ? (a->stack_size + kPage - 1) / kPage * kPage : 256 * 1024;
  {
    Dl_info di;
    if (dladdr((void*)a->thunk, &di) && di.dli_fname) {
      L.lib_base = (uintptr_t)di.dli_fbase;
      L.lib_name = di.dli_fname;
    }
  }
  std::string err;
  if (!setup_buffers(&L, err)) {
    snprintf(errbuf, errlen, "%s", err.c_str());
    teardown_buffers(&L);
    return 1;
  }
  int nw = a->nworkers > 0 ? a->nworkers : 1;
  if ((uint64_t)nw > L.ntg) nw = (int)L.ntg;
  std::vector<Worker> ws(nw);
  std::vector<std::thread> th;
  for (int i = 0; i < nw; ++i) {
    Worker& w = ws[i];
    w.L = &L;
    w.altstack = (char*)malloc(256 * 1024);
  }
  for (int i = 0; i < nw; ++i) th.emplace_back(worker_main, &L, &ws[i]);
  {
    std::unique_lock<std::mutex> lk(L.done_mu);
    auto pred = [&] { return L.done == nw; };
    if (a->timeout_ms > 0) {
      if (!L.done_cv.wait_for(lk, std::chrono::milliseconds(a->timeout_ms), pred)) {
        L.timed_out = true;
        L.abort = true;
        while (!pred()) {
          for (auto& t : th) pthread_kill(t.native_handle(), timeout_signal());
          L.done_cv.wait_for(lk, std::chrono::milliseconds(50), pred);
        }
      }
    } else {
      L.done_cv.wait(lk, pred);
    }
  }
  for (auto& t : th) t.join();
  uint64_t barriers = 0;
  uint32_t tgmax = 0;
  for (auto& w : ws) {
    barriers += w.barriers;
    tgmax = std::max(tgmax, w.tg_mem_max);
    free(w.altstack);
  }
  teardown_buffers(&L);
  if (stats) {
    stats->barriers = barriers;
    stats->threadgroup_memory = tgmax;
    stats->threadgroups = L.ntg;
  }
  if (L.abort.load()) {
    std::string e = L.error.empty() ? std::string("launch aborted") : L.error;
    snprintf(errbuf, errlen, "%s", e.c_str());
    return 1;
  }
  return 0;
}

void mslsim_tg_barrier(uint32_t mem_flags, const char* file, int line) {
  t_in_fiber = false;  // not interruptible while switching
  Worker* w = t_worker;
  Fiber* f = w->cur;
  f->state = F_TG;
  f->barrier_flags = mem_flags;
  f->last_size = 0;
  f->file = file;
  f->line = line;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  t_in_fiber = true;
}

void mslsim_simd_collective(Coll* c, const char* file, int line) {
  t_in_fiber = false;  // not interruptible while switching
  Worker* w = t_worker;
  Fiber* f = w->cur;
  c->lane = f->lane;
  f->coll = c;
  f->state = F_SIMD;
  f->last_size = 0;
  f->file = file;
  f->line = line;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  t_in_fiber = true;
}

void mslsim_yield(void) {
  t_in_fiber = false;  // not interruptible while switching
  Worker* w = t_worker;
  Fiber* f = w->cur;
  f->state = F_YIELD;
  f->last_size = 0;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  t_in_fiber = true;
}

int mslsim_lane(void) { return t_worker->cur->lane; }

void mslsim_fail(const char* msg, const char* file, int line) {
  Worker* w = t_worker;
  t_in_fiber = false;
  Fiber* f = w->cur;
  std::string m = msg;
  if (file) m += " at " + fmt_site(file, line);
  fail(w, m + " (" + thread_desc(w, f) + ")");
  t_in_fiber = false;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  abort();
}

struct NoInterrupt {
  bool saved;
  NoInterrupt() : saved(t_in_fiber) { t_in_fiber = false; }
  ~NoInterrupt() { t_in_fiber = saved; }
};

void* mslsim_tg_alloc(const void* key, unsigned long size, unsigned long align, const char* file, int line) {
  Worker* w = t_worker;
  NoInterrupt guard;
  for (auto& d : w->tg_static)
    if (d.key == key) return w->arena + d.off;
  if (align < 16) align = 16;
  size_t off = (w->arena_used + align - 1) / align * align;
  size_t end = off + size;
  if (end > 32768) {
    char b[300];
    snprintf(b, sizeof b,
             "threadgroup memory over budget: %zu bytes (dynamic [[threadgroup(n)]] %zu + kernel-scope "
             "threadgroup arrays %zu) exceeds the Apple limit of 32768 bytes",
             end, w->arena_dyn, end - w->arena_dyn);
    mslsim_fail(b, file, line);
  }
  w->arena_used = end;
  if (end > w->arena_hwm) w->arena_hwm = end;
  w->tg_static.push_back(TgDecl{key, off, size, file, line});
  return w->arena + off;
}

RaceRange mslsim_race_range = {0, 0};

static std::string race_pc_tag(const Launch* L, uint32_t pc) {
  if (L->lib_name.empty()) return "";
  char b[64];
  snprintf(b, sizeof b, "+0x%lx]", (unsigned long)pc - 1);  // the call of the access hook
  return " [pc " + L->lib_name + b;
}

static std::string threadgroup_where(const Worker* w, size_t off) {
  const LaunchArgs* a = w->L->a;
  char b[200];
  size_t base = 0;
  for (int i = 0; i < 32; ++i) {
    size_t n = (a->tg_dyn_size[i] + 15) & ~(uint64_t)15;
    if (a->tg_dyn_size[i] && off >= base && off < base + n) {
      snprintf(b, sizeof b, "byte %zu of the [[threadgroup(%d)]] buffer", off - base, i);
      return b;
    }
    base += n;
  }
  for (auto& d : w->tg_static)
    if (off >= d.off && off < d.off + d.size) {
      snprintf(b, sizeof b, "byte %zu of the threadgroup variable declared at %s:%d", off - d.off,
               d.file ? d.file : "?", d.line);
      return b;
    }
  snprintf(b, sizeof b, "byte %zu of threadgroup memory", off);
  return b;
}

static std::string device_where(const Worker* w, uintptr_t addr) {
  char b[120];
  for (auto& g : w->L->bufs)
    if (addr >= (uintptr_t)g.data && addr < (uintptr_t)g.data + g.size) {
      snprintf(b, sizeof b, "byte %zu of buffer(%d)", (size_t)(addr - (uintptr_t)g.data), g.index);
      return b;
    }
  snprintf(b, sizeof b, "device memory at %p", (void*)addr);
  return b;
}

// One access being checked (for the report): who, in which memory space, where in the code.
struct RaceAccess {
  Worker* w;
  Fiber* f;
  int space;
  uint32_t pc;
  bool is_write;
};

[[noreturn]] __attribute__((noinline)) static void race_report(RaceAccess r, uintptr_t addr, Access o,
                                                               bool other_wrote) {
  Worker* w = r.w;
  Fiber* f = r.f;
  Fiber* g = &w->fibers[o.tid];
  const bool device = r.space == S_DEVICE;
  const std::string where = device ? device_where(w, addr) : threadgroup_where(w, addr - (uintptr_t)w->arena);
  const std::string flag = device ? "mem_flags::mem_device" : "mem_flags::mem_threadgroup";
  std::string kind = std::string(other_wrote ? "write" : "read") + "-" + (r.is_write ? "write" : "read");
  std::string m = std::string(device ? "device" : "threadgroup") + " memory race (" + kind + ") on " + where + ": " +
                  thread_desc(w, g) + (other_wrote ? " writes it" : " reads it") + race_pc_tag(w->L, o.pc) +
                  " and " + thread_desc(w, f) + (r.is_write ? " writes it" : " reads it") + race_pc_tag(w->L, r.pc) +
                  " in the same barrier interval; the accesses are not ordered by a threadgroup_barrier with " + flag;
  if (g->sg == f->sg) m += " or, within the simdgroup, by a simdgroup_barrier with " + flag + " or a simd collective";
  fail(w, m);
  t_in_fiber = false;
  mslsim_ctx_switch(&f->sp, w->sched_sp);
  abort();
}

// Check the current thread's access to n consecutive bytes at addr (memory space `space`) against their
// shadow cells c and record it. Ordered: the other access is by this thread, from an earlier barrier
// interval of the memory space, or by a lane of this simdgroup that has synchronised (transitively) with
// this one since, in that space.
__attribute__((always_inline)) static inline void race_check(Worker* w, int space, int is_write, void* pcp, Cell* c,
                                                             size_t n, uintptr_t addr) {
  Fiber* f = w->cur;
  const uint32_t phase = w->phase[space], tid = (uint32_t)f->tid;
  const int sg = f->sg;
  const uint32_t* vc = space_clock(f, space);
  const uint32_t pc = (uint32_t)((uintptr_t)pcp - w->L->lib_base);
  auto unordered = [=](const Access& o) {
    return o.phase == phase && o.tid != tid && ((int)o.tid / 32 != sg || vc[o.tid % 32] < o.clk);
  };
  const Access me{phase, (uint16_t)tid, 0, vc[f->lane], pc};
  for (size_t i = 0; i < n; ++i) {
    Cell& x = c[i];
    if (unordered(x.w)) race_report(RaceAccess{w, f, space, pc, is_write != 0}, addr + i, x.w, true);
    if (is_write) {
      for (const Access& o : x.r)
        if (unordered(o)) race_report(RaceAccess{w, f, space, pc, true}, addr + i, o, false);
      x.w = me;
      x.r[0].phase = x.r[1].phase = 0;
    } else if (x.r[0].phase != phase || x.r[0].tid == tid) {
      x.r[0] = me;
    } else {
      x.r[1] = me;
    }
  }
}

// The shadow cells of device-pool chunk idx for this threadgroup, or nullptr beyond the budget.
static Cell* device_chunk(DevShadow& d, size_t idx) {
  if (d.table[idx]) return d.table[idx];
  if (d.used.size() >= kDevChunksPerThreadgroup) return nullptr;
  NoInterrupt guard;  // the allocator must not be interrupted by the timeout signal
  Cell* c;
  if (!d.spare.empty()) {
    c = d.spare.back();
    d.spare.pop_back();
  } else {
    c = (Cell*)calloc(kDevChunk, sizeof(Cell));
    if (!c) return nullptr;
  }
  d.table[idx] = c;
  d.used.push_back((uint32_t)idx);
  return c;
}

// The bytes were this thread's last access (a write, or a read now read again) and no other thread has run
// since: the check would find and record nothing new (at most a newer code address of the same thread).
static inline bool repeats_last_access(Fiber* f, uintptr_t addr, unsigned long size, int is_write) {
  return addr >= f->last_addr && addr + size <= f->last_addr + f->last_size && (!is_write || f->last_write);
}

static inline void remember_access(Fiber* f, uintptr_t addr, unsigned long size, int is_write) {
  f->last_addr = addr;
  f->last_size = size;
  f->last_write = is_write != 0;
}

// An access to a writable device buffer: checked against the other threads of this threadgroup only.
static void device_race_access(uintptr_t addr, unsigned long size, int is_write, void* pcp) {
  Worker* w = t_worker;
  if (!w || !w->race || !w->cur || repeats_last_access(w->cur, addr, size, is_write)) return;
  const size_t off = addr - (uintptr_t)g_dev_pool;
  for (unsigned long i = 0; i < size;) {
    const size_t idx = (off + i) / kDevChunk, in = (off + i) % kDevChunk;
    const size_t n = std::min<size_t>(size - i, kDevChunk - in);
    Cell* c = device_chunk(*w->dev, idx);
    if (!c) return;
    race_check(w, S_DEVICE, is_write, pcp, c + in, n, addr + i);
    i += n;
  }
  remember_access(w->cur, addr, size, is_write);
}

// Called by the kernel library for every access to the race-checked pool (before the access happens).
void mslsim_race_access(uintptr_t addr, unsigned long size, int is_write, void* pcp) {
  if (addr >= (uintptr_t)g_dev_pool) {
    device_race_access(addr, size, is_write, pcp);
    return;
  }
  // threadgroup memory: the arena's owner (cheaper than the thread-local t_worker); only its fibers use it
  const size_t slot = (addr - (uintptr_t)g_pool) / kArenaSlot;
  Worker* w = slot < (size_t)kPoolSlots ? g_slots[slot].owner : nullptr;
  if (!w || !w->race || !w->cur || repeats_last_access(w->cur, addr, size, is_write)) return;
  size_t off = addr - (uintptr_t)w->arena;
  if (off >= kArenaUse) return;  // beyond Apple's limit (reported as over budget)
  if (off + size > kArenaUse) size = kArenaUse - off;
  race_check(w, S_THREADGROUP, is_write, pcp, w->shadow + off, size, addr);
  remember_access(w->cur, addr, size, is_write);
}

int mslsim_abi_version(void) { return MSLSIM_ABI_VERSION; }

}  // extern "C"
