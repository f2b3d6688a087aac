// Out-of-line functions of fsdpx/checkpoint/step_format.hpp: the formats' registry, and fsdpx's own format.
// Included by it (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <array>
#include <cstdio>
#include <set>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/checkpoint/step_format.hpp>

namespace fsdpx::checkpoint::detail {

/// Rank `r`'s files of component `c` of a committed step, streamed to `fn`, each checked against the record.
/// At the saving topology a rank reads only the file that holds its shards (`only_rank`).
inline void for_each_saved_file(const fs::path& dir, const CommitRecord& record, Component c,
                                std::optional<int> only_rank, bool verify,
                                const std::function<void(const StateDict&)>& fn) {
  for (int r = 0; r < record.world_size; ++r) {
    if (only_rank && r != *only_rank) continue;
    const std::string name = shard_file_name(c, record.world_size, r);
    fn(load_shard_file(dir, name, record.file(dir, name, verify)));
  }
}

/// fsdpx's own format: one torch.save file per rank and component (format.hpp), its marker "<file> <bytes>
/// <crc32c>".
class FsdpxStepFormat final : public StepFormat {
 public:
  CheckpointFormat format() const override { return CheckpointFormat::fsdpx; }

  WrittenComponent write(const SaveRequest& req, const fs::path& dir, Component c, int rank, int world_size,
                         const SaveNames&) const override {
    const fs::path path = dir / shard_file_name(c, world_size, rank);
    WrittenComponent out;
    out.file = c == Component::model   ? save_state_dict(path, req.model)
               : c == Component::optim ? save_state_dict(path, *req.optim)
                                       : save_ivalue(path, *req.extra);
    out.marker = ::fsdpx::detail::str(path.filename().string(), " ", out.file.bytes, " ", out.file.crc32c, "\n");
    return out;
  }

  std::map<std::string, CommittedFile> commit(const fs::path&, int64_t step, Component c,
                                              std::span<const std::string> markers) const override {
    std::map<std::string, CommittedFile> files;
    for (size_t r = 0; r < markers.size(); ++r) {
      char name[256] = {};
      long long bytes = 0;
      unsigned long crc = 0;
      FSDPX_CHECK_AS(IoError, std::sscanf(markers[r].c_str(), "%255s %lld %lu", name, &bytes, &crc) == 3,
                     "checkpoint step ", step, ": rank ", r, "'s ", to_string(c), " marker is corrupt");
      files[name] = {int64_t{bytes}, static_cast<uint32_t>(crc)};
    }
    return files;
  }

  void load_model(core::ShardedModel& model, const fs::path& dir, const CommitRecord& record,
                  const LoadOptions& options) const override {
    // A full checkpoint is rank 0's file; a local one is each rank's own.
    const auto& mesh = model.mesh();
    const std::optional<int> only = record.kind == "full"    ? std::optional<int>(0)
                                    : record.kind == "local" ? std::optional<int>(mesh.world().rank())
                                                             : std::nullopt;
    with_own_file_first(model, record, [&](std::optional<int> own) {
      load_model_state_dict(
          model,
          [&](const auto& fn) {
            for_each_saved_file(dir, record, Component::model, only ? only : own, options.verify_checksums, fn);
          },
          options.strict);
    });
  }

  void load_optimizer(core::ShardedModel& model, torch::optim::Optimizer& optimizer, const fs::path& dir,
                      const CommitRecord& record, const LoadOptions& options) const override {
    with_own_file_first(model, record, [&](std::optional<int> own) {
      load_optimizer_state_dict(model, optimizer, [&](const auto& fn) {
        for_each_saved_file(dir, record, Component::optim, own, options.verify_checksums, fn);
      });
    });
  }

