// Out-of-line functions of fsdpx/checkpoint/detail/torch_io.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp). LibTorch's serializer
// headers are included here only, so a separately compiled program's translation units do not parse them.
#pragma once

#include <algorithm>
#include <cerrno>
#include <map>
#include <string>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fsdpx/checkpoint/detail/archive_reader.hpp>
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
    if (count > 0) std::memcpy(buf, bytes_.data() + pos, count);  // a read of nothing may pass no buffer
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

/// Refuses a zip whose central directory claims an entry larger than the archive: LibTorch's zip reader
/// allocates an entry's uncompressed size as the directory states it (its constructor reads the version record
/// so), so a 3 KB file could ask for 4 GiB. Every entry's sizes are checked here, from the directory's bytes
/// alone (zip64 included), before that reader is made. Not a zip at all is left to it to say.
inline void check_zip_sizes(const caffe2::serialize::ReadAdapterInterface& in, const std::string& what) {
  const uint64_t size = in.size();
  const auto corrupt = [&](const auto&... args) {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", size, " bytes) is corrupt: ", args...));
  };
  const auto le = [](const unsigned char* p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  };
  const auto read = [&](uint64_t at, uint64_t n, const char* part) {
    if (at > size || n > size - at) corrupt("its ", part, " lies past its end");  // checked before the allocation
    std::vector<unsigned char> out(n);
    if (n > 0 && in.read(at, out.data(), n, part) != n) corrupt("its ", part, " cannot be read whole");
    return out;
  };
  // The end of central directory record: 22 bytes and a comment of up to 64 KiB, at the end.
  const uint64_t tail_n = std::min<uint64_t>(size, 22 + 0xFFFF);
  if (tail_n < 22) return;
  const std::vector<unsigned char> tail = read(size - tail_n, tail_n, "end of central directory");
  int64_t at = -1;
  for (int64_t i = static_cast<int64_t>(tail_n) - 22; i >= 0 && at < 0; --i) {
    if (le(&tail[static_cast<size_t>(i)], 4) == 0x06054b50) at = i;
  }
  if (at < 0) return;
  const unsigned char* eocd = &tail[static_cast<size_t>(at)];
  uint64_t entries = le(eocd + 10, 2), dir_size = le(eocd + 12, 4), dir_at = le(eocd + 16, 4);
  if (entries == 0xFFFF || dir_size == 0xFFFFFFFF || dir_at == 0xFFFFFFFF) {  // zip64: its own end record
    const uint64_t eocd_at = size - tail_n + static_cast<uint64_t>(at);
    if (eocd_at < 20) corrupt("its zip64 end record locator lies before its start");
    const std::vector<unsigned char> locator = read(eocd_at - 20, 20, "zip64 end record locator");
    if (le(locator.data(), 4) != 0x07064b50) corrupt("it has no zip64 end record locator");
    const std::vector<unsigned char> end64 = read(le(locator.data() + 8, 8), 56, "zip64 end record");
    if (le(end64.data(), 4) != 0x06064b50) corrupt("it has no zip64 end record where its locator says");
    entries = le(end64.data() + 32, 8);
    dir_size = le(end64.data() + 40, 8);
    dir_at = le(end64.data() + 48, 8);
  }
  const std::vector<unsigned char> dir = read(dir_at, dir_size, "central directory");
  uint64_t pos = 0;
  for (uint64_t k = 0; k < entries; ++k) {
    if (dir_size - pos < 46 || le(&dir[pos], 4) != 0x02014b50) corrupt("its central directory ends before entry ", k);
    const unsigned char* e = &dir[pos];
    uint64_t compressed = le(e + 20, 4), uncompressed = le(e + 24, 4);
    const uint64_t name_n = le(e + 28, 2), extra_n = le(e + 30, 2), comment_n = le(e + 32, 2);
    if (dir_size - pos - 46 < name_n + extra_n + comment_n)
      corrupt("its central directory's entry ", k, " runs past it");
    const std::string name(reinterpret_cast<const char*>(e + 46), name_n);
    // zip64's sizes, in the extra field 0x0001, for those that are 0xFFFFFFFF (uncompressed first)
    for (uint64_t x = 0; x + 4 <= extra_n;) {
      const unsigned char* f = e + 46 + name_n + x;
      const uint64_t id = le(f, 2), n = le(f + 2, 2);
      if (x + 4 + n > extra_n) break;
      if (id == 1) {
        uint64_t o = 4;
        if (uncompressed == 0xFFFFFFFF && o + 8 <= 4 + n) uncompressed = le(f + o, 8), o += 8;
        if (compressed == 0xFFFFFFFF && o + 8 <= 4 + n) compressed = le(f + o, 8);
      }
      x += 4 + n;
    }
    if (uncompressed > size || compressed > size) {
      corrupt("its entry '", name, "' claims ", std::max(uncompressed, compressed),
              " bytes, more than the archive has");
    }
    pos += 46 + name_n + extra_n + comment_n;
  }
}

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
    // Every size is checked against the bytes there are before it is allocated; what remains is a file
    // that is whole and larger than this machine's memory.
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", bytes, " bytes) does not fit in this machine's memory"));
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what, " (", bytes, " bytes) is corrupt: ", e.what()));
  }
}

