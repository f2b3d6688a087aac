// Out-of-line functions of fsdpx/checkpoint/resume.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>

#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/step_format.hpp>

namespace fsdpx::checkpoint::detail {

/// The committed step `step` of the fsdpx root `root`, opened for world rank `rank`: its extra state (that
/// rank's file, in every format: scheduler, client state, RNG) read and checked; the model and optimizer load
/// through the step's format.
inline SavedStep open_root_step(const fs::path& root, int64_t step, int rank, const LoadOptions& options) {
  const fs::path dir = step_dir(root, step);
  const auto read = read_commit_record(dir);
  FSDPX_CHECK_AS(IoError, read && is_committed(*read, /*weights_only=*/true), "checkpoint step ", step, " in '",
                 root.string(), "' is not committed");
  const auto record = std::make_shared<const CommitRecord>(*read);
  SavedStep s;
  s.step = step;
  s.saved_world_size = record->world_size;
  s.what = ::fsdpx::detail::str("checkpoint step ", step, " in '", root.string(), "'");
  const StepFormat& format = step_format(record->files_format, s.what);
  const auto saved = [&](Component c) {
    const auto& cs = record->components;
    return std::find(cs.begin(), cs.end(), std::string(to_string(c))) != cs.end();
  };
  s.has_optimizer = saved(Component::optim);
  if (!s.has_optimizer) s.no_optimizer = "it was saved without one";
  s.no_scheduler = s.no_client_state = "it was saved without extra state";
  const std::string extra_name = shard_file_name(Component::extra_state, s.saved_world_size, rank % s.saved_world_size);
  if (saved(Component::extra_state) && record->files.count(extra_name) != 0) {
    const fs::path path = dir / extra_name;
    const c10::IValue extra_saved =
        load_committed_ivalue(path, record->file(dir, extra_name, options.verify_checksums));
    const ExtraState extra = extra_state_from_ivalue(extra_saved, path, /*restore_rng=*/false);
    s.extra_step = extra.step;
    s.client = extra.client;
    if (extra.scheduler.isNone()) {
      s.no_scheduler = "it was saved without an LR scheduler";
    } else {
      s.scheduler = extra.scheduler;
    }
    s.restore_rng = [extra_saved, path] { extra_state_from_ivalue(extra_saved, path, /*restore_rng=*/true); };
  }
  s.load_model = [&format, dir, record, options](core::ShardedModel& model) {
    format.load_model(model, dir, *record, options);
  };
  s.load_optimizer = [&format, dir, record, options](core::ShardedModel& model, torch::optim::Optimizer& optimizer) {
    format.load_optimizer(model, optimizer, dir, *record, options);
  };
  s.foreign_tensors = [&format, dir, record, options](core::ShardedModel& model) {
    return format.foreign_tensors(model, dir, *record, options);
  };
  return s;
}

/// The one rule of resuming, whatever wrote the step: every part asked for is found (or, with allow_missing,
/// warned about) and the small ones checked before anything is loaded; then the model, the optimizer, the
/// scheduler (after the optimizer: when one is passed, its state decides the LRs, not the ones the optimizer's
/// state brought) and the RNG states.
inline ResumeInfo resume(core::ShardedModel& model, const SavedStep& s, torch::optim::Optimizer* optimizer,
                         LrScheduler* scheduler, const LoadOptions& options) {
  ResumeInfo info;
  info.step = s.step;
  info.saved_world_size = s.saved_world_size;
  const bool want_optimizer = optimizer != nullptr && options.load_optimizer;
  const bool want_scheduler = scheduler != nullptr && options.load_scheduler;
  bool model_checked = false;
  const auto lacks = [&](const std::string& part, const std::string& why) {
    // Another model's checkpoint (another program's root) is the cause to report, not its missing part.
    if (!options.allow_missing && !model_checked && s.foreign_tensors) {
      model_checked = true;
      const std::vector<std::string> foreign = s.foreign_tensors(model);
      FSDPX_CHECK_AS(IoError, foreign.empty(), s.what,
                     " holds another model than this one (another program's checkpoint root?): ",
                     ::fsdpx::detail::join_names(foreign, 8), " are not parameters or buffers of this model");
    }
    FSDPX_CHECK_AS(IoError, options.allow_missing, s.what, " has no ", part, " (", why, "); pass LoadOptions{.load_",
                   part == "client state" ? "client_state" : part,
                   " = false} to resume without it, or .allow_missing = true to be warned instead");
    TORCH_WARN("fsdpx: ", s.what, " has no ", part, " (", why, "); resuming without it");
    info.missing.push_back(part);
  };
  if (!s.client && options.load_client_state && want_optimizer) lacks("client state", s.no_client_state);
  const bool load_optimizer = want_optimizer && s.has_optimizer;
  if (want_optimizer && !load_optimizer) lacks("optimizer", s.no_optimizer);
  const bool load_scheduler = want_scheduler && s.scheduler.has_value();
  if (want_scheduler && !load_scheduler) lacks("scheduler", s.no_scheduler);
  if (load_scheduler) scheduler->check_state_dict(*s.scheduler);

  s.load_model(model);
  if (load_optimizer) s.load_optimizer(model, *optimizer);
  if (load_scheduler) {
    scheduler->load_state_dict(*s.scheduler);
    info.extra.scheduler = *s.scheduler;
  } else if (scheduler != nullptr && load_optimizer) {
    scheduler->apply();
  }
  if (s.restore_rng && options.restore_rng) s.restore_rng();
  info.extra.step = s.extra_step;
  if (s.client && options.load_client_state) info.extra.client = *s.client;
  return info;
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx {

FSDPX_DECL std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                     torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                                     const LoadOptions& options) {
  namespace ckpt = checkpoint;
  // What is asked for, as the step's opener sees it: it reads no part that is not
  LoadOptions asked = options;
  asked.load_optimizer = optimizer != nullptr && options.load_optimizer;
  asked.load_scheduler = scheduler != nullptr && options.load_scheduler;
  // A folder another trainer wrote (PyTorch DCP: LightRFT's, torchtitan's step folder), not an fsdpx root
  if (const auto foreign = ckpt::folder_format(root)) {
    const auto& format = ckpt::step_format(*foreign, ::fsdpx::detail::str("resuming from '", root.string(), "'"));
    return ckpt::detail::resume(*model, format.open_folder(root, *model, asked), optimizer, scheduler, asked);
  }
  std::optional<int64_t> step = options.step;
  if (!step) step = ckpt::find_latest_checkpoint(root, /*weights_only=*/!asked.load_optimizer);
  if (!step && asked.load_optimizer && options.allow_missing)
    step = ckpt::find_latest_checkpoint(root, /*weights_only=*/true);
  if (!step) return std::nullopt;
  const ckpt::SavedStep saved = ckpt::detail::open_root_step(root, *step, model->mesh().world().rank(), asked);
  return ckpt::detail::resume(*model, saved, optimizer, scheduler, asked);
}

}  // namespace fsdpx
