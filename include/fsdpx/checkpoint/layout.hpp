// The checkpoint directory: iteration files, which steps are committed, rotation and leases.
//
// A step is committed once rank 0 has written its fsdp_config.json (after every rank's files were
// durable): "components" lists what is complete; "complete": true means model, optimizer and extra
// state. Rotation deletes only committed steps older than the newest committed one (and debris of
// failed saves older than it), never one an iteration file names or a reader has leased, and renames
// a step away before removing it so that a crash mid-delete never leaves a half-deleted step that
// looks committed.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <unistd.h>

#include <fsdpx/checkpoint/detail/file_io.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx::checkpoint {

/// The step an iteration file names, nullopt if the file does not exist; a garbled file is an IoError.
FSDPX_DECL std::optional<int64_t> read_iteration_file(const fs::path& path);

/// A step's commit record (fsdp_config.json, written by rank 0 once every rank's files were durable),
/// read and checked in one place for resume, merge, rotation and the watcher.
struct CommitRecord {
  fs::path path;                         // the fsdp_config.json it was read from
  std::optional<int64_t> step;
  int world_size = 0;
  std::optional<int64_t> mesh_shard;     // the saving mesh's shard size, when recorded
  std::string kind;                      // "full", "sharded" or "local"; empty when not recorded
  bool complete = false;                 // model, optimizer and extra state are all committed
  std::vector<std::string> components;   // those committed ("model" first: the weights alone)
  std::map<std::string, CommittedFile> files;  // every file of the step: size and CRC-32C

  /// The entry for file `name` of the step in `dir` (its CRC only when `verify_checksums`); IoError
  /// when the record does not list it.
  CommittedFile file(const fs::path& dir, const std::string& name, bool verify_checksums) const {
    const auto it = files.find(name);
    FSDPX_CHECK_AS(IoError, it != files.end(), "'", (dir / name).string(), "' is not listed in ", path.string(),
                   ": it was not written by the save that committed this checkpoint");
    return {it->second.bytes, verify_checksums ? it->second.crc32c : std::nullopt};
  }
};

/// Parses and checks `config` (a step's fsdp_config.json); every error is an IoError naming it.
FSDPX_DECL CommitRecord parse_commit_record(const fs::path& config);

/// The commit record of the step in `dir`, nullopt when the step is not committed.
inline std::optional<CommitRecord> read_commit_record(const fs::path& dir) {
  std::error_code ec;
  const fs::path config = dir / config_file;
  if (!fs::exists(config, ec)) return std::nullopt;
  return parse_commit_record(config);
}

/// Committed with weights (weights_only) or with everything.
inline bool is_committed(const CommitRecord& record, bool weights_only) {
  const auto& c = record.components;
  return weights_only ? std::find(c.begin(), c.end(), "model") != c.end() : record.complete;
}

/// Reads every state dict file the commit record lists (model and optim, or those of `components`),
/// each checked against its recorded size and, when `verify_checksums`, its CRC-32C; IoError naming
/// the first bad file.
inline void verify_step(const fs::path& dir, const CommitRecord& record, bool verify_checksums,
                        const std::vector<std::string>& components = {"model", "optim"}) {
  for (const auto& [name, info] : record.files) {
    if (std::none_of(components.begin(), components.end(),
                     [&](const std::string& c) { return name.rfind(c + "_world_size_", 0) == 0; })) {
      continue;
    }
    load_shard_file(dir, name, record.file(dir, name, verify_checksums));
  }
}

/// A step directory of the root: global_step_<N>.
struct StepDir {
  int64_t step;
  fs::path path;  // <root>/global_step_<N>
};
FSDPX_DECL std::vector<StepDir> list_steps(const fs::path& root);

/// The newest step before `before` that is committed (with weights, or with everything), found by
/// scanning; nullopt when there is none.
FSDPX_DECL std::optional<int64_t> find_committed_before(const fs::path& root, int64_t before, bool weights_only);

/// The newest committed step: from the iteration file, or, when it is missing, by scanning for
/// committed steps. nullopt when there is none.
FSDPX_DECL std::optional<int64_t> find_latest_checkpoint(const fs::path& root, bool weights_only = false);

// ---- leases: readers pin a step against rotation ----------------------------------------------------

namespace detail {
inline std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}
/// How long a lease file may stay unreadable or empty (a reader writing it) before it counts as the
/// debris of a reader that crashed mid-write.
inline constexpr std::chrono::seconds lease_write_grace{60};

/// A lease file "<host> <pid>" is live unless it names a process of this host that is gone. One that
/// cannot be read or parsed (being written: the temporary file, or a crash left it empty) is live for
/// lease_write_grace after it was last modified, so a crashed reader cannot pin a step forever.
FSDPX_DECL bool lease_is_live(const fs::path& lease);
}  // namespace detail

inline bool is_leased(const fs::path& step_root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(step_root / ".leases", ec)) {
    if (detail::lease_is_live(entry.path())) return true;
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
      FSDPX_FAIL(IoError, "cannot lease step ", step, ": it is not (or no longer) committed");
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

FSDPX_DECL int64_t directory_bytes(const fs::path& dir);

/// Renames a step away, then removes it: a crash in between leaves only a ".deleting" directory,
/// which no reader takes for a checkpoint and the next rotation removes.
FSDPX_DECL void delete_step(const fs::path& root, const StepDir& s);

/// Deletes committed steps beyond the policy's count and bytes, oldest first, and debris of failed
/// saves older than the newest committed step. The newest committed step is the newest one an
/// iteration file names (without iteration files: the newest found by scanning). Never deleted: a
/// step an iteration file names, a leased step, one in `in_flight`, or any step newer than the newest
/// committed one: it is still being saved, or an interrupted run left it and this run saves it
/// again. Those newer steps do not count against the policy either.
inline void rotate_checkpoints(const fs::path& root, const RotationPolicy& policy, const std::set<int64_t>& in_flight = {}) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().filename().string().rfind(".deleting_global_step_", 0) == 0) fs::remove_all(e.path(), ec);
  }
  std::set<int64_t> named;
  try {
    for (const char* file : {state_dict_iteration_file, checkpointed_iteration_file}) {
      if (const auto step = read_iteration_file(root / file)) named.insert(*step);
    }
  } catch (const IoError& e) {  // which steps are in use is unknown: delete nothing
    TORCH_WARN("fsdpx: checkpoint rotation skipped: ", e.what());
    return;
  }
  std::vector<StepDir> committed, debris;
  for (const StepDir& s : list_steps(root)) {
    std::optional<CommitRecord> record;
    try {
      record = read_commit_record(s.path / "actor");
    } catch (const IoError&) {
    }
    (record && is_committed(*record, /*weights_only=*/true) ? committed : debris).push_back(s);
  }
  if (committed.empty()) return;
  const int64_t newest = named.empty() ? committed.back().step : *named.rbegin();
  const auto in_use = [&](const StepDir& s) { return named.count(s.step) != 0 || in_flight.count(s.step) != 0 || is_leased(s.path); };
  for (const StepDir& s : debris) {
    if (s.step < newest && !in_use(s)) delete_step(root, s);
  }
  int kept = 0;
  int64_t bytes = 0;
  for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
    if (it->step > newest) continue;
    const int64_t size = directory_bytes(it->path);
    const bool over = (policy.max_to_keep > 0 && kept >= policy.max_to_keep) ||
                      (policy.max_bytes > 0 && bytes + size > policy.max_bytes);
    if (it->step == newest || !over || in_use(*it)) {
      ++kept;
      bytes += size;
      continue;
    }
    delete_step(root, *it);
  }
}

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/layout.ipp>
#endif
