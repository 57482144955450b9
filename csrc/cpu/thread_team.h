// A team of threads that runs one job at a time on all of them, for the decode
// engine (csrc/cpu/decode_engine.cpp): as llama.cpp runs a token, the caller and
// persistent workers go through the token's phases together and meet at
// spinning barriers between them, instead of a fork and join of torch's thread
// pool per phase (about 20 per token). Waiting spins with a pause instruction
// for a bounded time; then a barrier yields the core, and a worker with no job
// sleeps, so an idle team does not hold a core.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace marlin {
namespace cpu {

class ThreadTeam {
 public:
  // The caller of run() and threads - 1 workers started here.
  explicit ThreadTeam(int threads) : threads_(threads) {
    try {
      for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
    } catch (...) {  // no thread left running (or unjoined) when one cannot start
      stop();
      throw;
    }
  }
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;
  ~ThreadTeam() { stop(); }

  int size() const { return threads_; }

  // job(t) on every thread t (the caller is 0); returns when all have returned.
  // job must not throw.
  void run(const std::function<void(int)>& job) {
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    start_job();
    job(0);
    spin_until([&] { return done_.load(std::memory_order_acquire) == threads_ - 1; }, false);
  }

  // Within a job: returns once every thread of the team has called it (as often).
  void barrier() {
    if (threads_ == 1) return;
    const uint32_t round = round_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      round_.store(round + 1, std::memory_order_release);
      return;
    }
    spin_until([&] { return round_.load(std::memory_order_acquire) != round; }, false);
  }

 private:
  // How long a waiting thread spins before it yields (kBarrierSpin: longer than a
  // token's usual imbalance between threads, short enough that a thread sharing its
  // core with the one it waits for, on a busy machine, gives it the core soon) or
  // before a worker sleeps between jobs (kJobSpin: longer than the caller's usual
  // time between two tokens, so that wake-ups stay rare).
  static constexpr std::chrono::microseconds kBarrierSpin{50}, kJobSpin{500};

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Spins on done() for kBarrierSpin, then yields the core between checks; or
  // (sleep) spins for kJobSpin, then returns false to let the caller sleep.
  template <class Done>
  static bool spin_until(Done&& done, bool sleep) {
    const auto spin = sleep ? kJobSpin : kBarrierSpin;
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t i = 1;; ++i) {
      if (done()) return true;
      if (i % 256 != 0) {
        pause();
      } else if (std::chrono::steady_clock::now() - start > spin) {
        if (sleep) return false;
        std::this_thread::yield();
        i = 255;  // check the clock no more: yield between checks from now on
      }
    }
  }

  void stop() {
    stop_.store(true, std::memory_order_relaxed);
    start_job();
    for (std::thread& w : workers_) w.join();
  }

  void start_job() {
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      // A worker that counted itself a sleeper either saw the new epoch or waits on cv_.
      { std::lock_guard<std::mutex> lock(mutex_); }
      cv_.notify_all();
    }
  }

  void work(int t) {
    uint64_t seen = 0;
    for (;;) {
      auto started = [&] { return epoch_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(started, true)) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) return;
      (*job_)(t);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint64_t> epoch_{0};  // one more per job (and to stop)
  alignas(64) std::atomic<int> done_{0};        // workers done with the job
  alignas(64) std::atomic<int> arrived_{0};     // threads at the current barrier
  alignas(64) std::atomic<uint32_t> round_{0};  // barriers passed
  std::atomic<int> sleepers_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
};

}  // namespace cpu
}  // namespace marlin
