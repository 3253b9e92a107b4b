// Threads that stay awake through one decode step: see step_pool.h for why.
//
// A loop is published as one atomic ticket (generation, ranges, next range). Every thread, the
// caller included, claims ranges by compare-and-swap on it until none are left, so a worker that
// the OS has not scheduled yet never holds the step up: the caller runs its range instead. The
// caller writes the loop's body before publishing the ticket and waits for every claimed range to
// finish before it returns, so a claim always sees the body of its own generation.
#include "step_pool.h"

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace step_pool {
namespace {

// pause is ~3 cycles on Zen 1, ~140 on recent Intel cores: a few to a few hundred microseconds of
// spinning, then each check yields to a thread the OS queued on this core
constexpr int kSpinsBeforeYield = 4096;

inline uint64_t generation_of(uint64_t ticket) { return ticket >> 32; }
inline uint64_t ticket_for(uint64_t generation, uint64_t ranges, uint64_t next) {
  return generation << 32 | ranges << 16 | next;
}

// Set while this thread runs a range: a parallel_for inside one runs on this thread alone (a
// nested loop would publish a new ticket while the outer loop's ranges are still out).
thread_local bool in_loop = false;

inline void relax(int& spins) {
  if (++spins < kSpinsBeforeYield) _mm_pause();
  else sched_yield();
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& thread : threads_) thread.join();
  }

  int threads() const { return int(threads_.size()) + 1; }

  void set_awake(bool awake) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      awake_.store(awake, std::memory_order_relaxed);
    }
    if (awake) wake_.notify_all();
  }

  void run(int64_t n, int64_t ranges, const std::function<void(int64_t, int64_t)>& body) {
    body_ = &body;
    n_ = n;
    ranges_ = ranges;
    error_ = nullptr;
    remaining_.store(ranges, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & 0xFFFFFFFF;  // the ticket keeps 32 bits of it
    const uint64_t generation = generation_;
    ticket_.store(ticket_for(generation, ranges, 0), std::memory_order_release);
    while (run_one(generation)) {
    }
    int spins = 0;
    while (remaining_.load(std::memory_order_acquire) != 0) relax(spins);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Claims and runs one range of `generation`'s loop; false when none is left to claim.
  bool run_one(uint64_t generation) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    int64_t range;
    do {
      range = int64_t(ticket & 0xFFFF);
      if (generation_of(ticket) != generation || range >= int64_t((ticket >> 16) & 0xFFFF)) return false;
    } while (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel));
    in_loop = true;
    try {
      (*body_)(range * n_ / ranges_, (range + 1) * n_ / ranges_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_loop = false;
    remaining_.fetch_sub(1, std::memory_order_release);
    return true;
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      int spins = 0;
      for (;;) {
        const uint64_t ticket = ticket_.load(std::memory_order_acquire);
        if (generation_of(ticket) != seen) {
          seen = generation_of(ticket);
          break;
        }
        if (awake_.load(std::memory_order_relaxed)) {
          relax(spins);
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] {
          return stopping_ || awake_.load(std::memory_order_relaxed) ||
                 generation_of(ticket_.load(std::memory_order_acquire)) != seen;
        });
        if (stopping_) return;
      }
      while (run_one(seen)) {
      }
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> remaining_{0};
  std::atomic<bool> awake_{false};
  uint64_t generation_ = 0;  // written by the caller only; 32 bits, as in the ticket
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0, ranges_ = 1;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
};

// The pool and who holds it. After fork() the child has none of the parent's worker threads: it
// forgets the parent's pool (leaked, never touched again) and makes its own on first use.
Pool* pool = nullptr;
std::atomic<bool> held{false};
std::atomic<int64_t> loops{0};
thread_local bool holding = false;

void forget_after_fork() {
  pool = nullptr;
  held.store(false);
  holding = false;
}

Pool& pool_with(int threads) {
  static const bool registered = pthread_atfork(nullptr, nullptr, forget_after_fork) == 0;
  (void)registered;
  if (pool == nullptr || pool->threads() != threads) {
    delete pool;  // its workers are asleep or spinning: nothing of theirs is in flight
    pool = new Pool(std::max(threads - 1, 0));
  }
  return *pool;
}

}  // namespace

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body, bool worth_waking) {
  if (n <= 0) return;
  if (in_loop) {
    body(0, n);
    return;
  }
  if (!holding) {
    if (worth_waking) at::parallel_for(0, n, grain, body);
    else body(0, n);
    return;
  }
  const int64_t ranges = std::min<int64_t>({int64_t(pool->threads()), (n + grain - 1) / std::max<int64_t>(grain, 1), 0xFFFF});
  if (ranges <= 1) {
    body(0, n);
    return;
  }
  loops.fetch_add(1, std::memory_order_relaxed);
  pool->run(n, ranges, body);
}

void parallel_tasks(int64_t n, const std::function<void(int64_t)>& task, bool worth_waking) {
  const auto run_range = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) task(i);
  };
  if (n <= 0) return;
  if (in_loop || (!holding && !worth_waking) || n == 1) return run_range(0, n);
  if (!holding) return at::parallel_for(0, n, 1, run_range);
  loops.fetch_add(1, std::memory_order_relaxed);
  pool->run(n, std::min<int64_t>(n, 0xFFFF), run_range);  // one range a task: claimed one by one
}

int64_t loops_run() { return loops.load(std::memory_order_relaxed); }

AwakeScope::AwakeScope() : active_(false) {
  static const bool enabled = std::getenv("DFLASH_STEP_POOL") == nullptr || std::string(std::getenv("DFLASH_STEP_POOL")) != "0";
  const int threads = at::get_num_threads();
  if (!enabled || threads < 2 || holding) return;
  bool expected = false;
  if (!held.compare_exchange_strong(expected, true)) return;
  pool_with(threads).set_awake(true);
  holding = active_ = true;
}

AwakeScope::~AwakeScope() {
  if (!active_) return;
  pool->set_awake(false);
  holding = false;
  held.store(false);
}

}  // namespace step_pool
