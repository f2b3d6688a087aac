// What one receiver holds of the last version it took, so that the next delta applies to it: the
// receivers' common part (the TCP client, WeightReceiver, SynchronizerReader). Internal.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/load.hpp>
#include <fsdpx/sync/manifest.hpp>

namespace fsdpx::sync {

namespace detail {

/// What one receiver holds of the last version it took (the TCP client, a WeightReceiver, a
/// SynchronizerReader): its own copy, or a module's tensors after a whole version was loaded into
/// them; the next delta is applied to it. Copy-on-write for its own copy (tensors handed out before
/// never change), in place for a module's. On any failure it holds nothing (the next version must come
/// full) and the module keeps its previous weights, bit for bit.
class HeldVersion {
 public:
  /// Before taking a version into `module` (nullptr: into its own copy): what is held stays the base
  /// only if the next version lands where it lies (the same module, its tensors the same memory,
  /// dtypes and shapes: Module::to or place_on_huge_pages move them) and nothing wrote them in place
  /// since (their version counters: a write that bypasses them, straight to memory, is caught by the
  /// next delta's checksums instead).
  FSDPX_DECL void prepare(torch::nn::Module* module);
  /// The version a delta may be cut from (after prepare), or nullptr.
  const Manifest* base() const { return store_.empty() ? nullptr : &store_.manifest(); }
  /// True when the base is version `version` of digest `digest`.
  bool holds(int64_t version, uint32_t digest) const { return store_.holds(version, digest); }

  /// Takes a received version (its manifest first) into its own copy: a delta is applied to the base
  /// (copy-on-write), a full version checked whole. Returns the version's tensors (read-only: the next
  /// delta's base) and its manifest.
  FSDPX_DECL std::pair<std::vector<NamedTensor>, std::shared_ptr<const Manifest>> take(
      std::vector<NamedTensor> received, std::string_view where,
      std::optional<std::chrono::steady_clock::time_point> deadline = {});
  /// Takes a received version into `module`: a delta in place into the module's tensors (they are the
  /// base); a full version staged, checked whole and against the module, then loaded, and the module's
  /// tensors become the base (when each is contiguous, of the sent dtype and in memory of its own).
  FSDPX_DECL void take_into(torch::nn::Module& module, std::vector<NamedTensor> received, std::string_view where,
                            std::optional<std::chrono::steady_clock::time_point> deadline = {});
  /// A whole version already landed in `module` by other means (a broadcast received in place, checked
  /// on the way): the module's tensors become the base, as after take_into.
  FSDPX_DECL void loaded_into(torch::nn::Module& module, const Manifest& manifest);
  /// A version was taken without a base for deltas (only its manifest, for verify()).
  FSDPX_DECL void taken(const Manifest& manifest);

  /// Holds nothing any more; verify() still knows the last manifest.
  FSDPX_DECL void forget();
  /// "Do I hold the version taken last, exactly?" (sync::verify against its manifest).
  FSDPX_DECL void verify(torch::nn::Module& module) const;
  FSDPX_DECL void verify(const std::vector<NamedTensor>& tensors) const;
  /// The manifest of the version taken last, or nullptr.
  FSDPX_DECL std::shared_ptr<const Manifest> last_manifest() const;

  /// Names and shapes of a whole version against the module's, before anything is copied: a mismatch
  /// is a SyncError and leaves the module as it was (load_into reports after copying what it could).
  FSDPX_DECL static void check_loadable(torch::nn::Module& module, const std::vector<NamedTensor>& tensors);

 private:
  FSDPX_DECL void adopt(torch::nn::Module& module, const Manifest& manifest);
  FSDPX_DECL bool still_adopted(torch::nn::Module& module) const;
  /// Notes the module's tensors' version counters: any in-place write after this (load_state_dict,
  /// copy_, an optimizer) makes them no delta's base.
  FSDPX_DECL void note_writes();

  VersionStore store_;
  torch::nn::Module* target_ = nullptr;  // the module whose tensors store_ aliases; nullptr: its own copy
  std::vector<int64_t> counters_;        // their version counters after the last version landed
  std::shared_ptr<const Manifest> last_manifest_;
};

}  // namespace detail

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/held_version.ipp>
#endif
