// The synchronizer's frames: the codec shared by its server and client (docs/sync.md, "Frames", is
// the specification; the Python receiver implements the same).
//
// A frame is a 40-byte little-endian header {u32 magic 'FXS2', u16 kind, u16 flags, i64 version,
// u64 payload length, u64 checksum (CRC-32C of the payload in the low 32 bits), u64 aux} and the
// payload. Which kinds may carry a payload, and how large, is fixed per kind: a receiver refuses a
// frame before it allocates anything for it.
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include <ATen/ATen.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/bucket.hpp>

namespace fsdpx::sync::detail {

enum class FrameKind : uint16_t {
  publish_begin = 1,   // version; aux = bucket count
  bucket = 2,          // aux = bucket index; payload = one weight bucket
  publish_end = 3,     // version
  ack = 4,             // version committed
  fetch = 5,           // version = the reader's; aux = how long the server may wait, ms
  snapshot_begin = 6,  // version; aux = bucket count; bucket frames follow
  timeout = 7,         // version = the server's latest
  error = 8,           // payload = message (server to client only)
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
inline constexpr uint64_t protocol_version = 2;
/// Error texts are short; a longer one is refused, not allocated.
inline constexpr uint64_t max_error_bytes = 64 << 10;

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
  FrameHeader begin;
  std::vector<FrameHeader> headers;
  std::vector<at::Tensor> buckets;  // uint8, CPU
  int64_t bytes = 0;
};

inline std::shared_ptr<const EncodedSnapshot> encode_snapshot(int64_t version, std::vector<at::Tensor> buckets,
                                                              std::vector<FrameHeader> headers = {}) {
  auto s = std::make_shared<EncodedSnapshot>();
  s->version = version;
  s->begin = make_frame(FrameKind::snapshot_begin, version, buckets.size());
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

/// Checks that `bucket` is bucket `index` of `count` of `version`; returns its layout.
inline BucketLayout check_bucket(const at::Tensor& bucket, int64_t version, uint64_t index, uint64_t count,
                                 std::string_view where) {
  BucketLayout b = decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where);
  FSDPX_CHECK_AS(SyncError, b.version == version && b.index == index && b.count == count &&
                                b.total_bytes == bucket.numel(),
                 "weight bucket out of order from ", where, ": expected bucket ", index, " of ", count, " of version ",
                 version, " (", bucket.numel(), " bytes), got bucket ", b.index, " of ", b.count, " of version ",
                 b.version, " (", b.total_bytes, " bytes)");
  return b;
}

}  // namespace fsdpx::sync::detail
