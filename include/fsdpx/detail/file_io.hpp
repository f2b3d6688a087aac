// File I/O for every file fsdpx writes or reads (checkpoints, safetensors, model folders). Writes are
// durable: every file is written to a temporary name, fsynced, renamed into place and its directory
// fsynced, so a crash leaves either the old file or the new one, never a torn one. Reads of files
// that are not trusted open them only if they are regular files. Errors name the file and the cause
// (a full disk says so).
#pragma once

#include <fsdpx/detail/config.hpp>

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

namespace fsdpx::detail {

namespace fs = std::filesystem;

// ---- fault injection (tests): writes fail with `error` once the process has written `after_bytes`
// checkpoint bytes, as a full disk or a broken device would. Set from FSDPX_INJECT_WRITE_ERROR=
// <ENOSPC|EIO|EDQUOT>:<bytes> at first use, or by inject_write_error().

struct FaultInjection {
  std::atomic<int> error{0};
  std::atomic<int64_t> after_bytes{0};
  std::atomic<int64_t> written{0};
};

FSDPX_DECL FaultInjection& fault_injection();

/// Tests: from now on, checkpoint writes fail with `error` after `after_bytes` more bytes (0: off).
FSDPX_DECL void inject_write_error(int error, int64_t after_bytes = 0);

FSDPX_DECL std::string errno_text(int err);

[[noreturn]] inline void throw_io(std::string_view what, const fs::path& path, int err) {
  throw IoError(str("fsdpx: ", what, " '", path.string(), "' failed: ", errno_text(err)));
}

/// An open file descriptor that closes itself.
class Fd {
 public:
  // Never blocking: a FIFO put where a file is expected would hang open() (for writing, until a reader
  // comes); with O_NONBLOCK it opens or fails at once, and regular files behave as without it.
  Fd(const fs::path& path, int flags, mode_t mode = 0644)
      : fd_(::open(path.c_str(), flags | O_CLOEXEC | O_NONBLOCK, mode)) {
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

FSDPX_DECL void fsync_directory(const fs::path& dir);

/// Removes `path` (nothing to do when it is absent) and fsyncs its directory, so the removal
/// survives a crash.
FSDPX_DECL void remove_durably(const fs::path& path);

/// Allocates `bytes` of disk to `path` (no data written), so they can be freed for a later write
/// when the disk is full. An IoError when the disk has no room even for that.
FSDPX_DECL void reserve_space(const fs::path& path, int64_t bytes);
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
  explicit DurableFile(fs::path path)
      : path_(std::move(path)), tmp_(path_.string() + ".tmp"), fd_(create_fresh(tmp_)) {}
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  ~DurableFile() {
    if (committed_) return;
    std::error_code ignored;
    fs::remove(tmp_, ignored);
  }

  FSDPX_DECL void append(const void* data, size_t n);
  int64_t bytes() const { return bytes_; }

  FSDPX_DECL WrittenFile commit();

 private:
  // Whatever is at the temporary name (a crash's leftover, a FIFO, a link) is replaced, never written through.
  static Fd create_fresh(const fs::path& tmp) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return Fd(tmp, O_WRONLY | O_CREAT | O_EXCL);
  }

  fs::path path_;
  fs::path tmp_;
  Fd fd_;
  Crc32c crc_;
  int64_t bytes_ = 0;
  bool committed_ = false;
};

/// Writes `path` durably (DurableFile): `produce(sink)` calls sink(data, n) with the content in order.
FSDPX_DECL WrittenFile write_file_durably(
    const fs::path& path, const std::function<void(const std::function<void(const void*, size_t)>&)>& produce);

inline WrittenFile write_text_durably(const fs::path& path, std::string_view text) {
  return write_file_durably(path, [&](const auto& sink) { sink(text.data(), text.size()); });
}

/// The most bytes fsdpx reads whole from a file that describes data rather than holding it (config.json,
/// a commit record, an iteration file, a marker, a lease): a 2 GiB config.json is refused, not parsed.
inline constexpr int64_t max_record_file_bytes = int64_t{16} << 20;

/// Whether a file may be reached through a symbolic link: a checkpoint's data files may not (a link could
/// point out of its folder), a model folder's may (the Hugging Face cache links them to its blobs).
enum class Links { follow, refuse };

/// The whole file, if it is a regular file of at most `max_bytes` (checked before anything is
/// allocated); an IoError naming it (`what`) otherwise.
FSDPX_DECL std::vector<char> read_file(const fs::path& path, const char* what, int64_t max_bytes,
                                       Links links = Links::follow);

inline std::string read_text(const fs::path& path, const char* what = "file",
                             int64_t max_bytes = max_record_file_bytes) {
  const auto data = read_file(path, what, max_bytes);
  return {data.begin(), data.end()};
}

/// Opens `path` for reading only if it is a regular file (a FIFO or a device would block or never end), and
/// with Links::refuse only if it is no symbolic link.
FSDPX_DECL Fd open_regular_file(const fs::path& path, const char* what, Links links = Links::follow);

/// Reads exactly n bytes at `offset`, or an IoError naming the file as truncated.
FSDPX_DECL void read_exact(int fd, const fs::path& path, int64_t offset, void* out, int64_t n, int64_t file_size);

}  // namespace fsdpx::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/detail/impl/file_io.ipp>
#endif
