// Out-of-line functions of fsdpx/dcp/reader.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/archive_reader.hpp>
#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/dcp/plan.hpp>
#include <fsdpx/dcp/reader.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/pickle/pickle.hpp>

namespace fsdpx::dcp::detail {

inline bool no_globals(std::string_view, std::string_view) { return false; }

/// The plain value of the torch.save archive at bytes [offset, offset + length) of `path`: its pickle only,
/// read by fsdpx's pickle reader with no global admitted (LibTorch's unpickler would make some classes, an
/// OrderedDict, None; and a plain value has no business holding any).
inline c10::IValue plain_archive_value(const fs::path& path, int64_t offset, int64_t length, const std::string& what,
                                       const ReaderOptions& options) {
  const std::vector<std::byte> data =
      ::fsdpx::checkpoint::detail::read_archive_pickle(path, offset, length, what, options.max_bytes_entry);
  ::fsdpx::pickle::Limits limits;
  limits.max_bytes = options.max_bytes_entry;
  limits.max_values = options.max_bytes_values;
  const auto p = ::fsdpx::pickle::parse(data, what, no_globals, limits);
  return ::fsdpx::checkpoint::detail::pickle_value(p, what, /*storages=*/nullptr);
}

/// The folder's `.metadata`, checked against its commit record (size and CRC-32C on the very bytes parsed)
/// when there is one.
inline Metadata open_metadata(const fs::path& dir, const ReaderOptions& options) {
  const fs::path path = dir / metadata_file_name;
  const std::vector<char> data =
      ::fsdpx::detail::read_file(path, "DCP metadata file", options.metadata.max_bytes, ::fsdpx::detail::Links::refuse);
  if (options.committed) {
    const auto it = options.committed->find(metadata_file_name);
    FSDPX_CHECK_AS(IoError, it != options.committed->end(), "DCP metadata file '", path.string(),
                   "' is not listed in its step's commit record");
    ::fsdpx::checkpoint::detail::check_committed_bytes(path, "DCP metadata file", data, it->second.bytes,
                                                       it->second.crc32c);
  }
  return parse_metadata(std::as_bytes(std::span(data)), path.string(), options.metadata);
}

inline std::string box_text(const Chunk& c) {
  return ::fsdpx::detail::str("offsets ", c10::IntArrayRef(c.offsets), ", sizes ", c10::IntArrayRef(c.sizes));
}

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL bool is_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::exists(dir / metadata_file_name, ec);
}

