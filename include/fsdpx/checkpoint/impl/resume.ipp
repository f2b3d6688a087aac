// Out-of-line functions of fsdpx/checkpoint/resume.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cctype>
#include <cstdio>

#include <fsdpx/checkpoint/resume.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL void for_each_saved_file(const fs::path& dir, const CommitRecord& record, Component c,
                                    std::optional<int> only_rank, bool verify,
                                    const std::function<void(const StateDict&)>& fn) {
  for (int r = 0; r < record.world_size; ++r) {
    if (only_rank && r != *only_rank) continue;
    const std::string name = shard_file_name(c, record.world_size, r);
    fn(load_shard_file(dir, name, record.file(dir, name, verify)));
  }
}

FSDPX_DECL ResumeInfo load_dcp_checkpoint(const fs::path& dir, core::ShardedModel& model, bool want_optimizer,
                                          bool want_scheduler, const LoadOptions& options) {
  ResumeInfo info;
  // LightRFT names a step's folder by its tag ("global_step10"): the number it ends with is the step.
  const std::string name = dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  size_t digits = name.size();
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(name[digits - 1])) != 0) --digits;
  if (digits < name.size() && name.size() - digits <= 15) info.step = std::stoll(name.substr(digits));
  const dcp::Reader reader(dir);
  for (const auto& [key, storage] : reader.metadata().storage) {  // "__<rank>_<n>.distcp": the saving ranks
    int rank = 0;
    if (std::sscanf(storage.relative_path.c_str(), "__%d_", &rank) == 1 && rank >= 0 && rank < max_world_size)
      info.saved_world_size = std::max(info.saved_world_size, rank + 1);
  }
  // Every part asked for is checked before the model is touched, as for fsdpx's own checkpoints.
  const auto lacks = [&](const std::string& part, const std::string& why) {
    FSDPX_CHECK_AS(IoError, options.allow_missing, "DCP checkpoint '", dir.string(), "': its ", part,
                   " is not loaded (", why, "); pass LoadOptions{.load_", part,
                   " = false} to resume without it, or .allow_missing = true "
                   "to be warned instead");
    TORCH_WARN("fsdpx: DCP checkpoint '", dir.string(), "': its ", part, " is not loaded (", why,
               "); resuming without it");
    info.missing.push_back(part);
  };
  if (want_optimizer) {
    lacks("optimizer", dcp::is_checkpoint(dir / "optim_states")
                           ? "fsdpx does not read a DCP optimizer state (optim_states/) yet"
                           : "the folder has no optim_states/ checkpoint");
  }
  if (want_scheduler) lacks("scheduler", "a DCP checkpoint holds no fsdpx LR scheduler state");
  load_model_state_dict(model, reader, {.strict = options.strict});
  return info;
}

}  // namespace fsdpx::checkpoint::detail
