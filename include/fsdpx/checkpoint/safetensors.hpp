// safetensors files, in Hugging Face's layout, written and read without Python:
//
//   <dir>/model.safetensors                                   when everything fits in one file, else
//   <dir>/model-00001-of-0000N.safetensors ... + model.safetensors.index.json
//
// A file is an 8-byte little-endian header length, a JSON header padded with spaces to a multiple
// of 8 bytes ({"__metadata__": {"format": "pt"}, name: {"dtype": "F32", "shape": [...],
// "data_offsets": [begin, end]}}), then the tensors' bytes, contiguous and little-endian. The index
// is {"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {name: file}}, as
// transformers' save_pretrained writes it; Python's safetensors.torch.load_file and
// transformers' from_pretrained read both.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/file_io.hpp>
#include <fsdpx/checkpoint/detail/json.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint {

namespace fs = std::filesystem;

/// Tensors by name, in order (a state dict as a merger or a loader produces it).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct SafetensorsOptions {
  /// A file holds at most this many bytes of tensors, unless one tensor alone is larger (it then has
  /// a file of its own). The default is Hugging Face's save_pretrained default, "5GB" (5 * 10^9).
  int64_t max_shard_bytes = 5'000'000'000;
  /// Extra "__metadata__" entries; "format": "pt" is always there (transformers expects it).
  std::map<std::string, std::string> metadata;
  /// The file name stem: "model" gives model.safetensors / model-00001-of-00002.safetensors.
  std::string name = "model";
};

/// What save_safetensors wrote.
struct SavedSafetensors {
  std::vector<detail::WrittenFile> files;         // the .safetensors files, in order
  std::optional<detail::WrittenFile> index;       // the index, when there is more than one file
  int64_t total_size = 0;                         // bytes of tensor data (the index's total_size)
};

namespace detail {

struct SafetensorsDtype {
  at::ScalarType type;
  const char* code;
};
inline constexpr SafetensorsDtype safetensors_dtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"},   {at::kHalf, "F16"},    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},     {at::kShort, "I16"},   {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},   {at::kUInt16, "U16"},  {at::kUInt32, "U32"},
    {at::kUInt64, "U64"}, {at::kFloat8_e4m3fn, "F8_E4M3"}, {at::kFloat8_e5m2, "F8_E5M2"},
};

inline const char* safetensors_dtype_code(at::ScalarType t, const std::string& name) {
  for (const auto& d : safetensors_dtypes) {
    if (d.type == t) return d.code;
  }
  FSDPX_CHECK(false, "safetensors: tensor '", name, "' has dtype ", t, ", which safetensors cannot store");
  return nullptr;
}

inline std::optional<at::ScalarType> safetensors_dtype(const std::string& code) {
  for (const auto& d : safetensors_dtypes) {
    if (code == d.code) return d.type;
  }
  return std::nullopt;
}

inline void check_little_endian() {
  FSDPX_CHECK(std::endian::native == std::endian::little,
              "safetensors: this machine is big-endian; fsdpx reads and writes safetensors only on little-endian hosts");
}

inline int64_t tensor_bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

/// One .safetensors file holding `tensors` (CPU, contiguous), written durably.
inline WrittenFile write_safetensors_file(const fs::path& path, const NamedTensors& tensors,
                                          const std::map<std::string, std::string>& metadata) {
  Json::Object header;
  Json::Object meta;
  for (const auto& [k, v] : metadata) meta[k] = Json(v);
  meta["format"] = Json("pt");
  header["__metadata__"] = Json(std::move(meta));
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    FSDPX_CHECK(name != "__metadata__", "safetensors: a tensor cannot be named '__metadata__'");
    FSDPX_CHECK(header.count(name) == 0, "safetensors: the tensor name '", name, "' appears twice");
    Json::Array shape;
    for (const int64_t d : t.sizes()) shape.emplace_back(d);
    const int64_t n = tensor_bytes(t);
    header[name] = Json(Json::Object{{"dtype", Json(safetensors_dtype_code(t.scalar_type(), name))},
                                     {"shape", Json(std::move(shape))},
                                     {"data_offsets", Json(Json::Array{Json(offset), Json(offset + n)})}});
    offset += n;
  }
  std::string text = Json(std::move(header)).dump(0);
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t length = text.size();  // little-endian: checked by the caller
  return write_file_durably(path, [&](const auto& sink) {
    sink(&length, sizeof length);
    sink(text.data(), text.size());
    for (const auto& [name, t] : tensors) {
      if (t.numel() > 0) sink(t.data_ptr(), static_cast<size_t>(tensor_bytes(t)));
    }
  });
}

