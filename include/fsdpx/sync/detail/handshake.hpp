// The synchronizer's per-connection proof of a shared secret: an HMAC-SHA256 challenge-response in
// both directions (OpenSSL's libcrypto), so neither side ever sends the secret, a recorded handshake
// cannot be replayed (each side's nonce is fresh), and a client knows the server holds the secret too.
//
//   server -> client  hello    32-byte server nonce
//   client -> server  auth     role, 32-byte client nonce, HMAC(secret[role], "fsdpx-sync-2 client" role Ns Nc)
//   server -> client  welcome  HMAC(secret[role], "fsdpx-sync-2 server" role Nc Ns)    (or error, then close)
//
// docs/sync.md ("Authentication") is the specification the Python receiver follows.
#pragma once

#include <fsdpx/sync/detail/auth.hpp>  // first: its #error explains a build without the sync service

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include <fsdpx/error.hpp>

namespace fsdpx::sync::detail {

inline constexpr size_t nonce_bytes = 32;
inline constexpr size_t mac_bytes = 32;
using Nonce = std::array<uint8_t, nonce_bytes>;
using Mac = std::array<uint8_t, mac_bytes>;

inline Nonce fresh_nonce() {
  Nonce n;
  FSDPX_CHECK_AS(SyncError, RAND_bytes(n.data(), static_cast<int>(n.size())) == 1,
                 "the synchronizer could not draw a random nonce (OpenSSL RAND_bytes failed)");
  return n;
}

/// HMAC-SHA256(secret, label || u64 role (little-endian) || first || second).
inline Mac handshake_mac(std::string_view secret, std::string_view label, Role role, const Nonce& first,
                         const Nonce& second) {
  std::string message(label);
  const auto r = static_cast<uint64_t>(role);
  for (int i = 0; i < 8; ++i) message.push_back(static_cast<char>((r >> (8 * i)) & 0xff));
  message.append(reinterpret_cast<const char*>(first.data()), first.size());
  message.append(reinterpret_cast<const char*>(second.data()), second.size());
  Mac mac{};
  unsigned int len = 0;
  const auto* out = HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                         reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(), &len);
  FSDPX_CHECK_AS(SyncError, out != nullptr && len == mac.size(), "the synchronizer's HMAC-SHA256 failed (OpenSSL)");
  return mac;
}

inline constexpr std::string_view client_label = "fsdpx-sync-2 client";
inline constexpr std::string_view server_label = "fsdpx-sync-2 server";

/// What readers (and errors) see of a publisher's run identity: 32 hex digits of SHA-256 over it. The
/// identity itself stays with the publisher and the server, so a peer that reads versions cannot
/// publish as the trainer's run (and lock it out with a version far ahead).
inline std::string run_label(std::string_view run) {
  std::string message = "fsdpx-sync run ";
  message.append(run);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  FSDPX_CHECK_AS(SyncError,
                 EVP_Digest(message.data(), message.size(), digest, &len, EVP_sha256(), nullptr) == 1 && len >= 16,
                 "the synchronizer's SHA-256 failed (OpenSSL)");
  static constexpr char hex[] = "0123456789abcdef";
  std::string label;
  for (unsigned int i = 0; i < 16; ++i) {
    label.push_back(hex[digest[i] >> 4]);
    label.push_back(hex[digest[i] & 15]);
  }
  return label;
}

/// Constant-time: the comparison's duration says nothing about where the MACs differ.
inline bool same_mac(const Mac& a, const uint8_t* b) { return CRYPTO_memcmp(a.data(), b, a.size()) == 0; }

}  // namespace fsdpx::sync::detail
