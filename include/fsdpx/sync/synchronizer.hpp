// The in-memory hand-off: trainer rank 0 publishes full weights under a version (the training step);
// readers wait for a version newer than the one they hold.
//
//   fsdpx::sync::Synchronizer sync;
//   // trainer (every trainer rank gathers; rank 0 publishes):
//   auto weights = fsdpx::sync::gather_full_state_dict(model, rank == 0, {.dtype = at::kBFloat16});
//   if (rank == 0) sync.publish(step, std::move(weights));
//   // a rollout thread, into its module (only what changed is written once the module holds a version):
//   fsdpx::sync::SynchronizerReader reader(sync);
//   const int64_t version = reader.load_newer_into(*rollout_model, std::chrono::seconds(30));
//   // or the shared, immutable snapshot itself:
//   auto snapshot = sync.wait_newer(have, std::chrono::seconds(30));
//   fsdpx::sync::verify(snapshot->tensors, *snapshot->manifest);   // proof: CRC-32C per tensor
//
// Guarantees: versions only increase (publishing an older or equal one is an error); a reader gets
// either the whole of one published version or an error, never a mixture, because a version becomes
// visible in one step, as one immutable shared snapshot, after it is complete. Readers asking for a
// version newer than theirs always get the newest one (a late reader skips the ones it missed).
// Every version carries its manifest (each tensor's CRC-32C). Host tensors published in a row with the
// same names, dtypes and shapes are also cut into a delta against the version before (sync/delta.hpp):
// a SynchronizerReader whose module holds that version writes only the changed elements, checked
// against the manifest; any other reader loads the version whole. Across processes,
// fsdpx/sync/service.hpp serves the same guarantees over TCP.
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
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/held_version.hpp>

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
    FSDPX_CHECK_AS(SyncError, ready, "no weight version newer than ", have, " was published within ", timeout.count(),
                   " ms (latest: ", version_, "); the trainer may be slow, stopped or dead");
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

struct SynchronizerOptions {
  /// How each version is cut against the one before it, for readers whose module holds that one
  /// (SynchronizerReader). Deltas are cut between host tensors (contiguous, in place); device tensors
  /// are handed over whole. enabled = false: every version whole.
  DeltaOptions delta;
};

class Synchronizer {
 public:
  explicit Synchronizer(SynchronizerOptions options = {}) : options_(options) {}

  /// Publishes `tensors` as `version`. The synchronizer takes them as they are, without copying: the
  /// caller must not modify them afterwards (gather_full_state_dict returns fresh tensors). Computes
  /// the version's manifest (a CRC-32C per tensor: device tensors are read through a host copy) and,
  /// with deltas on, the delta from the version before (a pass comparing the two), before it becomes
  /// visible.
  FSDPX_DECL void publish(int64_t version, std::vector<NamedTensor> tensors);

  /// The newest snapshot, or nullptr before the first publish.
  std::shared_ptr<const WeightVersion> latest() const { return snapshot_of(slot_.latest().second); }
  int64_t latest_version() const { return slot_.version(); }

  /// The newest snapshot once its version exceeds `have` (no_version: any); SyncError after `timeout`.
  std::shared_ptr<const WeightVersion> wait_newer(int64_t have, std::chrono::milliseconds timeout) const {
    return snapshot_of(slot_.wait_newer(have, timeout).second);
  }

  /// Ends the hand-off: waiting and later readers that need a newer version get a SyncError with `reason`.
  void close(std::string reason = "closed by its owner") { slot_.close(std::move(reason)); }

 private:
  friend class SynchronizerReader;
  /// A version as readers get it: the snapshot, and the delta from the version before (empty: none).
  struct Published {
    WeightVersion snapshot;
    std::vector<NamedTensor> delta;  // as it would travel: its manifest first
  };
  static std::shared_ptr<const WeightVersion> snapshot_of(const std::shared_ptr<const Published>& p) {
    return p ? std::shared_ptr<const WeightVersion>(p, &p->snapshot) : nullptr;
  }

  SynchronizerOptions options_;
  detail::VersionedSlot<Published> slot_;
  std::mutex publish_mutex_;   // one publish at a time: the delta base is the version before
  detail::VersionStore base_;  // the newest version's tensors (aliases), when they can be a delta's base
};

/// One rollout's reader of a Synchronizer: loads each newer version into a module, in place. Once the
/// module holds a version, the next one's delta lands in it (only changed elements are written); every
/// written tensor is checked against the version's CRC-32C, and on any failure the module keeps its
/// previous weights, bit for bit. Not thread-safe: one reader per rollout thread.
class SynchronizerReader {
 public:
  explicit SynchronizerReader(const Synchronizer& source) : source_(&source) {}

  /// The newest version once it is newer than the one this reader loaded last, into `module`'s
  /// parameters and buffers by name; SyncError after `timeout`. Returns the version.
  FSDPX_DECL int64_t load_newer_into(torch::nn::Module& module, std::chrono::milliseconds timeout);

  /// "Does `module` hold the version loaded last, exactly?": every tensor's CRC-32C against its manifest.
  void verify(torch::nn::Module& module) const { held_.verify(module); }
  int64_t last_version() const { return last_version_; }
  /// Whether the last load applied a delta (else it copied the whole version).
  bool last_was_delta() const { return last_was_delta_; }

 private:
  const Synchronizer* source_;
  detail::HeldVersion held_;
  int64_t last_version_ = no_version;
  bool last_was_delta_ = false;
};
static_assert(Receiver<SynchronizerReader>);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/synchronizer.ipp>
#endif