/// A torch.save archive's value, read by fsdpx's own pickle reader (checkpoint/detail/archive_reader.hpp),
/// never by LibTorch's unpickler: the pickle runs nothing and sizes nothing from a length before the bytes
/// are there, each storage record is read once, and the records read together fit in the archive (a crafted
/// central directory may point many names at the same bytes).
inline c10::IValue read_checked_archive(caffe2::serialize::PyTorchStreamReader& reader, size_t archive_bytes,
                                        const std::string& what) {
  FSDPX_CHECK_AS(IoError, reader.hasRecord("data.pkl"), what, " is not a torch.save archive: it has no data.pkl");
  const size_t pickle_bytes = reader.getRecordSize("data.pkl");
  FSDPX_CHECK_AS(IoError, pickle_bytes <= archive_bytes, what, " is corrupt: its pickle claims ", pickle_bytes,
                 " bytes, more than the archive's ", archive_bytes);
  std::vector<std::byte> pickle(pickle_bytes);
  if (pickle_bytes > 0) reader.getRecord("data.pkl", pickle.data(), pickle_bytes);
  const auto parsed =
      ::fsdpx::pickle::parse(pickle, what, archive_global, archive_limits(static_cast<int64_t>(archive_bytes)));
  size_t left = archive_bytes - pickle_bytes;
  const StorageRecords records = [&](const std::string& key) {
    const std::string record = "data/" + key;
    FSDPX_CHECK_AS(IoError, reader.hasRecord(record), what, " is corrupt: it has no record '", record,
                   "' for a storage its pickle names");
    const size_t size = reader.getRecordSize(record);
    FSDPX_CHECK_AS(IoError, size <= left, what, " is corrupt: its record '", record, "' claims ", size,
                   " bytes, more than the archive's ", archive_bytes, " bytes hold beside its other records");
    left -= size;
    auto [ptr, n] = reader.getRecord(record);
    return c10::Storage(c10::Storage::use_byte_size_t(), n, std::move(ptr), /*allocator=*/nullptr,
                        /*resizable=*/false);
  };
  return pickle_value(parsed, what, &records);
}

FSDPX_DECL void check_committed_bytes(const fs::path& path, std::string_view kind, const std::vector<char>& data,
                                      std::optional<int64_t> bytes, std::optional<uint32_t> crc32c) {
  FSDPX_CHECK_AS(IoError, !bytes || static_cast<int64_t>(data.size()) == *bytes, kind, " '", path.string(), "' has ",
                 data.size(), " bytes but its commit record says ", bytes.value_or(0),
                 ": the file is truncated or was replaced");
  if (!crc32c) return;
  const uint32_t crc = ::fsdpx::detail::Crc32c::of(data.data(), data.size());
  FSDPX_CHECK_AS(IoError, crc == *crc32c, kind, " '", path.string(), "' is corrupt: its CRC-32C is ", crc, " but ",
                 *crc32c, " was committed");
}

FSDPX_DECL c10::IValue load_ivalue(const fs::path& path, std::optional<uint32_t> expected_crc32c, int64_t max_bytes,
                                   ::fsdpx::detail::Links links) {
  std::vector<char> data = ::fsdpx::detail::read_file(path, "checkpoint file", max_bytes, links);
  const size_t bytes = data.size();
  check_committed_bytes(path, "checkpoint file", data, std::nullopt, expected_crc32c);
  const std::string what = ::fsdpx::detail::str("checkpoint file '", path.string(), "'");
  return archive_errors(what, bytes, [&] {
    // Through a reader that cannot read past the file (see BoundedBytesReader).
    const auto in = std::make_shared<BoundedBytesReader>(std::move(data));
    check_zip_sizes(*in, what);
    caffe2::serialize::PyTorchStreamReader reader(in);
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
    const auto in = std::make_shared<FileRangeReader>(std::move(fd), offset, length);
    check_zip_sizes(*in, what);
    caffe2::serialize::PyTorchStreamReader reader(in);
    return read_checked_archive(reader, static_cast<size_t>(length), what);
  });
}

FSDPX_DECL std::vector<std::byte> read_archive_pickle(const fs::path& path, int64_t offset, int64_t length,
                                                      const std::string& what, int64_t max_bytes) {
  auto fd = open_range(path, offset, length, what);
  return archive_errors(what, static_cast<size_t>(length), [&] {
    const auto in = std::make_shared<FileRangeReader>(std::move(fd), offset, length);
    check_zip_sizes(*in, what);
    caffe2::serialize::PyTorchStreamReader reader(in);
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
