// Out-of-line functions of fsdpx/dcp/layouts.hpp: the known folder layouts, and DCP's checkpoint::StepFormat
// with its registration. Included by layouts.hpp (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/layouts.hpp>

#include <algorithm>
#include <any>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/dcp/state_dict_loader.hpp>
#include <fsdpx/dcp/state_dict_saver.hpp>
#include <fsdpx/dcp/writer.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx::dcp {

FSDPX_DECL FolderLayout folder_layout(const Reader& reader) {
  return reader.has_entry_under("optimizer.state.") || reader.find_tensor("train_state.step") != nullptr
             ? FolderLayout::torchtitan
             : FolderLayout::lightrft;
}

FSDPX_DECL LoadOptions optimizer_names(const LoadOptions& model_names, std::string prefix) {
  LoadOptions names;
  names.prefix = std::move(prefix);
  names.file_name = model_names.file_name;
  names.placed_in = model_names.placed_in;
  return names;
}

FSDPX_DECL hf::NamedTensors read_tensors(const Reader& reader, std::optional<c10::ScalarType> dtype) {
  hf::NamedTensors out;
  for (const auto& [fqn, entry] : reader.metadata().entries) {
    if (!std::holds_alternative<TensorEntry>(entry)) continue;
    at::Tensor t = reader.read(fqn);
    if (dtype && at::isFloatingType(t.scalar_type())) t = t.to(*dtype);
    out.emplace_back(fqn, std::move(t));
  }
  return out;
}

}  // namespace fsdpx::dcp

namespace fsdpx::dcp::detail {

/// fsdpx's LrScheduler state ({"last_step", "base_lrs"}) from a torch LR scheduler's state_dict (LightRFT's
/// scheduler_state.pt, torchtitan's lr_scheduler entries): its last_epoch is the number of steps taken, its
/// base_lrs each group's base LR.
inline c10::IValue lr_scheduler_state_from_torch(const c10::IValue& saved, const fs::path& path) {
  const auto bad = [&](const std::string& why) {
    return IoError(::fsdpx::detail::str("fsdpx: '", path.string(), "' is not a torch LR scheduler's state: ", why));
  };
  if (!saved.isGenericDict()) throw bad(::fsdpx::detail::str("it holds ", saved.tagKind(), ", not a dict"));
  const auto d = saved.toGenericDict();
  if (!d.contains("last_epoch") || !d.at("last_epoch").isInt()) throw bad("no integer last_epoch");
  if (!d.contains("base_lrs") || !d.at("base_lrs").isList()) throw bad("no list base_lrs");
  std::vector<double> lrs;
  for (const c10::IValue& lr : d.at("base_lrs").toListRef()) {
    if (!lr.isDouble() && !lr.isInt()) throw bad("a base_lrs entry is not a number");
    lrs.push_back(lr.isDouble() ? lr.toDouble() : static_cast<double>(lr.toInt()));
  }
  const std::string implausible = ::fsdpx::detail::implausible_schedule(d.at("last_epoch").toInt(), lrs, "last_epoch");
  if (!implausible.empty()) throw bad(implausible);
  const c10::List<double> base_lrs(lrs);
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("last_step", d.at("last_epoch").toInt());
  out.insert("base_lrs", base_lrs);
  return out;
}

/// LightRFT's client_state.pt as the client state of a resume from its folder of step `step`: the counters
/// that LightRFT's and OpenRLHF's trainers keep there (global_step, episode, consumed_samples) must be integers
/// a run reaches, and global_step the folder's own step; the other values are the user's and pass as read.
inline c10::impl::GenericDict client_state_from_lightrft(const c10::IValue& saved, const fs::path& path, int64_t step) {
  const auto bad = [&](const std::string& why) {
    return IoError(::fsdpx::detail::str("fsdpx: '", path.string(), "' is not a client state to resume: ", why));
  };
  if (!saved.isGenericDict()) throw bad(::fsdpx::detail::str("it holds ", saved.tagKind(), ", not a dict"));
  const auto d = saved.toGenericDict();
  constexpr int64_t max_count = int64_t{1} << 48;
  for (const char* key : {"global_step", "episode", "consumed_samples"}) {
    if (!d.contains(key)) continue;
    const c10::IValue& v = d.at(key);
    if (!v.isInt() || v.toInt() < 0 || v.toInt() > max_count)
      throw bad(::fsdpx::detail::str("its ", key, " is ", v, ", not an integer in [0, 2^48]"));
  }
  if (step > 0 && d.contains("global_step") && d.at("global_step").toInt() != step)
    throw bad(::fsdpx::detail::str("its global_step is ", d.at("global_step").toInt(), ", its folder is step ", step));
  return d;
}

/// The step LightRFT names a step's folder by ("global_step10": the number it ends with); 0 without one.
inline int64_t step_of_folder(const fs::path& dir) {
  const std::string name = dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  size_t digits = name.size();
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(name[digits - 1])) != 0) --digits;
  return digits < name.size() && name.size() - digits <= 15 ? std::stoll(name.substr(digits)) : 0;
}

