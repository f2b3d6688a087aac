// Work: the handle an asynchronous collective returns.
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
  /// Blocks (or, on a device backend, orders the caller's stream) until the operation is done;
  /// rethrows its error. Idempotent.
  virtual void wait() = 0;
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
  void wait() override {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
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

  /// Waits for completion and rethrows the collective's error (fsdpx::TimeoutError, fsdpx::CommError).
  void wait() const {
    if (state_) state_->wait();
  }
  bool is_completed() const { return !state_ || state_->is_completed(); }

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace fsdpx::dist
