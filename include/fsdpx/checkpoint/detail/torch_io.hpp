// torch.save-compatible serialization streamed straight to a file: torch::pickle_save builds the
// whole archive in memory first (a second copy of every tensor); this writes the same zip archive
// record by record through the durable writer. The one place fsdpx uses LibTorch's serializer
// internals (Pickler, PyTorchStreamWriter, writeArchiveAndTensors), in impl/torch_io.ipp.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>

#include <ATen/core/ivalue.h>

#include <limits>

#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::checkpoint::detail {

namespace fs = std::filesystem;

/// Writes `value` durably in torch.save's zip format (Python: torch.load(path, weights_only=True)).
FSDPX_DECL ::fsdpx::detail::WrittenFile save_ivalue(const fs::path& path, const c10::IValue& value,
                                                    bool compute_record_crc32 = false);

/// Reads a file written by save_ivalue or Python's torch.save; a missing, truncated or corrupt file
/// (or one whose CRC-32C differs from `expected_crc32c`, or larger than `max_bytes`: a commit record's
/// size) is an IoError that names it.
FSDPX_DECL c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c = std::nullopt,
                                   int64_t max_bytes = std::numeric_limits<int64_t>::max());

}  // namespace fsdpx::checkpoint::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/torch_io.ipp>
#endif
