// Checkpoint-based weight sync: a rollout process follows a checkpoint root that a trainer writes with
// fsdpx::CheckpointCoordinator, and loads the newest committed weights (the model shards merged into
// whole tensors, checksums verified). No connection to the trainer is needed: only the file system.
//
//   fsdpx::sync::CheckpointWatcher watcher("/ckpt", {.poll_interval = std::chrono::milliseconds(200),
//                                                    .timeout = std::chrono::minutes(5)});
//   int64_t have = fsdpx::sync::no_version;
//   for (...) {
//     if (auto w = watcher.poll()) { w->load_into(*rollout); have = w->step; }   // non-blocking
//     // or: auto w = watcher.wait_newer(have);                                  // blocks, SyncError on timeout
//     generate(rollout);
//   }
//
// The reading protocol, for every attempt:
//   1. read latest_state_dict_iteration.txt (the trainer advances it only after a step's weights are
//      committed, atomically and never backwards); a step not newer than the last one returned is
//      ignored, so versions never go backwards even if the file is rewritten with a smaller number;
//   2. lease the step (checkpoint::CheckpointLease), so that rotation cannot delete it mid-read; a
//      step that is already gone cannot be leased;
//   3. check its commit record (fsdp_config.json) commits the weights;
//   4. merge its model shards (checkpoint::merge_checkpoint, every file's size and CRC-32C checked
//      against the commit record), and check that no model file was replaced while it was read
//      (inode, size and modification time, before and after).
// When 2-4 fail (a file replaced, truncated or rotated away meanwhile) and the iteration file has
// moved on, the newer step is tried at once; otherwise the failure is remembered, the attempt
// returns nothing, and wait_newer keeps waiting (the failure is part of its timeout error). A step
// whose commit record is missing, or does not list the model, is never read.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/load.hpp>

namespace fsdpx::sync {

struct WatcherOptions {
  /// How often wait_newer looks at the iteration file.
  std::chrono::milliseconds poll_interval{200};
  /// How long wait_newer(version) waits before its SyncError (the overload with a timeout overrides it).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Cast floating-point tensors to this dtype on loading (e.g. at::kBFloat16 for the rollout);
  /// default: as saved (the float32 master weights).
  std::optional<at::ScalarType> dtype;
  /// Observes each attempt (tests, tracing): stage "chosen" after the iteration file named `step`,
  /// before its lease; "leased" after the lease and the commit record were checked, before any
  /// model file is read.
  std::function<void(std::string_view stage, int64_t step)> on_stage;
};

namespace detail {

/// Identity of a file's content as far as the file system tells: a rename over it changes the inode,
/// a write or truncation in place the size or the modification time.
struct FileStamp {
  std::string name;
  uint64_t device = 0, inode = 0;
  int64_t size = 0, mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};

/// The model shard files of a step directory (and its commit record, with `with_record`), by name;
/// empty when the directory is gone.
FSDPX_DECL std::vector<FileStamp> stamp_model_files(const std::filesystem::path& dir, bool with_record = false);

}  // namespace detail

/// Follows a checkpoint root's latest_state_dict_iteration.txt. Not thread-safe: one watcher per thread.
class CheckpointWatcher {
 public:
  explicit CheckpointWatcher(std::filesystem::path root, WatcherOptions options = {})
      : root_(std::move(root)), options_(std::move(options)) {
    FSDPX_CHECK(options_.poll_interval.count() > 0, "CheckpointWatcher: poll_interval must be positive");
  }

  /// Non-blocking: the weights of the newest committed step if it is newer than the last step
  /// returned, else std::nullopt (nothing new yet, or the newest step could not be read: see
  /// last_error()). Does not wait for a step to appear; reading one takes the time of its merge.
  std::optional<WeightVersion> poll() { return try_load(last_returned_); }

  /// Waits for a committed step newer than `version` (no_version: any) and returns its weights (the
  /// newest one at that moment: steps in between are skipped). Never a step older than the last one
  /// returned. After `timeout` a SyncError naming the root, the last step seen and the last failure.
  FSDPX_DECL WeightVersion wait_newer(int64_t version, std::chrono::milliseconds timeout);
  WeightVersion wait_newer(int64_t version) { return wait_newer(version, options_.timeout); }

  /// The newest committed step newer than the one returned last, into `module`'s parameters and buffers
  /// by name, waiting up to `wait`; returns the step (the receivers' verb: sync::Receiver). Names and
  /// shapes are checked before anything is copied (a mismatch leaves the module as it was).
  FSDPX_DECL int64_t load_newer_into(torch::nn::Module& module, std::chrono::milliseconds wait);
  /// "Does `module` hold the step loaded last by load_newer_into, exactly?": each tensor's CRC-32C as read.
  FSDPX_DECL void verify(torch::nn::Module& module) const;

  /// The step of the last weights returned (no_version before the first).
  int64_t last_version() const { return last_returned_; }
  int64_t last_step() const { return last_returned_; }
  /// A checkpoint is read whole: never a delta.
  bool last_was_delta() const { return false; }
  /// The newest step the iteration file was seen to name (no_version when none).
  int64_t newest_step_seen() const { return newest_seen_; }
  /// Why the last failed attempt to read a step failed; cleared when a step is returned.
  const std::string& last_error() const { return last_error_; }
  const std::filesystem::path& root() const { return root_; }

 private:
  // A step newer than `after` and not older than the last one returned, or nothing.
  FSDPX_DECL std::optional<WeightVersion> try_load(int64_t after);

  FSDPX_DECL WeightVersion load(int64_t step, const std::filesystem::path& dir);

  std::filesystem::path root_;
  WatcherOptions options_;
  int64_t last_returned_ = no_version;
  int64_t newest_seen_ = no_version;
  std::optional<int64_t> latest_seen_;
  std::string last_error_;
  int64_t failed_step_ = no_version;
  std::vector<detail::FileStamp> failed_stamps_;
  std::shared_ptr<const Manifest> loaded_manifest_;  // of the step load_newer_into loaded last
};
static_assert(Receiver<CheckpointWatcher>);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/watcher.ipp>
#endif
