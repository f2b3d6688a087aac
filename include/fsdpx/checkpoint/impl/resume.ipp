// Out-of-line functions of fsdpx/checkpoint/resume.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <fsdpx/checkpoint/memory_tier.hpp>
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
    FSDPX_CHECK_AS(IoError, extra.step == step, "'", path.string(), "' says step ", extra.step, ", its folder is step ",
                   step);
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
  if (load_scheduler) {
    try {
      scheduler->check_state_dict(*s.scheduler);
    } catch (const ConfigError& e) {
      FSDPX_FAIL(IoError, s.what, "'s LR scheduler state cannot be resumed: ", ::fsdpx::detail::unprefixed(e.what()));
    }
  }

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

/// `path` as the step folder of an fsdpx root (global_step_<N>, or its actor/, holding a commit record): the
/// root and the step; nullopt for anything else.
inline std::optional<std::pair<fs::path, int64_t>> as_step_folder(const fs::path& path) {
  fs::path p = path.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::error_code ec;
  if (p.filename() == "actor" && fs::exists(p / config_file, ec)) p = p.parent_path();
  const std::string name = p.filename().string();
  if (name.rfind("global_step_", 0) != 0 || !fs::exists(p / "actor" / config_file, ec)) return std::nullopt;
  try {
    size_t used = 0;
    const int64_t step = std::stoll(name.substr(12), &used);
    if (used == name.size() - 12 && step >= 0) return std::make_pair(p.parent_path(), step);
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

/// Whether `name` is something fsdpx's coordinator keeps in a checkpoint root.
inline bool is_root_entry(const std::string& name) {
  return name.rfind("global_step_", 0) == 0 || name.rfind(".deleting_global_step_", 0) == 0 ||
         name == state_dict_iteration_file || name == checkpointed_iteration_file || name == memory_tier_id_file;
}

/// The newest committed step of `root` a load of the options' parts can take (with everything when an optimizer
/// is asked for; with allow_missing, else the weights alone).
inline std::optional<int64_t> newest_step(const fs::path& root, const LoadOptions& asked) {
  std::optional<int64_t> step = find_latest_checkpoint(root, /*weights_only=*/!asked.load_optimizer);
  if (!step && asked.load_optimizer && asked.allow_missing) step = find_latest_checkpoint(root, /*weights_only=*/true);
  return step;
}

/// Collective, for a root with a memory tier: the step the ranks resumed from it (every rank holds that step
/// there, read whole by all), or nullopt when the disk's step at `disk_step` is to be taken instead (no memory
/// step as new, or a copy some rank could not read: its cause is said, and the model is then loaded again
/// from disk, which overwrites whatever the memory step had loaded).
inline std::optional<ResumeInfo> resume_from_memory(core::ShardedModel& model, const fs::path& root,
                                                    std::optional<int64_t> disk_step,
                                                    torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                                    const LoadOptions& asked) {
  auto& world = model.mesh().world();
  const int rank = world.rank();
  const auto device = at::TensorOptions().dtype(at::kLong).device(world.device_type());
  std::string cause;
  fs::path folder;
  std::optional<int64_t> newest;
  try {
    if (const auto id = read_memory_tier_id(root)) {
      folder = memory_tier_root(memory_tier_dir(asked.memory_dir), *id);
      newest = newest_step(folder, asked);
    }
  } catch (const std::exception& e) {
    cause = e.what();
  }
  // the newest step every rank holds (keep >= 2: the one before the newest, when a rank's newest did not commit)
  at::Tensor agreed = at::full({1}, newest.value_or(-1), device);
  world.all_reduce(agreed, dist::ReduceOp::min);
  const int64_t step = agreed.item<int64_t>();
  if (step < 0 || step < disk_step.value_or(-1)) {
    if (!cause.empty()) TORCH_WARN("fsdpx: load_checkpoint: rank ", rank, " cannot use the memory tier: ", cause);
    if (rank == 0 && disk_step) {
      std::fprintf(stderr,
                   "fsdpx: load_checkpoint: the memory tier ('%s') holds no step as new as the disk's on every rank: "
                   "resuming step %lld from disk\n",
                   folder.string().c_str(), static_cast<long long>(*disk_step));
    }
    return std::nullopt;
  }
  std::optional<ResumeInfo> info;
  try {
    info = resume(model, open_root_step(folder, step, rank, asked), optimizer, scheduler, asked);
  } catch (const std::exception& e) {
    cause = e.what();
  }
  at::Tensor failed = at::full({1}, info ? 0 : 1, device);
  world.all_reduce(failed, dist::ReduceOp::max);
  if (failed.item<int64_t>() != 0) {
    if (!info) TORCH_WARN("fsdpx: load_checkpoint: rank ", rank, " cannot read memory step ", step, ": ", cause);
    FSDPX_CHECK_AS(IoError, disk_step.has_value(), "load_checkpoint: step ", step, " of the memory tier ('",
                   folder.string(), "') could not be read by every rank, and '", root.string(),
                   "' has no committed step on disk to resume instead");
    if (rank == 0) {
      std::fprintf(stderr,
                   "fsdpx: load_checkpoint: memory step %lld was not whole on every rank: resuming the disk's\n",
                   static_cast<long long>(step));
    }
    return std::nullopt;
  }
  if (rank == 0) {
    std::fprintf(stderr, "fsdpx: load_checkpoint: resuming step %lld from the memory tier ('%s'; on disk: %s)\n",
                 static_cast<long long>(step), folder.string().c_str(),
                 disk_step ? ::fsdpx::detail::str("step ", *disk_step).c_str() : "none");
  }
  info->source = folder;
  info->from_memory = true;
  return info;
}

/// `root` holds no step to resume: says so once (world rank 0) and starts from scratch when that is what a
/// relaunch expects (no root, an empty one, a root whose steps are not committed yet); anything else there
/// is an IoError that names it, so that a wrong path never silently trains from scratch.
inline void nothing_to_resume(const fs::path& root, bool want_optimizer, bool rank0) {
  const auto note = [&](const std::string& what) {
    if (rank0) std::fprintf(stderr, "fsdpx: load_checkpoint: %s: starting from scratch\n", what.c_str());
  };
  std::error_code ec;
  if (!fs::exists(root, ec)) return note(::fsdpx::detail::str("'", root.string(), "' does not exist yet"));
  FSDPX_CHECK_AS(IoError, fs::is_directory(root, ec), "load_checkpoint: '", root.string(),
                 "' is a file, not a checkpoint root (a folder)");
  std::vector<std::string> ours, other;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    (is_root_entry(name) ? ours : other).push_back(name);
  }
  std::sort(ours.begin(), ours.end());
  std::sort(other.begin(), other.end());
  if (ours.empty() && other.empty()) return note(::fsdpx::detail::str("'", root.string(), "' is empty"));
  FSDPX_CHECK_AS(IoError, !ours.empty(), "load_checkpoint: '", root.string(),
                 "' holds no fsdpx checkpoint (no global_step_<N> folder, no iteration file) and no PyTorch "
                 "Distributed Checkpoint (no .metadata), but ",
                 ::fsdpx::detail::join_names(other, 8),
                 ": give the checkpoint root (the folder the coordinator saved into), a step folder of it, or a "
                 "new or empty folder to start from scratch");
  // A commit record that cannot be read is a damaged root, not an empty one (the scans take it for no commit)
  for (const StepDir& s : list_steps(root)) read_commit_record(s.path / "actor");
  if (want_optimizer) {
    if (const auto weights = find_latest_checkpoint(root, /*weights_only=*/true)) {
      return note(::fsdpx::detail::str("'", root.string(), "' has the weights of step ", *weights,
                                       " committed but no step saved whole with its optimizer (pass "
                                       "LoadOptions{.allow_missing = true} to resume those weights)"));
    }
  }
  note(::fsdpx::detail::str("'", root.string(), "' has no committed step yet (", ::fsdpx::detail::join_names(ours, 8),
                            ")"));
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx {

FSDPX_DECL std::optional<ResumeInfo> load_checkpoint(ShardedModelRef model, const std::filesystem::path& root,
                                                     torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                                     const LoadOptions& options) {
  namespace ckpt = checkpoint;
  const bool rank0 = model->mesh().world().rank() == 0;
  // What is asked for, as the step's opener sees it: it reads no part that is not
  LoadOptions asked = options;
  asked.load_optimizer = optimizer != nullptr && options.load_optimizer;
  asked.load_scheduler = scheduler != nullptr && options.load_scheduler;
  // A step folder of an fsdpx root (what fsdpx-merge takes): that step, from its root
  if (const auto step_folder = ckpt::detail::as_step_folder(root)) {
    const auto& [parent, step] = *step_folder;
    FSDPX_CHECK_AS(ConfigError, !options.step || *options.step == step, "load_checkpoint: '", root.string(),
                   "' is the folder of step ", step, ", but LoadOptions::step is ", *options.step,
                   "; give the checkpoint root '", parent.string(), "' to choose a step");
    if (rank0) {
      std::fprintf(stderr,
                   "fsdpx: load_checkpoint: '%s' is step %lld of the checkpoint root '%s': resuming it "
                   "(give the root to resume its newest committed step)\n",
                   root.string().c_str(), static_cast<long long>(step), parent.string().c_str());
    }
    const ckpt::SavedStep saved = ckpt::detail::open_root_step(parent, step, model->mesh().world().rank(), asked);
    return ckpt::detail::resume(*model, saved, optimizer, scheduler, asked);
  }
  // A folder another trainer wrote (PyTorch DCP: LightRFT's, torchtitan's step folder), not an fsdpx root
  if (const auto foreign = ckpt::folder_format(root)) {
    const auto& format = ckpt::step_format(*foreign, ::fsdpx::detail::str("resuming from '", root.string(), "'"));
    return ckpt::detail::resume(*model, format.open_folder(root, *model, asked), optimizer, scheduler, asked);
  }
  std::optional<int64_t> step = options.step ? options.step : ckpt::detail::newest_step(root, asked);
  // Every rank sees the root's memory tier id file, or none does (the root is shared): all or none agree here
  std::error_code ec;
  if (!options.step && options.from_memory && std::filesystem::exists(root / ckpt::memory_tier_id_file, ec)) {
    if (auto info = ckpt::detail::resume_from_memory(*model, root, step, optimizer, scheduler, asked)) return info;
  }
  if (!step) {
    ckpt::detail::nothing_to_resume(root, asked.load_optimizer, rank0);
    return std::nullopt;
  }
  const ckpt::SavedStep saved = ckpt::detail::open_root_step(root, *step, model->mesh().world().rank(), asked);
  ResumeInfo info = ckpt::detail::resume(*model, saved, optimizer, scheduler, asked);
  info.source = root;
  return info;
}

}  // namespace fsdpx
