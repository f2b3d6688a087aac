// Resuming from a checkpoint: the newest committed step (or a chosen one), loaded into a model of
// the same or a different world size and mesh, with optimizer, RNG and client state; or the weights of a
// PyTorch Distributed Checkpoint folder (dcp_reader.hpp).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/dcp_reader.hpp>
#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/lr_schedule.hpp>

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
  /// A PyTorch Distributed Checkpoint folder: how its entries meet the model's names (its prefix, name hooks
  /// and ignored entries; models::dcp_load_options for the decoder). Loading is strict when both say so.
  DcpLoadOptions dcp;
};

struct ResumeInfo {
  int64_t step = 0;
  int saved_world_size = 0;
  ExtraState extra;  // the client and scheduler state saved with the step (empty when not loaded)
  /// The parts asked for that the checkpoint lacked (allow_missing): "optimizer", "scheduler", "client state".
  std::vector<std::string> missing;
};

namespace checkpoint::detail {

/// Streams the files of one component of a committed step to `fn`, each checked against the record.
/// At the saving topology a rank reads only the file that holds its shards.
FSDPX_DECL void for_each_saved_file(const fs::path& dir, const CommitRecord& record, Component c,
                                    std::optional<int> only_rank, bool verify,
                                    const std::function<void(const StateDict&)>& fn);

/// load_checkpoint of a PyTorch Distributed Checkpoint folder. In LightRFT's layout: the model's DCP in the folder
/// itself; the optimizer's in optim_states/ (when `optimizer` is given); the LR scheduler's state from
/// scheduler_state.pt (a torch LR scheduler's state_dict: its last_epoch is the step, its base_lrs the groups'
/// base LRs; when `scheduler` is given); and client_state.pt's plain values as the client state. In torchtitan's
/// (one DCP with "optimizer.state." or "train_state.step" entries): the model under "model." (or at the top
/// level), the optimizer's state under "optimizer." (its param groups, flattened by parameter, are not mapped:
/// the optimizer keeps its own hyperparameters), the scheduler from "lr_scheduler.last_epoch" and
/// "lr_scheduler.base_lrs", the step from "train_state.step". A part asked for that the folder lacks is an error
/// naming it, or with allow_missing a warning and ResumeInfo::missing.
FSDPX_DECL ResumeInfo load_dcp_checkpoint(const fs::path& dir, core::ShardedModel& model,
                                          torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                          const LoadOptions& options);

}  // namespace checkpoint::detail

