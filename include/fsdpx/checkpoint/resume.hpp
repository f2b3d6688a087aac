// Resuming from a checkpoint: the newest committed step of an fsdpx root (or a chosen one), loaded into a
// model of the same or a different world size and mesh, with optimizer, RNG and client state; or a folder
// another trainer wrote (PyTorch Distributed Checkpoint: LightRFT's or torchtitan's step folder, with
// <fsdpx/dcp.hpp>).
//
//   if (auto info = fsdpx::load_checkpoint(model, "/ckpt/run1", optimizer, scheduler)) start = info->step + 1;
//
// One rule for every format (checkpoint/step_format.hpp): every part asked for is found and checked before
// anything is loaded, then the model, the optimizer, the scheduler (whose state decides the LRs) and the RNG.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/names.hpp>
#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/core/model_ref.hpp>

namespace fsdpx {

struct LoadOptions {
  /// Load this step instead of the newest committed one.
  std::optional<int64_t> step;
  /// Check each file read against the CRC-32C of the commit record.
  bool verify_checksums = true;
  bool restore_rng = true;
  /// Parameters in the checkpoint that the model lacks are errors.
  bool strict = true;
  /// Resume flags (LightRFT's load_ckpt): the parts restored besides the model. The optimizer's and
  /// scheduler's states load only when asked here and their target is passed; the client state is
  /// required only by a load with an optimizer (a weights-only load returns it when present).
  bool load_optimizer = true;
  bool load_scheduler = true;
  bool load_client_state = true;
  /// A part asked for that the checkpoint lacks: a warning naming it and ResumeInfo::missing (true),
  /// or an error naming it (false).
  bool allow_missing = false;
  /// A PyTorch Distributed Checkpoint (a folder, or a root saved with CheckpointFormat::dcp): how its entries
  /// meet the model's names (its prefix, name hooks and ignored entries; models::dcp_load_options for the
  /// decoder). Loading is strict when both say so.
  LoadNames dcp;
  /// A root whose job kept steps in the memory tier (CheckpointCoordinator::save_to_memory): resume its newest
  /// step when it is newer than the disk's (or as new) and every rank can read its copy, else the disk's. Taking
  /// it is collective: every rank calls load_checkpoint.
  bool from_memory = true;
  /// Where the memory tier's copies are (CheckpointOptions::memory_tier.dir); empty: $FSDPX_MEMORY_DIR, else
  /// /dev/shm.
  std::filesystem::path memory_dir;
};

struct ResumeInfo {
  int64_t step = 0;
  int saved_world_size = 0;
  ExtraState extra;  // the client and scheduler state saved with the step (empty when not loaded)
  /// The parts asked for that the checkpoint lacked (allow_missing): "optimizer", "scheduler", "client state".
  std::vector<std::string> missing;
  /// The checkpoint root the step was read from: the root given, or the memory tier's folder.
  std::filesystem::path source;
  bool from_memory = false;
};

/// Loads the newest committed checkpoint under `root` (or options.step) into `model` and, when given
/// and asked for by the options, `optimizer` and `scheduler`; restores the RNG states and returns the
/// step and client state. nullopt when the root has no committed checkpoint. Not collective (each
/// rank reads what it needs), except for a root with a memory tier (checkpoint/memory_tier.hpp): its
/// ranks agree on the newest step every one of them holds there, and say which tier they resumed from. When an
/// optimizer is asked for, the newest step saved with optimizer and extra state is chosen; with allow_missing and no
/// such step, the newest with weights.
///
/// `root` may also be a PyTorch Distributed Checkpoint folder (one with a `.metadata`; <fsdpx/dcp.hpp>). In
/// LightRFT's layout: the model's DCP in the folder itself; the optimizer's in optim_states/; the LR scheduler's
/// state from scheduler_state.pt (a torch LR scheduler's state_dict: its last_epoch is the step, its base_lrs the
/// groups' base LRs); client_state.pt's plain values as the client state; the step from the folder's name
/// ("global_step10"). In torchtitan's (one DCP with "optimizer.state." or "train_state.step" entries): the model
/// under "model." (or at the top level), the optimizer's state under "optimizer." (its param groups, flattened by
/// parameter, are not mapped: the optimizer keeps its own hyperparameters), the scheduler from
/// "lr_scheduler.last_epoch" and "lr_scheduler.base_lrs", the step from "train_state.step".
///
/// A part asked for that the checkpoint lacks is an error naming it, or with allow_missing a warning and
/// ResumeInfo::missing; nothing is loaded when a part is missing.
FSDPX_DECL std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                     torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                                     const LoadOptions& options = {});
/// The weights (and the RNG states and client state saved with them).
inline std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                 const LoadOptions& options = {}) {
  return load_checkpoint(model, root, nullptr, nullptr, options);
}
inline std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                 torch::optim::Optimizer* optimizer, const LoadOptions& options = {}) {
  return load_checkpoint(model, root, optimizer, nullptr, options);
}
inline std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                 torch::optim::Optimizer& optimizer, const LoadOptions& options = {}) {
  return load_checkpoint(model, root, &optimizer, nullptr, options);
}
inline std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                 torch::optim::Optimizer& optimizer, LrScheduler& scheduler,
                                                 const LoadOptions& options = {}) {
  return load_checkpoint(model, root, &optimizer, &scheduler, options);
}

// ---- the spellings before the model came first (2026-12): one release, deprecated ------------------

#define FSDPX_LOAD_CHECKPOINT_ROOT_FIRST                                                        \
  [[deprecated(                                                                                 \
      "fsdpx::load_checkpoint(root, model, ...) is now load_checkpoint(model, root, ...): the " \
      "model first, as in every load, save and sync call")]]

template <ShardedModelLike Sharded>
FSDPX_LOAD_CHECKPOINT_ROOT_FIRST std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root,
                                                                           Sharded& model,
                                                                           torch::optim::Optimizer* optimizer,
                                                                           LrScheduler* scheduler,
                                                                           const LoadOptions& options = {}) {
  return load_checkpoint(ShardedModelRef(model), root, optimizer, scheduler, options);
}
template <ShardedModelLike Sharded>
FSDPX_LOAD_CHECKPOINT_ROOT_FIRST std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root,
                                                                           Sharded& model,
                                                                           torch::optim::Optimizer* optimizer = nullptr,
                                                                           const LoadOptions& options = {}) {
  return load_checkpoint(ShardedModelRef(model), root, optimizer, nullptr, options);
}
template <ShardedModelLike Sharded>
FSDPX_LOAD_CHECKPOINT_ROOT_FIRST std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root,
                                                                           Sharded& model,
                                                                           torch::optim::Optimizer& optimizer,
                                                                           const LoadOptions& options = {}) {
  return load_checkpoint(ShardedModelRef(model), root, &optimizer, nullptr, options);
}
template <ShardedModelLike Sharded>
FSDPX_LOAD_CHECKPOINT_ROOT_FIRST std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root,
                                                                           Sharded& model,
                                                                           torch::optim::Optimizer& optimizer,
                                                                           LrScheduler& scheduler,
                                                                           const LoadOptions& options = {}) {
  return load_checkpoint(ShardedModelRef(model), root, &optimizer, &scheduler, options);
}

#undef FSDPX_LOAD_CHECKPOINT_ROOT_FIRST

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/resume.ipp>
#endif
