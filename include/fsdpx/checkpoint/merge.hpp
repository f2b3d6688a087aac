// Merging a checkpoint's model shards into the full state dict, without the model and without a
// process group: the model_world_size_<W>_rank_<r>.pt files of one step directory are read one at
// a time and their slices copied into whole tensors. What `fsdpx-merge` runs.
//
// Checked, each failure an IoError naming the file: the world size of fsdp_config.json against the
// model_* file names present (a missing rank, a file of another world size), every file's size and
// CRC-32C against fsdp_config.json, every file's own world_size and rank against its name, and the
// coverage of every parameter (a gap names the parameter and the range).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/hf/model_folder.hpp>
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint {

struct MergeOptions {
  /// Check each model file's size and CRC-32C against fsdp_config.json (reads each file twice).
  bool verify_checksums = true;
  /// Cast floating-point tensors to this dtype (e.g. at::kBFloat16); integer tensors are kept.
  std::optional<at::ScalarType> dtype;
  /// Where warnings go (a checkpoint without fsdp_config.json); std::cerr when empty.
  std::function<void(const std::string&)> warn;
};

/// What merge_checkpoint found, for a tool to report.
struct MergeReport {
  CheckpointFormat format = CheckpointFormat::fsdpx;  // the files' format (a folder of DCP: dcp)
  fs::path dir;                                       // the directory holding the model files
  int world_size = 0;
  bool committed = false;  // fsdp_config.json was there, with the model among its components
  bool complete = false;   // ... and every component (optimizer, extra state) committed too
  bool checksums_verified = false;
  std::optional<int64_t> step;  // from fsdp_config.json
  std::string kind;             // "sharded" or "full"
  std::vector<fs::path> files;  // the model files read, by rank
  std::vector<std::string> warnings;
};

/// Where a step directory's model files are: `dir` itself, or dir/actor when `dir` is global_step_<N>.
FSDPX_DECL fs::path model_dir(const fs::path& dir);

/// The full state dict of the checkpoint in `step_dir` (…/global_step_<N>/actor, or …/global_step_<N>):
/// every parameter whole, with its saved shape, in name order (the files do not record the model's order: a
/// rank's file lists only its slices, and nothing says where one unit ends). Reads one model file at
/// a time; holds only the result. Throws IoError naming the file (or the parameter) on any inconsistency.
/// A step saved in PyTorch Distributed Checkpoint (CheckpointFormat::dcp), or a DCP folder itself, is read
/// through DCP's code (<fsdpx/dcp.hpp>): its tensors whole, under their saved names.
FSDPX_DECL hf::NamedTensors merge_checkpoint(const fs::path& step_dir, const MergeOptions& options = {},
                                             MergeReport* report = nullptr);

namespace detail {

FSDPX_DECL std::string local_kind_message(const fs::path& what);

/// merge_checkpoint of fsdpx's own shard files in `dir` (`record`: the step's commit record, nullptr when it
/// has none: the world size then comes from the file names, with a warning).
FSDPX_DECL hf::NamedTensors merge_shard_files(const fs::path& dir, const CommitRecord* record,
                                              const MergeOptions& options, MergeReport& report);

}  // namespace detail

/// The step's huggingface/ folder (config.json, tokenizer files), or an empty path when it has none.
FSDPX_DECL fs::path huggingface_dir(const fs::path& step_dir);

/// Copies the step's huggingface/ files other than weights into `out_dir`, durably; returns the files
/// written (none when there is no huggingface/ folder). A checkpoint is not trusted: links are not
/// followed, and nothing is written outside `out_dir`.
inline std::vector<::fsdpx::detail::WrittenFile> copy_huggingface_files(
    const fs::path& step_dir, const fs::path& out_dir, std::function<bool(const std::string&)> skip = {}) {
  const fs::path hf = huggingface_dir(step_dir);
  if (hf.empty()) return {};
  return hf::copy_model_files(hf, out_dir, {.follow_symlinks = false, .skip = std::move(skip)});
}

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/merge.ipp>
#endif
