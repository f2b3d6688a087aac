// The weight bucket: the one wire format of weight sync, used by the broadcast to rollout ranks and by
// the TCP synchronizer service alike.
//
// A bucket is one contiguous byte buffer: a self-describing header, then 64-byte-aligned payloads.
//
//   prefix (40 bytes, little-endian)
//     u32 magic 'FXSB'   u16 format (1)   u16 flags (bit 0: last bucket of the version)
//     u32 entry_count    u32 header_bytes (payloads start here; a multiple of 64)
//     u64 total_bytes    i64 version      u32 index      u32 count (buckets in this version)
//   entry_count entries
//     u16 name length, name bytes, u8 dtype code, u8 ndim, i64 shape[ndim],
//     i64 element_offset, i64 numel, u64 byte_offset
//
// An entry is a chunk of one tensor: elements [element_offset, element_offset + numel) of the tensor
// flattened in row-major order, stored at byte_offset from the bucket's start. Tensors larger than a
// bucket are split over consecutive buckets; everything a receiver needs is in the header.
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

#include <fsdpx/memory/host.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::sync {

static_assert(std::endian::native == std::endian::little,
              "fsdpx/sync: the weight bucket format is little-endian and is written with memcpy; "
              "big-endian hosts are not supported");

/// "No version yet": what a reader that holds nothing passes to wait for the first version.
inline constexpr int64_t no_version = -1;

struct Manifest;  // sync/delta.hpp

/// A tensor with its fully qualified parameter name ("blocks.3.mlp.fc.weight").
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

/// A complete set of weights under one version: what a receiver gets, what a synchronizer holds.
struct WeightSnapshot {
  int64_t version = no_version;
  std::vector<NamedTensor> tensors;
  /// The trainer run that published it (the TCP service: ClientOptions::run); empty in process.
  std::string run = {};
  /// What the version must be (each tensor's CRC-32C, the digest): sync::verify(tensors, *manifest)
  /// says whether weights are exactly it. Set by the TCP client and the Synchronizer.
  std::shared_ptr<const Manifest> manifest = {};

  /// The tensor named `name`; a SyncError naming it when absent.
  const at::Tensor& at(std::string_view name) const {
    for (const auto& t : tensors) {
      if (t.name == name) return t.tensor;
    }
    throw SyncError(::fsdpx::detail::str("fsdpx: weight snapshot version ", version, " has no tensor '", name, "'"));
  }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const auto& t : tensors) n += static_cast<int64_t>(t.tensor.nbytes());
    return n;
  }
};

/// What will be sent for one tensor: its name, shape and the dtype it travels in.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  /// Element offsets (ascending, within the flattened tensor) where a chunk must end: the sender's
  /// data changes place there (e.g. one rank's shard ends). The receiver needs no knowledge of them.
  std::vector<int64_t> breaks = {};
};

/// One chunk of one tensor inside a bucket.
struct BucketEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t element_offset = 0;  // first element of the chunk within the flattened tensor
  int64_t numel = 0;           // elements in the chunk
  int64_t byte_offset = 0;     // from the bucket's start, 64-byte aligned

  int64_t nbytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
  int64_t tensor_numel() const {
    int64_t n = 1;
    for (const int64_t s : shape) n *= s;
    return n;
  }
};

/// One bucket: where every entry lies, the header's size and the bucket's total size.
struct BucketLayout {
  int64_t version = no_version;
  uint32_t index = 0;
  uint32_t count = 0;
  bool last = false;
  std::vector<BucketEntry> entries;
  int64_t header_bytes = 0;
  int64_t total_bytes = 0;
};

namespace detail {

inline constexpr uint32_t bucket_magic = 0x42535846;  // "FXSB"
inline constexpr uint16_t bucket_format = 1;
inline constexpr int64_t prefix_bytes = 40;
inline constexpr int64_t alignment = 64;
inline constexpr int max_ndim = 16;

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

/// Which elements of one tensor have arrived: disjoint [begin, end) ranges, merged where they touch,
/// so chunks that arrive in order take one range. Readers and the server count a tensor whole only
/// when every element arrived exactly once: counting elements alone would take the first half sent
/// twice for the whole tensor, and hand out the other half uninitialised.
class Coverage {
 public:
  /// Records elements [begin, begin + n) of a tensor of `numel` elements; the reason it cannot (out of
  /// range, arrived before, an empty chunk of a non-empty tensor), recording nothing; empty when done.
  FSDPX_DECL std::string add(int64_t begin, int64_t n, int64_t numel);
  /// Elements recorded so far (each once).
  int64_t covered() const { return covered_; }
  /// Disjoint ranges held: what the bookkeeping costs.
  size_t ranges() const { return ranges_.size(); }
  /// Empty when all `numel` elements arrived; else the first range that did not, in words.
  FSDPX_DECL std::string gap(int64_t numel) const;

