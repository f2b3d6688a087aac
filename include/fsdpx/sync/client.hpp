// The synchronizer client: one connection to a SynchronizerServer, for publishing (the trainer) or
// fetching (a rollout). It proves it holds the role's secret, and checks that the server holds it too
// (so a rollout never loads weights from an impostor), before the first request.
//
// Declarations only: the connection (Boost.Asio, OpenSSL) is in sync/impl/client.ipp, compiled here
// unless FSDPX_SEPARATE_COMPILATION (fsdpx/detail/config.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include <fsdpx/detail/config.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/held_version.hpp>
#include <fsdpx/sync/detail/auth.hpp>  // Role, secrets (public API in both modes)

namespace fsdpx::sync {

struct ClientOptions {
  /// How long to keep trying to connect (the server may start after the client, or refuse it for a
  /// while when too many connections wait to authenticate).
  std::chrono::milliseconds connect_timeout{10000};
  /// Deadline for sending or receiving one frame (one bucket). A fetch also ends by its own `wait`.
  std::chrono::milliseconds io_timeout{60000};
  /// Bucket capacity for publish(); the server refuses buckets above its max_bucket_bytes.
  int64_t bucket_bytes = int64_t{16} << 20;
  /// How publish() cuts a version against the one it published before (docs/sync.md, "Delta
  /// versions"). The publisher keeps a copy of what it last published, in the published dtypes.
  DeltaOptions delta;
  /// The secret of the role this client uses (publish or fetch); empty: the environment
  /// (FSDPX_SYNC_PUBLISH_SECRET / FSDPX_SYNC_FETCH_SECRET, then FSDPX_SYNC_SECRET), else none.
  std::string secret;
  /// The publisher's run: versions of one run must increase; a version of a new run takes over from
  /// the previous run's, whatever their numbers (a restarted trainer, or one resumed from an earlier
  /// checkpoint). Empty: this process's own run, fresh per process. Text of at most 256 bytes; give
  /// one (a job and attempt id, say) only if it changes whenever the trainer restarts.
  std::string run;
  /// Limits on what the server may send: one bucket, one version.
  int64_t max_bucket_bytes = int64_t{1} << 30;
  int64_t max_version_bytes = int64_t{64} << 30;
  /// TLS, to a server that speaks it (ServerOptions::tls_certificate_file): its certificate must be
  /// signed by an authority of tls_ca_file (PEM; empty: the system's) and name tls_server_name (a host
  /// name or IP address; empty: the address given).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_server_name;
};

namespace detail {
class ClientConnection;
}  // namespace detail

/// One connection to a SynchronizerServer. Not thread-safe: one client per thread.
class SynchronizerClient {
 public:
  /// Connects (retrying up to options.connect_timeout); `host` is an IP address.
  FSDPX_DECL SynchronizerClient(std::string host, uint16_t port, ClientOptions options = {});
  SynchronizerClient(const SynchronizerClient&) = delete;
  SynchronizerClient& operator=(const SynchronizerClient&) = delete;
  FSDPX_DECL SynchronizerClient(SynchronizerClient&&) noexcept;
  FSDPX_DECL SynchronizerClient& operator=(SynchronizerClient&&) noexcept;
  /// Closes the connection (a publisher says goodbye first); errors are swallowed.
  FSDPX_DECL ~SynchronizerClient();

  /// Publishes `tensors` as `version`; returns once the server committed it (readers can see it).
  /// Bucket by bucket, so the trainer holds one bucket beyond the tensors.
  FSDPX_DECL void publish(int64_t version, const std::vector<NamedTensor>& tensors);
  /// The same, handing the tensors over (gather_full_state_dict's fresh ones): host, contiguous tensors
  /// are kept as the base of the next delta as they are, instead of a copy of the version. They must
  /// not change afterwards (a tensor that is still the base's memory at the next publish sends that
  /// version whole).
  FSDPX_DECL void publish(int64_t version, std::vector<NamedTensor>&& tensors);

  /// The newest version once it is newer than `have` (no_version: any), waiting up to `wait` for one.
  /// `wait` is the deadline of the whole fetch, the version's transfer included: whatever the server
  /// sends, it returns or throws within `wait` (a large version needs a wait that covers its transfer).
  /// All of one version (every element of every tensor exactly once) or a SyncError: on a timeout, when
  /// the trainer disconnected, when the server is gone, on a corrupt frame. A connection the server
  /// closed while it was idle is opened again. A version of another trainer run than the one `have`
  /// came from (this client's last fetch) is newer whatever its number: a new run took over.
  /// When `have` is the version this client returned last, the server may send a delta from it: it is
  /// applied to fresh copies of the tensors it touches (snapshots returned before never change), and
  /// every tensor written is checked against the version's CRC-32C. The returned tensors are the base of
  /// the next delta: treat them as read-only (clone one to change it).
  FSDPX_DECL WeightVersion fetch_newer(int64_t have, std::chrono::milliseconds wait);

  /// fetch_newer, into `module`'s parameters and buffers by name; returns the version. When the last
  /// version this client fetched went into this module and `have` is it, a delta lands in place (only
  /// the changed elements are written); otherwise the whole version is staged, checked, then loaded.
  /// Either way every written tensor is checked against the version's CRC-32C, and on any failure the
  /// module keeps its previous weights, bit for bit (the next fetch then asks for a full version).
  /// Deltas need the module's tensors contiguous and of the sent dtypes; otherwise versions come full.
  FSDPX_DECL int64_t fetch_newer_into(torch::nn::Module& module, int64_t have, std::chrono::milliseconds wait);

  /// fetch_newer_into(module, last_version(), wait): the receivers' verb (sync::Receiver).
  int64_t load_newer_into(torch::nn::Module& module, std::chrono::milliseconds wait) {
    return fetch_newer_into(module, last_version(), wait);
  }
  /// The version fetched last (no_version before the first fetch).
  FSDPX_DECL int64_t last_version() const;
  /// Whether the last fetch (or publish) came as a delta: last_transfer().delta.
  bool last_was_delta() const { return last_transfer().delta; }

  /// "Do I hold the version fetched last, exactly?": every tensor's CRC-32C against its manifest. A
  /// SyncError naming what differs, or nothing. (Any version: sync::verify(tensors, *snapshot.manifest).)
  FSDPX_DECL void verify(torch::nn::Module& module) const;
  FSDPX_DECL void verify(const std::vector<NamedTensor>& tensors) const;

  /// What the last publish() or fetch sent or received: bytes on the wire, and a full version's bytes.
  struct Transfer {
    int64_t version = no_version;
    bool delta = false;
    int64_t bytes = 0;
    int64_t full_bytes = 0;
  };
  FSDPX_DECL Transfer last_transfer() const;

  /// Leaves: a publisher says goodbye first, so readers are not told that the trainer was lost.
  FSDPX_DECL void close();

 private:
  std::unique_ptr<detail::ClientConnection> connection_;
};
static_assert(Receiver<SynchronizerClient>);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/client.ipp>
#endif
