// A Hugging Face model folder's files other than weights: config.json, generation_config.json, the
// tokenizer's files, a chat template. They travel with a model: into every checkpoint step's
// huggingface/, into a merge's output, into an exported model folder. Weights never travel this way.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::hf {

namespace fs = std::filesystem;

/// Weight files of any format a model folder may hold (and their indexes): never copied with the
/// config and tokenizer files.
FSDPX_DECL bool is_weight_file(std::string_view name);

struct ModelFolderCopy {
  /// Follow symbolic links to regular files (the Hugging Face cache's snapshot folders are made of
  /// links into its blobs). Off for folders that are not trusted (a checkpoint's huggingface/): a link
  /// could name any file on the machine.
  bool follow_symlinks = true;
  /// Files not copied besides weights (e.g. "config.json" when the caller writes its own).
  std::function<bool(const std::string&)> skip;
  /// Files larger than this are refused (a tokenizer.json is a few MB; this bounds a crafted folder).
  int64_t max_file_bytes = int64_t{1} << 30;
};

/// Copies the top-level regular files of `from` that are not weights into `to` (created), each written
/// durably under its own name: nothing is written outside `to`, whatever the names or links in `from`.
/// Returns the files written.
FSDPX_DECL std::vector<::fsdpx::detail::WrittenFile> copy_model_files(const fs::path& from, const fs::path& to,
                                                                      const ModelFolderCopy& options = {});

}  // namespace fsdpx::hf

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/hf/impl/model_folder.ipp>
#endif
