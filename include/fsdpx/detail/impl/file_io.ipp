// Out-of-line functions of fsdpx/detail/file_io.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::detail {

FSDPX_DECL FaultInjection& fault_injection() {
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

FSDPX_DECL void inject_write_error(int error, int64_t after_bytes) {
  auto& f = fault_injection();
  f.after_bytes = f.written.load() + after_bytes;
  f.error = error;
}

FSDPX_DECL std::string errno_text(int err) {
  std::string text = std::strerror(err);
  if (err == ENOSPC) text += " (ENOSPC: the disk is full)";
  if (err == EDQUOT) text += " (EDQUOT: the disk quota is exhausted)";
  return text;
}

FSDPX_DECL void fsync_directory(const fs::path& dir) {
  Fd fd(dir, O_RDONLY | O_DIRECTORY);
  if (::fsync(fd.get()) != 0) throw_io("fsync of directory", dir, errno);
}

FSDPX_DECL void remove_durably(const fs::path& path) {
  std::error_code ec;
  if (!fs::remove(path, ec)) {
    if (ec) throw_io("removing", path, ec.value());
    return;
  }
  fsync_directory(path.parent_path());
}

FSDPX_DECL void reserve_space(const fs::path& path, int64_t bytes) {
  Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC);
  if (const int err = ::posix_fallocate(fd.get(), 0, bytes); err != 0) {
    std::error_code ignored;
    fs::remove(path, ignored);
    throw_io("reserving room for the commit record in", path, err);
  }
}

FSDPX_DECL WrittenFile write_file_durably(
    const fs::path& path, const std::function<void(const std::function<void(const void*, size_t)>&)>& produce) {
  DurableFile file(path);
  produce([&](const void* data, size_t n) { file.append(data, n); });
  return file.commit();
}

FSDPX_DECL std::vector<char> read_file(const fs::path& path, const char* what, int64_t max_bytes, Links links) {
  // The one way in: a regular file, opened without blocking (a FIFO or a device would hang or never end).
  const Fd fd = open_regular_file(path, what, links);
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw_io("stat of", path, errno);
  FSDPX_CHECK_AS(IoError, st.st_size <= max_bytes, what, " '", path.string(), "' has ", int64_t{st.st_size},
                 " bytes; it may have at most ", max_bytes);
  std::vector<char> data(static_cast<size_t>(st.st_size));
  read_exact(fd.get(), path, 0, data.data(), st.st_size, st.st_size);
  return data;
}

FSDPX_DECL void DurableFile::append(const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  crc_.update(p, n);
  FaultInjection& fault = fault_injection();
  while (n > 0) {
    if (const int err = fault.error.load();
        err != 0 && fault.written.load() + static_cast<int64_t>(n) > fault.after_bytes) {
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

FSDPX_DECL WrittenFile DurableFile::commit() {
  if (::fsync(fd_.get()) != 0) throw_io("fsync of", tmp_, errno);
  fd_.close(tmp_);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) throw_io("renaming into place", path_, errno);
  committed_ = true;
  fsync_directory(path_.parent_path().empty() ? fs::path(".") : path_.parent_path());
  return {path_, bytes_, crc_.value()};
}

FSDPX_DECL Fd open_regular_file(const fs::path& path, const char* what, Links links) {
  std::error_code ec;
  if (links == Links::refuse) {
    FSDPX_CHECK_AS(IoError, !fs::is_symlink(fs::symlink_status(path, ec)), what, " '", path.string(),
                   "' is a symbolic link; a checkpoint's files must be regular files inside its folder");
  }
  FSDPX_CHECK_AS(IoError, fs::exists(path, ec), what, " '", path.string(), "' does not exist");
  // O_NOFOLLOW: a link put in place after the check above fails to open rather than being followed
  Fd fd(path, O_RDONLY | O_NONBLOCK | (links == Links::refuse ? O_NOFOLLOW : 0));
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw_io("stat of", path, errno);
  FSDPX_CHECK_AS(IoError, S_ISREG(st.st_mode), what, " '", path.string(), "' is not a regular file");
  return fd;
}

FSDPX_DECL void read_exact(int fd, const fs::path& path, int64_t offset, void* out, int64_t n, int64_t file_size) {
  auto* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < n) {
    const ssize_t k = ::pread(fd, p + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw_io("reading", path, errno);
    FSDPX_CHECK_AS(IoError, k > 0, "file '", path.string(), "' is truncated: it has ", file_size,
                   " bytes, its contents need at least ", offset + n);
    done += k;
  }
}

}  // namespace fsdpx::detail
