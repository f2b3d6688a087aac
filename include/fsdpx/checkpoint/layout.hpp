// The checkpoint directory: iteration files, which steps are committed, rotation and leases.
//
// A step is committed once rank 0 has written its fsdp_config.json (after every rank's files were
// durable): "components" lists what is complete; "complete": true means model, optimizer and extra
// state. Rotation deletes only committed steps older than the newest committed one (and debris of
// failed saves older than it), never one a reader has leased, and renames a step away before
// removing it so that a crash mid-delete never leaves a half-deleted step that looks committed.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <unistd.h>

#include <fsdpx/checkpoint/detail/file_io.hpp>
#include <fsdpx/checkpoint/detail/json.hpp>
#include <fsdpx/checkpoint/format.hpp>

namespace fsdpx::checkpoint {

/// The step an iteration file names, nullopt if the file does not exist; a garbled file is an IoError.
inline std::optional<int64_t> read_iteration_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string text = detail::read_text(path);
  size_t used = 0;
  int64_t step = -1;
  try {
    step = std::stoll(text, &used);
  } catch (...) {
  }
  FSDPX_CHECK_AS(IoError, step >= 0 && text.find_first_not_of(" \n\r\t", used) == std::string::npos,
                 "iteration file '", path.string(), "' does not hold a step number: '", text.substr(0, 40), "'");
  return step;
}

/// The commit record of a step, nullopt when the step is not committed.
inline std::optional<detail::Json> read_commit_record(const fs::path& dir) {
  std::error_code ec;
  const fs::path config = dir / config_file;
  if (!fs::exists(config, ec)) return std::nullopt;
  return detail::Json::parse(detail::read_text(config), config.string());
}

/// Committed with weights (weights_only) or with everything.
inline bool is_committed(const detail::Json& record, bool weights_only) {
  if (!weights_only) return record.contains("complete") && record["complete"].boolean();
  for (const auto& c : record["components"].array()) {
    if (c.string() == "model") return true;
  }
  return false;
}

namespace detail {
/// The record's entry for file `name` of the step in `dir`; IoError when the record does not list it.
inline CommittedFile committed_file(const fs::path& dir, const Json& record, const std::string& name, bool verify_checksums) {
  const auto& files = record["files"];
  FSDPX_CHECK_AS(IoError, files.contains(name), "'", (dir / name).string(), "' is not listed in ",
                 (dir / config_file).string(), ": it was not written by the save that committed this checkpoint");
  const auto& info = files[name];
  return {info["bytes"].integer(),
          verify_checksums ? std::optional<uint32_t>(static_cast<uint32_t>(info["crc32c"].integer())) : std::nullopt};
}
}  // namespace detail

/// Reads every state dict file the commit record lists (model and optim, or those of `components`),
/// each checked against its recorded size and, when `verify_checksums`, its CRC-32C; IoError naming
/// the first bad file.
inline void verify_step(const fs::path& dir, const detail::Json& record, bool verify_checksums,
                        const std::vector<std::string>& components = {"model", "optim"}) {
  for (const auto& [name, info] : record["files"].object()) {
    if (std::none_of(components.begin(), components.end(),
                     [&](const std::string& c) { return name.rfind(c + "_world_size_", 0) == 0; })) {
      continue;
    }
    load_shard_file(dir, name, detail::committed_file(dir, record, name, verify_checksums));
  }
}

/// A step directory of the root: global_step_<N>.
struct StepDir {
  int64_t step;
  fs::path path;  // <root>/global_step_<N>
};
inline std::vector<StepDir> list_steps(const fs::path& root) {
  std::vector<StepDir> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("global_step_", 0) != 0 || !entry.is_directory()) continue;
    try {
      size_t used = 0;
      const int64_t step = std::stoll(name.substr(12), &used);
      if (used == name.size() - 12 && step >= 0) out.push_back({step, entry.path()});
    } catch (...) {
    }
  }
  std::sort(out.begin(), out.end(), [](const StepDir& a, const StepDir& b) { return a.step < b.step; });
  return out;
}

/// The newest committed step: from the iteration file, or, when it is missing, by scanning for
/// committed steps. nullopt when there is none.
inline std::optional<int64_t> find_latest_checkpoint(const fs::path& root, bool weights_only = false) {
  const fs::path file = root / (weights_only ? state_dict_iteration_file : checkpointed_iteration_file);
  if (const auto step = read_iteration_file(file)) {
    const auto record = read_commit_record(step_dir(root, *step));
    FSDPX_CHECK_AS(IoError, record && is_committed(*record, weights_only), "'", file.string(), "' names step ", *step,
                   ", but ", step_dir(root, *step).string(), " has no commit record (", config_file,
                   "): the checkpoint root was modified by hand");
    return step;
  }
  std::optional<int64_t> newest;
  for (const StepDir& s : list_steps(root)) {
    try {
      if (const auto record = read_commit_record(s.path / "actor"); record && is_committed(*record, weights_only)) newest = s.step;
    } catch (const IoError&) {  // a garbled record is not a commit
    }
  }
  return newest;
}

