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

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/checkpoint/format.hpp>

namespace fsdpx::checkpoint {

/// The step an iteration file names, nullopt if the file does not exist; a garbled file is an IoError.
FSDPX_DECL std::optional<int64_t> read_iteration_file(const fs::path& path);

/// A step's commit record (fsdp_config.json, written by rank 0 once every rank's files were durable),
/// read and checked in one place for resume, merge, rotation and the watcher.
struct CommitRecord {
  fs::path path;  // the fsdp_config.json it was read from
  std::optional<int64_t> step;
  int world_size = 0;
  std::optional<int64_t> mesh_shard;           // the saving mesh's shard size, when recorded
  std::string kind;                            // "full", "sharded" or "local"; empty when not recorded
  bool complete = false;                       // model, optimizer and extra state are all committed
  std::vector<std::string> components;         // those committed ("model" first: the weights alone)
  std::map<std::string, CommittedFile> files;  // every file of the step: size and CRC-32C
  /// The files' format ("files_format": "fsdpx", its own shard files, when absent; "dcp", PyTorch Distributed
  /// Checkpoint's, the model's in the step folder and the optimizer's in optim_states/).
  CheckpointFormat files_format = CheckpointFormat::fsdpx;

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
FSDPX_DECL std::optional<CommitRecord> read_commit_record(const fs::path& dir);

/// Committed with weights (weights_only) or with everything.
FSDPX_DECL bool is_committed(const CommitRecord& record, bool weights_only);

/// Reads every state dict file the commit record lists (model and optim, or those of `components`),
/// each checked against its recorded size and, when `verify_checksums`, its CRC-32C; IoError naming
/// the first bad file.
FSDPX_DECL void verify_step(const fs::path& dir, const CommitRecord& record, bool verify_checksums,
                            const std::vector<std::string>& components = {"model", "optim"});

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

FSDPX_DECL bool is_leased(const fs::path& step_root);

/// Pins a committed step: rotation does not delete it while the lease lives (readers: weight sync,
/// evaluation, export). A lease of a process that died is ignored.
class CheckpointLease {
 public:
  FSDPX_DECL CheckpointLease(const fs::path& root, int64_t step);
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
FSDPX_DECL void rotate_checkpoints(const fs::path& root, const RotationPolicy& policy,
                                   const std::set<int64_t>& in_flight = {});

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/layout.ipp>
#endif
