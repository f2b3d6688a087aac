// The synchronizer server's parts (sync/impl/server.ipp): the version it serves, its shared state and
// admission (ServerCore: which versions are taken, which connections are accepted), and one connection's
// protocol (Session; its functions are in sync/impl/server_session.ipp, session_publish.ipp and
// session_close.ipp). Internal: included by the server's implementation only.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/io_context.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/handshake.hpp>
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/detail/stream.hpp>
#include <fsdpx/sync/synchronizer.hpp>
#include <fsdpx/sync/server.hpp>

namespace fsdpx::sync::detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

struct ServerCore;

/// The newest version as the server serves it: a delta from the version before (when it has one) for
/// readers that hold that one, the full version for everyone else (built on first demand when the
/// version arrived as a delta: most readers then never need it).
struct ServedVersion {
  std::string run;
  uint32_t digest = 0;
  int64_t base_version = no_version;
  uint32_t base_digest = 0;
  std::shared_ptr<const EncodedSnapshot> delta;
  mutable std::shared_ptr<const EncodedSnapshot> full;  // guarded by ServerCore::full_mutex
};

/// How long, and for how many bytes, a server that refused an authenticated peer keeps reading (and
/// dropping) what it still sends, so that the refusal reaches it instead of a reset.
inline constexpr std::chrono::milliseconds linger_time{2000};
inline constexpr int64_t linger_bytes = int64_t{256} << 20;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ServerCore* core, tcp::socket socket);
  ~Session();
  void start();
  void wake();
  const std::string& address() const { return address_; }
  std::chrono::steady_clock::time_point accepted_at() const { return accepted_at_; }
  void evict_unauthenticated(const std::string& why);

 private:
  struct Pending {
    int64_t version = no_version;
    uint64_t count = 0;
    std::string run;
    int64_t bytes = 0;      // frames received, kept or not: what allowed_payload bounds
    uint64_t received = 0;  // buckets received, kept or not
    std::vector<at::Tensor> buckets;
    int64_t held_bytes = 0;    // of `buckets`
    int64_t staged_bytes = 0;  // held_bytes and the coverage's bookkeeping: its share of ServerCore::staged_bytes
    std::chrono::steady_clock::time_point last_progress = std::chrono::steady_clock::now();
    VersionCoverage coverage;  // every element of every tensor exactly once, or no commit
    std::string rejected;      // why the publish will not commit (told at its end frame); its buckets are dropped
  };

  template <class Fn>
  void guarded(Fn&& fn);
  void arm(std::chrono::milliseconds after);
  void read_header();
  void on_header(const boost::system::error_code& ec);
  void on_payload(const boost::system::error_code& ec);
  void handle();
  void on_auth();
  void begin_publish();
  void on_bucket();
  void make_staging_room();
  void stage(Pending p);
  void unstage();
  void drop_staged(const std::string& why);
  bool publishes_served_run() const;
  void end_publish();
  struct Outcome {
    std::string rejected;  // empty: committed
    uint64_t refusal = 0;  // the error frame's aux when refused
  };
  Outcome commit_publish(Pending& p) const;
  void answer_publish(int64_t version, const Outcome& outcome);
  template <class Fn>
  void off_io_thread(Fn&& job);
  void check_fetch();
  void send(FrameHeader frame, std::string text = {}, bool then_close = false);
  void send_bucket(std::shared_ptr<const EncodedSnapshot> snapshot, size_t index);
  void refuse(const std::string& why, int64_t ServerStats::* counter);
  void linger();
  void drain();
  void on_closed(const boost::system::error_code& ec);
  uint64_t allowed_payload(FrameKind kind) const;

  void send_hello();
  void leave_handshake_pool();
  std::string small_text() const { return std::string(reinterpret_cast<const char*>(small_.data()), in_.length); }

  ServerCore* core_;
  Stream stream_;
  std::string peer_;
  std::string address_;  // the peer's address, as counted in core_->handshaking_from
  std::chrono::steady_clock::time_point accepted_at_ = std::chrono::steady_clock::now();
  FrameHeader in_;
  std::array<uint8_t, std::max<size_t>(2 * nonce_bytes, max_fetch_bytes)> small_{};  // handshakes, runs, fetches
  at::Tensor payload_;
  Nonce server_nonce_{};
  std::optional<Role> role_;
  bool in_handshake_pool_ = true;  // counted in stats.handshaking and handshaking_from
  bool hello_sent_ = false;
  std::optional<Pending> pending_;
  bool closed_ = false;
  bool is_publisher_ = false;
  bool said_goodbye_ = false;
  int64_t last_published_ = no_version;
  std::string publish_run_;  // the run label of this connection's publishes
  // deadlines: one watchdog, re-armed for each wait
  asio::steady_timer watchdog_;
  uint64_t watch_generation_ = 0;
  // fetch
  int64_t have_ = no_version;
  std::string have_run_;  // the run of the reader's version (empty: unknown; compared by number only)
  FetchBase have_base_;   // whether the reader holds version have_ exactly, and its digest
  std::chrono::steady_clock::time_point deadline_;
  asio::steady_timer fetch_timer_;
  bool waiting_ = false;
  bool listed_ = false;   // in core_->waiters
  bool closing_ = false;  // refused: its last frame is being sent, nothing more is read
  // lingering close (refuse): what the peer still sends is read and dropped, so that the refusal it was
  // sent is not destroyed by the reset a close with unread data would send
  bool reading_ = false;    // a read of the stream is in flight
  bool lingering_ = false;  // the refusal went out: what arrives now is drained
  int64_t drained_ = 0;
};