 private:
  std::map<int64_t, int64_t> ranges_;  // begin -> end
  int64_t covered_ = 0;
  bool empty_seen_ = false;  // the one entry of an empty tensor
};

/// A version's chunks as its buckets arrive (the server, before it commits a publish): each tensor
/// has one dtype and shape, and every element of every tensor arrives exactly once.
class VersionCoverage {
 public:
  /// Records entry `e` of bucket `bucket`; why it cannot belong to the version (naming the tensor),
  /// or empty.
  FSDPX_DECL std::string add(const BucketEntry& e, uint32_t bucket);
  /// Empty when every tensor arrived whole; else the tensors that did not (named, with their gaps).
  FSDPX_DECL std::string missing() const;
  /// What this bookkeeping holds, in bytes (so that a limit on a version can count it).
  int64_t bookkeeping_bytes() const { return bookkeeping_; }

 private:
  struct Tensor {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    Coverage coverage;
  };
  std::unordered_map<std::string, size_t> index_;
  std::vector<Tensor> tensors_;
  int64_t bookkeeping_ = 0;
};

}  // namespace detail

/// Splits tensors, in order, into buckets of at most `capacity` bytes (header included). A tensor that
/// does not fit the space left is split; the first bucket that cannot hold even one element of a
/// tensor besides its header entry is an error naming the tensor.
FSDPX_DECL std::vector<BucketLayout> plan_buckets(const std::vector<TensorSpec>& specs, int64_t capacity,
                                                  int64_t version);

/// The header bytes of `b` (b.header_bytes long, zero-padded).
FSDPX_DECL std::vector<uint8_t> encode_header(const BucketLayout& b);

/// The header's fixed prefix: enough to learn header_bytes and total_bytes.
inline constexpr int64_t bucket_prefix_bytes = detail::prefix_bytes;

/// Parses and validates a bucket header from `data` (at least the header's bytes). `where` names the
/// source in errors ("broadcast from trainer", "synchronizer 127.0.0.1:5000"). A header may describe no
/// more entries than detail::header_bookkeeping_floor and the payload bytes at hand allow; a `deadline`
/// (a fetch's) is checked while entries are parsed.
FSDPX_DECL BucketLayout decode_header(const uint8_t* data, int64_t available, std::string_view where,
                                      std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt);

/// The chunk of `bucket` (a 1-D uint8 tensor) that entry `e` occupies, as a 1-D tensor of its dtype.
inline at::Tensor entry_view(const at::Tensor& bucket, const BucketEntry& e) {
  return bucket.narrow(0, e.byte_offset, e.nbytes()).view(e.dtype);
}

/// Copies entry `e`'s chunk of `source` (the whole tensor, any dtype) into `bucket`, cast to e.dtype.
FSDPX_DECL void pack_entry(const at::Tensor& bucket, const BucketEntry& e, const at::Tensor& source);

/// Writes `b`'s header into the start of `bucket`.
FSDPX_DECL void write_header(const at::Tensor& bucket, const BucketLayout& b);

/// Packs whole tensors (already in memory) into freshly allocated buckets (the TCP service's path).
FSDPX_DECL std::vector<at::Tensor> pack_buckets(const std::vector<NamedTensor>& tensors, int64_t capacity,
                                                int64_t version, std::vector<BucketLayout>* layouts = nullptr);

// ---- receiving: where the chunks go -----------------------------------------------------------------

/// Assembles whole tensors from chunks, allocating each on first sight (on `device`).
class TensorCollector {
 public:
  /// `max_bytes`: the most the tensors of one version may take together; a sender announcing more is
  /// refused before the allocation. Their bookkeeping may exceed the bytes that arrived by at most
  /// detail::version_bookkeeping_floor: a version of many empty tensors is refused, not held.
  /// `huge_pages`: host tensors from memory::empty_buffer (2 MiB pages from 2 MiB); a receiver of
  /// untrusted peers passes false, so that scattered one-element chunks touch 4 KiB of memory each, not
  /// 2 MiB (1,024 of them, a 40 KB bucket, touched 2 GiB).
  explicit TensorCollector(at::Device device = at::kCPU, int64_t max_bytes = std::numeric_limits<int64_t>::max(),
                           bool huge_pages = true)
      : device_(device), max_bytes_(max_bytes), huge_pages_(huge_pages) {}

