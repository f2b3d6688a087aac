// What a weight bucket carries (sync/bucket.hpp is its format): the tensors to send (TensorSpec), one
// chunk of one tensor (BucketEntry) and where a bucket's chunks lie (BucketLayout). Receivers take
// chunks (sync/detail/receive.hpp), whatever brought them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync {

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

}  // namespace fsdpx::sync