  std::vector<std::string> foreign_tensors(core::ShardedModel& model, const fs::path& dir, const CommitRecord& record,
                                           const LoadOptions& options) const override {
    // Not for full state dicts (rank 0's file is the whole model) nor local ones (their entries are units), and
    // not when loading is not strict (extra names are then allowed). Reads this rank's model file.
    if (record.kind == "local" || record.kind == "full" || !options.strict) return {};
    const std::string name =
        shard_file_name(Component::model, record.world_size, model.mesh().world().rank() % record.world_size);
    if (record.files.count(name) == 0) return {};
    const StateDict saved = load_shard_file(dir, name, record.file(dir, name, options.verify_checksums));
    std::set<std::string> ours;
    for (size_t i = 0; i < model.num_units(); ++i) {
      for (const auto& p : model.unit(i).layout().params()) ours.insert(p.name);
    }
    for (const auto& [buffer, b] : model.named_buffers()) ours.insert(buffer);
    std::vector<std::string> foreign;
    for (const TensorSlice& e : saved.entries) {
      if (ours.count(e.name) == 0) foreign.push_back(e.name);
    }
    return foreign;
  }

  hf::NamedTensors merge(const fs::path& dir, const CommitRecord* record, const MergeOptions& options,
                         MergeReport* report) const override {
    return merge_shard_files(dir, record, options, *report);
  }

 private:
  /// At the saving topology, the file of this rank's shard holds everything it needs; but only when the flat
  /// layout is the saving job's too: with other parameters frozen or other units, this rank's shards are other
  /// ranges, and every saving rank's file is read (which also names what does not match the model now).
  template <class Load>
  static void with_own_file_first(core::ShardedModel& model, const CommitRecord& record, const Load& load) {
    const auto& mesh = model.mesh();
    const bool same_topology = record.world_size == mesh.world().size() && record.mesh_shard == mesh.shard_size();
    if (!same_topology) return load(std::nullopt);
    try {
      load(std::optional<int>(mesh.shard_group().rank()));
    } catch (const Error&) {
      load(std::nullopt);
    }
  }
};

/// The registered formats, by CheckpointFormat; fsdpx's own is always there. Made once and never destroyed, as
/// the formats are: a coordinator that outlives static destruction still finds them.
inline std::array<const StepFormat*, 2>& step_formats() {
  static auto* formats = new std::array<const StepFormat*, 2>{new FsdpxStepFormat(), nullptr};
  return *formats;
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx::checkpoint {

FSDPX_DECL SavedStep StepFormat::open_folder(const fs::path& dir, core::ShardedModel&, const LoadOptions&) const {
  FSDPX_FAIL(Error, "'", dir.string(), "': checkpoint format '", to_string(format()),
             "' has no folders outside an fsdpx checkpoint root");
}

FSDPX_DECL const StepFormat& step_format(CheckpointFormat f, std::string_view needed_for) {
  const auto index = static_cast<size_t>(f);
  const auto& formats = detail::step_formats();
  if (index < formats.size() && formats[index] != nullptr) return *formats[index];
  const char* header = "its header";
  for (const auto& home : detail::format_homes) {
    if (home.format == f) header = home.header;
  }
  throw ConfigError(::fsdpx::detail::str(
      "fsdpx: ", needed_for.empty() ? std::string_view("this") : needed_for, " needs checkpoint format '", to_string(f),
      "', whose code this program lacks: include ", header,
      " in one of its translation units (or link fsdpx's separately compiled part, which has it)"));
}

FSDPX_DECL void register_step_format(const StepFormat& impl) {
  const auto index = static_cast<size_t>(impl.format());
  auto& formats = detail::step_formats();
  FSDPX_CHECK(index < formats.size(), "register_step_format: format ", index, " is not a CheckpointFormat");
  formats[index] = &impl;
}

FSDPX_DECL std::optional<CheckpointFormat> folder_format(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  for (const auto& home : detail::format_homes) {
    if (fs::exists(dir / home.folder_marker, ec)) return home.format;
  }
  return std::nullopt;
}

}  // namespace fsdpx::checkpoint