/// The world size that saved a folder: its data files are "__<rank>_<n>.distcp".
inline int saving_world_size(const Reader& reader) {
  int world = 0;
  for (const auto& [key, storage] : reader.metadata().storage) {
    int rank = 0;
    if (std::sscanf(storage.relative_path.c_str(), "__%d_", &rank) == 1 && rank >= 0 &&
        rank < checkpoint::max_world_size)
      world = std::max(world, rank + 1);
  }
  return world;
}

/// A reader of the DCP folder `prefix` ("" or "optim_states/") of a committed step: its files as the commit
/// record lists them, their CRC-32C checked when `verify` (a record without files, written before fsdpx
/// recorded them, checks nothing).
inline ReaderOptions committed_reader(const checkpoint::CommitRecord& record, const std::string& prefix, bool verify) {
  ReaderOptions options;
  if (record.files.empty()) return options;
  auto& files = options.committed.emplace();
  for (const auto& [name, file] : record.files) {
    if (!name.starts_with(prefix) || name.find('/', prefix.size()) != std::string::npos) continue;
    files[name.substr(prefix.size())] = {file.bytes, verify ? file.crc32c : std::nullopt};
  }
  return options;
}

/// The model's names in a step of `options` (LoadOptions::dcp), strict when both say so.
inline LoadOptions model_names(const ::fsdpx::LoadOptions& options) {
  LoadOptions names = options.dcp;
  names.strict = names.strict && options.strict;
  return names;
}

/// Where a component of a step written in LightRFT's layout lies, relative to the step folder: the model's DCP
/// in it, the optimizer's in optim_states/.
inline std::string component_folder(checkpoint::Component c) {
  return c == checkpoint::Component::model ? std::string() : std::string(optimizer_folder) + "/";
}

