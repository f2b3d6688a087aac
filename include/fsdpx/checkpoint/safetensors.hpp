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

#include <fsdpx/checkpoint/detail/file_io.hpp>
#include <fsdpx/detail/json.hpp>
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

/// What a safetensors save wrote.
struct SavedSafetensors {
  std::vector<detail::WrittenFile> files;         // the .safetensors files, in order
  std::optional<detail::WrittenFile> index;       // the index, when there is more than one file
  int64_t total_size = 0;                         // bytes of tensor data (the index's total_size)
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
    {at::kDouble, "F64"}, {at::kFloat, "F32"},   {at::kHalf, "F16"},    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},     {at::kShort, "I16"},   {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},   {at::kUInt16, "U16"},  {at::kUInt32, "U32"},
    {at::kUInt64, "U64"}, {at::kFloat8_e4m3fn, "F8_E4M3"}, {at::kFloat8_e5m2, "F8_E5M2"},
};

FSDPX_DECL const char* safetensors_dtype_code(at::ScalarType t, const std::string& name);

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

inline int64_t spec_bytes(const TensorSpec& s) {
  return c10::multiply_integers(s.shape) * static_cast<int64_t>(c10::elementSize(s.dtype));
}

/// A header longer than this is refused before it is read (the safetensors library's own limit).
inline constexpr uint64_t max_header_bytes = 100'000'000;

/// The header text of a file holding `specs` in this order, padded to a multiple of 8 bytes.
FSDPX_DECL std::string safetensors_header(const std::vector<TensorSpec>& specs, const std::map<std::string,
    std::string>& metadata);

FSDPX_DECL bool is_shard_file_name(const std::string& file, const std::string& stem);

/// Opens `path` for reading only if it is a regular file (a FIFO or a device would block or never end).
FSDPX_DECL Fd open_regular_file(const fs::path& path, const char* what);

/// Reads exactly n bytes at `offset`, or an IoError naming the file as truncated.
FSDPX_DECL void read_exact(int fd, const fs::path& path, int64_t offset, void* out, int64_t n, int64_t file_size);

}  // namespace detail

// ---- writing -------------------------------------------------------------------------------------------

/// Writes tensors in Hugging Face's layout one by one, in the order of the specs given up front, so a
/// caller that produces them one at a time (a sharded model gathered unit by unit) never holds them
/// all. Files are split as save_pretrained splits them: in order, a new file when the next tensor
/// would overflow this one. Each file is written durably (DurableFile); the index comes last; files
/// an earlier save left under the same stem and not written now are removed at the end.
class SafetensorsWriter {
 public:
  SafetensorsWriter(fs::path dir, std::vector<TensorSpec> specs, SafetensorsOptions options = {})
      : dir_(std::move(dir)), options_(std::move(options)) {
    detail::check_little_endian();
    FSDPX_CHECK(options_.max_shard_bytes > 0, "safetensors: max_shard_bytes must be positive, not ", options_.max_shard_bytes);
    std::error_code ec;
    fs::create_directories(dir_, ec);
    FSDPX_CHECK_AS(IoError, !ec && fs::is_directory(dir_), "creating the directory '", dir_.string(), "' failed: ",
                   ec ? ec.message() : "it is not a directory");
    files_.emplace_back();
    int64_t bytes = 0;
    for (auto& s : specs) {
      const int64_t n = detail::spec_bytes(s);
      if (!files_.back().empty() && bytes + n > options_.max_shard_bytes) {
        files_.emplace_back();
        bytes = 0;
      }
      bytes += n;
      total_ += n;
      files_.back().push_back(std::move(s));
    }
  }

