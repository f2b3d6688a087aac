// The broadcast's wire format (sync/broadcast.hpp), its one description:
//
// On the wire, per version: an announcement {magic, version, kind, base version, base digest, flags}
// (a small broadcast), and, when it names a base, one all-reduce (minimum) in which each receiver says
// whether it holds that base. Then a preamble {magic, version, bucket count, largest header,
// direct_bytes (BroadcastOptions::direct_bytes), largest bucket} and the header sizes (two small
// broadcasts); then, per bucket, its self-describing header (a small broadcast of its own) and its
// payload in segments: a chunk of at least direct_bytes alone, runs of smaller chunks together (detail::segments_of,
// derived from the header on both sides). A lone chunk is sent straight from where it lies (the gather buffer, or the
// sending rank's own shard) when no cast is needed, and received straight into the destination
// parameter (or tensor) when the dtypes match; the rest goes through two staging buckets on each side,
// so that packing and unpacking overlap the broadcasts.
//
// Internal: the constants, the announcement, the segments of a bucket (decided from its header alone,
// so both sides agree) and the sink that checksums chunks as they arrive.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/manifest.hpp>

namespace fsdpx::sync::detail {

inline constexpr int64_t preamble_magic = 0x46585357'50524533;  // "FXSWPRE3"
inline constexpr int64_t preamble_longs = 6;
inline constexpr int64_t announce_magic = 0x46585357'414e4e31;  // "FXSWANN1"
/// A preamble's bucket count saying the sender failed after announcing the version: nothing follows.
inline constexpr int64_t aborted_version = -1;
inline constexpr int64_t announce_longs = 6;
/// The most bytes a version's manifest may take on the wire (checked before the allocation).
inline constexpr int64_t max_manifest_bytes = int64_t{1} << 30;

/// A version, as announced before it travels (the first broadcast of every version).
struct Announcement {
  enum Kind : int64_t { streamed = 0, cut = 1 };
  int64_t version = no_version;
  Kind kind = streamed;
  int64_t base_version = no_version;  // cut: the version a delta would come from (no_version: none)
  uint32_t base_digest = 0;
  bool checksums = false;  // streamed: the manifest follows the buckets
};

/// Wraps a bucket sink (TensorCollector, ModuleLoader) and computes each tensor's CRC-32C from its
/// chunks as they arrive, in the dtype they travel in (before a module casts them), to check against
/// the version's manifest. Chunks of one tensor must come in order (the receiver hands them over so).
template <class Sink>
class ChecksumSink {
 public:
  explicit ChecksumSink(Sink& sink) : sink_(sink) {}
  void accept(const BucketEntry& e, const at::Tensor& chunk) {
    add(e, chunk);
    sink_.accept(e, chunk);
  }
  at::Tensor destination(const BucketEntry& e) {
    at::Tensor d = sink_.destination(e);
    if (d.defined()) direct_[{e.name, e.element_offset}] = d;
    return d;
  }
  void accepted(const BucketEntry& e) {
    const auto it = direct_.find({e.name, e.element_offset});
    if (it != direct_.end()) {
      add(e, it->second);
      direct_.erase(it);
    }
    sink_.accepted(e);
  }
  /// The size of the manifest of exactly the tensors that arrived (what the sender's must be).
  int64_t manifest_bytes() const { return manifest_bytes_; }
  /// Every tensor of `manifest` arrived with its CRC-32C, and nothing else did: a SyncError naming the
  /// tensors that differ otherwise.
  void check(const Manifest& manifest, std::string_view where) const {
    std::vector<std::string> problems;
    for (const ManifestEntry& m : manifest.entries) {
      const auto it = crcs_.find(m.name);
      if (it == crcs_.end()) {
        problems.push_back(::fsdpx::detail::str("'", m.name, "' never arrived"));
      } else if (it->second.value() != m.crc) {
        problems.push_back(::fsdpx::detail::str("'", m.name, "' does not match its checksum (CRC-32C)"));
      }
    }
    const auto listed = entries_by_name(manifest);
    for (const auto& [name, crc] : crcs_) {
      if (!listed.contains(name)) problems.push_back(::fsdpx::detail::str("'", name, "' is not in the manifest"));
    }
    FSDPX_CHECK_AS(SyncError, problems.empty(), "version ", manifest.version, " from ", where,
                   " did not arrive intact (the transport corrupted it, or the sender is not fsdpx): ",
                   TensorCollector::join(problems));
  }

 private:
  void add(const BucketEntry& e, const at::Tensor& chunk) {
    auto [it, fresh] = crcs_.try_emplace(e.name);
    if (fresh) manifest_bytes_ += 20 + static_cast<int64_t>(e.name.size() + 8 * e.shape.size());  // its entry
    const at::Tensor host = chunk.is_cpu() ? chunk.contiguous() : chunk.cpu();
    it->second.update(host.const_data_ptr(), host.nbytes());
  }
  Sink& sink_;
  int64_t manifest_bytes_ = 48;                                   // the manifest's prefix
  std::map<std::pair<std::string, int64_t>, at::Tensor> direct_;  // received in place, not yet accepted
  std::unordered_map<std::string, ::fsdpx::detail::Crc32c> crcs_;
};

/// One broadcast of a bucket's payload: entries [first, last] of the bucket, bytes [begin, end) of it.
struct Segment {
  size_t first = 0, last = 0;
  int64_t begin = 0, end = 0;
  bool single() const { return first == last; }
};

/// How a bucket's payload travels, decided from its header alone (so both sides agree): an entry of
/// at least `direct_bytes` bytes is a broadcast of its own (sent from where the data lies and received
/// where it belongs); each run of consecutive smaller entries is one broadcast of the bytes they span
/// in the bucket's layout. Empty entries carry no bytes and are in no segment.
FSDPX_DECL std::vector<Segment> segments_of(const BucketLayout& b, int64_t direct_bytes);

inline at::Tensor as_bytes(const at::Tensor& t) { return t.view(at::kByte); }

}  // namespace fsdpx::sync::detail