/// LightRFT's or torchtitan's step folder `dir`, opened for resuming `model` (see load_checkpoint).
inline checkpoint::SavedStep open_folder(const fs::path& dir, core::ShardedModel& model,
                                         const ::fsdpx::LoadOptions& options) {
  checkpoint::SavedStep s;
  s.what = ::fsdpx::detail::str("DCP checkpoint '", dir.string(), "'");
  s.step = step_of_folder(dir);
  const auto reader = std::make_shared<const Reader>(dir);
  if (model.mesh().world().rank() == 0) {
    std::fprintf(stderr,
                 "fsdpx: load_checkpoint: '%s' is a DCP folder another trainer wrote: its data carries no "
                 "checksums, so a corrupt file is found only where it fails to parse\n",
                 dir.string().c_str());
  }
  s.saved_world_size = saving_world_size(*reader);
  const bool titan = folder_layout(*reader) == FolderLayout::torchtitan;
  LoadOptions names = model_names(options);
  if (titan) {
    // {"model": ...} nests the model's entries under "model."; transformers' own names start with "model." too,
    // so the nesting is what the model's names are found under
    const auto nested = [&] {
      for (size_t i = 0; i < model.num_units(); ++i) {
        for (const core::ParamInfo& p : model.unit(i).layout().params()) {
          const auto file = names.file_name ? names.file_name(p.name) : std::optional<std::string>(p.name);
          if (file && reader->has_entry_under("model." + *file)) return true;
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
    if (const auto* step = reader->find_tensor("train_state.step"); step != nullptr && step->size.empty())
      s.step = reader->read("train_state.step").to(at::kLong).item<int64_t>();
  }
  s.extra_step = s.step;
  const fs::path optim_dir = dir / optimizer_folder, scheduler_file = dir / "scheduler_state.pt",
                 client_file = dir / "client_state.pt";
  s.has_optimizer = titan ? reader->has_entry_under("optimizer.state.") : is_checkpoint(optim_dir);
  if (!s.has_optimizer)
    s.no_optimizer = titan ? "it has no optimizer.state entries" : "the folder has no optim_states/ checkpoint";
  if (options.load_scheduler) {
    if (titan && reader->has_bytes("lr_scheduler.last_epoch") && reader->has_bytes("lr_scheduler.base_lrs")) {
      c10::impl::GenericDict saved(c10::StringType::get(), c10::AnyType::get());
      saved.insert("last_epoch", reader->read_bytes("lr_scheduler.last_epoch"));
      saved.insert("base_lrs", reader->read_bytes("lr_scheduler.base_lrs"));
      s.scheduler = lr_scheduler_state_from_torch(saved, dir / "lr_scheduler");
    } else if (!titan && fs::exists(scheduler_file)) {
      s.scheduler = lr_scheduler_state_from_torch(read_plain_file(scheduler_file), scheduler_file);
    } else {
      s.no_scheduler = titan ? "it has no lr_scheduler.last_epoch and lr_scheduler.base_lrs"
                             : "the folder has no scheduler_state.pt";
    }
  }
  if (titan) {
    s.client = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());  // it keeps none
  } else if (options.load_client_state && fs::exists(client_file)) {
    s.client = client_state_from_lightrft(read_plain_file(client_file), client_file, s.step);
  } else {
    s.no_client_state = "the folder has no client_state.pt";
  }
  s.load_model = [reader, names](core::ShardedModel& m) { load_model(m, *reader, names); };
  if (titan) {
    s.load_optimizer = [reader, names](core::ShardedModel& m, torch::optim::Optimizer& o) {
      load_optimizer(m, o, *reader, optimizer_names(names, "optimizer."));
    };
  } else {
    s.load_optimizer = [optim_dir, names](core::ShardedModel& m, torch::optim::Optimizer& o) {
      load_optimizer(m, o, optim_dir, optimizer_names(names, ""));
    };
  }
  return s;
}

/// DCP's seam: a step in LightRFT's layout (the model's DCP in the step folder, the optimizer's in
/// optim_states/), each `.metadata` written by rank 0 once every rank's data file is durable; the extra state
/// is fsdpx's own file.
class DcpStepFormat final : public checkpoint::StepFormat {
 public:
  CheckpointFormat format() const override { return CheckpointFormat::dcp; }

  void prepare(SaveRequest& req, core::ShardedModel& model, torch::optim::Optimizer* optimizer,
               const SaveNames& names) const override {
    FSDPX_CHECK(req.model.kind != StateDictKind::local,
                "CheckpointFormat::dcp writes sharded or full state dicts; this model's StateDict policy is "
                "LocalStateDict, whose entries are flat unit shards that name no tensor");
    // The param groups' parameter lists come from every rank's shards: gathered here, collectively.
    if (optimizer != nullptr) req.format_data = param_group_entries(model, *optimizer, names);
  }

  std::vector<std::string> commit_files() const override {
    return {metadata_file_name, component_folder(checkpoint::Component::optim) + metadata_file_name};
  }

  checkpoint::WrittenComponent write(const SaveRequest& req, const fs::path& dir, checkpoint::Component c, int rank,
                                     int world_size, const SaveNames& names) const override {
    if (c == checkpoint::Component::extra_state) return fsdpx_format().write(req, dir, c, rank, world_size, names);
    const std::string prefix = component_folder(c);
    const fs::path where = dir / prefix;
    std::error_code ec;
    fs::create_directories(where, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create '", where.string(), "': ", ec.message());
    RankState state;
    if (c == checkpoint::Component::model) {
      state.tensors = model_tensors(req.model, names);
    } else {
      state.tensors = optimizer_tensors(*req.optim, names);
      if (const auto* groups = std::any_cast<std::vector<SavedBytes>>(&req.format_data)) state.bytes = *groups;
    }
    const RankData data = write_rank_data(where, rank, state);
    ::fsdpx::detail::Json marker = ::fsdpx::detail::Json::object();
    marker["file"] = data.file.path.empty() ? std::string() : prefix + data.relative_path;
    marker["bytes"] = data.file.bytes;
    marker["crc32c"] = data.file.crc32c;
    marker["rank_data"] = encode_rank_data(data);
    return {data.file, marker.dump() + "\n"};
  }

  std::map<std::string, checkpoint::CommittedFile> commit(const fs::path& dir, int64_t step, checkpoint::Component c,
                                                          std::span<const std::string> markers) const override {
    if (c == checkpoint::Component::extra_state) return fsdpx_format().commit(dir, step, c, markers);
    const std::string prefix = component_folder(c);
    std::map<std::string, checkpoint::CommittedFile> files;
    std::vector<RankData> ranks;
    for (int r = 0; r < static_cast<int>(markers.size()); ++r) {
      ::fsdpx::detail::Json m;
      try {
        m = ::fsdpx::detail::Json::parse(markers[r]);
        const auto file = m.at("file").get<std::string>();
        if (!file.empty()) files[file] = {m.at("bytes").get<int64_t>(), m.at("crc32c").get<uint32_t>()};
      } catch (const std::exception& e) {
        throw IoError(::fsdpx::detail::str("fsdpx: checkpoint step ", step, ": rank ", r, "'s ", to_string(c),
                                           " marker is corrupt: ", e.what()));
      }
      ranks.push_back(decode_rank_data(m.at("rank_data").get<std::string>(), r));
    }
    // Every rank's data file is durable: the component's .metadata now, before any commit record names it
    const auto written = write_metadata(dir / prefix / metadata_file_name, make_metadata(ranks));
    files[prefix + metadata_file_name] = {written.bytes, written.crc32c};
    return files;
  }

  void load_model(core::ShardedModel& model, const fs::path& dir, const checkpoint::CommitRecord& record,
                  const ::fsdpx::LoadOptions& options) const override {
    ::fsdpx::dcp::load_model(model, Reader(dir, committed_reader(record, "", options.verify_checksums)),
                             model_names(options));
  }

  void load_optimizer(core::ShardedModel& model, torch::optim::Optimizer& optimizer, const fs::path& dir,
                      const checkpoint::CommitRecord& record, const ::fsdpx::LoadOptions& options) const override {
    ::fsdpx::dcp::load_optimizer(
        model, optimizer,
        Reader(dir / optimizer_folder,
               committed_reader(record, std::string(optimizer_folder) + "/", options.verify_checksums)),
        optimizer_names(options.dcp, ""));
  }

  hf::NamedTensors merge(const fs::path& dir, const checkpoint::CommitRecord* record,
                         const checkpoint::MergeOptions& options, checkpoint::MergeReport* report) const override {
    if (record != nullptr) {
      FSDPX_CHECK_AS(IoError, checkpoint::is_committed(*record, /*weights_only=*/true), "commit record '",
                     record->path.string(),
                     "': the model component is not committed (its \"components\" omit \"model\")");
    }
    const Reader reader(dir,
                        record != nullptr ? committed_reader(*record, "", options.verify_checksums) : ReaderOptions{});
    hf::NamedTensors tensors = read_tensors(reader, options.dtype);
    FSDPX_CHECK_AS(IoError, !tensors.empty(), "the DCP checkpoint in '", dir.string(), "' holds no tensor");
    report->dir = dir;
    report->world_size = record != nullptr ? record->world_size : saving_world_size(reader);
    report->committed = record != nullptr;
    report->complete = record != nullptr && record->complete;
    report->step = record != nullptr ? record->step : std::nullopt;
    report->kind = record != nullptr ? record->kind : std::string();
    report->checksums_verified = record != nullptr && !record->files.empty() && options.verify_checksums;
    std::set<std::string> files;
    for (const auto& [key, info] : reader.metadata().storage) files.insert(info.relative_path);
    for (const std::string& f : files) report->files.push_back(dir / f);
    return tensors;
  }

  checkpoint::SavedStep open_folder(const fs::path& dir, core::ShardedModel& model,
                                    const ::fsdpx::LoadOptions& options) const override {
    return detail::open_folder(dir, model, options);
  }

 private:
  static const checkpoint::StepFormat& fsdpx_format() { return checkpoint::step_format(CheckpointFormat::fsdpx); }
};

static_assert(std::string_view(metadata_file_name) == checkpoint::detail::format_homes[0].folder_marker &&
                  std::string_view(metadata_file_name) == checkpoint::detail::format_homes[0].commit_files[0] &&
                  std::string_view("optim_states/.metadata") == checkpoint::detail::format_homes[0].commit_files[1] &&
                  std::string_view(optimizer_folder) == "optim_states",
              "the checkpoint layer knows a DCP folder by its .metadata, and its commit files "
              "(checkpoint/step_format.hpp)");

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL const checkpoint::StepFormat& step_format() {
  static const auto* format = new detail::DcpStepFormat();  // never destroyed: see checkpoint::detail::step_formats
  return *format;
}

namespace detail {
/// DCP's seam joins the registry when the program starts: any translation unit that includes this header (or
/// fsdpx's separately compiled part) brings it. (An inline variable's initialization, which GCC and Clang run
/// at start-up in every program that links such a translation unit; in a shared library built with hidden
/// symbols, the library's registry is its own.)
inline const bool step_format_registered = (checkpoint::register_step_format(::fsdpx::dcp::step_format()), true);
}  // namespace detail

}  // namespace fsdpx::dcp
