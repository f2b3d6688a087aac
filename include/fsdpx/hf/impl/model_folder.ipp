// Out-of-line functions of fsdpx/hf/model_folder.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/hf/model_folder.hpp>

namespace fsdpx::hf {

FSDPX_DECL bool is_weight_file(std::string_view name) {
  constexpr std::array<std::string_view, 10> suffixes = {".safetensors", ".bin",     ".pt",   ".pth",  ".ckpt",
                                                         ".h5",          ".msgpack", ".gguf", ".onnx", ".index.json"};
  return std::any_of(suffixes.begin(), suffixes.end(), [&](std::string_view s) {
    return name.size() >= s.size() && name.substr(name.size() - s.size()) == s;
  });
}

FSDPX_DECL std::vector<::fsdpx::detail::WrittenFile> copy_model_files(const fs::path& from, const fs::path& to,
                                                                      const ModelFolderCopy& options) {
  std::vector<::fsdpx::detail::WrittenFile> written;
  std::error_code ec;
  FSDPX_CHECK_AS(IoError, fs::is_directory(from, ec), "model folder '", from.string(), "' is not a directory");
  fs::create_directories(to, ec);
  FSDPX_CHECK_AS(IoError, !ec && fs::is_directory(to), "cannot create '", to.string(),
                 "': ", ec ? ec.message() : "not a directory");
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
    const std::vector<char> data = ::fsdpx::detail::read_file(file, "model folder file", options.max_file_bytes);
    written.push_back(::fsdpx::detail::write_file_durably(to / file.filename(),
                                                          [&](const auto& sink) { sink(data.data(), data.size()); }));
  }
  return written;
}

}  // namespace fsdpx::hf
