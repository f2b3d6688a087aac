// Delta versions and proof of arrival: what a version's receiver must end with (the manifest: a CRC-32C
// per tensor and a digest over them), and a version cut against the one before it so that only what
// changed travels. The wire format is docs/sync.md's "Delta versions and proof of arrival".
//
// A version is a list of named tensors: the manifest first (`manifest_name`, uint8), then what travels
// (a full version: every tensor; a delta: per tensor nothing, sparse indices and values, the tensor, or
// a zlib stream of its bits XOR the base's). Every transport (buckets, broadcast, TCP) moves it as it
// moves any tensors; a VersionStore on each end holds the version the next delta is cut from or
// applied to. Nothing here needs Boost or OpenSSL; the xor encoding needs zlib.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>
#include <fsdpx/sync/bucket.hpp>

namespace fsdpx::sync {

/// The name of a version's manifest tensor: it starts with a dot, which no module's name can.
inline constexpr std::string_view manifest_name = ".fsdpx.manifest";

/// How one tensor of a version travels (docs/sync.md's table).
enum class DeltaEncoding : uint8_t { unchanged = 0, sparse = 1, full = 2, xor_zlib = 3 };

FSDPX_DECL const char* to_string(DeltaEncoding e);

/// One tensor of a version: what the receiver must hold after it, and how it travels.
struct ManifestEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  DeltaEncoding encoding = DeltaEncoding::full;
  uint8_t index_bytes = 0;  // sparse: 4 or 8
  uint32_t crc = 0;         // CRC-32C of the final bytes
  int64_t changed = -1;     // elements whose bits differ from the base; -1 in a full version

  FSDPX_DECL int64_t numel() const;
  int64_t nbytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }
};

/// What a version must be: its tensors (names, dtypes, shapes, CRCs) and, for a delta, its base.
struct Manifest {
  int64_t version = no_version;
  int64_t base_version = no_version;  // no_version: a full version
  uint32_t base_digest = 0;
  uint32_t digest = 0;
  std::vector<ManifestEntry> entries;

  bool is_delta() const { return base_version != no_version; }
  /// CRC-32C over every entry's name, dtype, shape and CRC: one number for the whole version.
  FSDPX_DECL uint32_t compute_digest() const;
  /// The same version as a full one: what the tensors are, not how they travelled.
  FSDPX_DECL Manifest whole() const;
  /// The entry named `name`, or nullptr.
  FSDPX_DECL const ManifestEntry* find(std::string_view name) const;
  /// The manifest tensor (uint8, 1-D) as it travels.
  FSDPX_DECL at::Tensor encode() const;
  /// Parses and checks a manifest tensor; every failure is a SyncError naming `where`.
  FSDPX_DECL static Manifest decode(const at::Tensor& bytes, std::string_view where);
};

/// CRC-32C of a tensor's bytes, row-major (a contiguous host copy is made only when needed).
FSDPX_DECL uint32_t tensor_crc32c(const at::Tensor& t);

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

  bool empty() const { return !manifest_.has_value(); }
  const Manifest& manifest() const { return *manifest_; }
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
  FSDPX_DECL void accept(std::vector<NamedTensor> received, Apply mode, std::string_view where);

  /// Holds `tensors` (aliases: a module's parameters after a full version was loaded into them) as
  /// version `manifest`. They must have its names, dtypes and shapes, in order, and be contiguous; checked.
  FSDPX_DECL void adopt(std::vector<NamedTensor> tensors, Manifest manifest);

 private:
  std::optional<Manifest> manifest_;
  std::vector<NamedTensor> tensors_;
};

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
      std::vector<NamedTensor> received, std::string_view where);
  /// Takes a received version into `module`: a delta in place into the module's tensors (they are the
  /// base); a full version staged, checked whole and against the module, then loaded, and the module's
  /// tensors become the base (when each is contiguous, of the sent dtype and in memory of its own).
  FSDPX_DECL void take_into(torch::nn::Module& module, std::vector<NamedTensor> received, std::string_view where);
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

/// The manifest of a full version of `tensors` (every CRC computed).
FSDPX_DECL Manifest full_manifest(int64_t version, const std::vector<NamedTensor>& tensors);

/// Splits a received version into its manifest and its other tensors (checked: the manifest comes
/// first, once). `where` names the sender.
FSDPX_DECL std::pair<Manifest, std::vector<NamedTensor>> split_manifest(std::vector<NamedTensor> received,
                                                                        std::string_view where);

/// "Do I hold version V exactly": every tensor of `manifest` is in `tensors` (by name) with its dtype,
/// shape and CRC-32C, and nothing else is. A SyncError naming what differs, otherwise nothing.
FSDPX_DECL void verify(const std::vector<NamedTensor>& tensors, const Manifest& manifest);
/// The same for a module's parameters and buffers (by name, as load_into fills them).
FSDPX_DECL void verify(torch::nn::Module& module, const Manifest& manifest);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/delta.ipp>
#endif
