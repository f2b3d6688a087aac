// The synchronizer's frames: the codec shared by its server and client (docs/sync.md, "Frames", is
// the specification; the Python receiver implements the same).
//
// A frame is a 40-byte little-endian header {u32 magic 'FXS2', u16 kind, u16 flags, i64 version,
// u64 payload length, u64 checksum (CRC-32C of the payload in the low 32 bits), u64 aux} and the
// payload. Which kinds may carry a payload, and how large, is fixed per kind: a receiver refuses a
// frame before it allocates anything for it.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>

namespace fsdpx::sync::detail {

enum class FrameKind : uint16_t {
  publish_begin = 1,   // version; aux = bucket count; payload = the publisher's run
  bucket = 2,          // aux = bucket index; payload = one weight bucket
  publish_end = 3,     // version
  ack = 4,             // version committed
  fetch = 5,           // version = the reader's; aux = how long the server may wait, ms; payload = FetchBase, its run
  snapshot_begin = 6,  // version; aux = bucket count; payload = its run; bucket frames follow
  timeout = 7,         // version = the server's latest
  error = 8,           // payload = message (server to client only); aux = refused_busy: try again later
  goodbye = 9,         // a publisher leaves on purpose
  hello = 10,          // server's first frame: aux = protocol; payload = server nonce
  auth = 11,           // aux = role; payload = client nonce, client MAC
  welcome = 12,        // aux = role; payload = server MAC
};

inline const char* to_string(FrameKind k) {
  switch (k) {
    case FrameKind::publish_begin: return "publish_begin";
    case FrameKind::bucket: return "bucket";
    case FrameKind::publish_end: return "publish_end";
    case FrameKind::ack: return "ack";
    case FrameKind::fetch: return "fetch";
    case FrameKind::snapshot_begin: return "snapshot_begin";
    case FrameKind::timeout: return "timeout";
    case FrameKind::error: return "error";
    case FrameKind::goodbye: return "goodbye";
    case FrameKind::hello: return "hello";
    case FrameKind::auth: return "auth";
    case FrameKind::welcome: return "welcome";
  }
  return "unknown";
}

inline constexpr uint32_t frame_magic = 0x32535846;  // "FXS2"
/// 3: runs (publish_begin, fetch and snapshot_begin carry one) and refusals at accept.
/// 4: every version carries its manifest (sync/manifest.hpp); versions may travel as deltas, and a fetch
/// says which version (and digest) the reader holds.
inline constexpr uint64_t protocol_version = 4;
/// Error texts are short; a longer one is refused, not allocated.
inline constexpr uint64_t max_error_bytes = 64 << 10;
/// A run's identity: text of at most this many bytes.
inline constexpr uint64_t max_run_bytes = 256;
/// An error frame's aux when the server refused a connection at accept for a limit (too many
/// connections, or unauthenticated ones): the client may try again until its connect_timeout.
inline constexpr uint64_t refused_busy = 1;
/// An error frame's aux when the server refused a delta publish because it does not hold the delta's
/// base (another publisher's version came between): the publisher sends the version full.
inline constexpr uint64_t refused_base = 2;

/// A fetch's flag: the reader holds version `have` (the frame's version) exactly, of the digest that follows.
inline constexpr uint32_t fetch_holds_base = 1;

/// What a fetch's payload starts with: whether the reader holds version `have` (the frame's version)
/// exactly, and its digest; the label of its run follows.
struct FetchBase {
  uint32_t flags = 0;  // fetch_holds_base
  uint32_t digest = 0;
  bool holds() const { return (flags & fetch_holds_base) != 0; }
};
static_assert(sizeof(FetchBase) == 8 && std::is_trivially_copyable_v<FetchBase>);
inline constexpr uint64_t max_fetch_bytes = sizeof(FetchBase) + max_run_bytes;

/// This process's run: what a publisher sends when it is given none (ClientOptions::run,
/// ServerOptions::run). Fresh per process, so a trainer that restarts (or resumes from a checkpoint)
/// is a new run and takes over from its previous one, whatever their versions.
/// Random (128 bits), since what a run is must not be guessed: readers see only its label (run_label).
inline const std::string& process_run() {
  static const std::string run = [] {
    std::random_device device;  // the system's entropy source (Linux: getrandom)
    std::string r = ::fsdpx::detail::str("pid ", ::getpid(), " ");
    char hex[9];
    for (int i = 0; i < 4; ++i) {
      std::snprintf(hex, sizeof(hex), "%08x", static_cast<unsigned>(device()));
      r += hex;
    }
    return r;
  }();
  return run;
}

using ::fsdpx::detail::unprefixed;

/// Why `run` cannot name a run; empty when it can.
inline std::string run_problem(std::string_view run) {
  if (run.size() > max_run_bytes) {
    return ::fsdpx::detail::str("a run identity of ", run.size(), " bytes (at most ", max_run_bytes, ")");
  }
  return {};
}

/// A run's label as errors quote it.
inline std::string quoted_run(std::string_view run) {
  return run.empty() ? std::string("(none)") : ::fsdpx::detail::str("'", run, "'");
}

/// A version must not list a tensor twice: its chunks would cover the same elements twice, and the
/// server would refuse the whole version for it. Said first, and plainly.
inline void check_unique_names(const std::vector<NamedTensor>& tensors, int64_t version) {
  std::unordered_set<std::string_view> seen;
  for (const auto& t : tensors) {
    FSDPX_CHECK_AS(SyncError, seen.insert(t.name).second, "cannot publish version ", version, ": tensor '", t.name,
                   "' is listed twice");
  }
}

struct FrameHeader {
  uint32_t magic = frame_magic;
  uint16_t kind = 0;
  uint16_t flags = 0;
  int64_t version = no_version;
  uint64_t length = 0;
  uint64_t checksum = 0;
  uint64_t aux = 0;
};
static_assert(sizeof(FrameHeader) == 40 && std::is_trivially_copyable_v<FrameHeader>);

inline uint64_t frame_checksum(const void* payload, size_t length) {
  return ::fsdpx::detail::Crc32c::of(payload, length);
}

inline FrameHeader make_frame(FrameKind kind, int64_t version, uint64_t aux = 0, const void* payload = nullptr,
                              size_t length = 0) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.version = version;
  h.aux = aux;
  h.length = length;
  h.checksum = frame_checksum(payload, length);
  return h;
}

