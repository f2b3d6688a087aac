// Out-of-line functions of fsdpx/checkpoint/detail/torch_io.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp). LibTorch's serializer
// headers are included here only, so a separately compiled program's translation units do not parse them.
#pragma once

#include <algorithm>
#include <cerrno>
#include <map>
#include <set>
#include <string>
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
#include <torch/csrc/jit/serialization/unpickler.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL void write_ivalue(const c10::IValue& value, const std::function<void(const void*, size_t)>& sink,
                             bool compute_record_crc32) {
  std::vector<char> pickle_bytes;
  // No type tags: Python's torch.load(weights_only=True) refuses their restore_type_tag global.
  torch::jit::Pickler pickler(
      [&](const char* data, size_t n) { pickle_bytes.insert(pickle_bytes.end(), data, data + n); }, nullptr, nullptr,
      nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
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
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_ivalue(const fs::path& path, const c10::IValue& value,
                                                    bool compute_record_crc32) {
  return ::fsdpx::detail::write_file_durably(
      path, [&](const auto& sink) { write_ivalue(value, sink, compute_record_crc32); });
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

/// Bytes [base, base + length) of an open regular file, read with positioned reads: a DCP data file holds one
/// torch.save archive per chunk, and LibTorch's zip reader reads only the central directory and the records
/// it is asked for. A failed or short read returns short (the zip reader reports it; no exception crosses
/// miniz, which is C).
class FileRangeReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  FileRangeReader(std::shared_ptr<::fsdpx::detail::Fd> fd, int64_t base, int64_t length)
      : fd_(std::move(fd)), base_(base), length_(length) {}
  size_t size() const override { return static_cast<size_t>(length_); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= static_cast<uint64_t>(length_)) return 0;
    const size_t count = static_cast<size_t>(std::min<uint64_t>(n, static_cast<uint64_t>(length_) - pos));
    size_t done = 0;
    while (done < count) {
      const ssize_t k = ::pread(fd_->get(), static_cast<char*>(buf) + done, count - done,
                                static_cast<off_t>(base_ + static_cast<int64_t>(pos + done)));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) break;
      done += static_cast<size_t>(k);
    }
    return done;
  }

 private:
  std::shared_ptr<::fsdpx::detail::Fd> fd_;
  int64_t base_ = 0, length_ = 0;
};

/// Runs `load` and turns what LibTorch's reader throws into an IoError naming `what` (its size in bytes).
template <class Load>
auto archive_errors(const std::string& what, size_t bytes, Load&& load) -> decltype(load()) {
  try {
    return load();
  } catch (const IoError&) {
    throw;
  } catch (const c10::Error& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", bytes,
                                       " bytes) is truncated or corrupt: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    // LibTorch's unpickler reserves what a length field says before reading it: a corrupt length
    // (reachable only without a checksum to check first) asks for more memory than there is.
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", bytes,
                                       " bytes) is corrupt: a length inside it asks for more memory than this "
                                       "machine has"));
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", bytes, " bytes) is corrupt: ", e.what()));
  }
}

/// Every tensor of `root` within the record it was read from. LibTorch's unpickler sizes a storage by
/// the element count the pickle claims (not by its record's bytes) and sets a tensor's offset, sizes and
/// strides as told, unchecked: a crafted archive would make a tensor that reads past its memory.
inline void check_tensor_bounds(const c10::IValue& root, const std::map<const void*, size_t>& records,
                                const std::string& what) {
  std::vector<const c10::IValue*> todo{&root};
  std::set<const void*> seen;  // containers visited (the memo can put a list inside itself)
  const auto corrupt = [&](const auto&... args) {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " is corrupt: ", args...));
  };
  while (!todo.empty()) {
    const c10::IValue& v = *todo.back();
    todo.pop_back();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.layout() != at::kStrided || t.is_quantized() || !t.is_cpu()) {
        corrupt("it holds a tensor that is not a dense CPU tensor (", t.toString(), ")");
      }
      const size_t nbytes = t.storage().nbytes();
      if (nbytes > 0) {
        const auto it = records.find(t.storage().data());
        if (it == records.end() || nbytes > it->second) {
          corrupt("a tensor's storage claims ", nbytes, " bytes, more than its record holds (",
                  it == records.end() ? size_t{0} : it->second, ")");
        }
      }
      if (t.numel() == 0) continue;
      int64_t last = t.storage_offset();
      bool ok = last >= 0;
      for (int64_t d = 0; d < t.dim() && ok; ++d) {
        int64_t step = 0;
        ok = t.stride(d) >= 0 && !__builtin_mul_overflow(t.size(d) - 1, t.stride(d), &step) &&
             !__builtin_add_overflow(last, step, &last);
      }
      int64_t reach = 0;
      ok = ok && !__builtin_mul_overflow(last + 1, static_cast<int64_t>(t.itemsize()), &reach) &&
           static_cast<uint64_t>(reach) <= nbytes;
      if (!ok) {
        corrupt("a tensor of sizes ", t.sizes(), " and strides ", t.strides(), " at storage offset ",
                t.storage_offset(), " reaches past its storage of ", nbytes, " bytes");
      }
    } else if (v.isList() || v.isTuple() || v.isGenericDict()) {
      if (!seen.insert(v.internalToPointer()).second) continue;
      if (v.isList()) {
        for (const c10::IValue& e : v.toListRef()) todo.push_back(&e);
      } else if (v.isTuple()) {
        for (const c10::IValue& e : v.toTupleRef().elements()) todo.push_back(&e);
      } else {
        for (const auto& item : v.toGenericDict()) {
          todo.push_back(&item.key());
          todo.push_back(&item.value());
        }
      }
    }
  }
}

