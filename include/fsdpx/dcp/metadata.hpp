// PyTorch Distributed Checkpoint (torch.distributed.checkpoint, "DCP"): its `.metadata` file, read and
// written. A DCP checkpoint is a directory of data files (`__<rank>_<n>.distcp`) and one `.metadata`,
// a Python pickle of torch's `Metadata` dataclass: what each entry of the flattened state dict is (a
// tensor: its dtype, size and the chunks it was saved in; anything else: bytes), and where each chunk
// or bytes item lies (a file, an offset and a length). This reads it with a restricted pickle reader
// that runs nothing (fsdpx/pickle/pickle.hpp) and checks what it says (chunks within their tensor and
// covering it, a storage record for each, file names that stay in the directory), and writes it as
// torch does (the same objects, in pickle protocol 2), so that Python's `torch.distributed.checkpoint`,
// and torch's weights_only unpickler too, read what fsdpx writes.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/dtype_names.hpp>

namespace fsdpx::dcp {

namespace fs = std::filesystem;

/// The metadata file's name in a checkpoint directory.
inline constexpr const char* metadata_file_name = ".metadata";
/// The `version` torch 2.13 writes (filesystem.py's CURRENT_DCP_VERSION); older torch wrote none.
inline constexpr const char* current_version = "1.0.0";

/// One saved piece of a tensor: the box [offsets, offsets + sizes).
struct Chunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  bool operator==(const Chunk&) const = default;
};

/// TensorProperties' memory format (torch's _MEM_FORMAT_ENCODING); deprecated by torch, kept so that
/// a rewrite says what the original said.
enum class MemoryFormat : uint8_t { contiguous = 0, channels_last = 1, preserve = 2 };

/// A tensor entry (TensorStorageMetadata).
struct TensorEntry {
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> size;
  std::vector<Chunk> chunks{};
  // TensorProperties' deprecated fields (the layout is always torch.strided)
  bool requires_grad = false;
  bool pin_memory = false;
  MemoryFormat memory_format = MemoryFormat::contiguous;
  bool operator==(const TensorEntry&) const = default;
};

/// Any other entry (BytesStorageMetadata): a torch.save'd Python object, such as an optimizer's lr.
struct BytesEntry {
  bool operator==(const BytesEntry&) const = default;
};

using Entry = std::variant<TensorEntry, BytesEntry>;

/// A storage record's key (MetadataIndex): the entry, and for a tensor the chunk's offsets.
struct StorageIndex {
  std::string fqn;
  std::optional<std::vector<int64_t>> offsets;  // nullopt: a bytes entry
  auto operator<=>(const StorageIndex&) const = default;
};

/// Where a chunk or a bytes item lies (filesystem.py's _StorageInfo).
struct StorageInfo {
  std::string relative_path;  // a file name in the checkpoint directory
  int64_t offset = 0;
  int64_t length = 0;
  /// MetadataIndex.index: which of the entry's chunks this is, a hint torch probes first (torch's
  /// MetadataIndex compares without it, so it is no part of the key here either).
  std::optional<int64_t> chunk_index{};
  /// The extensions the bytes went through (a compressor's descriptor), in order; nullopt: none.
  std::optional<std::vector<std::string>> transform_descriptors{};
  bool operator==(const StorageInfo&) const = default;
};

/// One step of the path from the state dict's root to an entry: a dict key or a list index.
using PathStep = std::variant<std::string, int64_t>;

/// StorageMeta: who saved the checkpoint, and where.
struct StorageMeta {
  std::optional<std::string> checkpoint_id;
  bool checkpoint_id_is_path = false;  // a pathlib.PosixPath in the file rather than a str
  std::optional<std::string> save_id;
  std::optional<std::string> load_id;
  std::vector<std::string> modules;
  bool operator==(const StorageMeta&) const = default;
};

/// The whole `.metadata` (torch.distributed.checkpoint.metadata.Metadata).
struct Metadata {
  /// state_dict_metadata: the flattened state dict's entries by their fully qualified name.
  std::map<std::string, Entry> entries;
  /// storage_data: each tensor chunk's and bytes entry's place.
  std::map<StorageIndex, StorageInfo> storage;
  /// planner_data as DefaultSavePlanner writes it: each entry's path in the nested state dict it was
  /// flattened from (what dcp.load unflattens it by); nullopt: None.
  std::optional<std::map<std::string, std::vector<PathStep>>> planner_data;
  std::optional<StorageMeta> storage_meta;
  std::optional<std::string> version;
  bool operator==(const Metadata&) const = default;
};

/// What reading a `.metadata` may cost; more is refused (an IoError) before it is allocated.
struct MetadataLimits {
  int64_t max_bytes = int64_t{256} << 20;
  /// The pickle's values and the entries, chunks and dimensions made of them (about 100 bytes each at
  /// most): a real file makes about 40 per chunk, so the default takes checkpoints of ~800k chunks.
  int64_t max_values = int64_t{1} << 25;
  /// The bytes of the strings copied out of the pickle (names, paths), each copy counted: a memo lets a
  /// small file name one long string many times. A real file copies about 100 bytes per chunk.
  int64_t max_text_bytes = int64_t{256} << 20;
};

/// DCP's name of a dtype ("bfloat16", as torch.bfloat16 pickles: fsdpx::torch_dtype_name); a ConfigError for
/// one it cannot name. The name's dtype: fsdpx::torch_dtype_from_name.
inline const char* dtype_name(c10::ScalarType t) {
  const char* name = torch_dtype_name(t);
  if (name == nullptr)
    throw ConfigError(::fsdpx::detail::str("fsdpx: DCP: the dtype ", t, " has no torch name fsdpx knows"));
  return name;
}

/// Checks what `md` says: every tensor's size and chunks (within it, in range, covering its elements),
/// a storage record for each chunk and bytes entry and none for anything else, and file names that
/// stay in the checkpoint directory. An IoError naming `what` and the entry.
FSDPX_DECL void validate_metadata(const Metadata& md, std::string_view what);

/// Parses and validates a `.metadata` pickle; an IoError naming `what` for anything it refuses (a class
/// DCP does not use, a malformed or truncated pickle, a limit passed, an entry validate_metadata refuses).
FSDPX_DECL Metadata parse_metadata(std::span<const std::byte> data, std::string_view what = metadata_file_name,
                                   const MetadataLimits& limits = {});

/// Reads `path` (a checkpoint directory's `.metadata`; a regular file only) and parses it.
FSDPX_DECL Metadata read_metadata(const fs::path& path, const MetadataLimits& limits = {});

/// The pickle torch writes for `md` (in protocol 2: fsdpx/pickle/pickle.hpp's Writer says why), after the checks
/// of validate_metadata (a ConfigError for what they refuse: `md` is the caller's).
FSDPX_DECL std::vector<std::byte> serialize_metadata(const Metadata& md);

/// Writes serialize_metadata(md) to `path` durably (detail/file_io.hpp).
FSDPX_DECL ::fsdpx::detail::WrittenFile write_metadata(const fs::path& path, const Metadata& md);

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/metadata_check.ipp>
#include <fsdpx/dcp/impl/metadata_read.ipp>
#include <fsdpx/dcp/impl/metadata_write.ipp>
#endif
