// Work: the handle an asynchronous collective returns.
//
// Two waits, because the backends differ and callers must say which they need:
//   wait_stream()  the result is ready for work the calling thread issues next on its current stream of
//                  the collective's device (NCCL: that stream waits on the collective's event; the host
//                  does not block). For results consumed by kernels: unsharded parameters, gradients
//                  reduced further, buffers reused by the device.
//   wait_host()    the host blocks until the collective has finished. For results the host reads or
//                  frees itself, and for teardown after an error.
// On the host backend (MPI) both block. Both rethrow the collective's error (TimeoutError, CommError).
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

namespace fsdpx::dist {
namespace detail {

/// What a backend implements behind a Work handle.
class WorkState {
 public:
  virtual ~WorkState() = default;
  /// Orders the caller's current stream after the operation (a host backend blocks); rethrows its
  /// error. Idempotent.
  virtual void wait_stream() = 0;
  /// Blocks the host until the operation is done; rethrows its error. Idempotent.
  virtual void wait_host() = 0;
  /// True once the result may be read without waiting.
  virtual bool is_completed() = 0;
};

/// A WorkState completed from another host thread (the MPI progress engine, a thread pool).
class HostWorkState final : public WorkState {
 public:
  void set_done(std::exception_ptr error = nullptr) {
    {
      std::lock_guard lock(mutex_);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }
  void wait_host() override {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  void wait_stream() override { wait_host(); }  // no device stream: the host's order is the only one
  bool is_completed() override {
    std::lock_guard lock(mutex_);
    return done_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace detail

/// Handle to an asynchronous collective. A default-constructed Work is already complete.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  /// Makes the result ready for what the caller issues next on its current stream (see the top of
  /// this file); rethrows the collective's error (fsdpx::TimeoutError, fsdpx::CommError).
  void wait_stream() const {
    if (state_) state_->wait_stream();
  }
  /// Blocks the host until the collective is done; rethrows its error.
  void wait_host() const {
    if (state_) state_->wait_host();
  }
  bool is_completed() const { return !state_ || state_->is_completed(); }

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace fsdpx::dist
