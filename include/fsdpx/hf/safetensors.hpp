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
//
// Reading is by positioned reads of exactly the bytes asked for (SafetensorsDir::read), so a rank
// loads its shard of a tensor without reading the rest. Files and folders are not trusted: every
// size is bounded before it is used, index entries must name files inside the folder, only regular
// files are opened, and every bad input is an IoError naming the file.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/detail/json_fwd.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::hf {

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

/// What a safetensors save wrote.
struct SavedSafetensors {
  std::vector<::fsdpx::detail::WrittenFile> files;    // the .safetensors files, in order
  std::optional<::fsdpx::detail::WrittenFile> index;  // the index, when there is more than one file
  int64_t total_size = 0;                             // bytes of tensor data (the index's total_size)
};

/// One tensor to be written: its name, dtype and shape (the bytes come later).
struct TensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

namespace detail {

struct SafetensorsDtype {
  at::ScalarType type;
  const char* code;
};
inline constexpr SafetensorsDtype safetensors_dtypes[] = {
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
    {at::kUInt16, "U16"},
    {at::kUInt32, "U32"},
    {at::kUInt64, "U64"},
    {at::kFloat8_e4m3fn, "F8_E4M3"},
    {at::kFloat8_e5m2, "F8_E5M2"},
};

FSDPX_DECL const char* safetensors_dtype_code(at::ScalarType t, const std::string& name);

inline std::optional<at::ScalarType> safetensors_dtype(const std::string& code) {
  for (const auto& d : safetensors_dtypes) {
    if (code == d.code) return d.type;
  }
  return std::nullopt;
}

inline void check_little_endian() {
  FSDPX_CHECK(
      std::endian::native == std::endian::little,
      "safetensors: this machine is big-endian; fsdpx reads and writes safetensors only on little-endian hosts");
}

inline int64_t tensor_bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

inline int64_t spec_bytes(const TensorSpec& s) {
  return c10::multiply_integers(s.shape) * static_cast<int64_t>(c10::elementSize(s.dtype));
}

/// A header longer than this is refused before it is read (the safetensors library's own limit).
inline constexpr uint64_t max_header_bytes = 100'000'000;

/// The header text of a file holding `specs` in this order, padded to a multiple of 8 bytes.
FSDPX_DECL std::string safetensors_header(const std::vector<TensorSpec>& specs,
                                          const std::map<std::string, std::string>& metadata);

FSDPX_DECL bool is_shard_file_name(const std::string& file, const std::string& stem);

}  // namespace detail

// ---- writing -------------------------------------------------------------------------------------------

/// Writes tensors in Hugging Face's layout one by one, in the order of the specs given up front, so a
/// caller that produces them one at a time (a sharded model gathered unit by unit) never holds them
/// all. Files are split as save_pretrained splits them: in order, a new file when the next tensor
/// would overflow this one. Each file is written durably (DurableFile); the index comes last; files
/// an earlier save left under the same stem and not written now are removed at the end.
class SafetensorsWriter {
 public:
  FSDPX_DECL SafetensorsWriter(fs::path dir, std::vector<TensorSpec> specs, SafetensorsOptions options = {});

  /// Writes the next tensor; its name, dtype and shape must be those of the next spec.
  FSDPX_DECL void write(const std::string& name, const at::Tensor& tensor);

  /// After the last tensor: writes the index (more than one file) and removes stale files.
  FSDPX_DECL SavedSafetensors finish();

  int64_t total_size() const { return total_; }
  size_t file_count() const { return files_.size(); }

 private:
  FSDPX_DECL std::string file_name(size_t i) const;

  FSDPX_DECL void open_file();

  fs::path dir_;
  SafetensorsOptions options_;
  std::vector<std::vector<TensorSpec>> files_;
  int64_t total_ = 0;
  size_t file_ = 0, next_ = 0;
  std::unique_ptr<::fsdpx::detail::DurableFile> current_;
  SavedSafetensors saved_;
};

/// Writes `tensors` (any device, layout and dtype safetensors knows) under `dir` in Hugging Face's
/// layout (SafetensorsWriter): one file when they fit in options.max_shard_bytes, else numbered
/// files and an index.
inline SavedSafetensors save_safetensors(const fs::path& dir, const NamedTensors& tensors,
                                         const SafetensorsOptions& options = {}) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    FSDPX_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsWriter writer(dir, std::move(specs), options);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  return writer.finish();
}

// ---- reading -------------------------------------------------------------------------------------------

/// One tensor of a safetensors file, as its header describes it.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t begin = 0;  // byte offsets in the file (the header's data_offsets plus the data's start)
  int64_t end = 0;
};

