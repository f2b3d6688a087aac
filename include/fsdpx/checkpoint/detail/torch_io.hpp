// torch.save-compatible serialization streamed straight to a file: torch::pickle_save builds the
// whole archive in memory first (a second copy of every tensor); this writes the same zip archive
// record by record through the durable writer. The one place fsdpx uses LibTorch's serializer
// internals (Pickler, PyTorchStreamWriter, writeArchiveAndTensors; and the zip reader,
// PyTorchStreamReader), in impl/torch_io.ipp. Archives are read by fsdpx's own pickle reader
// (archive_reader.hpp), never by LibTorch's unpickler, which trusts what a file says.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>

#include <limits>

#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::checkpoint::detail {

namespace fs = std::filesystem;

/// Streams `value` in torch.save's zip format to `sink`, piece by piece in order: what save_ivalue writes,
/// for a file that holds several archives (DCP's data files). The first exception of `sink` is rethrown.
FSDPX_DECL void write_ivalue(const c10::IValue& value, const std::function<void(const void*, size_t)>& sink,
                             bool compute_record_crc32 = false);

/// Writes `value` durably in torch.save's zip format (Python: torch.load(path, weights_only=True)).
FSDPX_DECL ::fsdpx::detail::WrittenFile save_ivalue(const fs::path& path, const c10::IValue& value,
                                                    bool compute_record_crc32 = false);

/// The one check of a committed file's bytes against its commit record, on the very bytes that are then
/// parsed: `bytes` long (when given) and of CRC-32C `crc32c` (when given). An IoError names the file as a
/// `kind` ("checkpoint file", "DCP metadata file") and says which of the two failed.
FSDPX_DECL void check_committed_bytes(const fs::path& path, std::string_view kind, const std::vector<char>& data,
                                      std::optional<int64_t> bytes, std::optional<uint32_t> crc32c);

/// Reads a file written by save_ivalue or Python's torch.save; a missing, truncated or corrupt file
/// (or one whose CRC-32C differs from `expected_crc32c`, or larger than `max_bytes`: a commit record's
/// size, or a symbolic link with Links::refuse, refused when it is opened) is an IoError that names it.
FSDPX_DECL c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c = std::nullopt,
                                   int64_t max_bytes = std::numeric_limits<int64_t>::max(),
                                   ::fsdpx::detail::Links links = ::fsdpx::detail::Links::follow);

/// Reads the torch.save archive at bytes [offset, offset + length) of the regular file `path` (a DCP data
/// file holds one per chunk), with positioned reads of what the archive's records need and nothing outside
/// the range. A range past the file's end, or a truncated or corrupt archive, is an IoError naming `what`.
FSDPX_DECL c10::IValue load_ivalue_range(const fs::path& path, int64_t offset, int64_t length, const std::string& what);

/// The pickle (data.pkl) of the torch.save archive at [offset, offset + length) of `path`, unparsed, for a
/// reader that runs nothing (fsdpx/pickle/pickle.hpp); more than `max_bytes` is refused before it is read.
FSDPX_DECL std::vector<std::byte> read_archive_pickle(const fs::path& path, int64_t offset, int64_t length,
                                                      const std::string& what, int64_t max_bytes);

}  // namespace fsdpx::checkpoint::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/torch_io.ipp>
#endif
