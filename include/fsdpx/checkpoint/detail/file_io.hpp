// Durable file I/O for checkpoints: every file is written to a temporary name, fsynced, renamed
// into place and its directory fsynced, so a crash leaves either the old file or the new one,
// never a torn one. Errors name the file and the cause (a full disk says so).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint::detail {

namespace fs = std::filesystem;

using ::fsdpx::detail::Crc32c;  // the checksum recorded for every file in fsdp_config.json

// ---- fault injection (tests): writes fail with `error` once the process has written `after_bytes`
// checkpoint bytes, as a full disk or a broken device would. Set from FSDPX_INJECT_WRITE_ERROR=
// <ENOSPC|EIO|EDQUOT>:<bytes> at first use, or by inject_write_error().

struct FaultInjection {
  std::atomic<int> error{0};
  std::atomic<int64_t> after_bytes{0};
  std::atomic<int64_t> written{0};
};

inline FaultInjection& fault_injection() {
  static FaultInjection* f = [] {
    auto* fi = new FaultInjection;  // never destroyed: background writers may outlive static destruction
    const char* spec = std::getenv("FSDPX_INJECT_WRITE_ERROR");
    if (spec == nullptr || *spec == '\0') return fi;
    const std::string s(spec);
    const auto colon = s.find(':');
    const std::string name = s.substr(0, colon);
    const int err = name == "ENOSPC" ? ENOSPC : name == "EIO" ? EIO : name == "EDQUOT" ? EDQUOT : 0;
    FSDPX_CHECK(err != 0, "FSDPX_INJECT_WRITE_ERROR='", s, "': the error must be ENOSPC, EIO or EDQUOT");
    fi->after_bytes = colon == std::string::npos ? 0 : std::stoll(s.substr(colon + 1));
    fi->error = err;
    return fi;
  }();
  return *f;
}

/// Tests: from now on, checkpoint writes fail with `error` after `after_bytes` more bytes (0: off).
inline void inject_write_error(int error, int64_t after_bytes = 0) {
  auto& f = fault_injection();
  f.after_bytes = f.written.load() + after_bytes;
  f.error = error;
}

inline std::string errno_text(int err) {
  std::string text = std::strerror(err);
  if (err == ENOSPC) text += " (ENOSPC: the disk is full)";
  if (err == EDQUOT) text += " (EDQUOT: the disk quota is exhausted)";
  return text;
}

[[noreturn]] inline void throw_io(std::string_view what, const fs::path& path, int err) {
  throw IoError(::fsdpx::detail::str("fsdpx: ", what, " '", path.string(), "' failed: ", errno_text(err)));
}

/// An open file descriptor that closes itself.
class Fd {
 public:
  Fd(const fs::path& path, int flags, mode_t mode = 0644) : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
    if (fd_ < 0) throw_io("opening", path, errno);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  void close(const fs::path& path) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw_io("closing", path, errno);
  }

 private:
  int fd_;
};

inline void fsync_directory(const fs::path& dir) {
  Fd fd(dir, O_RDONLY | O_DIRECTORY);
  if (::fsync(fd.get()) != 0) throw_io("fsync of directory", dir, errno);
}

/// Removes `path` (nothing to do when it is absent) and fsyncs its directory, so the removal
/// survives a crash.
inline void remove_durably(const fs::path& path) {
  std::error_code ec;
  if (!fs::remove(path, ec)) {
    if (ec) throw_io("removing", path, ec.value());
    return;
  }
  fsync_directory(path.parent_path());
}

/// Allocates `bytes` of disk to `path` (no data written), so they can be freed for a later write
/// when the disk is full. An IoError when the disk has no room even for that.
inline void reserve_space(const fs::path& path, int64_t bytes) {
  Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC);
  if (const int err = ::posix_fallocate(fd.get(), 0, bytes); err != 0) {
    std::error_code ignored;
    fs::remove(path, ignored);
    throw_io("reserving room for the commit record in", path, err);
  }
}
inline void release_space(const fs::path& path) {
  std::error_code ignored;
  fs::remove(path, ignored);
}

/// What a durable write produced.
struct WrittenFile {
  fs::path path;
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

/// A file written durably, piece by piece: the bytes go to "<path>.tmp"; commit() fsyncs it, renames
/// it over `path` and fsyncs the directory. Destroyed uncommitted (an error on the way), the
/// temporary file is removed and `path` is left as it was.
class DurableFile {
 public:
  explicit DurableFile(fs::path path) : path_(std::move(path)), tmp_(path_.string() + ".tmp"), fd_(tmp_, O_WRONLY | O_CREAT | O_TRUNC) {}
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  ~DurableFile() {
    if (committed_) return;
    std::error_code ignored;
    fs::remove(tmp_, ignored);
  }

  void append(const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    crc_.update(p, n);
    FaultInjection& fault = fault_injection();
    while (n > 0) {
      if (const int err = fault.error.load(); err != 0 && fault.written.load() + static_cast<int64_t>(n) > fault.after_bytes) {
        throw_io("writing", tmp_, err);
      }
      const ssize_t k = ::write(fd_.get(), p, n);
      if (k < 0) {
        if (errno == EINTR) continue;
        throw_io("writing", tmp_, errno);
      }
      p += k;
      n -= static_cast<size_t>(k);
      bytes_ += k;
      fault.written += k;
    }
  }
  int64_t bytes() const { return bytes_; }

  WrittenFile commit() {
    if (::fsync(fd_.get()) != 0) throw_io("fsync of", tmp_, errno);
    fd_.close(tmp_);
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) throw_io("renaming into place", path_, errno);
    committed_ = true;
    fsync_directory(path_.parent_path().empty() ? fs::path(".") : path_.parent_path());
    return {path_, bytes_, crc_.value()};
  }

 private:
  fs::path path_;
  fs::path tmp_;
  Fd fd_;
  Crc32c crc_;
  int64_t bytes_ = 0;
  bool committed_ = false;
};

/// Writes `path` durably (DurableFile): `produce(sink)` calls sink(data, n) with the content in order.
inline WrittenFile write_file_durably(const fs::path& path,
                                     const std::function<void(const std::function<void(const void*, size_t)>&)>& produce) {
  DurableFile file(path);
  produce([&](const void* data, size_t n) { file.append(data, n); });
  return file.commit();
}

inline WrittenFile write_text_durably(const fs::path& path, std::string_view text) {
  return write_file_durably(path, [&](const auto& sink) { sink(text.data(), text.size()); });
}

/// The whole file, or an IoError naming it.
inline std::vector<char> read_file(const fs::path& path) {
  Fd fd(path, O_RDONLY);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_io("stat of", path, errno);
  std::vector<char> data(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t k = ::read(fd.get(), data.data() + done, data.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw_io("reading", path, errno);
    if (k == 0) break;
    done += static_cast<size_t>(k);
  }
  FSDPX_CHECK_AS(IoError, done == data.size(), "reading '", path.string(), "': the file shrank while being read (",
                 done, " of ", data.size(), " bytes)");
  return data;
}

inline std::string read_text(const fs::path& path) {
  const auto data = read_file(path);
  return {data.begin(), data.end()};
}

}  // namespace fsdpx::checkpoint::detail
