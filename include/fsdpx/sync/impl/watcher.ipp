// CheckpointWatcher's member functions, out of line: included by fsdpx/sync/watcher.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <sys/stat.h>

#include <algorithm>
#include <thread>

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/sync/watcher.hpp>
#include <fsdpx/sync/detail/held_version.hpp>

namespace fsdpx::sync {

FSDPX_DECL WeightVersion CheckpointWatcher::wait_newer(int64_t version, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = dist::deadline_after(timeout);
  while (true) {
    if (auto v = try_load(version)) return std::move(*v);
    const auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(options_.poll_interval, deadline - now));
  }
  std::string seen =
      latest_seen_ ? ::fsdpx::detail::str("it names step ", *latest_seen_)
                   : std::string(std::filesystem::exists(root_) ? "it does not exist yet" : "the root does not exist");
  throw SyncError(::fsdpx::detail::str(
      "fsdpx: no committed weights newer than step ", version, " appeared under the checkpoint root '", root_.string(),
      "' within ", timeout.count(), " ms (", checkpoint::state_dict_iteration_file, ": ", seen,
      "; the last step seen: ", newest_seen_ == no_version ? std::string("none") : std::to_string(newest_seen_),
      "; the last step loaded: ", last_returned_ == no_version ? std::string("none") : std::to_string(last_returned_),
      "); the trainer may be slow, stopped or dead",
      last_error_.empty() ? std::string() : "; the last attempt failed: " + last_error_));
}

FSDPX_DECL int64_t CheckpointWatcher::load_newer_into(torch::nn::Module& module, std::chrono::milliseconds wait) {
  const int64_t before = last_returned_;
  const WeightVersion v = wait_newer(last_returned_, wait);
  try {
    detail::HeldVersion::check_loadable(module, v.tensors);
  } catch (...) {
    last_returned_ = before;  // not loaded: the next call reads it again
    throw;
  }
  auto manifest = std::make_shared<const Manifest>(full_manifest(v.version, v.tensors));
  v.load_into(module);
  loaded_manifest_ = std::move(manifest);
  return v.version;
}

FSDPX_DECL void CheckpointWatcher::verify(torch::nn::Module& module) const {
  FSDPX_CHECK_AS(SyncError, loaded_manifest_ != nullptr,
                 "CheckpointWatcher::verify: no step was loaded into a module "
                 "yet (load_newer_into)");
  sync::verify(module, *loaded_manifest_);
}

FSDPX_DECL std::optional<WeightVersion> CheckpointWatcher::try_load(int64_t after) {
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

FSDPX_DECL WeightVersion CheckpointWatcher::load(int64_t step, const std::filesystem::path& dir) {
  const auto stage = [&](std::string_view s) {
    if (options_.on_stage) options_.on_stage(s, step);
  };
  stage("chosen");
  const checkpoint::CheckpointLease lease(root_, step);  // IoError when the step is gone or uncommitted
  const auto record = checkpoint::read_commit_record(dir);
  FSDPX_CHECK_AS(IoError, record && checkpoint::is_committed(*record, /*weights_only=*/true), "'", dir.string(),
                 "' has no commit record that commits the model weights (", checkpoint::config_file, ")");
  FSDPX_CHECK_AS(IoError, record->files_format == CheckpointFormat::fsdpx, "'", dir.string(),
                 "' was saved in PyTorch Distributed Checkpoint (CheckpointFormat::dcp), whose files the watcher "
                 "cannot check against their CRC-32C yet: watch a root saved in fsdpx's own format");
  stage("leased");
  const auto before = detail::stamp_model_files(dir);
  checkpoint::MergeReport report;
  fsdpx::hf::NamedTensors merged = checkpoint::merge_checkpoint(
      dir, {.verify_checksums = true, .dtype = options_.dtype, .warn = [](const std::string&) {}}, &report);
  FSDPX_CHECK_AS(IoError, report.committed && report.checksums_verified, "'", dir.string(),
                 "' was read without its commit record or without checksums to verify");
  FSDPX_CHECK_AS(IoError, !report.step || *report.step == step, "'", dir.string(), "' holds step ", *report.step,
                 ", not step ", step);
  FSDPX_CHECK_AS(IoError, before == detail::stamp_model_files(dir), "a model file in '", dir.string(),
                 "' was replaced or changed while it was read");
  WeightVersion v;
  v.version = step;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  v.step = step;  // the deprecated name, for one release
#pragma GCC diagnostic pop
  v.tensors.reserve(merged.size());
  for (auto& [name, t] : merged) v.tensors.push_back({std::move(name), std::move(t)});
  last_returned_ = step;
  return v;
}

}  // namespace fsdpx::sync

namespace fsdpx::sync::detail {

FSDPX_DECL std::vector<FileStamp> stamp_model_files(const std::filesystem::path& dir, bool with_record) {
  std::vector<FileStamp> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto parsed = checkpoint::parse_shard_file_name(name);
    const bool model = parsed && parsed->component == checkpoint::Component::model;
    if (!model && !(with_record && name == checkpoint::config_file)) continue;
    struct stat st{};
    if (::stat(e.path().c_str(), &st) != 0) {
      out.push_back({name, 0, 0, -1, 0});  // vanished meanwhile
      continue;
    }
    out.push_back({name, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                   static_cast<int64_t>(st.st_size),
                   static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec});
  }
  std::sort(out.begin(), out.end(), [](const FileStamp& a, const FileStamp& b) { return a.name < b.name; });
  return out;
}

}  // namespace fsdpx::sync::detail