struct ServerCore {
  // State first: it outlives the io_context, whose destruction destroys the sessions its pending
  // handlers hold (they update the counters as they go).
  ServerOptions options;
  Secret publish_secret, fetch_secret;
  VersionedSlot<ServedVersion> slot;
  // The newest version's tensors (deltas are applied to them, in place; the full version is built from
  // them on demand). Held by whoever changes or reads the store: the committer (a publisher's version,
  // a full version built for readers) and an in-process publish(); never the I/O thread, which a big
  // commit would stall for every client. Lock order: store_mutex, then runs_mutex, then full_mutex.
  std::mutex store_mutex;
  VersionStore store;
  std::mutex full_mutex;                      // ServedVersion::full, briefly
  int64_t served_full = 0, served_delta = 0;  // io thread
  // Touched on the io thread only.
  std::string publisher_lost;  // why readers should stop waiting; cleared by the next publish
  std::vector<std::weak_ptr<Session>> waiters;
  // Unfinished publishes, one per publishing connection, holding staged_bytes together (at most
  // max_version_bytes: when a bucket needs room, the publishes that progressed least recently are dropped).
  std::vector<Session*> staging;
  int64_t staged_bytes = 0;
  int64_t committing_bytes = 0;  // of whole publishes waiting for their commit (on the committer)
  std::unordered_map<std::string, int> handshaking_from;  // unauthenticated connections per peer address
  std::vector<Session*> handshake_pool;                   // those connections (each adds and removes itself)
  ServerStats stats;                                      // written on the io thread; read through post()
  // Runs (the io thread and publish() in process): the label of the run whose versions are served.
  std::mutex runs_mutex;
  std::string current_run;
  std::atomic<int64_t> runs_taken_over{0};
  std::optional<asio::ssl::context> tls;  // set: every connection speaks TLS
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_pause{io};
  // Where the store is changed and read, one job at a time (publishes' commits, full versions built for
  // readers), off the I/O thread. Last: destroyed first, so a running job finishes while the state it
  // touches, and the io_context it answers on, still exist.
  asio::thread_pool committer{1};

  const Secret& secret(Role r) const { return r == Role::publish ? publish_secret : fetch_secret; }

  /// Why version `version` of the run labelled `run` (run_label) cannot be published now; empty when
  /// it can. Versions of one run only increase; a version of another run takes over whatever its number:
  /// a trainer that restarted, or resumed from an earlier checkpoint, is never locked out, nor is a
  /// trainer whose versions someone else published over (without a secret, anyone local may publish;
  /// no one learns a run's identity from what readers see, so no one can publish as that run).
  /// Caller holds runs_mutex.
  std::string admission(const std::string& run, int64_t version) const {
    if (version < 0) return ::fsdpx::detail::str("version ", version, " is negative");
    const int64_t latest = slot.version();
    if (latest == no_version || run != current_run || version > latest) return {};
    return ::fsdpx::detail::str(
        "version ", version, " is not newer than ", latest,
        ", the latest version this trainer run published (the "
        "versions of one run only increase). A trainer that restarted, or resumed from an earlier checkpoint, takes "
        "over as a new run: each process is a new run by default; a run identity given in ClientOptions::run must "
        "change when the trainer restarts");
  }

