// The weight bucket (internal: the transports use it; users never name it): the one wire format of weight sync, used by
// the broadcast to rollout ranks and by the TCP synchronizer service alike.
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

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/wire.hpp>
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync::detail {

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

/// Splits tensors, in order, into buckets of at most `capacity` bytes (header included). A tensor that
/// does not fit the space left is split; the first bucket that cannot hold even one element of a
/// tensor besides its header entry is an error naming the tensor.
FSDPX_DECL std::vector<BucketLayout> plan_buckets(const std::vector<TensorSpec>& specs, int64_t capacity,
                                                  int64_t version);

/// The header bytes of `b` (b.header_bytes long, zero-padded).
FSDPX_DECL std::vector<uint8_t> encode_header(const BucketLayout& b);

/// Parses and validates a bucket header from `data` (at least the header's bytes). `where` names the
/// source in errors ("broadcast from trainer", "synchronizer 127.0.0.1:5000"). A header may describe no
/// more entries than header_bookkeeping_floor and the payload bytes at hand allow; a `deadline`
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

}  // namespace fsdpx::sync::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/bucket.ipp>
#endif
