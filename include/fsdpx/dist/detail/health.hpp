// Shared "is this communicator still usable" state. After a timeout or backend error the peers can
// no longer agree on which collectives completed, so every later call fails fast with the first cause.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

class CommHealth {
 public:
  /// Records the first failure; later ones are ignored (the first is the cause).
  void mark_broken(const std::string& cause) {
    std::lock_guard lock(mutex_);
    if (!broken_.load()) {
      cause_ = cause;
      broken_.store(true);
    }
  }
  bool broken() const { return broken_.load(); }
  std::string cause() const {
    std::lock_guard lock(mutex_);
    return cause_;
  }
  /// Throws CommError naming the operation and the original cause when the communicator is broken.
  template <class Context>
  void check(const Context& context) const {
    if (broken_.load()) [[unlikely]] {
      throw CommError(
          str("fsdpx: ", context, " refused: the communicator is unusable after an earlier failure: ", cause()));
    }
  }

 private:
  std::atomic<bool> broken_{false};
  mutable std::mutex mutex_;
  std::string cause_;
};

}  // namespace fsdpx::dist::detail
