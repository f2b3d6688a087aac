// The version one end of a sync holds (VersionStore), and what a publisher cuts from it for the next
// version (EncodedVersion): internal to the transports, which hold one on each end. DeltaOptions and the
// wire format are sync/delta.hpp's.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/sync/delta.hpp>
#include <fsdpx/sync/manifest.hpp>
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync::detail {

/// What a publisher sends for one version, and what it saves.
struct EncodedVersion {
  Manifest manifest;
  std::vector<NamedTensor> tensors;  // the manifest tensor first, then what travels
  int64_t bytes = 0;                 // bytes of `tensors` (the manifest included)
  int64_t full_bytes = 0;            // bytes of the version's tensors: what a full version sends
  /// Per manifest entry: the final host tensor of a full or xor entry (commit() copies it into the store).
  std::vector<at::Tensor> finals;
  int64_t count(DeltaEncoding e) const {
    int64_t n = 0;
    for (const auto& m : manifest.entries) n += m.encoding == e;
    return n;
  }
};

/// The version one end of a sync holds: its tensors, in the manifest's order, and the manifest they
/// match. A publisher cuts the next version against it; a receiver applies the next delta to it.
/// Tensors may alias a module's parameters (adopt()): then deltas land in the module, in place.
class VersionStore {
 public:
  /// How a delta lands: in place in the held tensors (a module's); in place, except that a tensor sent
  /// whole replaces the held one (`owned`: no one else holds the store's tensors, e.g. the server's own
  /// copy); or into fresh copies of the tensors it touches, so that tensors handed out earlier never change.
  enum class Apply { in_place, owned, copy_on_write };

  bool empty() const { return manifest_ == nullptr; }
  const Manifest& manifest() const { return *manifest_; }
  /// The manifest held, shared (never changed: the next version gets a manifest of its own).
  std::shared_ptr<const Manifest> shared_manifest() const { return manifest_; }
  int64_t version() const { return manifest_ ? manifest_->version : no_version; }
  uint32_t digest() const { return manifest_ ? manifest_->digest : 0; }
  /// True when it holds version `version` of digest `digest`.
  bool holds(int64_t version, uint32_t digest) const {
    return manifest_ && manifest_->version == version && manifest_->digest == digest;
  }
  const std::vector<NamedTensor>& tensors() const { return tensors_; }
  void clear() {
    manifest_.reset();
    tensors_.clear();
  }

  /// Cuts `version` of `tensors` (host or device, any layout; sent in their own dtypes) against the held
  /// version: a delta when the store holds one with the same names, dtypes and shapes in the same
  /// order and `options.enabled`; else a full version. The store does not change (commit() does).
  FSDPX_DECL EncodedVersion cut(int64_t version, const std::vector<NamedTensor>& tensors,
                                const DeltaOptions& options = {}) const;
  /// The receiver accepted `v` (cut by this store): the store now holds it. A delta is applied in place
  /// without checking again; a full version's tensors are taken as they are (they are fresh host copies).
  FSDPX_DECL void commit(EncodedVersion v);

  /// Takes a received version (its tensors as they arrived, the manifest first). A full version replaces
  /// what is held; a delta is applied to it (only if the store holds its base). Every tensor it wrote is
  /// checked against the manifest's CRC-32C. Any failure is a SyncError naming the tensor, and the store
  /// (and, in place, the tensors it aliases) keeps what it held, bit for bit. `where` names the sender.
  /// Past `deadline` (a fetch's), checking stops with a SyncError, the store unchanged.
  FSDPX_DECL void accept(std::vector<NamedTensor> received, Apply mode, std::string_view where,
                         std::optional<std::chrono::steady_clock::time_point> deadline = {});

  /// Holds `tensors` (aliases: a module's parameters after a full version was loaded into them) as
  /// version `manifest`. They must have its names, dtypes and shapes, in order, and be contiguous; checked.
  FSDPX_DECL void adopt(std::vector<NamedTensor> tensors, Manifest manifest);

 private:
  std::shared_ptr<const Manifest> manifest_;
  std::vector<NamedTensor> tensors_;
};

}  // namespace fsdpx::sync::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/version_store.ipp>
#endif
