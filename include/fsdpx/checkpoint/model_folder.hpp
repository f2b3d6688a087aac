// A Hugging Face model folder's files other than weights: config.json, generation_config.json, the
// tokenizer's files, a chat template. They travel with a model: into every checkpoint step's
// huggingface/, into a merge's output, into an exported model folder. Weights never travel this way.
#pragma once

#include <algorithm>
#include <array>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include <fsdpx/checkpoint/detail/file_io.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint {

namespace fs = std::filesystem;

/// Weight files of any format a model folder may hold (and their indexes): never copied with the
/// config and tokenizer files.
inline bool is_weight_file(std::string_view name) {
  constexpr std::array<std::string_view, 10> suffixes = {".safetensors", ".bin", ".pt", ".pth", ".ckpt",
                                                          ".h5", ".msgpack", ".gguf", ".onnx", ".index.json"};
  return std::any_of(suffixes.begin(), suffixes.end(), [&](std::string_view s) {
    return name.size() >= s.size() && name.substr(name.size() - s.size()) == s;
  });
}

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
inline std::vector<detail::WrittenFile> copy_model_files(const fs::path& from, const fs::path& to,
                                                         const ModelFolderCopy& options = {}) {
  std::vector<detail::WrittenFile> written;
  std::error_code ec;
  FSDPX_CHECK_AS(IoError, fs::is_directory(from, ec), "model folder '", from.string(), "' is not a directory");
  fs::create_directories(to, ec);
  FSDPX_CHECK_AS(IoError, !ec && fs::is_directory(to), "cannot create '", to.string(), "': ", ec ? ec.message() : "not a directory");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(from, ec)) {
    const std::string name = entry.path().filename().string();
    const bool link = entry.is_symlink(ec);
    if ((link && !options.follow_symlinks) || !entry.is_regular_file(ec)) continue;  // is_regular_file follows links
    const bool partial = name.size() > 4 && name.substr(name.size() - 4) == ".tmp";  // a write in progress
    if (partial || is_weight_file(name) || (options.skip && options.skip(name))) continue;
    files.push_back(entry.path());
  }
  FSDPX_CHECK_AS(IoError, !ec, "listing '", from.string(), "' failed: ", ec.message());
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) {
    const int64_t size = static_cast<int64_t>(fs::file_size(file, ec));
    FSDPX_CHECK_AS(IoError, !ec && size <= options.max_file_bytes, "model folder file '", file.string(), "' ",
                   ec ? "cannot be read: " + ec.message() : "is larger than " + std::to_string(options.max_file_bytes) + " bytes");
    const std::vector<char> data = detail::read_file(file);
    written.push_back(detail::write_file_durably(to / file.filename(), [&](const auto& sink) { sink(data.data(), data.size()); }));
  }
  return written;
}

}  // namespace fsdpx::checkpoint