  FSDPX_DECL void accept(const BucketEntry& e, const at::Tensor& chunk);

  /// Where entry `e`'s chunk can be received in place (the tensor allocated on first sight), or an
  /// undefined tensor when it cannot (then accept() is called with the chunk and says why).
  FSDPX_DECL at::Tensor destination(const BucketEntry& e);
  /// Entry `e` was received into destination(e).
  FSDPX_DECL void accepted(const BucketEntry& e);

  /// Checks every tensor arrived whole, each element exactly once, and hands them out, in arrival order.
  FSDPX_DECL std::vector<NamedTensor> finish();

  FSDPX_DECL static std::string join(const std::vector<std::string>& items, size_t max = 8);

 private:
  /// The tensor for `e`'s name, allocated on first sight (host ones through memory::empty_buffer).
  FSDPX_DECL std::unordered_map<std::string, size_t>::iterator add(const BucketEntry& e);
  /// Records `e` in its tensor's coverage; false (a problem noted) when it overlaps or lies outside.
  FSDPX_DECL bool cover(size_t index, const BucketEntry& e);

  at::Device device_;
  int64_t max_bytes_;
  bool huge_pages_;
  int64_t allocated_ = 0;    // the tensors' bytes
  int64_t arrived_ = 0;      // the chunks' bytes accepted
  int64_t bookkeeping_ = 0;  // beyond the tensors' bytes (detail::bookkeeping_problem)
  std::unordered_map<std::string, size_t> index_;
  std::vector<NamedTensor> tensors_;
  std::vector<detail::Coverage> received_;
  std::vector<std::string> problems_;
};

/// Copies chunks into a module's parameters and buffers by name. Names, shapes and completeness are
/// checked; what does not match is collected and reported at finish(), after every chunk was consumed,
/// so that a broadcast stays in step with its sender. The target's dtype may differ from the wire's
/// (copy_ casts), but then the copy is not bit-exact.
class ModuleLoader {
 public:
  FSDPX_DECL explicit ModuleLoader(torch::nn::Module& module);

  FSDPX_DECL void accept(const BucketEntry& e, const at::Tensor& chunk);

  /// Where entry `e`'s chunk can be received in place: the parameter's elements when the name, shape
  /// and dtype match and the parameter is contiguous; else an undefined tensor (then accept() is
  /// called with the chunk, and casts or reports).
  FSDPX_DECL at::Tensor destination(const BucketEntry& e) const;
  /// Entry `e` was received into destination(e).
  FSDPX_DECL void accepted(const BucketEntry& e);

  FSDPX_DECL void finish();

 private:
  struct Target {
    std::string name;
    at::Tensor param;
    detail::Coverage received;
    bool reported = false;  // a mismatch was already recorded
  };
  /// Records `e` in its target's coverage; false (a problem noted) when it overlaps or lies outside.
  FSDPX_DECL bool cover(Target& t, const BucketEntry& e);
  std::vector<Target> targets_;
  std::map<std::string, size_t> by_name_;
  std::vector<std::string> unknown_;
  std::vector<std::string> problems_;
};

/// Loads whole named tensors into `module`'s parameters and buffers by name, with ModuleLoader's checks.
FSDPX_DECL void load_into(torch::nn::Module& module, const std::vector<NamedTensor>& tensors);

/// Moves `module`'s CPU parameters of memory::huge_page_bytes or more into memory::empty_host() memory
/// (2 MiB-aligned, advised to use huge pages), keeping each Parameter object, its values, shape and
/// requires_grad. For a receiving module (receive_into, load_into, fetch_newer_into): every copy of
/// a sync lands in its parameters, and on 4 KiB pages the broadcast runs slower (docs/sync.md,
/// "Measured", has the figures). Call it once, before anything keeps pointers into the parameters: their
/// storage changes. Tied parameters move once. Pinned, non-CPU and already 2 MiB-aligned ones stay,
/// and so do views into a larger storage (a flat buffer some other code owns, e.g. a module fsdpx
/// shards: moving them would cut them off from it). Returns the bytes moved (0 with
/// FSDPX_HUGE_PAGES=0, or off Linux, where empty_host() is PyTorch's allocator).
FSDPX_DECL int64_t place_on_huge_pages(torch::nn::Module& module);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/bucket.ipp>
#endif
