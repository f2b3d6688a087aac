// The synchronizer server (Boost.Asio, one I/O thread): a trainer publishes versions to it, rollout
// processes fetch a version newer than theirs. Same guarantees as the in-process Synchronizer:
// versions of one trainer run only increase (a new run takes over), a version becomes visible only
// once every element of every tensor arrived exactly once, a reader gets a whole version or an error.
//
// Nothing a network peer sends can end or wedge it: a connection proves it holds the role's secret
// (detail/auth.hpp) before it may send anything but the 64-byte handshake; every frame is checked
// against the limits of ServerOptions before anything is allocated for it; every wait has a deadline;
// an exception in a handler closes that connection only; the number of connections is capped (those
// not yet authenticated in all and per peer address; a refused client is told why), and an accept
// that fails (out of descriptors) is retried after a pause, never in a spin.
//
// Declarations only: the server (Boost.Asio, OpenSSL) is in sync/impl/server.ipp, compiled here unless
// FSDPX_SEPARATE_COMPILATION (fsdpx/detail/config.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fsdpx/detail/config.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/auth.hpp>  // Role, secrets (public API in both modes)
#include <fsdpx/sync/synchronizer.hpp>

namespace fsdpx::sync {

/// What one peer, and all of them together, can make the synchronizer server hold, and how long it waits
/// (ServerOptions::limits; docs/sync.md, "Limits and deadlines").
struct ServerLimits {
  int64_t max_bucket_bytes = int64_t{256} << 20;  // one bucket frame; clients' bucket_bytes must fit
  // One version, bookkeeping included, and all unfinished publishes together (each publishing connection
  // stages its own; those that progressed least recently are dropped, their publishers told why, to make room).
  int64_t max_version_bytes = int64_t{64} << 30;
  int max_connections = 512;
  // Of those, at most this many before their handshake ends: when full, a new one closes the oldest of the
  // address holding the most, except one alone from its address within its handshake_grace.
  int max_handshakes = 64;
  int max_handshakes_per_address = 16;                // and at most this many of those from one peer address
  std::chrono::milliseconds handshake_timeout{3000};  // from accept to a proven secret
  std::chrono::milliseconds handshake_grace{1000};    // an honest client's handshake takes less: never closed
  std::chrono::milliseconds idle_timeout{std::chrono::minutes(30)};  // between requests
  std::chrono::milliseconds io_timeout{60000};  // within a frame, between a publish's frames, per bucket sent
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                         // 0: the system picks one; see port()
  int64_t bucket_bytes = int64_t{16} << 20;  // for versions published in-process, and full versions built from deltas
  /// How versions published in-process are cut against the one before (docs/sync.md, "Delta versions").
  DeltaOptions delta;

  /// Secrets (see resolve_secret): `secret` for both roles, or one per role. Empty: the environment
  /// (FSDPX_SYNC_SECRET, FSDPX_SYNC_PUBLISH_SECRET, FSDPX_SYNC_FETCH_SECRET), else none.
  std::string secret;
  std::string publish_secret;
  std::string fetch_secret;
  /// A server bound beyond loopback with a role that has no secret refuses to start unless this is set.
  bool allow_unauthenticated = false;
  /// TLS: with a certificate chain and its private key (PEM files), every connection speaks TLS 1.2 or
  /// newer, and clients verify the certificate (ClientOptions::tls_ca_file). Both or neither.
  std::string tls_certificate_file;
  std::string tls_private_key_file;

  /// The run of versions published in this process (publish()); empty: the process's own, fresh per
  /// process (as ClientOptions::run). A version of a new run takes over from the previous run's.
  std::string run;

  /// Deprecated, for one release: the limits spelled flat, before they moved to `limits` (ServerLimits).
  /// Each one set here wins over its `limits` twin. (Not marked [[deprecated]]: GCC would then warn
  /// wherever a ServerOptions is made, flat spellings or not.)
  std::optional<int64_t> max_bucket_bytes;
  std::optional<int64_t> max_version_bytes;
  std::optional<int> max_connections;
  std::optional<int> max_handshakes;
  std::optional<int> max_handshakes_per_address;
  std::optional<std::chrono::milliseconds> handshake_timeout;
  std::optional<std::chrono::milliseconds> idle_timeout;
  std::optional<std::chrono::milliseconds> io_timeout;

  /// Advanced: what one peer, and all of them together, can make the server hold, and how long it
  /// waits. The defaults serve a trainer and hundreds of rollouts on a trusted network and bound what an
  /// untrusted one can cost (docs/sync.md, "Limits and deadlines").
  ServerLimits limits = {};
};

/// What the server has seen: for monitoring and for the tests that attack it.
struct ServerStats {
  int64_t accepted = 0;
  int64_t live = 0;
  int64_t handshaking = 0;         // live, not yet authenticated
  int64_t refused_over_limit = 0;  // refused (told why): max_connections, per address, or the oldest handshake closed
  int64_t runs_taken_over = 0;     // versions of a new run that superseded the previous run's
  int64_t failed_auth = 0;         // wrong or missing secret, a malformed handshake, a failed TLS handshake
  int64_t protocol_errors = 0;     // frames refused after the handshake
  int64_t timed_out = 0;           // handshake, idle or I/O deadlines
  int64_t accept_errors = 0;       // accept() failures (e.g. out of file descriptors), retried after a pause
  int64_t handler_errors = 0;      // exceptions contained to their connection
  int64_t served_full = 0;         // versions sent to readers whole
  int64_t served_delta = 0;        // versions sent to readers as a delta from the one they held
};

namespace detail {
struct ServerCore;
}  // namespace detail

/// Serves versions to rollout processes; receives them from a trainer (SynchronizerClient::publish) or
/// from this process (publish()). One I/O thread; snapshots are served from memory as written.
class SynchronizerServer {
 public:
  /// Listens and starts serving; refuses to listen beyond loopback without secrets (see ServerOptions).
  FSDPX_DECL explicit SynchronizerServer(ServerOptions options = {});
  SynchronizerServer(const SynchronizerServer&) = delete;
  SynchronizerServer& operator=(const SynchronizerServer&) = delete;
  FSDPX_DECL ~SynchronizerServer();

  uint16_t port() const { return port_; }
  FSDPX_DECL const std::string& host() const;
  FSDPX_DECL int64_t latest_version() const;
  /// Connections accepted so far.
  int64_t connections() const { return stats().accepted; }
  /// A consistent copy of the counters (taken on the I/O thread).
  FSDPX_DECL ServerStats stats() const;

  /// Publishes from this process (a trainer hosting the server). The tensors are packed (copied) now.
  FSDPX_DECL void publish(int64_t version, const std::vector<NamedTensor>& tensors);

  /// Stops serving: connections close (clients see a SyncError). Idempotent.
  FSDPX_DECL void stop();

 private:
  std::unique_ptr<detail::ServerCore> core_;
  uint16_t port_ = 0;
  std::thread thread_;
  ServerStats last_stats_;
  std::string stopped_host_;
};

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/server.ipp>
#endif
