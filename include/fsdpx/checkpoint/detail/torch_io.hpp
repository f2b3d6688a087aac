// torch.save-compatible serialization streamed straight to a file: torch::pickle_save builds the
// whole archive in memory first (a second copy of every tensor); this writes the same zip archive
// record by record through the durable writer. The one place fsdpx uses LibTorch's serializer
// internals (Pickler, PyTorchStreamWriter, writeArchiveAndTensors).
#pragma once

#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fsdpx/checkpoint/detail/file_io.hpp>

namespace fsdpx::checkpoint::detail {

/// Writes `value` durably in torch.save's zip format (Python: torch.load(path, weights_only=True)).
inline WrittenFile save_ivalue(const fs::path& path, const c10::IValue& value, bool compute_record_crc32 = false) {
  std::vector<char> pickle_bytes;
  // No type tags: Python's torch.load(weights_only=True) refuses their restore_type_tag global.
  torch::jit::Pickler pickler([&](const char* data, size_t n) { pickle_bytes.insert(pickle_bytes.end(), data, data + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  return write_file_durably(path, [&](const auto& sink) {
    // No exception may cross the zip writer (miniz is C; its destructor writes again): the first
    // failure is kept, the rest of the archive is swallowed, and the failure is thrown after.
    std::exception_ptr failure;
    {
      // The zip's per-record CRC-32 is off (as torch.serialization.config.save.compute_crc32 = False
      // does): it is a slow second pass over every byte, and the whole file's CRC-32C is recorded
      // in fsdp_config.json instead. torch.load does not check the records' CRCs.
      caffe2::serialize::PyTorchStreamWriter writer(
          [&](const void* data, size_t n) {
            if (failure) return n;
            try {
              sink(data, n);
            } catch (...) {
              failure = std::current_exception();
            }
            return n;
          },
          /*compute_crc32=*/compute_record_crc32);
      torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(), pickler.tensorData(), writer);
      writer.writeEndOfFile();
    }
    if (failure) std::rethrow_exception(failure);
  });
}

/// Reads a file written by save_ivalue or Python's torch.save; a missing, truncated or corrupt file
/// (or one whose CRC-32C differs from `expected_crc32c`) is an IoError that names it.
inline c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c = std::nullopt) {
  FSDPX_CHECK_AS(IoError, fs::exists(path), "checkpoint file '", path.string(), "' does not exist");
  std::vector<char> data = read_file(path);
  if (expected_crc32c) {
    const uint32_t crc = Crc32c::of(data.data(), data.size());
    FSDPX_CHECK_AS(IoError, crc == *expected_crc32c, "checkpoint file '", path.string(), "' is corrupt: its CRC-32C is ",
                   crc, " but ", *expected_crc32c, " was committed");
  }
  try {
    return torch::jit::pickle_load(data);
  } catch (const c10::Error& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", data.size(),
                                       " bytes) is truncated or corrupt: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    // LibTorch's unpickler reserves what a length field says before reading it: a corrupt length
    // (reachable only without a checksum to check first) asks for more memory than there is.
    throw IoError(::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", data.size(),
                                       " bytes) is corrupt: a length inside it asks for more memory than this machine has"));
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", data.size(), " bytes) is corrupt: ", e.what()));
  }
}

}  // namespace fsdpx::checkpoint::detail
