// Out-of-line functions of fsdpx/hf/safetensors.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx::hf::detail {

FSDPX_DECL const char* safetensors_dtype_code(at::ScalarType t, const std::string& name) {
  for (const auto& d : safetensors_dtypes) {
    if (d.type == t) return d.code;
  }
  throw ConfigError(::fsdpx::detail::str("fsdpx: safetensors: tensor '", name, "' has dtype ", t,
                                         ", which safetensors cannot store"));
}

FSDPX_DECL std::string safetensors_header(const std::vector<TensorSpec>& specs,
                                          const std::map<std::string, std::string>& metadata) {
  ::fsdpx::detail::Json header = ::fsdpx::detail::Json::object();
  auto& meta = header["__metadata__"] = ::fsdpx::detail::Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["format"] = "pt";
  int64_t offset = 0;
  for (const TensorSpec& s : specs) {
    FSDPX_CHECK(s.name != "__metadata__", "safetensors: a tensor cannot be named '__metadata__'");
    FSDPX_CHECK(!header.contains(s.name), "safetensors: the tensor name '", s.name, "' appears twice");
    const int64_t n = spec_bytes(s);
    header[s.name] = {
        {"dtype", safetensors_dtype_code(s.dtype, s.name)}, {"shape", s.shape}, {"data_offsets", {offset, offset + n}}};
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

}  // namespace fsdpx::hf::detail

namespace fsdpx::hf {

FSDPX_DECL NamedTensors load_safetensors(const fs::path& path, const std::string& stem) {
  SafetensorsDir dir(path, stem);
  NamedTensors out;
  for (const auto& file : dir.files()) {
    for (const auto& e : file->entries()) out.emplace_back(e.name, dir.read(e.name));
  }
  return out;
}

FSDPX_DECL SafetensorsFile::SafetensorsFile(const fs::path& path)
    : path_(path), fd_(::fsdpx::detail::open_regular_file(path, "safetensors file")) {
  detail::check_little_endian();
  struct stat st{};
  if (::fstat(fd_.get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", path_, errno);
  size_ = st.st_size;
  FSDPX_CHECK_AS(IoError, size_ >= 8, "safetensors file '", path_.string(), "' is truncated: ", size_,
                 " bytes, less than its 8-byte header length");
  uint64_t length = 0;
  ::fsdpx::detail::read_exact(fd_.get(), path_, 0, &length, 8, size_);
  FSDPX_CHECK_AS(IoError, length <= detail::max_header_bytes && length <= static_cast<uint64_t>(size_ - 8),
                 "safetensors file '", path_.string(),
                 "' is truncated or not a safetensors file: its header length is ", length, " bytes but the file has ",
                 size_, " bytes");
  std::string text(length, '\0');
  ::fsdpx::detail::read_exact(fd_.get(), path_, 8, text.data(), static_cast<int64_t>(length), size_);
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
      bad_header(::fsdpx::detail::str("tensor '", e.name, "' starts at byte ", e.begin - data_start_,
                                      " of the data, not ", expected - data_start_,
                                      ": the tensors overlap or leave a hole"));
    }
    expected = e.end;
  }
  FSDPX_CHECK_AS(IoError, expected == size_, "safetensors file '", path_.string(), "' is ",
                 (expected > size_ ? "truncated" : "corrupt"), ": its header describes ", expected,
                 " bytes but the file has ", size_);
  for (size_t i = 0; i < entries_.size(); ++i) by_name_[entries_[i].name] = i;
}

FSDPX_DECL void SafetensorsFile::bad_header(const std::string& why) const {
  throw IoError(::fsdpx::detail::str("fsdpx: safetensors file '", path_.string(),
                                     "' has a bad header: ", ::fsdpx::detail::unprefixed(why)));
}

FSDPX_DECL SafetensorsEntry SafetensorsFile::parse_entry(const std::string& name,
                                                         const ::fsdpx::detail::Json& v) const {
  const auto bad = [&](const std::string& why) { bad_header(::fsdpx::detail::str("tensor '", name, "' ", why)); };
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
      !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
      v["data_offsets"].size() != 2) {
    bad("lacks a dtype, a shape or two data_offsets");
  }
  const auto type = detail::safetensors_dtype(v["dtype"].get<std::string>());
  if (!type) bad("has the unknown dtype '" + v["dtype"].get<std::string>() + "'");
  SafetensorsEntry e{name, *type, {}, 1, 0, 0};
  const auto as_size = [&](const ::fsdpx::detail::Json& j, const char* what) {
    // Bounded, so that offsets plus the header never overflow; whether they fit the file is checked
    // once all are known (a short file is "truncated").
    constexpr int64_t limit = int64_t{1} << 60;
    if (!j.is_number_integer() ||
        (j.is_number_unsigned() ? j.get<uint64_t>() > static_cast<uint64_t>(limit) : j.get<int64_t>() < 0)) {
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
    bad(::fsdpx::detail::str("has data_offsets [", lo, ", ", hi, ") that do not fit its shape and dtype (", bytes,
                             " bytes)"));
  }
  e.begin = data_start_ + lo;
  e.end = data_start_ + hi;
  return e;
}

FSDPX_DECL SafetensorsDir::SafetensorsDir(const fs::path& path, const std::string& stem) : path_(path) {
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
  ::fsdpx::detail::Fd index_fd = ::fsdpx::detail::open_regular_file(index_path, "safetensors index");
  struct stat st{};
  if (::fstat(index_fd.get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", index_path, errno);
  FSDPX_CHECK_AS(IoError, static_cast<uint64_t>(st.st_size) <= detail::max_header_bytes, "safetensors index '", doc,
                 "' has ", st.st_size, " bytes; an index is refused above ", detail::max_header_bytes);
  std::string text(static_cast<size_t>(st.st_size), '\0');  // from the descriptor checked above
  ::fsdpx::detail::read_exact(index_fd.get(), index_path, 0, text.data(), st.st_size, st.st_size);
  const auto index = ::fsdpx::detail::parse_json(text, doc);
  const auto& weight_map = ::fsdpx::detail::json_at(index, "weight_map", doc);
  FSDPX_CHECK_AS(IoError, weight_map.is_object(), "safetensors index '", doc, "': \"weight_map\" is not an object");
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : weight_map.items()) {
    FSDPX_CHECK_AS(IoError, file.is_string(), "safetensors index '", doc, "': the file of '", name,
                   "' is not a string");
    const std::string f = file.get<std::string>();
    // A plain file name: the index must not lead out of the folder (../, absolute, sub-folders).
    FSDPX_CHECK_AS(IoError,
                   !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
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

FSDPX_DECL void SafetensorsDir::add_view(const std::string& name, const std::string& of, int64_t first,
                                         std::vector<int64_t> shape) {
  const SafetensorsEntry* source = find(of);
  FSDPX_CHECK_AS(IoError, source != nullptr && views_.count(of) == 0, "'", path_.string(), "' holds no tensor '", of,
                 "'");
  FSDPX_CHECK(views_.count(name) == 0 && (where_.count(name) == 0 || viewed_.count(name) != 0), "safetensors: a view '",
              name, "' would hide a tensor of that name in '", path_.string(), "'");
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FSDPX_CHECK(d >= 0 && (d == 0 || numel <= source->numel / d), "safetensors: a view ", c10::IntArrayRef(shape),
                " of '", of, "' is larger than it (", source->numel, " elements)");
    numel *= d;
  }
  FSDPX_CHECK(first >= 0 && numel <= source->numel - first, "safetensors: a view of elements [", first, ", ",
              first + numel, ") of '", of, "', which holds ", source->numel);
  const auto esize = static_cast<int64_t>(c10::elementSize(source->dtype));
  SafetensorsEntry e{name,
                     source->dtype,
                     std::move(shape),
                     numel,
                     source->begin + first * esize,
                     source->begin + (first + numel) * esize};
  views_.emplace(name, View{where_.at(of), std::move(e)});
  viewed_.insert(of);
}

FSDPX_DECL void SafetensorsDir::read(const std::string& name, int64_t first, int64_t last, const at::Tensor& out) {
  const SafetensorsEntry* e = find(name);
  FSDPX_CHECK_AS(IoError, e != nullptr, "'", path_.string(), "' holds no tensor '", name, "'");
  const SafetensorsFile& file = file_of(name);
  FSDPX_CHECK(0 <= first && first <= last && last <= e->numel, "safetensors: elements [", first, ", ", last, ") of '",
              name, "' are outside its ", e->numel);
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

FSDPX_DECL at::Tensor SafetensorsDir::read(const std::string& name) {
  const SafetensorsEntry* e = find(name);
  FSDPX_CHECK_AS(IoError, e != nullptr, "'", path_.string(), "' holds no tensor '", name, "'");
  at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(e->dtype));
  read(name, 0, e->numel, t.reshape({-1}));
  return t;
}

FSDPX_DECL size_t SafetensorsDir::add_file(const fs::path& file) {
  files_.push_back(std::make_unique<SafetensorsFile>(file));
  const size_t i = files_.size() - 1;
  for (const auto& e : files_[i]->entries()) {
    const auto [it, inserted] = where_.emplace(e.name, i);
    FSDPX_CHECK_AS(IoError, inserted, "'", path_.string(), "': tensor '", e.name, "' is in both '",
                   files_[it->second]->path().string(), "' and '", file.string(), "'");
  }
  return i;
}

FSDPX_DECL SafetensorsWriter::SafetensorsWriter(fs::path dir, std::vector<TensorSpec> specs, SafetensorsOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  detail::check_little_endian();
  FSDPX_CHECK(options_.max_shard_bytes > 0, "safetensors: max_shard_bytes must be positive, not ",
              options_.max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  FSDPX_CHECK_AS(IoError, !ec && fs::is_directory(dir_), "creating the directory '", dir_.string(),
                 "' failed: ", ec ? ec.message() : "it is not a directory");
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

FSDPX_DECL void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  FSDPX_CHECK(file_ < files_.size(), "safetensors: '", name, "' is one tensor more than the writer was planned for");
  const TensorSpec& s = files_[file_][next_];
  FSDPX_CHECK(name == s.name && tensor.scalar_type() == s.dtype && tensor.sizes() == c10::IntArrayRef(s.shape),
              "safetensors: the writer expected '", s.name, "' (", s.dtype, ", ", c10::IntArrayRef(s.shape),
              ") next, not '", name, "' (", tensor.scalar_type(), ", ", tensor.sizes(), ")");
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

FSDPX_DECL SavedSafetensors SafetensorsWriter::finish() {
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
    saved_.index = ::fsdpx::detail::write_text_durably(dir_ / index_name, index.dump(2) + "\n");
    written.insert(index_name);
  }
  // Stale files of an earlier save: a reader must not mix them with these.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string file = entry.path().filename().string();
    const bool ours =
        file == options_.name + ".safetensors" || file == index_name || detail::is_shard_file_name(file, options_.name);
    if (ours && written.count(file) == 0) fs::remove(entry.path(), ec);
  }
  return saved_;
}

FSDPX_DECL std::string SafetensorsWriter::file_name(size_t i) const {
  if (files_.size() == 1) return options_.name + ".safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", i + 1, files_.size());
  return options_.name + buf;
}

FSDPX_DECL void SafetensorsWriter::open_file() {
  const std::string header = detail::safetensors_header(files_[file_], options_.metadata);
  current_ = std::make_unique<::fsdpx::detail::DurableFile>(dir_ / file_name(file_));
  const uint64_t length = header.size();  // little-endian: checked in the constructor
  current_->append(&length, sizeof length);
  current_->append(header.data(), header.size());
}

}  // namespace fsdpx::hf
