// The public names weight sync had before its rebuild (2026-11) that are now internal: each still
// compiles, with a deprecation warning naming where it went, for one release. <fsdpx/sync.hpp> (and so
// <fsdpx/fsdp.hpp>) and <fsdpx/sync/bucket.hpp> include this header; nothing else in the library uses it.
// A trainer and a rollout worker need none of these: docs/sync.md's table lists what they call.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/sync/broadcast.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/manifest.hpp>

namespace fsdpx::sync {

// The functions are templates (of an unused parameter) so that a call that also finds detail's function
// by argument-dependent lookup picks detail's (a non-template wins a tie) instead of being ambiguous.
#define FSDPX_SYNC_INTERNAL(name)                                                    \
  [[deprecated("fsdpx::sync::" #name " is internal now (fsdpx::sync::detail::" #name \
               "), and goes in the next release")]]

// ---- the bucket wire format (sync/detail/bucket.hpp) ----------------------------------------------

using TensorSpec FSDPX_SYNC_INTERNAL(TensorSpec) = detail::TensorSpec;
using BucketEntry FSDPX_SYNC_INTERNAL(BucketEntry) = detail::BucketEntry;
using BucketLayout FSDPX_SYNC_INTERNAL(BucketLayout) = detail::BucketLayout;

[[deprecated(
    "fsdpx::sync::bucket_prefix_bytes is internal now (fsdpx::sync::detail::prefix_bytes), and goes in the next "
    "release")]]
inline constexpr int64_t bucket_prefix_bytes = detail::prefix_bytes;

template <class = void>
FSDPX_SYNC_INTERNAL(plan_buckets)
std::vector<detail::BucketLayout> plan_buckets(const std::vector<detail::TensorSpec>& specs, int64_t capacity,
                                               int64_t version) {
  return detail::plan_buckets(specs, capacity, version);
}
template <class = void>
FSDPX_SYNC_INTERNAL(encode_header)
std::vector<uint8_t> encode_header(const detail::BucketLayout& b) {
  return detail::encode_header(b);
}
template <class = void>
FSDPX_SYNC_INTERNAL(decode_header)
detail::BucketLayout decode_header(const uint8_t* data, int64_t available, std::string_view where,
                                   std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) {
  return detail::decode_header(data, available, where, deadline);
}
template <class = void>
FSDPX_SYNC_INTERNAL(entry_view)
at::Tensor entry_view(const at::Tensor& bucket, const detail::BucketEntry& e) {
  return detail::entry_view(bucket, e);
}
template <class = void>
FSDPX_SYNC_INTERNAL(pack_entry)
void pack_entry(const at::Tensor& bucket, const detail::BucketEntry& e, const at::Tensor& source) {
  detail::pack_entry(bucket, e, source);
}
template <class = void>
FSDPX_SYNC_INTERNAL(write_header)
void write_header(const at::Tensor& bucket, const detail::BucketLayout& b) {
  detail::write_header(bucket, b);
}
template <class = void>
FSDPX_SYNC_INTERNAL(pack_buckets)
std::vector<at::Tensor> pack_buckets(const std::vector<NamedTensor>& tensors, int64_t capacity, int64_t version,
                                     std::vector<detail::BucketLayout>* layouts = nullptr) {
  return detail::pack_buckets(tensors, capacity, version, layouts);
}

// ---- receiving (sync/detail/receive.hpp) ----------------------------------------------------------

using TensorCollector FSDPX_SYNC_INTERNAL(TensorCollector) = detail::TensorCollector;
using ModuleLoader FSDPX_SYNC_INTERNAL(ModuleLoader) = detail::ModuleLoader;

// ---- deltas and manifests (sync/detail/version_store.hpp, sync/manifest.hpp) ----------------------

using VersionStore FSDPX_SYNC_INTERNAL(VersionStore) = detail::VersionStore;
using EncodedVersion FSDPX_SYNC_INTERNAL(EncodedVersion) = detail::EncodedVersion;

FSDPX_SYNC_INTERNAL(manifest_name)
inline constexpr std::string_view manifest_name = detail::manifest_name;

template <class = void>
FSDPX_SYNC_INTERNAL(split_manifest)
std::pair<Manifest, std::vector<NamedTensor>> split_manifest(std::vector<NamedTensor> received,
                                                             std::string_view where) {
  return detail::split_manifest(std::move(received), where);
}

// ---- gathering (sync/broadcast.hpp) ---------------------------------------------------------------

template <class Fn>
FSDPX_SYNC_INTERNAL(for_each_unsharded_unit)
void for_each_unsharded_unit(core::ShardedModel& model, Fn&& fn) {
  detail::for_each_unsharded_unit(model, std::forward<Fn>(fn));
}
template <class = void>
FSDPX_SYNC_INTERNAL(module_buffers)
std::vector<NamedTensor> module_buffers(const core::ShardedModel& model) {
  return detail::module_buffers(model);
}

#undef FSDPX_SYNC_INTERNAL

}  // namespace fsdpx::sync
