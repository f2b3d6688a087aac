// Who may connect to the synchronizer and with which secret: the roles and the secrets' resolution
// (public API of the service in both compilation modes). The handshake that proves a secret is in
// detail/handshake.hpp, used by the service's implementation only.
#pragma once

#if !defined(FSDPX_WITH_SYNC_SERVICE)
#error \
    "fsdpx/sync/service.hpp (the TCP synchronizer service) is a component of its own: link fsdpx::sync_service (find_package(fsdpx COMPONENTS sync_service); it needs Boost.Asio and OpenSSL where fsdpx was configured, Debian: libboost-dev libssl-dev), or, without CMake, define FSDPX_WITH_SYNC_SERVICE and link libssl and libcrypto. The broadcast, the in-process Synchronizer and the watcher (<fsdpx/sync.hpp>) need neither."
#endif

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include <fsdpx/error.hpp>

namespace fsdpx::sync {

/// What a connection may do once authenticated. A publisher may also fetch.
enum class Role : uint64_t { publish = 1, fetch = 2 };

inline const char* to_string(Role r) { return r == Role::publish ? "publish" : "fetch"; }

namespace detail {

/// The environment variable's value, or nothing when unset or empty.
inline std::optional<std::string> env_secret(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

}  // namespace detail

/// A shared secret: held in memory only, never printed (its name is what errors mention).
struct Secret {
  std::string value;
  bool empty() const { return value.empty(); }
};

/// The secret for `role`: `specific` (the role's option), else `shared` (the common option), else the
/// environment (FSDPX_SYNC_PUBLISH_SECRET / FSDPX_SYNC_FETCH_SECRET, then FSDPX_SYNC_SECRET); empty when
/// none is set.
inline Secret resolve_secret(Role role, const std::string& specific, const std::string& shared) {
  if (!specific.empty()) return {specific};
  if (!shared.empty()) return {shared};
  if (auto v = detail::env_secret(role == Role::publish ? "FSDPX_SYNC_PUBLISH_SECRET" : "FSDPX_SYNC_FETCH_SECRET")) {
    return {*v};
  }
  if (auto v = detail::env_secret("FSDPX_SYNC_SECRET")) return {*v};
  return {};
}

}  // namespace fsdpx::sync