  /// Writes the next tensor; its name, dtype and shape must be those of the next spec.
  void write(const std::string& name, const at::Tensor& tensor) {
    FSDPX_CHECK(file_ < files_.size(), "safetensors: '", name, "' is one tensor more than the writer was planned for");
    const TensorSpec& s = files_[file_][next_];
    FSDPX_CHECK(name == s.name && tensor.scalar_type() == s.dtype && tensor.sizes() == c10::IntArrayRef(s.shape),
                "safetensors: the writer expected '", s.name, "' (", s.dtype, ", ", c10::IntArrayRef(s.shape), ") next, not '",
                name, "' (", tensor.scalar_type(), ", ", tensor.sizes(), ")");
    if (next_ == 0) open_file();
    const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    if (t.numel() > 0) current_->append(t.data_ptr(), static_cast<size_t>(detail::tensor_bytes(t)));
    if (++next_ == files_[file_].size()) {
      saved_.files.push_back(current_->commit());
      current_.reset();
      next_ = 0;
      ++file_;
    }
  }

  /// After the last tensor: writes the index (more than one file) and removes stale files.
  SavedSafetensors finish() {
    FSDPX_CHECK(file_ == files_.size() || (files_.size() == 1 && files_[0].empty()), "safetensors: finish() with ",
                files_.size() - file_, " file(s) not yet written");
    if (files_.size() == 1 && files_[0].empty()) {  // no tensors at all: one empty file
      open_file();
      saved_.files.push_back(current_->commit());
      current_.reset();
    }
    saved_.total_size = total_;
    std::set<std::string> written;
    for (const auto& f : saved_.files) written.insert(f.path.filename().string());
    const std::string index_name = options_.name + ".safetensors.index.json";
    if (files_.size() > 1) {
      ::fsdpx::detail::Json weight_map = ::fsdpx::detail::Json::object();
      for (size_t i = 0; i < files_.size(); ++i) {
        for (const TensorSpec& s : files_[i]) weight_map[s.name] = file_name(i);
      }
      const ::fsdpx::detail::Json index = {{"metadata", {{"total_size", total_}}}, {"weight_map", std::move(weight_map)}};
      saved_.index = detail::write_text_durably(dir_ / index_name, index.dump(2) + "\n");
      written.insert(index_name);
    }
    // Stale files of an earlier save: a reader must not mix them with these.
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      const std::string file = entry.path().filename().string();
      const bool ours = file == options_.name + ".safetensors" || file == index_name ||
                        detail::is_shard_file_name(file, options_.name);
      if (ours && written.count(file) == 0) fs::remove(entry.path(), ec);
    }
    return saved_;
  }

  int64_t total_size() const { return total_; }
  size_t file_count() const { return files_.size(); }

 private:
  std::string file_name(size_t i) const {
    if (files_.size() == 1) return options_.name + ".safetensors";
    char buf[64];
    std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", i + 1, files_.size());
    return options_.name + buf;
  }

  void open_file() {
    const std::string header = detail::safetensors_header(files_[file_], options_.metadata);
    current_ = std::make_unique<detail::DurableFile>(dir_ / file_name(file_));
    const uint64_t length = header.size();  // little-endian: checked in the constructor
    current_->append(&length, sizeof length);
    current_->append(header.data(), header.size());
  }

  fs::path dir_;
  SafetensorsOptions options_;
  std::vector<std::vector<TensorSpec>> files_;
  int64_t total_ = 0;
  size_t file_ = 0, next_ = 0;
  std::unique_ptr<detail::DurableFile> current_;
  SavedSafetensors saved_;
};

