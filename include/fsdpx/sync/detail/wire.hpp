// The byte-level vocabulary of weight sync's wire formats (the bucket, the manifest): their constants,
// the bounds on what a receiver's bookkeeping may cost, our dtype codes, and a writer and a bounded
// reader of little-endian fields. Internal; python/fsdpx_sync/wire.py holds the same constants, and a
// test compares the two.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>

namespace fsdpx::sync::detail {

static_assert(std::endian::native == std::endian::little,
              "fsdpx/sync: the weight bucket format is little-endian and is written with memcpy; "
              "big-endian hosts are not supported");

inline constexpr uint32_t bucket_magic = 0x42535846;  // "FXSB"
inline constexpr uint16_t bucket_format = 1;
inline constexpr int64_t prefix_bytes = 40;
inline constexpr int64_t alignment = 64;
inline constexpr int max_ndim = 16;
/// Bytes an entry takes in a bucket header at the least (no name, no dims): a count the header cannot
/// hold is refused before anything is parsed.
inline constexpr int64_t min_entry_bytes = 2 + 1 + 1 + 3 * 8;

inline int64_t align_up(int64_t n) { return (n + alignment - 1) / alignment * alignment; }

// A receiver's bookkeeping (a bucket's parsed entries; a version's tensors with their names, indexes and
// coverage, and its manifest's entries) costs memory whatever the bytes that came with it. Each may exceed
// the bytes that arrived by at most its floor: a bucket's parsed entries by header_bookkeeping_floor, a
// version's tensors and manifest by version_bookkeeping_floor (an honest delta of a model of 100,000
// tensors that barely changed stays within it). The per-item costs are upper bounds of what LibTorch and
// the standard library take (docs/sync.md, "Bounds on bookkeeping"); python/fsdpx_sync/bucket.py applies
// the same rule and the same per-tensor cost, so that what the server commits every receiver accepts.
inline constexpr int64_t header_bookkeeping_floor = int64_t{64} << 20;
inline constexpr int64_t version_bookkeeping_floor = int64_t{256} << 20;
inline constexpr int64_t parsed_entry_bytes = 256;                // a BucketEntry held while its bucket is read
inline constexpr int64_t tensor_bookkeeping_bytes = 2048;         // a received tensor besides its elements
inline constexpr int64_t range_bookkeeping_bytes = 64;            // a range of a tensor's chunks out of order
inline constexpr int64_t manifest_entry_bookkeeping_bytes = 512;  // a decoded manifest entry (as Python counts it)

/// Why `bookkeeping` bytes of bookkeeping are too many after `arrived` bytes with this `floor`, or empty.
FSDPX_DECL std::string bookkeeping_problem(int64_t bookkeeping, int64_t arrived, int64_t floor, std::string_view what);

inline int64_t entry_header_bytes(const std::string& name, size_t ndim) {
  return 2 + static_cast<int64_t>(name.size()) + 2 + 8 * static_cast<int64_t>(ndim) + 24;
}

// Codes of our own rather than at::ScalarType's numbering, which is not a stable interface.
FSDPX_DECL uint8_t dtype_code(at::ScalarType t);

FSDPX_DECL std::optional<at::ScalarType> dtype_from_code(uint8_t code);

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) {}
  template <class T>
  void put(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  void put_bytes(std::string_view s) { out_.insert(out_.end(), s.begin(), s.end()); }

 private:
  std::vector<uint8_t>& out_;
};

/// Bounds-checked reads of a header; every failure is a SyncError naming where the bytes came from.
class Reader {
 public:
  Reader(const uint8_t* data, int64_t size, std::string_view where) : data_(data), size_(size), where_(where) {}
  template <class T>
  T get(const char* what) {
    need(static_cast<int64_t>(sizeof(T)), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += static_cast<int64_t>(sizeof(T));
    return v;
  }
  std::string get_string(int64_t n, const char* what) {
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += n;
    return s;
  }
  int64_t position() const { return pos_; }
  [[noreturn]] void fail(const std::string& why) const {
    throw SyncError(::fsdpx::detail::str("fsdpx: corrupt weight bucket (", where_, "): ", why));
  }

 private:
  void need(int64_t n, const char* what) const {
    if (n < 0 || pos_ + n > size_) {
      fail(::fsdpx::detail::str("the header ends inside ", what, " (", size_, " header bytes)"));
    }
  }
  const uint8_t* data_;
  int64_t size_;
  int64_t pos_ = 0;
  std::string_view where_;
};

}  // namespace fsdpx::sync::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/wire.ipp>
#endif
