// Synchronizer's member functions, out of line: included by fsdpx/sync/synchronizer.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/synchronizer.hpp>

#include <algorithm>

namespace fsdpx::sync {

FSDPX_DECL void Synchronizer::publish(int64_t version, std::vector<NamedTensor> tensors) {
  FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
  std::lock_guard lock(publish_mutex_);
  const int64_t latest = slot_.version();
  FSDPX_CHECK_AS(SyncError, version > latest, "cannot publish version ", version,
                 ": it is not newer than the latest published version, ", latest, " (versions never go backwards)");
  for (const NamedTensor& t : tensors) {
    FSDPX_CHECK_AS(SyncError, t.tensor.defined(), "cannot publish version ", version, ": tensor '", t.name,
                   "' is undefined");
  }
  auto published = std::make_shared<Published>();
  const bool host = std::all_of(tensors.begin(), tensors.end(),
                                [](const NamedTensor& t) { return t.tensor.is_cpu() && t.tensor.is_contiguous(); });
  Manifest manifest;
  if (options_.delta.enabled && host) {
    detail::EncodedVersion cut = base_.cut(version, tensors, options_.delta);
    manifest = cut.manifest;
    if (cut.manifest.is_delta()) published->delta = std::move(cut.tensors);
    manifest = manifest.whole();  // the snapshot's: what the tensors are, not how they would travel
  } else {
    manifest = full_manifest(version, tensors);
  }
  published->snapshot = WeightVersion{version, std::move(tensors), {}, std::make_shared<const Manifest>(manifest)};
  slot_.publish(version, published);
  base_.clear();
  // The next delta's base: this version's own tensors, which never change (no copy is kept).
  if (options_.delta.enabled && host) base_.adopt(published->snapshot.tensors, std::move(manifest));
}

FSDPX_DECL int64_t SynchronizerReader::load_newer_into(torch::nn::Module& module, std::chrono::milliseconds timeout) {
  held_.prepare(&module);
  const auto [version, published] = source_->slot_.wait_newer(last_version_, timeout);
  const std::string where = ::fsdpx::detail::str("the in-process synchronizer (version ", version, ")");
  std::vector<NamedTensor> received;
  bool delta = false;
  last_was_delta_ = false;
  if (!published->delta.empty() && held_.base() != nullptr) {
    const Manifest m = Manifest::decode(published->delta.front().tensor, where);
    delta = held_.holds(m.base_version, m.base_digest);
  }
  if (delta) {
    received = published->delta;
  } else {
    const WeightVersion& s = published->snapshot;
    received.reserve(s.tensors.size() + 1);
    received.push_back({std::string(detail::manifest_name), s.manifest->encode()});
    received.insert(received.end(), s.tensors.begin(), s.tensors.end());
  }
  held_.take_into(module, std::move(received), where);
  last_version_ = version;
  last_was_delta_ = delta;
  return version;
}

}  // namespace fsdpx::sync
