// Threads that stay awake through one decode step (step_pool.cpp).
//
// A decode step of a small model is ~200 short parallel loops of 10-100 us each. torch's OpenMP
// threads sleep between loops under OMP_WAIT_POLICY=PASSIVE (which 2-core machines need, or idle
// spinning threads starve everything else), and waking them costs about as much as the loop saves:
// two threads decoded no faster than one. Inside an AwakeScope the pool's workers spin between
// loops instead, so a loop is handed out in about a microsecond; when the scope ends they sleep
// again, so an idle server burns no CPU.
#pragma once

#include <cstdint>
#include <functional>

namespace step_pool {

// Runs body(begin, end) over [0, n) cut into at most as many contiguous ranges as torch has
// threads, none shorter than `grain` (the last may be). On the pool's workers while this thread
// holds an AwakeScope, else through at::parallel_for if `worth_waking` (enough work to pay for
// waking sleeping threads, ~10-20 us each), else on this thread alone. Which thread runs a range
// never changes what it computes: callers split only over independent outputs.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body,
                  bool worth_waking = true);

// Runs task(i) for every i in [0, n), each task claimed on its own by whichever thread is free, so
// tasks of unequal cost balance across threads (list the costliest first). Otherwise as parallel_for.
void parallel_tasks(int64_t n, const std::function<void(int64_t)>& task, bool worth_waking = true);

// Multiply-adds from which a loop pays for waking OpenMP's sleeping threads (measured on a 2-core
// AMD EPYC: a 576x576 int4 matmul of one row, 0.3M, ran 30 us alone and 42 us woken on two).
constexpr int64_t kWorthWakingMacs = int64_t(1) << 22;

// Loops this process has handed to the pool's workers (benches and tests: did the pool run?).
int64_t loops_run();

// While alive, parallel_for on this thread runs on the spinning workers. One thread at a time holds
// the pool: a scope opened while another thread holds it is inactive (its loops go to OpenMP).
class AwakeScope {
 public:
  AwakeScope();
  ~AwakeScope();
  AwakeScope(const AwakeScope&) = delete;
  AwakeScope& operator=(const AwakeScope&) = delete;

 private:
  bool active_;
};

}  // namespace step_pool