/// One .safetensors file, opened and its header checked against the file's size: every tensor's
/// dtype, shape and byte range, no overlaps and no holes. Reads are positioned (pread).
class SafetensorsFile {
 public:
  FSDPX_DECL explicit SafetensorsFile(const fs::path& path);

  const fs::path& path() const { return path_; }
  int64_t size() const { return size_; }
  /// The tensors in the order of their data.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &entries_[it->second];
  }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// Reads the raw bytes [offset, offset + n) of the file.
  void read_bytes(int64_t offset, void* out, int64_t n) const {
    ::fsdpx::detail::read_exact(fd_.get(), path_, offset, out, n, size_);
  }

 private:
  [[noreturn]] FSDPX_DECL void bad_header(const std::string& why) const;

  FSDPX_DECL SafetensorsEntry parse_entry(const std::string& name, const ::fsdpx::detail::Json& v) const;

  fs::path path_;
  ::fsdpx::detail::Fd fd_;
  int64_t size_ = 0;
  int64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

/// A model folder's tensors: <stem>.safetensors, or <stem>.safetensors.index.json and the files it
/// names (which must be plain file names inside the folder); or one .safetensors file. Opens every
/// file and checks every header up front; reads only what is asked for. Not thread-safe.
class SafetensorsDir {
 public:
  FSDPX_DECL explicit SafetensorsDir(const fs::path& path, const std::string& stem = "model");

  const fs::path& path() const { return path_; }
  /// The index file, when the folder has one.
  const std::optional<fs::path>& index() const { return index_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  const SafetensorsEntry* find(const std::string& name) const {
    if (const auto v = views_.find(name); v != views_.end()) return &v->second.entry;
    const auto it = where_.find(name);
    return it == where_.end() ? nullptr : files_[it->second]->find(name);
  }
  const SafetensorsFile& file_of(const std::string& name) const {
    if (const auto v = views_.find(name); v != views_.end()) return *files_[v->second.file];
    const auto it = where_.find(name);
    FSDPX_CHECK_AS(IoError, it != where_.end(), "'", path_.string(), "' holds no tensor '", name, "'");
    return *files_[it->second];
  }
  /// Every tensor name, sorted: the files' own, but those seen through views, and the views'.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, i] : where_) {
      if (viewed_.count(name) == 0) out.push_back(name);
    }
    for (const auto& [name, v] : views_) out.push_back(name);
    std::sort(out.begin(), out.end());
    return out;
  }

  /// Makes `name` a tensor of its own: elements [first, first + numel(shape)) of the files' tensor `of`,
  /// in its dtype. For a family whose files hold in one tensor what its modules hold apart (a mixture
  /// of experts' experts stacked); `of` is then listed by names() only through its views.
  FSDPX_DECL void add_view(const std::string& name, const std::string& of, int64_t first, std::vector<int64_t> shape);
  /// Bytes of tensor data in all files.
  int64_t total_bytes() const {
    int64_t n = 0;
    for (const auto& f : files_) {
      for (const auto& e : f->entries()) n += e.end - e.begin;
    }
    return n;
  }
  /// Bytes read by read() so far.
  int64_t bytes_read() const { return bytes_read_; }

  /// Copies elements [first, last) of the flattened tensor `name` into `out` (a contiguous CPU tensor
  /// of last - first elements, of the file's dtype or, for floating tensors, any floating dtype: cast).
  /// Reads exactly those bytes, in pieces of at most `chunk_bytes`.
  FSDPX_DECL void read(const std::string& name, int64_t first, int64_t last, const at::Tensor& out);

  /// The whole tensor `name`, in its own dtype and shape.
  FSDPX_DECL at::Tensor read(const std::string& name);

  /// Reads are cast through a staging buffer of at most this many bytes.
  static constexpr int64_t chunk_bytes = int64_t{16} << 20;

 private:
  FSDPX_DECL size_t add_file(const fs::path& file);

  fs::path path_;
  std::optional<fs::path> index_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
  struct View {
    size_t file;
    SafetensorsEntry entry;
  };
  std::map<std::string, View> views_;
  std::set<std::string> viewed_;
  at::Tensor staging_;
  int64_t bytes_read_ = 0;
};

/// The "__metadata__" of one .safetensors file.
inline std::map<std::string, std::string> read_safetensors_metadata(const fs::path& path) {
  return SafetensorsFile(path).metadata();
}

/// Reads a .safetensors file, or a directory holding model.safetensors or an index and its files
/// (`stem` names them). Tensors come in the order of their files and of their data within a file.
/// A missing, truncated or malformed file is an IoError naming it.
FSDPX_DECL NamedTensors load_safetensors(const fs::path& path, const std::string& stem = "model");

}  // namespace fsdpx::hf

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/hf/impl/safetensors.ipp>
#endif