/// What torch::jit::readArchiveAndTensors does, with every storage on the CPU, no record larger than the
/// archive read, and every tensor checked against the record it came from (check_tensor_bounds).
inline c10::IValue read_checked_archive(caffe2::serialize::PyTorchStreamReader& reader, size_t archive_bytes,
                                        const std::string& what) {
  FSDPX_CHECK_AS(IoError, reader.hasRecord("data.pkl"), what, " is not a torch.save archive: it has no data.pkl");
  const size_t pickle_bytes = reader.getRecordSize("data.pkl");
  FSDPX_CHECK_AS(IoError, pickle_bytes <= archive_bytes, what, " is corrupt: its pickle claims ", pickle_bytes,
                 " bytes, more than the archive's ", archive_bytes);
  auto [pickle_ptr, pickle_size] = reader.getRecord("data.pkl");
  const char* data = static_cast<const char*>(pickle_ptr.get());
  size_t pos = 0;
  std::map<const void*, size_t> records;
  torch::jit::Unpickler unpickler(
      [&](char* buffer, size_t len) -> size_t {
        len = std::min(pickle_size - pos, len);
        std::memcpy(buffer, data + pos, len);
        pos += len;
        return len;
      },
      nullptr, nullptr,
      [&](const std::string& name) {
        const std::string record = "data/" + name;
        const size_t size = reader.getRecordSize(record);
        FSDPX_CHECK_AS(IoError, size <= archive_bytes, what, " is corrupt: its record '", record, "' claims ", size,
                       " bytes, more than the archive's ", archive_bytes);
        auto [ptr, n] = reader.getRecord(record);
        records[ptr.get()] = n;
        return std::move(ptr);
      },
      at::Device(at::kCPU));
  unpickler.set_version(reader.version());
  c10::IValue value = unpickler.parse_ivalue();
  check_tensor_bounds(value, records, what);
  return value;
}

FSDPX_DECL c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c, int64_t max_bytes) {
  std::vector<char> data = ::fsdpx::detail::read_file(path, "checkpoint file", max_bytes);
  const size_t bytes = data.size();
  if (expected_crc32c) {
    const uint32_t crc = ::fsdpx::detail::Crc32c::of(data.data(), data.size());
    FSDPX_CHECK_AS(IoError, crc == *expected_crc32c, "checkpoint file '", path.string(),
                   "' is corrupt: its CRC-32C is ", crc, " but ", *expected_crc32c, " was committed");
  }
  const std::string what = ::fsdpx::detail::str("checkpoint file '", path.string(), "'");
  return archive_errors(what, bytes, [&] {
    // Through a reader that cannot read past the file (see BoundedBytesReader).
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BoundedBytesReader>(std::move(data)));
    return read_checked_archive(reader, bytes, what);
  });
}

/// `path` opened (a regular file) with [offset, offset + length) checked to lie within it.
inline std::shared_ptr<::fsdpx::detail::Fd> open_range(const fs::path& path, int64_t offset, int64_t length,
                                                       const std::string& what) {
  auto fd = std::make_shared<::fsdpx::detail::Fd>(::fsdpx::detail::open_regular_file(path, "checkpoint file"));
  struct stat st{};
  if (::fstat(fd->get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", path, errno);
  int64_t end = 0;
  FSDPX_CHECK_AS(IoError,
                 offset >= 0 && length >= 0 && !__builtin_add_overflow(offset, length, &end) && end <= st.st_size, what,
                 " lies at bytes [", offset, ", ", offset, " + ", length, ") of '", path.string(), "', which has ",
                 int64_t{st.st_size}, " bytes");
  return fd;
}

FSDPX_DECL c10::IValue load_ivalue_range(const fs::path& path, int64_t offset, int64_t length,
                                         const std::string& what) {
  auto fd = open_range(path, offset, length, what);
  return archive_errors(what, static_cast<size_t>(length), [&] {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<FileRangeReader>(std::move(fd), offset, length));
    return read_checked_archive(reader, static_cast<size_t>(length), what);
  });
}

FSDPX_DECL std::vector<std::byte> read_archive_pickle(const fs::path& path, int64_t offset, int64_t length,
                                                      const std::string& what, int64_t max_bytes) {
  auto fd = open_range(path, offset, length, what);
  return archive_errors(what, static_cast<size_t>(length), [&] {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<FileRangeReader>(std::move(fd), offset, length));
    FSDPX_CHECK_AS(IoError, reader.hasRecord("data.pkl"), what, " is not a torch.save archive: it has no data.pkl");
    const size_t size = reader.getRecordSize("data.pkl");
    FSDPX_CHECK_AS(IoError, size <= static_cast<size_t>(std::min(length, max_bytes)), what,
                   " is too large or corrupt: its pickle claims ", size, " bytes (at most ",
                   std::min(length, max_bytes), " are read)");
    std::vector<std::byte> out(size);
    if (size > 0) reader.getRecord("data.pkl", out.data(), size);
    return out;
  });
}

}  // namespace fsdpx::checkpoint::detail