/// Why `h` cannot be a frame of the synchronizer with a payload of at most `max_payload` bytes;
/// empty when it can. Checked before its payload is read or allocated.
inline std::string frame_problem(const FrameHeader& h, uint64_t max_payload) {
  if (h.magic != frame_magic) {
    return h.magic == 0x46535846 ? "a frame of the synchronizer's protocol 1 (update the sender)"
                                 : "a frame without the synchronizer's magic number";
  }
  if (h.kind < 1 || h.kind > static_cast<uint16_t>(FrameKind::welcome)) {
    return ::fsdpx::detail::str("a frame of unknown kind ", h.kind);
  }
  if (h.length > max_payload) {
    return ::fsdpx::detail::str("a ", to_string(FrameKind(h.kind)), " frame of ", h.length, " bytes (at most ",
                                max_payload, " allowed here)");
  }
  if (h.checksum >> 32 != 0) return "a frame whose checksum field is not a CRC-32C";
  return {};
}

/// A version ready to serve: its buckets and their frame headers (checksums computed once).
struct EncodedSnapshot {
  int64_t version = no_version;
  std::string run;  // the snapshot_begin frame's payload
  FrameHeader begin;
  std::vector<FrameHeader> headers;
  std::vector<at::Tensor> buckets;  // uint8, CPU
  int64_t bytes = 0;
};

inline std::shared_ptr<const EncodedSnapshot> encode_snapshot(int64_t version, std::string run,
                                                              std::vector<at::Tensor> buckets,
                                                              std::vector<FrameHeader> headers = {}) {
  auto s = std::make_shared<EncodedSnapshot>();
  s->version = version;
  s->run = std::move(run);
  s->begin = make_frame(FrameKind::snapshot_begin, version, buckets.size(), s->run.data(), s->run.size());
  if (headers.empty()) {
    for (size_t i = 0; i < buckets.size(); ++i) {
      headers.push_back(make_frame(FrameKind::bucket, version, i, buckets[i].const_data_ptr(), buckets[i].nbytes()));
    }
  }
  for (const auto& b : buckets) s->bytes += static_cast<int64_t>(b.nbytes());
  s->headers = std::move(headers);
  s->buckets = std::move(buckets);
  return s;
}

/// Checks that `bucket` is bucket `index` of `count` of `version`; returns its layout. `deadline`: as
/// decode_header's.
inline BucketLayout check_bucket(const at::Tensor& bucket, int64_t version, uint64_t index, uint64_t count,
                                 std::string_view where,
                                 std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) {
  BucketLayout b = decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where, deadline);
  FSDPX_CHECK_AS(SyncError,
                 b.version == version && b.index == index && b.count == count && b.total_bytes == bucket.numel(),
                 "weight bucket out of order from ", where, ": expected bucket ", index, " of ", count, " of version ",
                 version, " (", bucket.numel(), " bytes), got bucket ", b.index, " of ", b.count, " of version ",
                 b.version, " (", b.total_bytes, " bytes)");
  return b;
}

}  // namespace fsdpx::sync::detail
