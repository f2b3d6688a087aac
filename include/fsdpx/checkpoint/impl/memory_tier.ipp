// Out-of-line functions of fsdpx/checkpoint/memory_tier.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstdlib>
#include <string>
#include <system_error>

#include <fsdpx/checkpoint/memory_tier.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint {

FSDPX_DECL std::filesystem::path memory_tier_dir(const std::filesystem::path& configured) {
  if (!configured.empty()) return configured;
  if (const char* env = std::getenv("FSDPX_MEMORY_DIR"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec)) return "/dev/shm";
  return std::filesystem::temp_directory_path();
}

FSDPX_DECL std::optional<uint64_t> read_memory_tier_id(const std::filesystem::path& root) {
  const std::filesystem::path path = root / memory_tier_id_file;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::string text = ::fsdpx::detail::read_text(path, "the memory tier's id file", 64);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  const bool hex =
      !text.empty() && text.size() <= 16 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
  const uint64_t id = hex ? std::stoull(text, nullptr, 16) : 0;
  FSDPX_CHECK_AS(IoError, id != 0, "'", path.string(),
                 "' is not a memory tier id (up to 16 lowercase hex digits, not zero): remove it to start a new "
                 "memory tier for this root");
  return id;
}

FSDPX_DECL std::filesystem::path memory_tier_root(const std::filesystem::path& dir, uint64_t id) {
  return dir / ::fsdpx::detail::str("fsdpx-memory-", std::hex, id);
}

}  // namespace fsdpx::checkpoint
