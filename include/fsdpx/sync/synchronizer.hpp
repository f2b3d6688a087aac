// The in-memory hand-off: trainer rank 0 publishes full weights under a version (the training step);
// readers wait for a version newer than the one they hold.
//
//   fsdpx::sync::Synchronizer sync;
//   // trainer (every trainer rank gathers; rank 0 publishes):
//   auto weights = fsdpx::sync::gather_full_state_dict(model, rank == 0, {.dtype = at::kBFloat16});
//   if (rank == 0) sync.publish(step, std::move(weights));
//   // a rollout thread:
//   auto snapshot = sync.wait_newer(have, std::chrono::seconds(30));   // shared, immutable
//   fsdpx::sync::load_into(*rollout_model, snapshot->tensors);
//   have = snapshot->version;
//
// Guarantees: versions only increase (publishing an older or equal one is an error); a reader gets
// either the whole of one published version or an error, never a mixture, because a version becomes
// visible in one step, as one immutable shared snapshot, after it is complete. Readers asking for a
// version newer than theirs always get the newest one (a late reader skips the ones it missed).
// Across processes, fsdpx/sync/service.hpp serves the same guarantees over TCP.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/bucket.hpp>

namespace fsdpx::sync {
namespace detail {

/// The newest version of an immutable T, with waiting. Shared by the in-process Synchronizer and the
/// TCP server (which keeps encoded snapshots).
template <class T>
class VersionedSlot {
 public:
  /// Makes `value` the newest version; `version` must exceed every earlier one.
  void publish(int64_t version, std::shared_ptr<const T> value) {
    {
      std::lock_guard lock(mutex_);
      FSDPX_CHECK_AS(SyncError, !closed_, "cannot publish version ", version, ": the synchronizer is closed (",
                     close_reason_, ")");
      FSDPX_CHECK_AS(SyncError, version > version_, "cannot publish version ", version,
                     ": it is not newer than the latest published version, ", version_,
                     " (versions never go backwards)");
      version_ = version;
      value_ = std::move(value);
    }
    cv_.notify_all();
  }

  /// Makes `value` the newest version whatever its number: the TCP server's new trainer run taking
  /// over from the previous run's versions (it decides when; in-process versions only increase).
  void replace(int64_t version, std::shared_ptr<const T> value) {
    {
      std::lock_guard lock(mutex_);
      FSDPX_CHECK_AS(SyncError, !closed_, "cannot publish version ", version, ": the synchronizer is closed (",
                     close_reason_, ")");
      version_ = version;
      value_ = std::move(value);
    }
    cv_.notify_all();
  }

  int64_t version() const {
    std::lock_guard lock(mutex_);
    return version_;
  }
  std::pair<int64_t, std::shared_ptr<const T>> latest() const {
    std::lock_guard lock(mutex_);
    return {version_, value_};
  }

  /// The newest version if it is newer than `have`; waits up to `timeout` for one. Throws SyncError
  /// on timeout or when the slot is closed.
  std::pair<int64_t, std::shared_ptr<const T>> wait_newer(int64_t have, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mutex_);
    const bool ready = cv_.wait_until(lock, dist::deadline_after(timeout), [&] { return version_ > have || closed_; });
    if (version_ > have) return {version_, value_};
    FSDPX_CHECK_AS(SyncError, !closed_, "waiting for a weight version newer than ", have,
                   ": the synchronizer was closed (", close_reason_, ")");
    FSDPX_CHECK_AS(SyncError, ready, "no weight version newer than ", have, " was published within ",
                   timeout.count(), " ms (latest: ", version_, "); the trainer may be slow, stopped or dead");
    return {version_, value_};
  }

  /// Wakes every waiter with an error; later publishes fail. Versions already published stay readable.
  void close(std::string reason) {
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
      close_reason_ = std::move(reason);
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  int64_t version_ = no_version;
  std::shared_ptr<const T> value_;
  bool closed_ = false;
  std::string close_reason_;
};

}  // namespace detail

class Synchronizer {
 public:
  /// Publishes `tensors` as `version`. The synchronizer takes them as they are, without copying: the
  /// caller must not modify them afterwards (gather_full_state_dict returns fresh tensors).
  FSDPX_DECL void publish(int64_t version, std::vector<NamedTensor> tensors);

  /// The newest snapshot, or nullptr before the first publish.
  std::shared_ptr<const WeightSnapshot> latest() const { return slot_.latest().second; }
  int64_t latest_version() const { return slot_.version(); }

  /// The newest snapshot once its version exceeds `have` (no_version: any); SyncError after `timeout`.
  std::shared_ptr<const WeightSnapshot> wait_newer(int64_t have, std::chrono::milliseconds timeout) const {
    return slot_.wait_newer(have, timeout).second;
  }

  /// Ends the hand-off: waiting and later readers that need a newer version get a SyncError with `reason`.
  void close(std::string reason = "closed by its owner") { slot_.close(std::move(reason)); }

 private:
  detail::VersionedSlot<WeightSnapshot> slot_;
};

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/synchronizer.ipp>
#endif
