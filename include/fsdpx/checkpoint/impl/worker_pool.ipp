// WorkerPool over Boost.Asio's thread_pool. Included by checkpoint/detail/worker_pool.hpp (header-only)
// or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#if !defined(FSDPX_WITH_BOOST)
#error \
    "fsdpx's checkpoint coordinator needs Boost.Asio: install Boost (Debian: libboost-dev) and build with FSDPX_WITH_BOOST (fsdpx's CMake package sets it when Boost is found)"
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>

#include <fsdpx/checkpoint/detail/worker_pool.hpp>

namespace fsdpx::checkpoint::detail {

struct WorkerPoolState {
  explicit WorkerPoolState(int threads) : pool(static_cast<size_t>(std::max(1, threads))) {}
  boost::asio::thread_pool pool;

  /// The task, with an escaped exception made loud: it ends the process naming itself.
  static void run(const std::function<void()>& task) noexcept {
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fsdpx: internal error: a checkpoint task threw (%s); aborting\n", e.what());
      std::abort();
    } catch (...) {
      std::fprintf(stderr, "fsdpx: internal error: a checkpoint task threw; aborting\n");
      std::abort();
    }
  }
};

FSDPX_DECL WorkerPool::WorkerPool(int threads) : state_(std::make_unique<WorkerPoolState>(threads)) {}

FSDPX_DECL WorkerPool::~WorkerPool() { join(); }

FSDPX_DECL void WorkerPool::post(std::function<void()> task) {
  boost::asio::post(state_->pool, [task = std::move(task)] { WorkerPoolState::run(task); });
}

FSDPX_DECL void WorkerPool::post_after(std::chrono::milliseconds delay, std::function<void()> task) {
  auto timer = std::make_shared<boost::asio::steady_timer>(state_->pool, delay);
  timer->async_wait([timer, task = std::move(task)](const boost::system::error_code&) { WorkerPoolState::run(task); });
}

FSDPX_DECL void WorkerPool::join() { state_->pool.join(); }

}  // namespace fsdpx::checkpoint::detail