FSDPX_DECL Reader::Reader(fs::path dir, const ReaderOptions& options)
    : dir_(std::move(dir)), options_(options), md_(detail::open_metadata(dir_, options)) {
  // Each data file once: a regular file in the folder (read_metadata refused names with a directory part; a
  // symbolic link could point out of it) large enough for every range recorded in it, so a read never starts
  // past a file's end, and of the size its commit record says when it has one.
  std::map<std::string, int64_t> sizes;
  for (const auto& [key, info] : md_.storage) {
    const std::string entry = key.offsets ? ::fsdpx::detail::str("entry '", key.fqn, "' (its chunk at offsets ",
                                                                 c10::IntArrayRef(*key.offsets), ")")
                                          : ::fsdpx::detail::str("bytes entry '", key.fqn, "'");
    if (info.transform_descriptors && !info.transform_descriptors->empty()) {
      throw IoError(::fsdpx::detail::str("fsdpx: DCP checkpoint '", dir_.string(), "': ", entry,
                                         " is stored through the transforms [",
                                         ::fsdpx::detail::join_names(*info.transform_descriptors),
                                         "] (a storage writer's extensions, such as a compressor), which fsdpx cannot "
                                         "undo; save it without extensions"));
    }
    auto it = sizes.find(info.relative_path);
    if (it == sizes.end()) {
      const fs::path path = dir_ / info.relative_path;
      const ::fsdpx::detail::Fd fd =
          ::fsdpx::detail::open_regular_file(path, "DCP data file", ::fsdpx::detail::Links::refuse);
      struct stat st{};
      if (::fstat(fd.get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", path, errno);
      it = sizes.emplace(info.relative_path, int64_t{st.st_size}).first;
      if (options_.committed) {
        const auto c = options_.committed->find(info.relative_path);
        FSDPX_CHECK_AS(IoError, c != options_.committed->end(), "DCP data file '", path.string(),
                       "' is not listed in its step's commit record: it was not written by the save that committed "
                       "the step");
        FSDPX_CHECK_AS(IoError, c->second.bytes == it->second, "DCP data file '", path.string(), "' has ", it->second,
                       " bytes but its commit record says ", c->second.bytes,
                       ": the file is truncated or was replaced");
      }
    }
    FSDPX_CHECK_AS(IoError, info.offset + info.length <= it->second, "DCP checkpoint '", dir_.string(), "': ", entry,
                   " lies at ", place(info), ", which has ", it->second, " bytes (truncated?)");
  }
  // A chunk's record holds its elements (and an archive around them): a box larger than its record is a lie
  // told before any read, refused here rather than sized from.
  for (const auto& [fqn, e] : md_.entries) {
    const auto* t = std::get_if<TensorEntry>(&e);
    if (t == nullptr) continue;
    const auto itemsize = static_cast<int64_t>(c10::elementSize(t->dtype));
    for (const Chunk& c : t->chunks) {
      int64_t volume = 1;
      for (const int64_t d : c.sizes) volume *= d;  // validate_metadata: within the tensor, no overflow
      const StorageInfo& info = storage({fqn, c.offsets});
      FSDPX_CHECK_AS(IoError, volume <= info.length / itemsize, "DCP checkpoint '", dir_.string(), "': the chunk of '",
                     fqn, "' (", detail::box_text(c), ") is ", volume, " elements of ", t->dtype, ", more than its ",
                     "record of ", info.length, " bytes at ", place(info), " holds");
    }
  }
}

FSDPX_DECL void Reader::check_committed(const std::string& relative_path) const {
  if (!options_.committed || checked_.contains(relative_path)) return;
  const auto expected = options_.committed->at(relative_path).crc32c;  // the constructor: every file is listed
  if (expected) {
    const fs::path path = dir_ / relative_path;
    const ::fsdpx::detail::Fd fd =
        ::fsdpx::detail::open_regular_file(path, "DCP data file", ::fsdpx::detail::Links::refuse);
    struct stat st{};
    if (::fstat(fd.get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", path, errno);
    ::fsdpx::detail::Crc32c crc;
    std::vector<char> block(std::min<int64_t>(st.st_size, int64_t{4} << 20));
    for (int64_t at = 0; at < st.st_size; at += static_cast<int64_t>(block.size())) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(block.size()), st.st_size - at);
      ::fsdpx::detail::read_exact(fd.get(), path, at, block.data(), n, st.st_size);
      crc.update(block.data(), static_cast<size_t>(n));
    }
    FSDPX_CHECK_AS(IoError, crc.value() == *expected, "DCP data file '", path.string(), "' is corrupt: its CRC-32C is ",
                   crc.value(), " but ", *expected, " was committed");
  }
  checked_.insert(relative_path);
}

FSDPX_DECL const TensorEntry* Reader::find_tensor(const std::string& fqn) const {
  const auto it = md_.entries.find(fqn);
  return it == md_.entries.end() ? nullptr : std::get_if<TensorEntry>(&it->second);
}

FSDPX_DECL const TensorEntry& Reader::tensor(const std::string& fqn) const {
  const TensorEntry* t = find_tensor(fqn);
  FSDPX_CHECK(t != nullptr, "DCP checkpoint '", dir_.string(), "' has no tensor '", fqn, "'",
              has_bytes(fqn) ? " (it is a bytes entry: read_bytes)" : "");
  return *t;
}

FSDPX_DECL bool Reader::has_bytes(const std::string& fqn) const {
  const auto it = md_.entries.find(fqn);
  return it != md_.entries.end() && std::holds_alternative<BytesEntry>(it->second);
}

FSDPX_DECL const StorageInfo& Reader::storage(const StorageIndex& key) const {
  return md_.storage.at(key);  // validate_metadata: every chunk and bytes entry has its record
}

FSDPX_DECL std::string Reader::place(const StorageInfo& info) const {
  return ::fsdpx::detail::str("bytes [", info.offset, ", ", info.offset, " + ", info.length, ") of '",
                              (dir_ / info.relative_path).string(), "'");
}

FSDPX_DECL void Reader::check_torch_save(const std::string& what, const StorageInfo& info) const {
  // DCP's default format is a torch.save (zip) archive per item; its other one (SerializationFormat.SAFETENSORS,
  // Hugging Face's storage writer) is one safetensors file per rank, which this reader does not parse.
  const fs::path path = dir_ / info.relative_path;
  const ::fsdpx::detail::Fd fd = ::fsdpx::detail::open_regular_file(path, "DCP data file");
  std::array<unsigned char, 9> head{};
  const int64_t n = std::min<int64_t>(info.length, static_cast<int64_t>(head.size()));
  ::fsdpx::detail::read_exact(fd.get(), path, info.offset, head.data(), n, info.offset + info.length);
  if (n >= 4 && std::memcmp(head.data(), "PK\x03\x04", 4) == 0) return;
  const bool safetensors = n == 9 && head[8] == '{';
  throw IoError(::fsdpx::detail::str(
      "fsdpx: ", what, " is not a torch.save archive (DCP's default storage format) but ",
      safetensors ? "a safetensors file (DCP's SerializationFormat.SAFETENSORS)" : "data of an unknown format",
      "; fsdpx reads DCP checkpoints written in the default format (FileSystemWriter's serialization_format="
      "TORCH_SAVE, no transforms)"));
}

FSDPX_DECL at::Tensor Reader::load_chunk(const std::string& fqn, const TensorEntry& t, const Chunk& c) const {
  const StorageInfo& info = storage({fqn, c.offsets});
  const std::string what = ::fsdpx::detail::str("DCP checkpoint '", dir_.string(), "': the chunk of '", fqn, "' (",
                                                detail::box_text(c), ") at ", place(info));
  check_committed(info.relative_path);
  check_torch_save(what, info);
  const c10::IValue v =
      ::fsdpx::checkpoint::detail::load_ivalue_range(dir_ / info.relative_path, info.offset, info.length, what);
  FSDPX_CHECK_AS(IoError, v.isTensor(), what, " holds ", v.tagKind(), ", not a tensor");
  const at::Tensor& chunk = v.toTensor();
  FSDPX_CHECK_AS(IoError, chunk.scalar_type() == t.dtype && chunk.sizes() == c10::IntArrayRef(c.sizes), what,
                 " holds a tensor of dtype ", chunk.scalar_type(), " and sizes ", chunk.sizes(), "; the metadata says ",
                 t.dtype, " and ", c10::IntArrayRef(c.sizes));
  ++chunks_read_;
  bytes_read_ += info.length;
  return chunk;
}

FSDPX_DECL void Reader::read_into(const std::string& fqn, int64_t begin, int64_t end, const at::Tensor& dst) const {
  const TensorEntry& t = tensor(fqn);
  const size_t nd = t.size.size();
  const std::vector<int64_t> stride = row_major_strides(t.size);
  int64_t numel = 1;
  for (const int64_t d : t.size) numel *= d;  // validate_metadata: no overflow
  FSDPX_CHECK(begin >= 0 && begin <= end && end <= numel, "reading elements [", begin, ", ", end, ") of DCP tensor '",
              fqn, "', which has ", numel);
  FSDPX_CHECK(dst.dim() == 1 && dst.numel() == end - begin, "reading elements [", begin, ", ", end, ") of DCP tensor '",
              fqn, "' into a tensor of sizes ", dst.sizes());
  if (begin == end) return;
  std::vector<std::pair<int64_t, int64_t>> filled;
  at::NoGradGuard no_grad;
  for (const Chunk& c : t.chunks) {
    const std::vector<ChunkRun> runs = chunk_runs(t.size, stride, c, begin, end);
    if (runs.empty()) continue;
    const at::Tensor data = load_chunk(fqn, t, c).contiguous().view({-1});
    for (const ChunkRun& r : runs) {
      dst.narrow(0, r.lo - begin, r.hi - r.lo).copy_(data.narrow(0, r.src, r.hi - r.lo));
      filled.emplace_back(r.lo, r.hi);
    }
  }
  std::sort(filled.begin(), filled.end());
  int64_t covered = begin;
  for (const auto& [lo, hi] : filled) {
    if (lo > covered) break;
    covered = std::max(covered, hi);
  }
  if (covered < end) {
    std::vector<int64_t> at(nd);
    for (size_t i = 0; i < nd; ++i) at[i] = covered / stride[i] % t.size[i];
    throw IoError(::fsdpx::detail::str("fsdpx: DCP checkpoint '", dir_.string(), "': no chunk of tensor '", fqn,
                                       "' (size ", c10::IntArrayRef(t.size), ") holds its element ", covered,
                                       " (flattened; at ", c10::IntArrayRef(at), ")"));
  }
}

FSDPX_DECL c10::IValue Reader::read_bytes(const std::string& fqn) const {
  FSDPX_CHECK(has_bytes(fqn), "DCP checkpoint '", dir_.string(), "' has no bytes entry '", fqn, "'",
              find_tensor(fqn) != nullptr ? " (it is a tensor: read)" : "");
  const StorageInfo& info = storage({fqn, std::nullopt});
  const std::string what =
      ::fsdpx::detail::str("DCP checkpoint '", dir_.string(), "': bytes entry '", fqn, "' at ", place(info));
  check_committed(info.relative_path);
  check_torch_save(what, info);
  ++chunks_read_;
  bytes_read_ += info.length;
  return detail::plain_archive_value(dir_ / info.relative_path, info.offset, info.length, what, options_);
}

FSDPX_DECL c10::IValue read_plain_file(const fs::path& path, const ReaderOptions& options) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);  // a stat: no open, so nothing that could block
  FSDPX_CHECK_AS(IoError, !ec, "cannot read '", path.string(), "': ", ec.message());
  return detail::plain_archive_value(path, 0, static_cast<int64_t>(size), ::fsdpx::detail::str("'", path.string(), "'"),
                                     options);
}

}  // namespace fsdpx::dcp
