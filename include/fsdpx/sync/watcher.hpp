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

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/bucket.hpp>

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

/// One committed step's weights, whole, in name order.
struct WeightVersion {
  int64_t step = no_version;
  std::vector<NamedTensor> tensors;

  /// The tensor named `name`; a SyncError naming it when absent.
  const at::Tensor& at(std::string_view name) const {
    for (const auto& t : tensors) {
      if (t.name == name) return t.tensor;
    }
    throw SyncError(::fsdpx::detail::str("fsdpx: the weights of step ", step, " have no tensor '", name, "'"));
  }
  /// Copies the tensors into `module`'s parameters by name, with the receivers' checks (sync::load_into:
  /// unknown, missing and mis-shaped names are one SyncError).
  void load_into(torch::nn::Module& module) const { sync::load_into(module, tensors); }
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
inline std::vector<FileStamp> stamp_model_files(const std::filesystem::path& dir, bool with_record = false) {
  std::vector<FileStamp> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto parsed = checkpoint::parse_shard_file_name(name);
    const bool model = parsed && parsed->component == checkpoint::Component::model;
    if (!model && !(with_record && name == checkpoint::config_file)) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) != 0) {
      out.push_back({name, 0, 0, -1, 0});  // vanished meanwhile
      continue;
    }
    out.push_back({name, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<int64_t>(st.st_size),
                   static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec});
  }
  std::sort(out.begin(), out.end(), [](const FileStamp& a, const FileStamp& b) { return a.name < b.name; });
  return out;
}

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
  WeightVersion wait_newer(int64_t version, std::chrono::milliseconds timeout) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = dist::deadline_after(timeout);
    while (true) {
      if (auto v = try_load(version)) return std::move(*v);
      const auto now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::min<Clock::duration>(options_.poll_interval, deadline - now));
    }
    std::string seen = latest_seen_ ? ::fsdpx::detail::str("it names step ", *latest_seen_)
                                    : std::string(std::filesystem::exists(root_) ? "it does not exist yet"
                                                                                 : "the root does not exist");
    throw SyncError(::fsdpx::detail::str(
        "fsdpx: no committed weights newer than step ", version, " appeared under the checkpoint root '", root_.string(),
        "' within ", timeout.count(), " ms (", checkpoint::state_dict_iteration_file, ": ", seen,
        "; the last step seen: ", newest_seen_ == no_version ? std::string("none") : std::to_string(newest_seen_),
        "; the last step loaded: ", last_returned_ == no_version ? std::string("none") : std::to_string(last_returned_),
        "); the trainer may be slow, stopped or dead",
        last_error_.empty() ? std::string() : "; the last attempt failed: " + last_error_));
  }
  WeightVersion wait_newer(int64_t version) { return wait_newer(version, options_.timeout); }

  /// The step of the last weights returned (no_version before the first).
  int64_t last_step() const { return last_returned_; }
  /// The newest step the iteration file was seen to name (no_version when none).
  int64_t newest_step_seen() const { return newest_seen_; }
  /// Why the last failed attempt to read a step failed; cleared when a step is returned.
  const std::string& last_error() const { return last_error_; }
  const std::filesystem::path& root() const { return root_; }

 private:
  // A step newer than `after` and not older than the last one returned, or nothing.
  std::optional<WeightVersion> try_load(int64_t after) {
    // The iteration file may move on while a step is read: each move is one more attempt.
    for (int attempt = 0; attempt < 16; ++attempt) {
      std::optional<int64_t> step;
      try {
        step = checkpoint::read_iteration_file(root_ / checkpoint::state_dict_iteration_file);
      } catch (const std::exception& e) {
        last_error_ = e.what();
        return std::nullopt;
      }
      latest_seen_ = step;
      if (!step) return std::nullopt;
      newest_seen_ = std::max(newest_seen_, *step);
      // Nothing new; or the file went back to an older step (rewritten by hand, a trainer restarted
      // from an older checkpoint): the newest weights already returned stay the newest.
      if (*step <= after || *step < last_returned_) return std::nullopt;
      const std::filesystem::path dir = checkpoint::step_dir(root_, *step);
      // A step that failed and has not changed since is not read again.
      if (failed_step_ == *step && failed_stamps_ == detail::stamp_model_files(dir, true)) return std::nullopt;
      try {
        WeightVersion v = load(*step, dir);
        last_error_.clear();
        failed_step_ = no_version;
        return v;
      } catch (const std::exception& e) {
        last_error_ = ::fsdpx::detail::str("step ", *step, ": ", e.what());
        failed_step_ = *step;
        failed_stamps_ = detail::stamp_model_files(dir, true);
      }
      std::optional<int64_t> now;
      try {
        now = checkpoint::read_iteration_file(root_ / checkpoint::state_dict_iteration_file);
      } catch (const std::exception&) {
      }
      if (!now || *now == *step) return std::nullopt;  // wait for the trainer to move on
    }
    return std::nullopt;
  }

  WeightVersion load(int64_t step, const std::filesystem::path& dir) {
    const auto stage = [&](std::string_view s) {
      if (options_.on_stage) options_.on_stage(s, step);
    };
    stage("chosen");
    const checkpoint::CheckpointLease lease(root_, step);  // IoError when the step is gone or uncommitted
    const auto record = checkpoint::read_commit_record(dir);
    FSDPX_CHECK_AS(IoError, record && checkpoint::is_committed(*record, /*weights_only=*/true), "'", dir.string(),
                   "' has no commit record that commits the model weights (", checkpoint::config_file, ")");
    stage("leased");
    const auto before = detail::stamp_model_files(dir);
    checkpoint::MergeReport report;
    checkpoint::NamedTensors merged = checkpoint::merge_checkpoint(
        dir, {.verify_checksums = true, .dtype = options_.dtype, .warn = [](const std::string&) {}}, &report);
    FSDPX_CHECK_AS(IoError, report.committed && report.checksums_verified, "'", dir.string(),
                   "' was read without its commit record or without checksums to verify");
    FSDPX_CHECK_AS(IoError, !report.step || *report.step == step, "'", dir.string(), "' holds step ", *report.step,
                   ", not step ", step);
    FSDPX_CHECK_AS(IoError, before == detail::stamp_model_files(dir), "a model file in '", dir.string(),
                   "' was replaced or changed while it was read");
    WeightVersion v;
    v.step = step;
    v.tensors.reserve(merged.size());
    for (auto& [name, t] : merged) v.tensors.push_back({std::move(name), std::move(t)});
    last_returned_ = step;
    return v;
  }

  std::filesystem::path root_;
  WatcherOptions options_;
  int64_t last_returned_ = no_version;
  int64_t newest_seen_ = no_version;
  std::optional<int64_t> latest_seen_;
  std::string last_error_;
  int64_t failed_step_ = no_version;
  std::vector<detail::FileStamp> failed_stamps_;
};

}  // namespace fsdpx::sync