  /// Makes the version `make()` builds (it updates `store`) the version served, when admission()
  /// allows; else returns why not, `store` untouched. make() throws when the version cannot be taken.
  /// Off the I/O thread (the committer, or an in-process publish): make() runs under store_mutex only,
  /// since the I/O thread takes runs_mutex to admit publishes. What admission() reads changes only here,
  /// under store_mutex, so its answer still holds once make() is done.
  template <class Make>
  std::string commit(const std::string& run, int64_t version, Make&& make) {
    std::lock_guard store_lock(store_mutex);
    {
      std::lock_guard lock(runs_mutex);
      if (std::string why = admission(run, version); !why.empty()) return why;
    }
    std::shared_ptr<ServedVersion> served = make();
    served->run = run;
    std::lock_guard lock(runs_mutex);
    if (slot.version() != no_version && run != current_run) ++runs_taken_over;
    current_run = run;
    slot.replace(version, std::move(served));
    return {};
  }

  /// The snapshot for a reader of `latest` that holds `have` (per `base`), or nullptr when it is the
  /// full version and that was not built yet (build_full). The I/O thread: it never reads the store.
  std::shared_ptr<const EncodedSnapshot> ready_snapshot_for(const ServedVersion& latest, int64_t have, FetchBase base) {
    if (latest.delta && base.holds() && have == latest.base_version && base.digest == latest.base_digest) {
      ++served_delta;
      return latest.delta;
    }
    std::lock_guard lock(full_mutex);
    if (latest.full) ++served_full;
    return latest.full;
  }

  /// Builds the full version of `latest` (version `version`, which arrived as a delta) from the store,
  /// unless it was built already or a newer version replaced it (its readers then get that one). On
  /// the committer: store and slot change together under store_mutex, so the store holds `version`
  /// here exactly while `latest` is still the newest.
  void build_full(const ServedVersion& latest, int64_t version) {
    std::lock_guard store_lock(store_mutex);
    {
      std::lock_guard lock(full_mutex);
      if (latest.full) return;
    }
    if (store.version() != version || store.digest() != latest.digest) return;
    auto full = encode_snapshot(version, latest.run, pack_full(store, options.bucket_bytes));
    std::lock_guard lock(full_mutex);
    latest.full = std::move(full);
  }

  /// The buckets of the full version `store` holds (its manifest first).
  static std::vector<at::Tensor> pack_full(const VersionStore& store, int64_t bucket_bytes) {
    Manifest m = store.manifest().whole();
    std::vector<NamedTensor> tensors{{std::string(manifest_name), m.encode()}};
    tensors.insert(tensors.end(), store.tensors().begin(), store.tensors().end());
    return pack_buckets(tensors, bucket_bytes, m.version);
  }