/// Loads the newest committed checkpoint under `root` (or options.step) into `model` and, when given
/// and asked for by the options, `optimizer` and `scheduler`; restores the RNG states and returns the
/// step and client state. nullopt when the root has no committed checkpoint. Not collective: each
/// rank reads what it needs. When an optimizer is asked for, the newest step saved with optimizer and
/// extra state is chosen; with allow_missing and no such step, the newest with weights.
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model,
                                          torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                          const LoadOptions& options = {}) {
  using checkpoint::Component;
  using checkpoint::fs::path;
  const bool want_optimizer = optimizer != nullptr && options.load_optimizer;
  const bool want_scheduler = scheduler != nullptr && options.load_scheduler;
  if (checkpoint::dcp::is_checkpoint(root)) {  // a folder with a .metadata: PyTorch's DCP, not fsdpx's layout
    return checkpoint::detail::load_dcp_checkpoint(root, model.sharded(), want_optimizer ? optimizer : nullptr,
                                                   want_scheduler ? scheduler : nullptr, options);
  }
  std::optional<int64_t> step = options.step;
  if (!step) step = checkpoint::find_latest_checkpoint(root, /*weights_only=*/!want_optimizer);
  if (!step && want_optimizer && options.allow_missing)
    step = checkpoint::find_latest_checkpoint(root, /*weights_only=*/true);
  if (!step) return std::nullopt;
  const path dir = checkpoint::step_dir(root, *step);
  const auto record = checkpoint::read_commit_record(dir);
  FSDPX_CHECK_AS(IoError, record && checkpoint::is_committed(*record, /*weights_only=*/true), "checkpoint step ", *step,
                 " in '", root.string(), "' is not committed");
  ResumeInfo info;
  info.step = *step;
  info.saved_world_size = record->world_size;
  // A part missing from another model's checkpoint (another program's root) is not the cause to
  // report: its model is. Checked only on this error path, once (it reads this rank's model file);
  // not for full state dicts (rank 0's file is the whole model) nor local ones (their entries are
  // units), and not when loading is not strict (extra names are then allowed).
  bool model_checked = false;
  const auto check_same_model = [&] {
    if (model_checked || record->kind == "local" || record->kind == "full" || !options.strict) return;
    model_checked = true;
    const auto& mesh = model.sharded().mesh();
    const std::string name =
        checkpoint::shard_file_name(Component::model, info.saved_world_size,
                                    record->kind == "full" ? 0 : mesh.world().rank() % info.saved_world_size);
    if (record->files.count(name) == 0) return;
    const StateDict saved = checkpoint::load_shard_file(dir, name, record->file(dir, name, options.verify_checksums));
    std::set<std::string> ours;
    for (size_t i = 0; i < model.sharded().num_units(); ++i) {
      for (const auto& p : model.sharded().unit(i).layout().params()) ours.insert(p.name);
    }
    for (const auto& [buffer, b] : model.sharded().named_buffers()) ours.insert(buffer);
    std::vector<std::string> foreign;
    for (const TensorSlice& e : saved.entries) {
      if (ours.count(e.name) == 0) foreign.push_back(e.name);
    }
    FSDPX_CHECK_AS(IoError, foreign.empty(), "checkpoint step ", *step, " in '", root.string(),
                   "' holds another model than "
                   "this one (another program's checkpoint root?): ",
                   ::fsdpx::detail::join_names(foreign, 8), " are not parameters or buffers of this model");
  };
  const auto lacks = [&](const std::string& part, const std::string& why) {
    if (!options.allow_missing) check_same_model();
    FSDPX_CHECK_AS(IoError, options.allow_missing, "checkpoint step ", *step, " in '", root.string(), "' has no ", part,
                   " (", why, "); pass LoadOptions{.load_", part == "client state" ? "client_state" : part,
                   " = false} to resume without it, or .allow_missing = true to be warned instead");
    TORCH_WARN("fsdpx: checkpoint step ", *step, " in '", root.string(), "' has no ", part, " (", why,
               "); resuming without it");
    info.missing.push_back(part);
  };
  const auto saved = [&](Component c) {
    const auto& cs = record->components;
    return std::find(cs.begin(), cs.end(), std::string(checkpoint::to_string(c))) != cs.end();
  };

  // Every part asked for is found and checked before anything is loaded: a missing or malformed part
  // leaves the model, optimizer and scheduler as they were.
  auto& sharded = model.sharded();
  const auto& mesh = sharded.mesh();
  const std::string extra_name = checkpoint::shard_file_name(Component::extra_state, info.saved_world_size,
                                                             mesh.world().rank() % info.saved_world_size);
  c10::IValue extra_saved;
  ExtraState extra;
  if (saved(Component::extra_state) && record->files.count(extra_name) != 0) {
    extra_saved =
        checkpoint::load_committed_ivalue(dir / extra_name, record->file(dir, extra_name, options.verify_checksums));
    extra = checkpoint::extra_state_from_ivalue(extra_saved, dir / extra_name, /*restore_rng=*/false);
  } else if (options.load_client_state && want_optimizer) {  // a weights-only load never required it
    lacks("client state", "it was saved without extra state");
  }
  const bool load_optimizer = want_optimizer && saved(Component::optim);
  if (want_optimizer && !load_optimizer) lacks("optimizer", "it was saved without one");
  const bool load_scheduler = want_scheduler && !extra.scheduler.isNone();
  if (want_scheduler && !load_scheduler) {
    lacks("scheduler",
          extra_saved.isNone() ? "it was saved without extra state" : "it was saved without an LR scheduler");
  }
  if (load_scheduler) scheduler->check_state_dict(extra.scheduler);

  // At the saving topology, the file of this rank's shard holds everything it needs.
  const bool same_topology = info.saved_world_size == mesh.world().size() && record->mesh_shard == mesh.shard_size();
  const std::optional<int> own_file = same_topology ? std::optional<int>(mesh.shard_group().rank()) : std::nullopt;
  const bool local = record->kind == "local";
  const bool full = record->kind == "full";
  // Its own file is enough only when the flat layout is the saving job's too: with other parameters
  // frozen or other units, this rank's shards are other ranges, and every saving rank's file is read.
  const auto with_own_file_first = [&](const auto& load) {
    if (!own_file) return load(std::nullopt);
    try {
      load(own_file);
    } catch (const Error&) {
      load(std::nullopt);  // every file: what does not match the model now is named from the whole checkpoint
    }
  };
  if (record->files_format == "dcp") {  // CheckpointFormat::dcp: each rank reads the chunks over its shards
    DcpLoadOptions names = options.dcp;
    names.strict = names.strict && options.strict;
    load_model_state_dict(sharded, path(dir), names);
    if (load_optimizer)
      load_optimizer_state_dict(*optimizer, sharded, dir / "optim_states", {.file_name = names.file_name});
  } else {
    with_own_file_first([&](std::optional<int> own) {
      load_model_state_dict(
          sharded,
          [&](const auto& fn) {
            // A full checkpoint is rank 0's file; a local one is each rank's own.
            const std::optional<int> only = full    ? std::optional<int>(0)
                                            : local ? std::optional<int>(mesh.world().rank())
                                                    : own;
            checkpoint::detail::for_each_saved_file(dir, *record, Component::model, only, options.verify_checksums, fn);
          },
          options.strict);
    });
    if (load_optimizer) {
      with_own_file_first([&](std::optional<int> own) {
        load_optimizer_state_dict(*optimizer, sharded, [&](const auto& fn) {
          checkpoint::detail::for_each_saved_file(dir, *record, Component::optim, own, options.verify_checksums, fn);
        });
      });
    }
  }
  if (load_scheduler) {
    scheduler->load_state_dict(extra.scheduler);
    info.extra.scheduler = extra.scheduler;
  } else if (scheduler != nullptr && load_optimizer) {
    scheduler->apply();  // the optimizer state brought its saved LRs; the scheduler's state decides them
  }
  if (!extra_saved.isNone()) {
    if (options.restore_rng) checkpoint::extra_state_from_ivalue(extra_saved, dir / extra_name, /*restore_rng=*/true);
    info.extra.step = extra.step;
    if (options.load_client_state) info.extra.client = extra.client;
  }
  return info;
}
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model,
                                          torch::optim::Optimizer* optimizer = nullptr,
                                          const LoadOptions& options = {}) {
  return load_checkpoint(root, model, optimizer, nullptr, options);
}
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model,
                                          torch::optim::Optimizer& optimizer, const LoadOptions& options = {}) {
  return load_checkpoint(root, model, &optimizer, nullptr, options);
}
template <class Sharded>
std::optional<ResumeInfo> load_checkpoint(const std::filesystem::path& root, Sharded& model,
                                          torch::optim::Optimizer& optimizer, LrScheduler& scheduler,
                                          const LoadOptions& options = {}) {
  return load_checkpoint(root, model, &optimizer, &scheduler, options);
}

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/resume.ipp>
#endif