/// Reads exactly n bytes at `offset`, or an IoError naming the file as truncated.
inline void read_exact(int fd, const fs::path& path, int64_t offset, void* out, int64_t n, int64_t file_size) {
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

inline bool is_shard_file_name(const std::string& file, const std::string& stem) {
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

}  // namespace detail

/// Writes `tensors` (any device, layout and dtype safetensors knows) under `dir` in Hugging Face's
/// layout: one file when they fit in options.max_shard_bytes, else numbered files and an index
/// (written last). Files a previous save left there under the same stem and not written now
/// (an older model.safetensors, more numbered shards, a stale index) are removed afterwards.
inline SavedSafetensors save_safetensors(const fs::path& dir, const NamedTensors& tensors,
                                         const SafetensorsOptions& options = {}) {
  detail::check_little_endian();
  FSDPX_CHECK(options.max_shard_bytes > 0, "save_safetensors: max_shard_bytes must be positive, not ",
              options.max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  FSDPX_CHECK_AS(IoError, !ec && fs::is_directory(dir), "creating the directory '", dir.string(), "' failed: ",
                 ec ? ec.message() : "it is not a directory");

  // Split as Hugging Face does: in order, a new file when the next tensor would overflow this one.
  std::vector<NamedTensors> shards(1);
  std::vector<int64_t> shard_bytes(1, 0);
  SavedSafetensors saved;
  for (const auto& [name, tensor] : tensors) {
    FSDPX_CHECK(tensor.defined(), "save_safetensors: tensor '", name, "' is undefined");
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const int64_t n = detail::tensor_bytes(t);
    if (!shards.back().empty() && shard_bytes.back() + n > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().emplace_back(name, std::move(t));
    shard_bytes.back() += n;
    saved.total_size += n;
  }
  const size_t count = shards.size();
  const auto file_name = [&](size_t i) {
    if (count == 1) return options.name + ".safetensors";
    char buf[64];
    std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", i + 1, count);
    return options.name + buf;
  };
  const std::string index_name = options.name + ".safetensors.index.json";
  detail::Json::Object weight_map;
  std::set<std::string> written;
  for (size_t i = 0; i < count; ++i) {
    const std::string file = file_name(i);
    saved.files.push_back(detail::write_safetensors_file(dir / file, shards[i], options.metadata));
    written.insert(file);
    for (const auto& [name, t] : shards[i]) weight_map[name] = detail::Json(file);
  }
  if (count > 1) {
    const detail::Json index(detail::Json::Object{
        {"metadata", detail::Json(detail::Json::Object{{"total_size", detail::Json(saved.total_size)}})},
        {"weight_map", detail::Json(std::move(weight_map))}});
    saved.index = detail::write_text_durably(dir / index_name, index.dump(2) + "\n");
    written.insert(index_name);
  }
  // Stale files of an earlier save: a reader must not mix them with these.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    const bool ours = file == options.name + ".safetensors" || file == index_name ||
                      detail::is_shard_file_name(file, options.name);
    if (ours && written.count(file) == 0) fs::remove(entry.path(), ec);
  }
  return saved;
}

/// The header of one .safetensors file (the JSON object), checked: an IoError names the file.
inline detail::Json read_safetensors_header(const fs::path& path, int64_t* data_start = nullptr,
                                            int64_t* file_size = nullptr) {
  detail::check_little_endian();
  FSDPX_CHECK_AS(IoError, fs::exists(path), "safetensors file '", path.string(), "' does not exist");
  detail::Fd fd(path, O_RDONLY);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) detail::throw_io("stat of", path, errno);
  const int64_t size = st.st_size;
  FSDPX_CHECK_AS(IoError, size >= 8, "safetensors file '", path.string(), "' is truncated: ", size,
                 " bytes, less than its 8-byte header length");
  uint64_t length = 0;
  detail::read_exact(fd.get(), path, 0, &length, 8, size);
  FSDPX_CHECK_AS(IoError, length <= 100'000'000 && static_cast<int64_t>(length) <= size - 8, "safetensors file '",
                 path.string(), "' is truncated or not a safetensors file: its header length is ", length,
                 " bytes but the file has ", size, " bytes");
  std::string text(length, '\0');
  detail::read_exact(fd.get(), path, 8, text.data(), static_cast<int64_t>(length), size);
  detail::Json header;
  try {
    header = detail::Json::parse(text, path.string());
  } catch (const IoError& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: safetensors file '", path.string(), "' has a bad header: ", e.what()));
  }
  FSDPX_CHECK_AS(IoError, header.is_object(), "safetensors file '", path.string(),
                 "' has a bad header: it is not a JSON object");
  if (data_start != nullptr) *data_start = 8 + static_cast<int64_t>(length);
  if (file_size != nullptr) *file_size = size;
  return header;
}

/// The "__metadata__" of one .safetensors file.
inline std::map<std::string, std::string> read_safetensors_metadata(const fs::path& path) {
  const detail::Json header = read_safetensors_header(path);
  std::map<std::string, std::string> out;
  if (header.contains("__metadata__") && header["__metadata__"].is_object()) {
    for (const auto& [k, v] : header["__metadata__"].object()) {
      if (v.is_string()) out[k] = v.string();
    }
  }
  return out;
}

namespace detail {

/// The tensors of one file, in the order of their data.
inline NamedTensors load_safetensors_file(const fs::path& path) {
  int64_t data_start = 0, size = 0;
  const Json header = read_safetensors_header(path, &data_start, &size);
  struct Entry {
    std::string name;
    at::ScalarType type;
    std::vector<int64_t> shape;
    int64_t begin, end;
  };
  std::vector<Entry> entries;
  const auto bad = [&](const std::string& name, const std::string& why) {
    throw IoError(::fsdpx::detail::str("fsdpx: safetensors file '", path.string(), "' has a bad header: tensor '",
                                       name, "' ", why));
  };
  for (const auto& [name, v] : header.object()) {
    if (name == "__metadata__") continue;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].array().size() != 2) {
      bad(name, "lacks a dtype, a shape or two data_offsets");
    }
    const auto type = safetensors_dtype(v["dtype"].string());
    if (!type) bad(name, "has the unknown dtype '" + v["dtype"].string() + "'");
    Entry e{name, *type, {}, v["data_offsets"].array()[0].integer(), v["data_offsets"].array()[1].integer()};
    int64_t numel = 1;
    for (const Json& d : v["shape"].array()) {
      if (!d.is_number() || d.integer() < 0) bad(name, "has a bad shape");
      e.shape.push_back(d.integer());
      numel *= d.integer();
    }
    if (e.begin < 0 || e.end < e.begin || e.end - e.begin != numel * static_cast<int64_t>(c10::elementSize(*type))) {
      bad(name, ::fsdpx::detail::str("has data_offsets [", e.begin, ", ", e.end, ") that do not fit its shape and dtype"));
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t expected = 0;
  for (const Entry& e : entries) {
    if (e.begin != expected) bad(e.name, ::fsdpx::detail::str("starts at byte ", e.begin, " of the data, not ", expected,
                                                                   ": the tensors overlap or leave a hole"));
    expected = e.end;
  }
  FSDPX_CHECK_AS(IoError, data_start + expected == size, "safetensors file '", path.string(), "' is ",
                 (data_start + expected > size ? "truncated" : "corrupt"), ": its header describes ",
                 data_start + expected, " bytes but the file has ", size);
  Fd fd(path, O_RDONLY);
  NamedTensors out;
  for (const Entry& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    read_exact(fd.get(), path, data_start + e.begin, t.data_ptr(), e.end - e.begin, size);
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace detail

/// Reads a .safetensors file, or a directory holding model.safetensors or an index and its files
/// (`stem` names them). Tensors come in the order of their files and of their data within a file.
/// A missing, truncated or malformed file is an IoError naming it.
inline NamedTensors load_safetensors(const fs::path& path, const std::string& stem = "model") {
  if (!fs::is_directory(path)) return detail::load_safetensors_file(path);
  const fs::path index_path = path / (stem + ".safetensors.index.json");
  if (!fs::exists(index_path)) {
    const fs::path single = path / (stem + ".safetensors");
    FSDPX_CHECK_AS(IoError, fs::exists(single), "'", path.string(), "' holds neither ", single.filename().string(),
                   " nor ", index_path.filename().string());
    return detail::load_safetensors_file(single);
  }
  const detail::Json index = detail::Json::parse(detail::read_text(index_path), index_path.string());
  FSDPX_CHECK_AS(IoError, index.contains("weight_map") && index["weight_map"].is_object(), "safetensors index '",
                 index_path.string(), "' has no weight_map object");
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : index["weight_map"].object()) {
    FSDPX_CHECK_AS(IoError, file.is_string(), "safetensors index '", index_path.string(), "': the file of '", name,
                   "' is not a string");
    by_file[file.string()].insert(name);
  }
  NamedTensors out;
  for (const auto& [file, names] : by_file) {
    std::set<std::string> found;
    for (auto& [name, t] : detail::load_safetensors_file(path / file)) {
      FSDPX_CHECK_AS(IoError, names.count(name) != 0, "safetensors file '", (path / file).string(), "' holds '", name,
                     "', which its index '", index_path.string(), "' maps elsewhere or not at all");
      found.insert(name);
      out.emplace_back(name, std::move(t));
    }
    for (const auto& name : names) {
      FSDPX_CHECK_AS(IoError, found.count(name) != 0, "safetensors index '", index_path.string(), "' maps '", name,
                     "' to '", (path / file).string(), "', which does not hold it");
    }
  }
  return out;
}

}  // namespace fsdpx::checkpoint
