// Out-of-line functions of fsdpx/checkpoint/memory_tier.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstdlib>
#include <exception>
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

namespace detail {

/// The id `text` spells (1-16 lowercase hex digits), or 0 when it spells none.
inline uint64_t parse_memory_tier_id(const std::string& text) {
  const bool hex =
      !text.empty() && text.size() <= 16 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
  return hex ? std::stoull(text, nullptr, 16) : 0;
}

}  // namespace detail

FSDPX_DECL std::optional<uint64_t> read_memory_tier_id(const std::filesystem::path& root) {
  const std::filesystem::path path = root / memory_tier_id_file;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::string text = ::fsdpx::detail::read_text(path, "the memory tier's id file", 64);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  const uint64_t id = detail::parse_memory_tier_id(text);
  FSDPX_CHECK_AS(IoError, id != 0, "'", path.string(),
                 "' is not a memory tier id (up to 16 lowercase hex digits, not zero): remove it to start a new "
                 "memory tier for this root");
  return id;
}

FSDPX_DECL std::filesystem::path memory_tier_root(const std::filesystem::path& dir, uint64_t id) {
  return dir / ::fsdpx::detail::str("fsdpx-memory-", std::hex, id);
}

FSDPX_DECL void claim_memory_tier(const std::filesystem::path& folder, const std::filesystem::path& disk_root) {
  ::fsdpx::detail::write_text_durably(folder / memory_tier_owner_file, std::filesystem::absolute(disk_root).string());
}

namespace detail {

/// The newest modification time of `folder`, its entries and theirs (a memory step is two levels deep).
inline std::filesystem::file_time_type newest_change(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::file_time_type newest = fs::last_write_time(folder, ec);
  for (auto it = fs::recursive_directory_iterator(folder, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it.depth() > 2) it.disable_recursion_pending();
    const auto t = fs::last_write_time(it->path(), ec);
    if (!ec && t > newest) newest = t;
    ec.clear();
  }
  return newest;
}

/// Why the memory tier in `folder` (of id `id`) is stale, or empty when it is not (or cannot be told).
inline std::string why_stale(const std::filesystem::path& folder, uint64_t id) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(folder / memory_tier_owner_file, ec)) return {};
  try {
    const fs::path root =
        ::fsdpx::detail::read_text(folder / memory_tier_owner_file, "a memory tier's owner file", 4096);
    if (!fs::exists(root, ec) && !ec) return ::fsdpx::detail::str("its disk root '", root.string(), "' is gone");
    const auto root_id = read_memory_tier_id(root);
    if (root_id && *root_id != id) {
      return ::fsdpx::detail::str("its disk root '", root.string(), "' names another memory tier");
    }
    if (!root_id && fs::is_directory(root, ec)) {
      return ::fsdpx::detail::str("its disk root '", root.string(), "' names no memory tier (it was started over)");
    }
  } catch (const std::exception&) {
    return {};  // an unreadable owner or id: not this job's to judge
  }
  return {};
}

}  // namespace detail

FSDPX_DECL std::vector<std::pair<std::filesystem::path, std::string>> remove_stale_memory_tiers(
    const std::filesystem::path& dir, const std::filesystem::path& own, std::chrono::seconds min_age) {
  namespace fs = std::filesystem;
  std::vector<std::pair<fs::path, std::string>> removed;
  std::error_code ec;
  const std::string prefix = "fsdpx-memory-";
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path folder = it->path();
    const std::string name = folder.filename().string();
    std::error_code entry_ec;
    if (name.rfind(prefix, 0) != 0 || folder == own || it->is_symlink(entry_ec) || !it->is_directory(entry_ec))
      continue;
    const uint64_t id = detail::parse_memory_tier_id(name.substr(prefix.size()));
    if (id == 0) continue;
    std::string why = detail::why_stale(folder, id);
    if (why.empty() || fs::file_time_type::clock::now() - detail::newest_change(folder) < min_age) continue;
    fs::remove_all(folder, entry_ec);
    if (!entry_ec) removed.emplace_back(folder, std::move(why));
  }
  return removed;
}

}  // namespace fsdpx::checkpoint
