// The memory tier: the newest steps kept in the memory of the ranks' node, beside the disk tier's every N, so
// that a killed process costs one step, not a checkpoint interval.
//
//   fsdpx::CheckpointCoordinator ckpt("/ckpt", model, {.max_to_keep = 3});
//   for (step...) {
//     train();
//     ckpt.save_to_memory(step, model, optimizer, scheduler);             // every step, in the background
//     if (step % 100 == 0) ckpt.save(step, model, optimizer, scheduler);  // the disk tier, as before
//   }
//   // relaunched after a crash: load_checkpoint(model, "/ckpt", ...) resumes the newest step either tier holds
//
// A memory step is a checkpoint root of its own in a node-local memory folder (MemoryTierOptions::dir, else
// $FSDPX_MEMORY_DIR, else /dev/shm), written and committed by a second coordinator under the disk tier's rules:
// a step counts only once every rank's files of it are whole (sizes and CRC-32C in its commit record), its
// iteration files advance atomically, a torn file is never taken. The files outlive the process (kill -9, a
// failing rank), not the node. The folder is named by an id rank 0 keeps in the disk root (memory_tier_id.txt),
// not by the launcher's job id: a relaunch on that root finds it, a job on another root never reads it.
//
// A folder names its disk root (disk_root.txt); one whose root is gone, or names another memory tier, is stale
// and removed by the next job that starts a memory tier on that node.
//
// For now every rank must see the same memory folder (the ranks of one node). A job across nodes, whose
// copies would need a buddy on another node, keeps the disk tier alone and says so when it starts.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdpx {

struct MemoryTierOptions {
  /// The node-local folder that holds the copies; empty: $FSDPX_MEMORY_DIR, else /dev/shm.
  std::filesystem::path dir;
  /// Steps kept (the newest committed one is never removed): the one being written and the one before.
  int keep = 2;
  /// Another disk root's memory tier in the same folder is removed when it is stale (its root gone, or naming
  /// another tier) and unchanged for this long.
  std::chrono::seconds stale_after = std::chrono::minutes(10);
};

namespace checkpoint {

/// The disk root's file naming its memory tier (written once by rank 0, then only read).
inline constexpr const char* memory_tier_id_file = "memory_tier_id.txt";

/// The memory folder: `configured`, else $FSDPX_MEMORY_DIR, else /dev/shm (the system's temporary
/// folder where there is no /dev/shm).
FSDPX_DECL std::filesystem::path memory_tier_dir(const std::filesystem::path& configured);

/// The id in `root`'s memory_tier_id.txt (16 hex digits at most, not zero); nullopt when the root has none.
/// A file that is not such an id is an IoError naming it.
FSDPX_DECL std::optional<uint64_t> read_memory_tier_id(const std::filesystem::path& root);

/// The memory tier's checkpoint root for the disk root of id `id`.
FSDPX_DECL std::filesystem::path memory_tier_root(const std::filesystem::path& dir, uint64_t id);

/// The file in a memory tier's folder that names the disk root it belongs to (its absolute path).
inline constexpr const char* memory_tier_owner_file = "disk_root.txt";

/// Writes `folder`'s owner file: `disk_root`, made absolute.
FSDPX_DECL void claim_memory_tier(const std::filesystem::path& folder, const std::filesystem::path& disk_root);

/// Removes the memory tiers in `dir` other than `own` that are stale: their owner file names a disk root that is
/// gone, or one whose id file names another memory tier, and nothing in them changed for `min_age` (a job
/// still writing there is never touched). A folder without an owner file, or whose owner cannot be read, is
/// left alone. Returns each removed folder with the reason.
FSDPX_DECL std::vector<std::pair<std::filesystem::path, std::string>> remove_stale_memory_tiers(
    const std::filesystem::path& dir, const std::filesystem::path& own, std::chrono::seconds min_age);

}  // namespace checkpoint
}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/memory_tier.ipp>
#endif
