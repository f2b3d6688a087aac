// Out-of-line functions of fsdpx/checkpoint/detail/torch_io.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp). LibTorch's serializer
// headers are included here only, so a separately compiled program's translation units do not parse them.
#pragma once

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL ::fsdpx::detail::WrittenFile save_ivalue(const fs::path& path, const c10::IValue& value,
                                                    bool compute_record_crc32) {
  std::vector<char> pickle_bytes;
  // No type tags: Python's torch.load(weights_only=True) refuses their restore_type_tag global.
  torch::jit::Pickler pickler(
      [&](const char* data, size_t n) { pickle_bytes.insert(pickle_bytes.end(), data, data + n); }, nullptr, nullptr,
      nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  return ::fsdpx::detail::write_file_durably(path, [&](const auto& sink) {
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
      torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(), pickler.tensorData(),
                                         writer);
      writer.writeEndOfFile();
    }
    if (failure) std::rethrow_exception(failure);
  });
}

/// A file's bytes as LibTorch's zip reader reads them, every read bounded by the bytes there are. Its own
/// VectorReader (torch::jit::pickle_load's) copies past the end wherever a crafted record's offset or
/// size points beyond the file: a crash, where a short read is an error the zip reader reports.
class BoundedBytesReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BoundedBytesReader(std::vector<char> bytes) : bytes_(std::move(bytes)) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    const size_t count = static_cast<size_t>(std::min<uint64_t>(n, bytes_.size() - pos));
    std::memcpy(buf, bytes_.data() + pos, count);
    return count;
  }

 private:
  std::vector<char> bytes_;
};

FSDPX_DECL c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c, int64_t max_bytes) {
  std::vector<char> data = ::fsdpx::detail::read_file(path, "checkpoint file", max_bytes);
  const size_t bytes = data.size();
  if (expected_crc32c) {
    const uint32_t crc = ::fsdpx::detail::Crc32c::of(data.data(), data.size());
    FSDPX_CHECK_AS(IoError, crc == *expected_crc32c, "checkpoint file '", path.string(),
                   "' is corrupt: its CRC-32C is ", crc, " but ", *expected_crc32c, " was committed");
  }
  try {
    // What torch::jit::pickle_load does, through a reader that cannot read past the file.
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BoundedBytesReader>(std::move(data)));
    return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", std::nullopt,
                                             std::nullopt, std::nullopt, reader);
  } catch (const c10::Error& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", bytes,
                                       " bytes) is truncated or corrupt: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    // LibTorch's unpickler reserves what a length field says before reading it: a corrupt length
    // (reachable only without a checksum to check first) asks for more memory than there is.
    throw IoError(
        ::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", bytes,
                             " bytes) is corrupt: a length inside it asks for more memory than this machine has"));
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: checkpoint file '", path.string(), "' (", bytes,
                                       " bytes) is corrupt: ", e.what()));
  }
}

}  // namespace fsdpx::checkpoint::detail
