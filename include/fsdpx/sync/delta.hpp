// Delta versions: a version cut against the one before it so that only what changed travels. Users
// choose how a publisher cuts them (DeltaOptions, here); the store each end of a transport holds, which
// cuts and applies them, is internal (sync/detail/version_store.hpp). What a receiver must end with, the
// manifest, is sync/manifest.hpp. The wire format is docs/sync.md's "Delta versions and proof of arrival".
//
// A version is a list of named tensors: the manifest first, then what travels (a full version: every
// tensor; a delta: per tensor nothing, sparse indices and values, the tensor, or a zlib stream of its
// bits XOR the base's). Every transport (buckets, broadcast, TCP) moves it as it moves any tensors.
// Nothing here needs Boost or OpenSSL; the xor encoding needs zlib.
#pragma once

#include <cstdint>

namespace fsdpx::sync {

/// How a publisher cuts deltas.
struct DeltaOptions {
  /// Off: every version is sent full (with its manifest).
  bool enabled = true;
  /// The link the version crosses, for the choice between encodings: a tensor travels in the encoding
  /// of least time (its bytes at this rate, plus compressing and inflating them at the rate measured on
  /// a sample). 0: the encoding of fewest bytes, whatever the time.
  double link_bytes_per_second = 1.25e9;
  int zlib_level = 1;
  /// XOR-and-compress is tried on tensors of at least this many changed elements.
  int64_t xor_min_changed = 4096;
};

}  // namespace fsdpx::sync