  /// Refuses a connection at accept, saying why in an error frame (the client may try again later).
  /// Plain TCP only: a TLS client would need a TLS handshake first, the work the limit saves.
  void refuse_at_accept(tcp::socket& socket, const std::string& why) {
    ++stats.refused_over_limit;
    if (!tls) write_plain_error(socket, "the server refused the connection: " + why, refused_busy);
    boost::system::error_code ignored;
    socket.close(ignored);
  }
  /// One error frame in plain TCP, then the sending side shut: what a plain client reads as the reason.
  static void write_plain_error(tcp::socket& socket, const std::string& text, uint64_t aux) {
    boost::system::error_code ignored;
    FrameHeader h = make_frame(FrameKind::error, no_version, aux, text.data(), text.size());
    std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
    frame += text;
    // Nothing was sent on the connection yet: one non-blocking write into its empty buffer never waits.
    socket.non_blocking(true, ignored);
    socket.write_some(asio::buffer(frame), ignored);
    socket.shutdown(tcp::socket::shutdown_send, ignored);
  }
  void wake_waiters() {
    auto list = std::move(waiters);
    waiters.clear();
    for (auto& w : list) {
      if (auto s = w.lock()) s->wake();
    }
  }
  /// Each waiting session is listed once; entries of closed ones are dropped as the list grows.
  void add_waiter(std::weak_ptr<Session> s) {
    if (waiters.size() > 2 * static_cast<size_t>(stats.live) + 16) {
      std::erase_if(waiters, [](const auto& w) { return w.expired(); });
    }
    waiters.push_back(std::move(s));
  }
  /// Makes room in the full pool of unauthenticated connections for a new one from `address`; false
  /// when none may be closed (the new one is then refused, and its client asks again). The one closed
  /// is the oldest of the address holding the most (the newcomer counted with its own): an address that
  /// reconnects however fast only ever replaces its own connections, or those of a busier address. A
  /// connection alone from its address within its first handshake_grace is what an honest client in
  /// its handshake looks like: it is never closed for another.
  bool make_handshake_room(const std::string& address) {
    const auto now = std::chrono::steady_clock::now();
    Session* victim = nullptr;
    int victim_count = 0;
    for (Session* s : handshake_pool) {
      const int count = handshaking_from[s->address()] + (s->address() == address ? 1 : 0);
      if (count == 1 && now - s->accepted_at() < options.limits.handshake_grace) continue;
      if (victim == nullptr || count > victim_count ||
          (count == victim_count && s->accepted_at() < victim->accepted_at())) {
        victim = s;
        victim_count = count;
      }
    }
    if (victim == nullptr) return false;
    victim->shared_from_this()->evict_unauthenticated(::fsdpx::detail::str(
        "it had not proved a secret when the server's pool of unauthenticated connections was full (max_handshakes ",
        options.limits.max_handshakes, ") and a new connection came: the oldest of the address with the most (",
        victim_count, ", ", victim->address(), ") is closed to make room"));
    return true;
  }
  void accept() {
    acceptor.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      try {
        on_accept(ec, std::move(socket));
      } catch (...) {
        ++stats.handler_errors;
        pause_accepting();  // whatever failed, accepting goes on
      }
    });
  }
  void pause_accepting() {
    accept_pause.expires_after(std::chrono::milliseconds(100));
    accept_pause.async_wait([this](const boost::system::error_code& e) {
      if (!e) accept();
    });
  }
  void on_accept(const boost::system::error_code& ec, tcp::socket socket) {
    {
      if (ec) {
        // Out of descriptors (EMFILE/ENFILE) or memory: the pending connection stays in the backlog.
        // Accepting again at once would spin; pause, so live connections are served meanwhile.
        ++stats.accept_errors;
        return pause_accepting();
      }
      ++stats.accepted;
      // Connections still proving a secret have caps of their own, in all and per peer address: peers
      // without a secret cannot take the slots of authenticated ones, and one address cannot take all
      // the slots of the others. A refused client is told which limit it met.
      boost::system::error_code aec;
      const auto remote = socket.remote_endpoint(aec);
      const std::string address = aec ? std::string("?") : remote.address().to_string();
      const auto from = handshaking_from.find(address);
      const int from_address = from == handshaking_from.end() ? 0 : from->second;
      if (stats.live >= options.limits.max_connections) {
        refuse_at_accept(socket, ::fsdpx::detail::str("too many connections (", stats.live, "; max_connections ",
                                                      options.limits.max_connections, ")"));
      } else if (from_address >= options.limits.max_handshakes_per_address) {
        refuse_at_accept(socket, ::fsdpx::detail::str("too many unauthenticated connections from ", address, " (",
                                                      from_address, "; max_handshakes_per_address ",
                                                      options.limits.max_handshakes_per_address, ")"));
      } else {
        if (stats.handshaking >= options.limits.max_handshakes && !make_handshake_room(address)) {
          refuse_at_accept(socket, ::fsdpx::detail::str("too many unauthenticated connections (max_handshakes ",
                                                        options.limits.max_handshakes,
                                                        "), each alone from its address and within its first ",
                                                        options.limits.handshake_grace.count(), " ms"));
          return accept();
        }
        try {
          // A full pool of unauthenticated connections (silent sockets from many addresses, say) made room
          // above: an honest client, whose handshake takes a round trip, is served.
          boost::system::error_code ignored;
          socket.set_option(tcp::no_delay(true), ignored);
          socket.set_option(asio::socket_base::keep_alive(true), ignored);
          auto session = std::make_shared<Session>(this, std::move(socket));
          session->start();
        } catch (const std::exception&) {
          ++stats.handler_errors;  // e.g. no memory for the session: this connection is dropped
        }
      }
      accept();
    }
  }
};

}  // namespace fsdpx::sync::detail
