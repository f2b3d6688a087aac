// Out-of-line functions of fsdpx/checkpoint/safetensors.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/safetensors.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL const char* safetensors_dtype_code(at::ScalarType t, const std::string& name) {
  for (const auto& d : safetensors_dtypes) {
    if (d.type == t) return d.code;
  }
  throw ConfigError(::fsdpx::detail::str("fsdpx: safetensors: tensor '", name, "' has dtype ", t,
                                         ", which safetensors cannot store"));
}

FSDPX_DECL std::string safetensors_header(const std::vector<TensorSpec>& specs, const std::map<std::string,
    std::string>& metadata) {
  ::fsdpx::detail::Json header = ::fsdpx::detail::Json::object();
  auto& meta = header["__metadata__"] = ::fsdpx::detail::Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["format"] = "pt";
  int64_t offset = 0;
  for (const TensorSpec& s : specs) {
    FSDPX_CHECK(s.name != "__metadata__", "safetensors: a tensor cannot be named '__metadata__'");
    FSDPX_CHECK(!header.contains(s.name), "safetensors: the tensor name '", s.name, "' appears twice");
    const int64_t n = spec_bytes(s);
    header[s.name] = {{"dtype", safetensors_dtype_code(s.dtype, s.name)}, {"shape", s.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

FSDPX_DECL bool is_shard_file_name(const std::string& file, const std::string& stem) {
  // <stem>-00001-of-00003.safetensors
  const std::string prefix = stem + "-", suffix = ".safetensors";
  if (file.size() != prefix.size() + 5 + 4 + 5 + suffix.size() || file.rfind(prefix, 0) != 0 ||
      file.substr(file.size() - suffix.size()) != suffix) {
    return false;
  }
  const std::string mid = file.substr(prefix.size(), 14);
  return mid.substr(5, 4) == "-of-" &&
         std::all_of(mid.begin(), mid.begin() + 5, [](char c) { return c >= '0' && c <= '9'; }) &&
         std::all_of(mid.begin() + 9, mid.end(), [](char c) { return c >= '0' && c <= '9'; });
}

FSDPX_DECL Fd open_regular_file(const fs::path& path, const char* what) {
  std::error_code ec;
  FSDPX_CHECK_AS(IoError, fs::exists(path, ec), what, " '", path.string(), "' does not exist");
  Fd fd(path, O_RDONLY | O_NONBLOCK);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_io("stat of", path, errno);
  FSDPX_CHECK_AS(IoError, S_ISREG(st.st_mode), what, " '", path.string(), "' is not a regular file");
  return fd;
}

FSDPX_DECL void read_exact(int fd, const fs::path& path, int64_t offset, void* out, int64_t n, int64_t file_size) {
  auto* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < n) {
    const ssize_t k = ::pread(fd, p + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw_io("reading", path, errno);
    FSDPX_CHECK_AS(IoError, k > 0, "safetensors file '", path.string(), "' is truncated: it has ", file_size,
                   " bytes, its header needs at least ", offset + n);
    done += k;
  }
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx::checkpoint {

FSDPX_DECL NamedTensors load_safetensors(const fs::path& path, const std::string& stem) {
  SafetensorsDir dir(path, stem);
  NamedTensors out;
  for (const auto& file : dir.files()) {
    for (const auto& e : file->entries()) out.emplace_back(e.name, dir.read(e.name));
  }
  return out;
}

}  // namespace fsdpx::checkpoint
