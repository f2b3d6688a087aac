// The checkpoint coordinator's threads: a fixed pool that runs posted tasks, now or after a delay.
// Boost.Asio's thread_pool behind a small interface, so that a translation unit using the coordinator
// compiles no Asio under FSDPX_SEPARATE_COMPILATION (checkpoint/impl/worker_pool.ipp).
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include <fsdpx/detail/config.hpp>

namespace fsdpx::checkpoint::detail {

struct WorkerPoolState;

class WorkerPool {
 public:
  /// Starts `threads` (at least 1) threads.
  FSDPX_DECL explicit WorkerPool(int threads);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  /// Joins: the tasks posted so far run first.
  FSDPX_DECL ~WorkerPool();

  /// Runs `task` on one of the threads. A task must not throw: one that does ends the process with its
  /// message (a checkpoint whose write was lost half-way must not be committed by the rest).
  FSDPX_DECL void post(std::function<void()> task);
  /// Runs `task` on one of the threads once `delay` has passed.
  FSDPX_DECL void post_after(std::chrono::milliseconds delay, std::function<void()> task);
  /// Waits until every task posted has run, and the threads have ended.
  FSDPX_DECL void join();

 private:
  std::unique_ptr<WorkerPoolState> state_;
};

}  // namespace fsdpx::checkpoint::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/worker_pool.ipp>
#endif
