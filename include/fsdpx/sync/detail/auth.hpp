// Who may connect to the synchronizer and with which secret: the roles and the secrets' resolution
// (public API of the service in both compilation modes). The handshake that proves a secret is in
// detail/handshake.hpp, used by the service's implementation only.
#pragma once

#if !defined(FSDPX_WITH_OPENSSL)
#error \
    "fsdpx/sync (the TCP synchronizer service) needs OpenSSL's libcrypto for its HMAC handshake: configure fsdpx where OpenSSL is installed (Debian: libssl-dev), so that FSDPX_WITH_OPENSSL is set."
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
