// Proof of arrival: what a version's receiver must end with. A manifest lists every tensor of a version
// (name, dtype, shape, CRC-32C) and one digest over them; for a delta, also the version it applies to and
// how each tensor travels. It travels as the version's first tensor (`manifest_name`, uint8); its wire
// format is docs/sync.md's "Delta versions and proof of arrival". Every receiver checks what it holds
// against it (verify), whichever transport brought the version. Nothing here needs Boost, OpenSSL or zlib.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync {

namespace detail {
inline constexpr uint32_t manifest_magic = 0x4D535846;  // "FXSM"
inline constexpr uint16_t manifest_format = 1;
inline constexpr int64_t manifest_prefix_bytes = 48;
/// Bytes an entry takes at the least: a count the manifest cannot hold is refused before anything is parsed.
inline constexpr int64_t manifest_min_entry_bytes = 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8;
/// A sparse entry's indices take 4 bytes in a tensor of at most this many elements, else 8.
inline constexpr int64_t narrow_index_limit = int64_t{1} << 32;
/// The name of a version's manifest tensor: it starts with a dot, which no module's name can.
inline constexpr std::string_view manifest_name = ".fsdpx.manifest";
}  // namespace detail

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
  /// The entry named `name`, or nullptr. A scan: to look up many, index them once (entries_by_name).
  FSDPX_DECL const ManifestEntry* find(std::string_view name) const;
  /// The manifest tensor (uint8, 1-D) as it travels.
  FSDPX_DECL at::Tensor encode() const;
  /// Parses and checks a manifest tensor; every failure is a SyncError naming `where`.
  FSDPX_DECL static Manifest decode(const at::Tensor& bytes, std::string_view where);
};

/// CRC-32C of a tensor's bytes, row-major (a contiguous host copy is made only when needed).
FSDPX_DECL uint32_t tensor_crc32c(const at::Tensor& t);

/// The manifest of a full version of `tensors` (every CRC computed).
FSDPX_DECL Manifest full_manifest(int64_t version, const std::vector<NamedTensor>& tensors);

/// "Do I hold version V exactly": every tensor of `manifest` is in `tensors` (by name) with its dtype,
/// shape and CRC-32C, and nothing else is. A SyncError naming what differs, otherwise nothing.
FSDPX_DECL void verify(const std::vector<NamedTensor>& tensors, const Manifest& manifest);
/// The same for a module's parameters and buffers (by name, as load_into fills them).
FSDPX_DECL void verify(torch::nn::Module& module, const Manifest& manifest);

namespace detail {
/// The entries of `manifest` by name, for callers that look up many (views of its names: valid while
/// `manifest` lives unchanged). Names are unique in a decoded manifest; the first entry wins otherwise.
FSDPX_DECL std::unordered_map<std::string_view, const ManifestEntry*> entries_by_name(const Manifest& manifest);

/// A manifest tensor's version and kind, read from its fixed prefix without decoding its entries;
/// nothing when it is not a manifest of this format (Manifest::decode then says why).
struct ManifestPrefix {
  int64_t version = no_version;
  bool delta = false;
};
FSDPX_DECL std::optional<ManifestPrefix> peek_manifest(const at::Tensor& bytes);

/// Splits a received version into its manifest and its other tensors (checked: the manifest comes
/// first, once). `where` names the sender.
FSDPX_DECL std::pair<Manifest, std::vector<NamedTensor>> split_manifest(std::vector<NamedTensor> received,
                                                                        std::string_view where);
}  // namespace detail

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/manifest.ipp>
#endif
