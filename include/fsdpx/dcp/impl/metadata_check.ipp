// Checking what a DCP `.metadata` says (fsdpx/dcp/metadata.hpp), on reading (an IoError: the file is
// untrusted) and before writing (a ConfigError: the Metadata is the caller's). Included by metadata.hpp
// (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/metadata.hpp>

#include <algorithm>
#include <set>

#include <c10/util/ArrayRef.h>

namespace fsdpx::dcp::detail {

template <class... Args>
[[noreturn]] void refuse(bool writing, std::string_view what, const Args&... args) {
  const std::string message = ::fsdpx::detail::str("fsdpx: '", what, "': ", args...);
  if (writing) throw ConfigError(message);
  throw IoError(message);
}

/// A file name that stays in the checkpoint directory: no directory part, not "." or "..".
inline bool plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

inline void check_tensor(const std::string& fqn, const TensorEntry& t, const Metadata& md, bool writing,
                         std::string_view what) {
  int64_t numel = 1;
  for (const int64_t d : t.size) {
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
      refuse(writing, what, "entry '", fqn, "' has the size ", c10::IntArrayRef(t.size),
             ", whose element count is negative or overflows");
    }
  }
  int64_t covered = 0;
  bool overflow = false;  // overlapping chunks of more elements than an int64 counts
  std::set<std::vector<int64_t>> offsets;
  for (const Chunk& c : t.chunks) {
    const auto box = [&] {
      return ::fsdpx::detail::str("offsets ", c10::IntArrayRef(c.offsets), " and sizes ", c10::IntArrayRef(c.sizes));
    };
    if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size()) {
      refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has a chunk of ", box());
    }
    int64_t volume = 1;
    for (size_t i = 0; i < t.size.size(); ++i) {
      int64_t end = 0;
      if (c.offsets[i] < 0 || c.sizes[i] < 0 || __builtin_add_overflow(c.offsets[i], c.sizes[i], &end) ||
          end > t.size[i]) {
        refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has a chunk of ", box(),
               ", which is not within it");
      }
      volume *= c.sizes[i];  // within the tensor, whose element count did not overflow
    }
    if (!offsets.insert(c.offsets).second) {
      refuse(writing, what, "entry '", fqn, "' has two chunks at the offsets ", c10::IntArrayRef(c.offsets));
    }
    if (md.storage.find(StorageIndex{fqn, c.offsets}) == md.storage.end()) {
      refuse(writing, what, "entry '", fqn, "' has no storage record for its chunk of ", box());
    }
    overflow = overflow || __builtin_add_overflow(covered, volume, &covered);
  }
  if (overflow || covered != numel) {
    refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has chunks of ",
           overflow ? std::string("more") : std::to_string(covered), " elements in all, not its ", numel,
           ": a chunk is missing or chunks overlap");
  }
}

inline void check_metadata(const Metadata& md, bool writing, std::string_view what) {
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorEntry>(&entry)) {
      check_tensor(fqn, *t, md, writing, what);
    } else if (md.storage.find(StorageIndex{fqn, std::nullopt}) == md.storage.end()) {
      refuse(writing, what, "bytes entry '", fqn, "' has no storage record");
    }
  }
  for (const auto& [key, info] : md.storage) {
    const auto entry = md.entries.find(key.fqn);
    if (entry == md.entries.end()) refuse(writing, what, "storage_data holds '", key.fqn, "', which is no entry");
    if (const auto* t = std::get_if<TensorEntry>(&entry->second)) {
      const auto& offsets = key.offsets;  // a structured binding is captured by lambdas from clang 16 only
      if (!offsets ||
          std::none_of(t->chunks.begin(), t->chunks.end(), [&](const Chunk& c) { return c.offsets == *offsets; })) {
        refuse(writing, what, "storage_data holds a record of tensor entry '", key.fqn,
               "' that is none of its chunks' offsets");
      }
    } else if (key.offsets) {
      refuse(writing, what, "storage_data holds a record of bytes entry '", key.fqn, "' with chunk offsets");
    }
    int64_t end = 0;
    if (!plain_file_name(info.relative_path)) {
      refuse(writing, what, "entry '", key.fqn, "' is stored in '", info.relative_path,
             "', which is not a file name in the checkpoint directory");
    }
    if (info.offset < 0 || info.length < 0 || __builtin_add_overflow(info.offset, info.length, &end)) {
      refuse(writing, what, "entry '", key.fqn, "' is stored at offset ", info.offset, " with length ", info.length,
             ", which is no range of a file");
    }
    if (info.chunk_index && *info.chunk_index < 0) {
      refuse(writing, what, "entry '", key.fqn, "' has the chunk index ", *info.chunk_index);
    }
  }
}

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL void validate_metadata(const Metadata& md, std::string_view what) {
  detail::check_metadata(md, false, what);
}

}  // namespace fsdpx::dcp
