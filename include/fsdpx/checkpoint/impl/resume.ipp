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

/// fsdpx's LrScheduler state ({"last_step", "base_lrs"}) from a torch LR scheduler's state_dict (LightRFT's
/// scheduler_state.pt): its last_epoch is the number of steps taken, its base_lrs each group's base LR.
inline c10::IValue lr_scheduler_state_from_torch(const c10::IValue& saved, const fs::path& path) {
  const auto bad = [&](const std::string& why) {
    return IoError(::fsdpx::detail::str("fsdpx: '", path.string(), "' is not a torch LR scheduler's state: ", why));
  };
  if (!saved.isGenericDict()) throw bad(::fsdpx::detail::str("it holds ", saved.tagKind(), ", not a dict"));
  const auto d = saved.toGenericDict();
  if (!d.contains("last_epoch") || !d.at("last_epoch").isInt() || d.at("last_epoch").toInt() < 0)
    throw bad("no integer last_epoch >= 0");
  if (!d.contains("base_lrs") || !d.at("base_lrs").isList()) throw bad("no list base_lrs");
  c10::List<double> base_lrs;
  for (const c10::IValue& lr : d.at("base_lrs").toListRef()) {
    if (!lr.isDouble() && !lr.isInt()) throw bad("a base_lrs entry is not a number");
    base_lrs.push_back(lr.isDouble() ? lr.toDouble() : static_cast<double>(lr.toInt()));
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("last_step", d.at("last_epoch").toInt());
  out.insert("base_lrs", base_lrs);
  return out;
}

FSDPX_DECL ResumeInfo load_dcp_checkpoint(const fs::path& dir, core::ShardedModel& model,
                                          torch::optim::Optimizer* optimizer, LrScheduler* scheduler,
                                          const LoadOptions& options) {
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
  // Every part asked for is checked, and the small ones read, before the model is touched, as for fsdpx's own
  // checkpoints.
  const auto lacks = [&](const std::string& part, const std::string& why) {
    FSDPX_CHECK_AS(IoError, options.allow_missing, "DCP checkpoint '", dir.string(), "': its ", part,
                   " is not loaded (", why, "); pass LoadOptions{.load_",
                   part == "client state" ? "client_state" : part,
                   " = false} to resume without it, or .allow_missing = true to be warned instead");
    TORCH_WARN("fsdpx: DCP checkpoint '", dir.string(), "': its ", part, " is not loaded (", why,
               "); resuming without it");
    info.missing.push_back(part);
  };
  // torchtitan's step folder is one DCP: {"model": ..., "optimizer": (flattened by parameter), "lr_scheduler":
  // ..., "dataloader": ..., "train_state": ...}; newer torchtitan puts the model's entries at the top level.
  // LightRFT's is the model's DCP, optim_states/, scheduler_state.pt and client_state.pt.
  const bool titan = reader.has_entry_under("optimizer.state.") || reader.find_tensor("train_state.step") != nullptr;
  DcpLoadOptions names = options.dcp;
  names.strict = names.strict && options.strict;
  if (titan) {
    // {"model": ...} nests the model's entries under "model."; transformers' own names start with "model." too,
    // so the nesting is what the model's names are found under
    const auto nested = [&] {
      for (size_t i = 0; i < model.num_units(); ++i) {
        for (const core::ParamInfo& p : model.unit(i).layout().params()) {
          const auto file = names.file_name ? names.file_name(p.name) : std::optional<std::string>(p.name);
          if (file && reader.has_entry_under("model." + *file)) return true;
        }
      }
      return false;
    };
    if (names.prefix.empty() && nested()) names.prefix = "model.";
    names.ignore = [user = names.ignore](const std::string& entry) {
      for (const char* part : {"optimizer.", "lr_scheduler.", "dataloader.", "train_state."}) {
        if (entry.starts_with(part)) return true;
      }
      return user && user(entry);
    };
    if (const auto* step = reader.find_tensor("train_state.step"); step != nullptr && step->size.empty())
      info.step = reader.read("train_state.step").to(at::kLong).item<int64_t>();
  }
  const fs::path optim_dir = dir / "optim_states", scheduler_file = dir / "scheduler_state.pt",
                 client_file = dir / "client_state.pt";
  const bool load_optimizer =
      optimizer != nullptr && (titan ? reader.has_entry_under("optimizer.state.") : dcp::is_checkpoint(optim_dir));
  if (optimizer != nullptr && !load_optimizer) {
    lacks("optimizer", titan ? "it has no optimizer.state entries" : "the folder has no optim_states/ checkpoint");
  }
  std::optional<c10::IValue> scheduler_state;
  if (scheduler != nullptr) {
    if (titan && reader.has_bytes("lr_scheduler.last_epoch") && reader.has_bytes("lr_scheduler.base_lrs")) {
      c10::impl::GenericDict saved(c10::StringType::get(), c10::AnyType::get());
      saved.insert("last_epoch", reader.read_bytes("lr_scheduler.last_epoch"));
      saved.insert("base_lrs", reader.read_bytes("lr_scheduler.base_lrs"));
      scheduler_state = lr_scheduler_state_from_torch(saved, dir / "lr_scheduler");
    } else if (!titan && fs::exists(scheduler_file)) {
      scheduler_state = lr_scheduler_state_from_torch(dcp::read_plain_file(scheduler_file), scheduler_file);
    } else {
      lacks("scheduler", titan ? "it has no lr_scheduler.last_epoch and lr_scheduler.base_lrs"
                               : "the folder has no scheduler_state.pt");
    }
    if (scheduler_state) scheduler->check_state_dict(*scheduler_state);
  }
  if (!titan && options.load_client_state && fs::exists(client_file)) {
    const c10::IValue client = dcp::read_plain_file(client_file);
    FSDPX_CHECK_AS(IoError, client.isGenericDict(), "DCP checkpoint '", dir.string(), "': client_state.pt holds ",
                   client.tagKind(), ", not a dict");
    info.extra.client = client.toGenericDict();
  } else if (!titan && options.load_client_state && optimizer != nullptr) {
    lacks("client state", "the folder has no client_state.pt");
  }
  info.extra.step = info.step;
  load_model_state_dict(model, reader, names);
  if (load_optimizer && titan) {
    load_optimizer_state_dict(*optimizer, model, reader, {.prefix = "optimizer.", .file_name = names.file_name});
  } else if (load_optimizer) {  // the optimizer's own checkpoint: the model's names, no prefix
    load_optimizer_state_dict(*optimizer, model, optim_dir, {.file_name = names.file_name});
  }
  if (scheduler_state) {
    scheduler->load_state_dict(*scheduler_state);  // after the optimizer: the LRs the schedule gives
    info.extra.scheduler = *scheduler_state;
  }
  return info;
}

}  // namespace fsdpx::checkpoint::detail
