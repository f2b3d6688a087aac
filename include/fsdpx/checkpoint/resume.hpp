// Resuming from a checkpoint: the newest committed step (or a chosen one), loaded into a model of
// the same or a different world size and mesh, with optimizer, RNG and client state.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>

namespace fsdpx {

struct LoadOptions {
  /// Load this step instead of the newest committed one.
  std::optional<int64_t> step;
  /// Check each file read against the CRC-32C of the commit record.
  bool verify_checksums = true;
  bool restore_rng = true;
  /// Parameters in the checkpoint that the model lacks are errors.
  bool strict = true;
};

struct ResumeInfo {
  int64_t step = 0;
  int saved_world_size = 0;
  ExtraState extra;  // the client state saved with the step (empty when none was saved)
};

namespace checkpoint::detail {

/// Streams the files of one component of a committed step to `fn`, each checked against the record.
/// At the saving topology a rank reads only the file that holds its shards.
inline void for_each_saved_file(const fs::path& dir, const CommitRecord& record, Component c, std::optional<int> only_rank,
                                bool verify, const std::function<void(const StateDict&)>& fn) {
  for (int r = 0; r < record.world_size; ++r) {
    if (only_rank && r != *only_rank) continue;
    const std::string name = shard_file_name(c, record.world_size, r);
    fn(load_shard_file(dir, name, record.file(dir, name, verify)));
  }
}

}  // namespace checkpoint::detail

/// Loads the newest committed checkpoint under `root` (or options.step) into `model` and, when given,
/// `optimizer`; restores the RNG states and returns the step and client state. nullopt when the root
/// has no committed checkpoint. Not collective: each rank reads what it needs.
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model,
                                          torch::optim::Optimizer* optimizer = nullptr, const LoadOptions& options = {}) {
  using checkpoint::Component;
  using checkpoint::fs::path;
  const bool weights_only = optimizer == nullptr;
  const std::optional<int64_t> step = options.step ? options.step : checkpoint::find_latest_checkpoint(root, weights_only);
  if (!step) return std::nullopt;
  const path dir = checkpoint::step_dir(root, *step);
  const auto record = checkpoint::read_commit_record(dir);
  FSDPX_CHECK_AS(IoError, record && checkpoint::is_committed(*record, weights_only), "checkpoint step ", *step, " in '", root.string(),
                 "' is not committed", weights_only ? "" : " with optimizer and extra state");
  ResumeInfo info;
  info.step = *step;
  info.saved_world_size = record->world_size;

  // At the saving topology, the file of this rank's shard holds everything it needs.
  auto& sharded = model.sharded();
  const auto& mesh = sharded.mesh();
  const bool same_topology = info.saved_world_size == mesh.world().size() && record->mesh_shard == mesh.shard_size();
  const std::optional<int> own_file = same_topology ? std::optional<int>(mesh.shard_group().rank()) : std::nullopt;
  const bool local = record->kind == "local";
  const bool full = record->kind == "full";
  load_model_state_dict(sharded, [&](const auto& fn) {
    // A full checkpoint is rank 0's file; a local one is each rank's own.
    const std::optional<int> only = full ? std::optional<int>(0) : local ? std::optional<int>(mesh.world().rank()) : own_file;
    checkpoint::detail::for_each_saved_file(dir, *record, Component::model, only, options.verify_checksums, fn);
  }, options.strict);
  if (optimizer != nullptr) {
    load_optimizer_state_dict(*optimizer, sharded, [&](const auto& fn) {
      checkpoint::detail::for_each_saved_file(dir, *record, Component::optim, own_file, options.verify_checksums, fn);
    });
  }
  const std::string extra_name = checkpoint::shard_file_name(Component::extra_state, info.saved_world_size,
                                                 mesh.world().rank() % info.saved_world_size);
  if (record->files.count(extra_name) != 0) {
    info.extra = checkpoint::extra_state_from_ivalue(
        checkpoint::load_committed_ivalue(dir / extra_name, record->file(dir, extra_name, options.verify_checksums)),
        dir / extra_name, options.restore_rng);
  }
  return info;
}
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model, torch::optim::Optimizer& optimizer,
                                          const LoadOptions& options = {}) {
  return load_checkpoint(root, model, &optimizer, options);
}

}  // namespace fsdpx