/// Writes `tensors` (any device, layout and dtype safetensors knows) under `dir` in Hugging Face's
/// layout (SafetensorsWriter): one file when they fit in options.max_shard_bytes, else numbered
/// files and an index.
inline SavedSafetensors save_safetensors(const fs::path& dir, const NamedTensors& tensors, const SafetensorsOptions& options = {}) {
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
  explicit SafetensorsFile(const fs::path& path) : path_(path), fd_(detail::open_regular_file(path, "safetensors file")) {
    detail::check_little_endian();
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) detail::throw_io("stat of", path_, errno);
    size_ = st.st_size;
    FSDPX_CHECK_AS(IoError, size_ >= 8, "safetensors file '", path_.string(), "' is truncated: ", size_,
                   " bytes, less than its 8-byte header length");
    uint64_t length = 0;
    detail::read_exact(fd_.get(), path_, 0, &length, 8, size_);
    FSDPX_CHECK_AS(IoError, length <= detail::max_header_bytes && length <= static_cast<uint64_t>(size_ - 8),
                   "safetensors file '", path_.string(), "' is truncated or not a safetensors file: its header length is ",
                   length, " bytes but the file has ", size_, " bytes");
    std::string text(length, '\0');
    detail::read_exact(fd_.get(), path_, 8, text.data(), static_cast<int64_t>(length), size_);
    data_start_ = 8 + static_cast<int64_t>(length);
    ::fsdpx::detail::Json header;
    try {
      header = ::fsdpx::detail::parse_json(text, path_.string());
    } catch (const IoError& e) {
      bad_header(e.what());
    }
    if (!header.is_object()) bad_header("it is not a JSON object");
    for (const auto& [name, v] : header.items()) {
      if (name == "__metadata__") {
        if (v.is_object()) {
          for (const auto& [k, m] : v.items()) {
            if (m.is_string()) metadata_[k] = m.get<std::string>();
          }
        }
        continue;
      }
      entries_.push_back(parse_entry(name, v));
    }
    std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    int64_t expected = data_start_;
    for (const SafetensorsEntry& e : entries_) {
      if (e.begin != expected) {
        bad_header(::fsdpx::detail::str("tensor '", e.name, "' starts at byte ", e.begin - data_start_, " of the data, not ",
                                        expected - data_start_, ": the tensors overlap or leave a hole"));
      }
      expected = e.end;
    }
    FSDPX_CHECK_AS(IoError, expected == size_, "safetensors file '", path_.string(), "' is ",
                   (expected > size_ ? "truncated" : "corrupt"), ": its header describes ", expected, " bytes but the file has ",
                   size_);
    for (size_t i = 0; i < entries_.size(); ++i) by_name_[entries_[i].name] = i;
  }

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
  void read_bytes(int64_t offset, void* out, int64_t n) const { detail::read_exact(fd_.get(), path_, offset, out, n, size_); }

 private:
  [[noreturn]] void bad_header(const std::string& why) const {
    std::string text = why;
    if (text.rfind("fsdpx: ", 0) == 0) text = text.substr(7);
    throw IoError(::fsdpx::detail::str("fsdpx: safetensors file '", path_.string(), "' has a bad header: ", text));
  }

  SafetensorsEntry parse_entry(const std::string& name, const ::fsdpx::detail::Json& v) const {
    const auto bad = [&](const std::string& why) { bad_header(::fsdpx::detail::str("tensor '", name, "' ", why)); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      bad("lacks a dtype, a shape or two data_offsets");
    }
    const auto type = detail::safetensors_dtype(v["dtype"].get<std::string>());
    if (!type) bad("has the unknown dtype '" + v["dtype"].get<std::string>() + "'");
    SafetensorsEntry e{name, *type, {}, 1, 0, 0};
    const auto as_size = [&](const ::fsdpx::detail::Json& j, const char* what) {
      // Bounded, so that offsets plus the header never overflow; whether they fit the file is checked
      // once all are known (a short file is "truncated").
      constexpr int64_t limit = int64_t{1} << 60;
      if (!j.is_number_integer() || (j.is_number_unsigned() ? j.get<uint64_t>() > static_cast<uint64_t>(limit) : j.get<int64_t>() < 0)) {
        bad(::fsdpx::detail::str("has a bad ", what, " (", j.dump(), ")"));
      }
      return j.get<int64_t>();
    };
    for (const auto& d : v["shape"]) {
      const int64_t dim = as_size(d, "shape");
      if (__builtin_mul_overflow(e.numel, dim, &e.numel)) bad("has a shape whose element count overflows");
      e.shape.push_back(dim);
    }
    int64_t bytes = 0;
    if (__builtin_mul_overflow(e.numel, static_cast<int64_t>(c10::elementSize(*type)), &bytes)) {
      bad("has a shape whose byte count overflows");
    }
    const int64_t lo = as_size(v["data_offsets"][0], "data_offsets"), hi = as_size(v["data_offsets"][1], "data_offsets");
    if (hi < lo || hi - lo != bytes) {
      bad(::fsdpx::detail::str("has data_offsets [", lo, ", ", hi, ") that do not fit its shape and dtype (", bytes, " bytes)"));
    }
    e.begin = data_start_ + lo;
    e.end = data_start_ + hi;
    return e;
  }

  fs::path path_;
  detail::Fd fd_;
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
  explicit SafetensorsDir(const fs::path& path, const std::string& stem = "model") : path_(path) {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
      add_file(path);
      return;
    }
    // As transformers: the single file when there is one, else the index.
    const fs::path index_path = path / (stem + ".safetensors.index.json");
    const fs::path single = path / (stem + ".safetensors");
    if (fs::exists(single, ec) || !fs::exists(index_path, ec)) {
      FSDPX_CHECK_AS(IoError, fs::exists(single, ec), "'", path.string(), "' holds neither ", single.filename().string(),
                     " nor ", index_path.filename().string());
      add_file(single);
      return;
    }
    index_ = index_path;
    const std::string doc = index_path.string();
    detail::Fd index_fd = detail::open_regular_file(index_path, "safetensors index");
    struct stat st {};
    if (::fstat(index_fd.get(), &st) != 0) detail::throw_io("stat of", index_path, errno);
    FSDPX_CHECK_AS(IoError, static_cast<uint64_t>(st.st_size) <= detail::max_header_bytes, "safetensors index '", doc,
                   "' has ", st.st_size, " bytes; an index is refused above ", detail::max_header_bytes);
    std::string text(static_cast<size_t>(st.st_size), '\0');  // from the descriptor checked above
    detail::read_exact(index_fd.get(), index_path, 0, text.data(), st.st_size, st.st_size);
    const auto index = ::fsdpx::detail::parse_json(text, doc);
    const auto& weight_map = ::fsdpx::detail::json_at(index, "weight_map", doc);
    FSDPX_CHECK_AS(IoError, weight_map.is_object(), "safetensors index '", doc, "': \"weight_map\" is not an object");
    std::map<std::string, std::set<std::string>> by_file;
    for (const auto& [name, file] : weight_map.items()) {
      FSDPX_CHECK_AS(IoError, file.is_string(), "safetensors index '", doc, "': the file of '", name, "' is not a string");
      const std::string f = file.get<std::string>();
      // A plain file name: the index must not lead out of the folder (../, absolute, sub-folders).
      FSDPX_CHECK_AS(IoError, !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                                  f.find('\\') == std::string::npos && f.find('\0') == std::string::npos,
                     "safetensors index '", doc, "' maps '", name, "' to '", f,
                     "', which is not a file name inside the folder (no paths are allowed)");
      by_file[f].insert(name);
    }
    std::vector<size_t> opened;  // every named file first: one that is missing is the first thing to say
    for (const auto& [file, names] : by_file) opened.push_back(add_file(path / file));
    auto file_index = opened.begin();
    for (const auto& [file, names] : by_file) {
      const size_t i = *file_index++;
      for (const auto& e : files_[i]->entries()) {
        FSDPX_CHECK_AS(IoError, names.count(e.name) != 0, "safetensors file '", files_[i]->path().string(), "' holds '",
                       e.name, "', which its index '", doc, "' maps elsewhere or not at all");
      }
      for (const auto& name : names) {
        FSDPX_CHECK_AS(IoError, files_[i]->find(name) != nullptr, "safetensors index '", doc, "' maps '", name, "' to '",
                       files_[i]->path().string(), "', which does not hold it");
      }
    }
  }

  const fs::path& path() const { return path_; }
  /// The index file, when the folder has one.
  const std::optional<fs::path>& index() const { return index_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  const SafetensorsEntry* find(const std::string& name) const {
    const auto it = where_.find(name);
    return it == where_.end() ? nullptr : files_[it->second]->find(name);
  }
  const SafetensorsFile& file_of(const std::string& name) const {
    const auto it = where_.find(name);
    FSDPX_CHECK_AS(IoError, it != where_.end(), "'", path_.string(), "' holds no tensor '", name, "'");
    return *files_[it->second];
  }
  /// Every tensor name, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, i] : where_) out.push_back(name);
    return out;
  }
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
  void read(const std::string& name, int64_t first, int64_t last, const at::Tensor& out) {
    const SafetensorsEntry* e = find(name);
    FSDPX_CHECK_AS(IoError, e != nullptr, "'", path_.string(), "' holds no tensor '", name, "'");
    const SafetensorsFile& file = file_of(name);
    FSDPX_CHECK(0 <= first && first <= last && last <= e->numel, "safetensors: elements [", first, ", ", last, ") of '", name,
                "' are outside its ", e->numel);
    FSDPX_CHECK(out.is_cpu() && out.is_contiguous() && out.numel() == last - first, "safetensors: reading '", name,
                "' needs a contiguous CPU tensor of ", last - first, " elements");
    FSDPX_CHECK(out.scalar_type() == e->dtype || (at::isFloatingType(out.scalar_type()) && at::isFloatingType(e->dtype)),
                "safetensors: tensor '", name, "' in '", file.path().string(), "' has dtype ", e->dtype,
                ", which cannot be cast to ", out.scalar_type());
    const int64_t esize = static_cast<int64_t>(c10::elementSize(e->dtype));
    if (out.scalar_type() == e->dtype) {  // straight into the destination
      file.read_bytes(e->begin + first * esize, out.data_ptr(), (last - first) * esize);
      bytes_read_ += (last - first) * esize;
      return;
    }
    const int64_t step = std::max<int64_t>(1, chunk_bytes / esize);
    if (!staging_.defined() || staging_.scalar_type() != e->dtype || staging_.numel() < std::min(step, last - first)) {
      staging_ = at::empty({std::min(step, last - first)}, at::TensorOptions().dtype(e->dtype));
    }
    for (int64_t pos = first; pos < last; pos += step) {
      const int64_t n = std::min(step, last - pos);
      at::Tensor piece = staging_.narrow(0, 0, n);
      file.read_bytes(e->begin + pos * esize, piece.data_ptr(), n * esize);
      out.narrow(0, pos - first, n).copy_(piece);
      bytes_read_ += n * esize;
    }
  }

  /// The whole tensor `name`, in its own dtype and shape.
  at::Tensor read(const std::string& name) {
    const SafetensorsEntry* e = find(name);
    FSDPX_CHECK_AS(IoError, e != nullptr, "'", path_.string(), "' holds no tensor '", name, "'");
    at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(e->dtype));
    read(name, 0, e->numel, t.reshape({-1}));
    return t;
  }

  /// Reads are cast through a staging buffer of at most this many bytes.
  static constexpr int64_t chunk_bytes = int64_t{16} << 20;

 private:
  size_t add_file(const fs::path& file) {
    files_.push_back(std::make_unique<SafetensorsFile>(file));
    const size_t i = files_.size() - 1;
    for (const auto& e : files_[i]->entries()) {
      const auto [it, inserted] = where_.emplace(e.name, i);
      FSDPX_CHECK_AS(IoError, inserted, "'", path_.string(), "': tensor '", e.name, "' is in both '",
                     files_[it->second]->path().string(), "' and '", file.string(), "'");
    }
    return i;
  }

  fs::path path_;
  std::optional<fs::path> index_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
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

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/safetensors.ipp>
#endif