// ---- leases: readers pin a step against rotation ----------------------------------------------------

namespace detail {
inline std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}
/// A lease file "<host> <pid>" is live unless it names a process of this host that is gone.
inline bool lease_is_live(const fs::path& lease) {
  char host[256] = {};
  long pid = 0;
  const std::string text = read_text(lease);
  if (std::sscanf(text.c_str(), "%255s %ld", host, &pid) != 2) return true;
  if (host_name() != host) return true;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}
}  // namespace detail

inline bool is_leased(const fs::path& step_root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(step_root / ".leases", ec)) {
    try {
      if (detail::lease_is_live(entry.path())) return true;
    } catch (const IoError&) {
      return true;  // being written: count it
    }
  }
  return false;
}

/// Pins a committed step: rotation does not delete it while the lease lives (readers: weight sync,
/// evaluation, export). A lease of a process that died is ignored.
class CheckpointLease {
 public:
  CheckpointLease(const fs::path& root, int64_t step) {
    static std::atomic<int> counter{0};
    // Checked first (no debris for a step already gone) and again after the lease exists (rotation
    // may have taken the step in between).
    FSDPX_CHECK_AS(IoError, read_commit_record(step_dir(root, step)).has_value(), "cannot lease step ", step,
                   ": it is not (or no longer) committed");
    const fs::path dir = root / ::fsdpx::detail::str("global_step_", step) / ".leases";
    std::error_code ec;
    fs::create_directories(dir, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot lease step ", step, ": creating '", dir.string(), "': ", ec.message());
    path_ = dir / ::fsdpx::detail::str(detail::host_name(), "-", ::getpid(), "-", counter++);
    detail::write_text_durably(path_, ::fsdpx::detail::str(detail::host_name(), " ", ::getpid(), "\n"));
    // The step may have been rotated away between the reader's choice and the lease.
    if (!read_commit_record(step_dir(root, step))) {
      fs::remove(path_, ec);
      FSDPX_CHECK_AS(IoError, false, "cannot lease step ", step, ": it is not (or no longer) committed");
    }
  }
  CheckpointLease(const CheckpointLease&) = delete;
  CheckpointLease& operator=(const CheckpointLease&) = delete;
  ~CheckpointLease() {
    std::error_code ec;
    fs::remove(path_, ec);
  }

 private:
  fs::path path_;
};

// ---- rotation -----------------------------------------------------------------------------------------

struct RotationPolicy {
  int max_to_keep = 0;    // 0: no count limit
  int64_t max_bytes = 0;  // 0: no size limit
};

inline int64_t directory_bytes(const fs::path& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) total += static_cast<int64_t>(e.file_size(ec));
  }
  return total;
}

/// Renames a step away, then removes it: a crash in between leaves only a ".deleting" directory,
/// which no reader takes for a checkpoint and the next rotation removes.
inline void delete_step(const fs::path& root, const StepDir& s) {
  const fs::path doomed = root / ::fsdpx::detail::str(".deleting_global_step_", s.step);
  std::error_code ec;
  fs::rename(s.path, doomed, ec);
  if (ec) {
    TORCH_WARN("fsdpx: could not delete old checkpoint '", s.path.string(), "': ", ec.message());
    return;
  }
  fs::remove_all(doomed, ec);
}

/// Deletes committed steps beyond the policy's count and bytes, oldest first, and debris of failed
/// saves older than the newest committed step. Never: the newest committed step, a leased step, a
/// step newer than the newest committed one (it may still be in flight), or one in `in_flight`.
inline void rotate_checkpoints(const fs::path& root, const RotationPolicy& policy, const std::set<int64_t>& in_flight = {}) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().filename().string().rfind(".deleting_global_step_", 0) == 0) fs::remove_all(e.path(), ec);
  }
  std::vector<StepDir> committed, debris;
  for (const StepDir& s : list_steps(root)) {
    std::optional<detail::Json> record;
    try {
      record = read_commit_record(s.path / "actor");
    } catch (const IoError&) {
    }
    (record && is_committed(*record, /*weights_only=*/true) ? committed : debris).push_back(s);
  }
  if (committed.empty()) return;
  const int64_t newest = committed.back().step;
  for (const StepDir& s : debris) {
    if (s.step < newest && in_flight.count(s.step) == 0 && !is_leased(s.path)) delete_step(root, s);
  }
  int kept = 0;
  int64_t bytes = 0;
  for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
    const int64_t size = directory_bytes(it->path);
    const bool is_newest = it->step == newest;
    const bool over = (policy.max_to_keep > 0 && kept >= policy.max_to_keep) ||
                      (policy.max_bytes > 0 && bytes + size > policy.max_bytes);
    if (is_newest || !over || is_leased(it->path) || in_flight.count(it->step) != 0) {
      ++kept;
      bytes += size;
      continue;
    }
    delete_step(root, *it);
  }
}

}  // namespace fsdpx::checkpoint
