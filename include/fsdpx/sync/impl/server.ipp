// SynchronizerServer's implementation: sessions and the I/O loop over Boost.Asio (TLS through OpenSSL).
// Included by sync/server.hpp (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#if !defined(FSDPX_WITH_BOOST)
#error \
    "fsdpx/sync/server.hpp's implementation (the TCP synchronizer service) needs Boost.Asio (Boost >= 1.74): configure fsdpx where Boost is installed, so that FSDPX_WITH_BOOST is set. The broadcast (fsdpx/sync/broadcast.hpp) and the in-process Synchronizer do not need Boost."
#endif

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/io_context.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
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
#include <fsdpx/sync/bucket.hpp>
#include <fsdpx/sync/delta.hpp>
#include <fsdpx/sync/detail/handshake.hpp>
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/detail/stream.hpp>
#include <fsdpx/sync/synchronizer.hpp>
#include <fsdpx/sync/server.hpp>

namespace fsdpx::sync {

namespace detail {

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
  mutable std::shared_ptr<const EncodedSnapshot> full;  // guarded by ServerCore::store_mutex
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ServerCore* core, tcp::socket socket);
  ~Session();
  void start();
  void wake();
  bool in_handshake_pool() const { return in_handshake_pool_; }
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
  void check_fetch();
  void send(FrameHeader frame, std::string text = {}, bool then_close = false);
  void send_bucket(std::shared_ptr<const EncodedSnapshot> snapshot, size_t index);
  void refuse(const std::string& why, int64_t ServerStats::* counter);
  void on_closed(const boost::system::error_code& ec);
  uint64_t allowed_payload(FrameKind kind) const;

  void send_hello();
  void leave_handshake_pool();
  std::string small_text() const { return std::string(reinterpret_cast<const char*>(small_.data()), in_.length); }

  ServerCore* core_;
  Stream stream_;
  std::string peer_;
  std::string address_;  // the peer's address, as counted in core_->handshaking_from
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
};

struct ServerCore {
  // State first: it outlives the io_context, whose destruction destroys the sessions its pending
  // handlers hold (they update the counters as they go).
  ServerOptions options;
  Secret publish_secret, fetch_secret;
  VersionedSlot<ServedVersion> slot;
  // The newest version's tensors (deltas are applied to them, in place; the full version is built from
  // them on demand). Lock order: store_mutex, then runs_mutex.
  std::mutex store_mutex;
  VersionStore store;
  int64_t served_full = 0, served_delta = 0;  // io thread
  // Touched on the io thread only.
  std::string publisher_lost;  // why readers should stop waiting; cleared by the next publish
  std::vector<std::weak_ptr<Session>> waiters;
  // Unfinished publishes, one per publishing connection, holding staged_bytes together (at most
  // max_version_bytes: when a bucket needs room, the publishes that progressed least recently are dropped).
  std::vector<Session*> staging;
  int64_t staged_bytes = 0;
  std::unordered_map<std::string, int> handshaking_from;  // unauthenticated connections per peer address
  std::deque<std::weak_ptr<Session>> handshake_order;     // unauthenticated connections, oldest first
  ServerStats stats;                                      // written on the io thread; read through post()
  // Runs (the io thread and publish() in process): the label of the run whose versions are served.
  std::mutex runs_mutex;
  std::string current_run;
  std::atomic<int64_t> runs_taken_over{0};
  std::optional<asio::ssl::context> tls;  // set: every connection speaks TLS
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_pause{io};

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
  template <class Make>
  std::string commit(const std::string& run, int64_t version, Make&& make) {
    std::scoped_lock lock(store_mutex, runs_mutex);
    if (std::string why = admission(run, version); !why.empty()) return why;
    std::shared_ptr<ServedVersion> served = make();
    served->run = run;
    if (slot.version() != no_version && run != current_run) ++runs_taken_over;
    current_run = run;
    slot.replace(version, std::move(served));
    return {};
  }

  /// The snapshot for a reader of `latest` that holds `have` (per `base`); the full one is built now
  /// if it was not yet. Caller holds store_mutex; `latest` is the newest version.
  std::shared_ptr<const EncodedSnapshot> snapshot_for(const ServedVersion& latest, int64_t version, int64_t have,
                                                      FetchBase base) {
    if (latest.delta && base.holds() && have == latest.base_version && base.digest == latest.base_digest) {
      ++served_delta;
      return latest.delta;
    }
    if (!latest.full) {
      FSDPX_CHECK_AS(SyncError, store.version() == version && store.digest() == latest.digest,
                     "synchronizer server: internal error: the held weights are not the newest version");
      latest.full = encode_snapshot(version, latest.run, pack_full(store, options.bucket_bytes));
    }
    ++served_full;
    return latest.full;
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
  /// Drops the entries of connections no longer in their handshake from the front: the list holds
  /// about the connections accepted within one handshake_timeout (and no session's memory beyond it).
  void prune_handshake_order() {
    while (!handshake_order.empty()) {
      const std::shared_ptr<Session> s = handshake_order.front().lock();
      if (s && s->in_handshake_pool()) return;
      handshake_order.pop_front();
    }
  }
  void evict_oldest_handshake() {
    prune_handshake_order();
    if (!handshake_order.empty()) {
      std::shared_ptr<Session> oldest = handshake_order.front().lock();
      handshake_order.pop_front();
      if (oldest) {
        return oldest->evict_unauthenticated(::fsdpx::detail::str(
            "it had not proved a secret when the server's pool of unauthenticated connections was full "
            "(max_handshakes ",
            options.max_handshakes, ") and a new connection came: the oldest is closed to make room"));
      }
    }
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
      if (stats.live >= options.max_connections) {
        refuse_at_accept(socket, ::fsdpx::detail::str("too many connections (", stats.live, "; max_connections ",
                                                      options.max_connections, ")"));
      } else if (from_address >= options.max_handshakes_per_address) {
        refuse_at_accept(
            socket, ::fsdpx::detail::str("too many unauthenticated connections from ", address, " (", from_address,
                                         "; max_handshakes_per_address ", options.max_handshakes_per_address, ")"));
      } else {
        try {
          // A full pool of unauthenticated connections (silent sockets from many addresses, say) makes
          // room by closing its oldest: an honest client, whose handshake takes a round trip, is served.
          if (stats.handshaking >= options.max_handshakes) evict_oldest_handshake();
          boost::system::error_code ignored;
          socket.set_option(tcp::no_delay(true), ignored);
          socket.set_option(asio::socket_base::keep_alive(true), ignored);
          auto session = std::make_shared<Session>(this, std::move(socket));
          prune_handshake_order();
          handshake_order.push_back(session);
          session->start();
        } catch (const std::exception&) {
          ++stats.handler_errors;  // e.g. no memory for the session: this connection is dropped
        }
      }
      accept();
    }
  }
};

inline Session::Session(ServerCore* core, tcp::socket socket)
    : core_(core),
      stream_(std::move(socket), core->tls ? &*core->tls : nullptr),
      watchdog_(core->io),
      fetch_timer_(core->io) {
  boost::system::error_code ec;
  const auto ep = stream_.socket().remote_endpoint(ec);
  address_ = ec ? std::string("?") : ep.address().to_string();
  peer_ = ec ? std::string("?") : address_ + ":" + std::to_string(ep.port());
  ++core_->stats.live;
  ++core_->stats.handshaking;
  ++core_->handshaking_from[address_];
}

inline Session::~Session() {
  --core_->stats.live;
  leave_handshake_pool();
  unstage();
}

inline void Session::leave_handshake_pool() {
  if (!in_handshake_pool_) return;
  in_handshake_pool_ = false;
  --core_->stats.handshaking;
  if (auto it = core_->handshaking_from.find(address_); it != core_->handshaking_from.end() && --it->second <= 0) {
    core_->handshaking_from.erase(it);
  }
}

/// Closes a connection still in its handshake at once, its slot freed now; counted as refused over a limit.
inline void Session::evict_unauthenticated(const std::string& why) {
  ++core_->stats.refused_over_limit;
  leave_handshake_pool();
  // A plain connection whose hello went out has no write in flight: the reason goes as an error frame.
  if (!core_->tls && hello_sent_) {
    ServerCore::write_plain_error(stream_.socket(), "the server closed the connection: " + why, refused_busy);
  }
  on_closed(asio::error::connection_aborted);
}

/// Runs a step of this connection's protocol; whatever it throws ends this connection only.
template <class Fn>
void Session::guarded(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    refuse(std::string("the server could not handle it: ") + e.what(), &ServerStats::handler_errors);
  } catch (...) {
    refuse("the server could not handle it", &ServerStats::handler_errors);
  }
}

inline void Session::start() {
  guarded([&] {
    // The whole handshake (TLS's, then the secret's), not each frame of it, must end within handshake_timeout.
    arm(core_->options.handshake_timeout);
    stream_.async_handshake(asio::ssl::stream_base::server,
                            [self = shared_from_this()](const boost::system::error_code& ec) {
                              if (ec) {
                                if (!self->closed_)
                                  ++self->core_->stats.failed_auth;  // not TLS, or no acceptable version or cipher
                                return self->on_closed(ec);
                              }
                              self->guarded([&] { self->send_hello(); });
                            });
  });
}

inline void Session::send_hello() {
  server_nonce_ = fresh_nonce();
  FrameHeader hello = make_frame(FrameKind::hello, no_version, protocol_version, server_nonce_.data(), nonce_bytes);
  hello.flags = static_cast<uint16_t>((core_->publish_secret.empty() ? 0 : 1) | (core_->fetch_secret.empty() ? 0 : 2));
  auto owned = std::make_shared<std::pair<FrameHeader, Nonce>>(hello, server_nonce_);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(&owned->first, sizeof(FrameHeader)),
                                            asio::buffer(owned->second)};
  stream_.async_write(buffers, [self = shared_from_this(), owned](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);
    self->hello_sent_ = true;
    self->guarded([&] { self->read_header(); });
  });
}

/// Closes the connection when `after` passes before the next arm() or close.
inline void Session::arm(std::chrono::milliseconds after) {
  const uint64_t generation = ++watch_generation_;
  watchdog_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::min(after, std::chrono::milliseconds(std::chrono::hours(24 * 365)))));
  watchdog_.async_wait([self = shared_from_this(), generation](const boost::system::error_code& ec) {
    if (ec || generation != self->watch_generation_ || self->closed_) return;
    ++self->core_->stats.timed_out;
    // The server ending an idle connection is no sign that the trainer is gone (it reconnects for its
    // next publish); a publish that stalls midway is.
    if (!self->pending_) self->said_goodbye_ = true;
    // A TLS client starts the TLS handshake at once; a peer that sent nothing by the deadline is most
    // likely a client without TLS, waiting for a plain hello: it is told so, in plain, not just dropped.
    if (self->stream_.tls_not_started()) {
      ServerCore::write_plain_error(
          self->stream_.socket(),
          ::fsdpx::detail::str(
              "this synchronizer speaks TLS, and no TLS handshake began within its handshake_timeout of ",
              self->core_->options.handshake_timeout.count(),
              " ms: set TLS on the client (ClientOptions::tls and tls_ca_file; "
              "Python: tls=True, tls_ca_file=...)"),
          0);
    }
    self->on_closed(asio::error::timed_out);
  });
}

inline void Session::read_header() {
  if (closed_ || closing_) return;
  if (role_) arm(pending_ ? core_->options.io_timeout : core_->options.idle_timeout);
  stream_.async_read(asio::buffer(&in_, sizeof(in_)),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       self->guarded([&] { self->on_header(ec); });
                     });
}

inline uint64_t Session::allowed_payload(FrameKind kind) const {
  if (!role_) return kind == FrameKind::auth ? 2 * nonce_bytes : 0;
  if (kind == FrameKind::publish_begin) return max_run_bytes;
  if (kind == FrameKind::fetch) return max_fetch_bytes;
  if (kind == FrameKind::bucket && pending_) {
    const int64_t room = core_->options.max_version_bytes - pending_->bytes - pending_->coverage.bookkeeping_bytes();
    return static_cast<uint64_t>(std::max<int64_t>(0, std::min(core_->options.max_bucket_bytes, room)));
  }
  return 0;
}

inline void Session::on_header(const boost::system::error_code& ec) {
  if (closing_) return;
  if (ec) return on_closed(ec);
  const auto kind = FrameKind(in_.kind);
  if (const std::string problem = frame_problem(in_, allowed_payload(kind)); !problem.empty()) {
    return refuse(problem, role_ ? &ServerStats::protocol_errors : &ServerStats::failed_auth);
  }
  if (!role_ && kind != FrameKind::auth) {
    return refuse(::fsdpx::detail::str("a ", to_string(kind), " frame before the handshake"),
                  &ServerStats::failed_auth);
  }
  if (in_.length == 0) {
    payload_ = at::Tensor();
    return on_payload({});
  }
  if (role_) arm(core_->options.io_timeout);
  void* into = small_.data();
  if (kind == FrameKind::bucket) {
    payload_ = at::empty({static_cast<int64_t>(in_.length)}, at::kByte);
    into = payload_.data_ptr();
  }
  stream_.async_read(asio::buffer(into, in_.length),
                     [self = shared_from_this()](const boost::system::error_code& e, size_t) {
                       self->guarded([&] { self->on_payload(e); });
                     });
}

inline void Session::on_payload(const boost::system::error_code& ec) {
  if (closing_) return;
  if (ec) return on_closed(ec);
  const void* data = payload_.defined() ? payload_.const_data_ptr() : static_cast<const void*>(small_.data());
  if (frame_checksum(data, in_.length) != in_.checksum) {
    return refuse(::fsdpx::detail::str("a ", to_string(FrameKind(in_.kind)),
                                       " frame whose checksum does not match its "
                                       "payload (corrupted in transit)"),
                  role_ ? &ServerStats::protocol_errors : &ServerStats::failed_auth);
  }
  handle();
}

inline void Session::handle() {
  const auto kind = FrameKind(in_.kind);
  if (kind == FrameKind::auth) return on_auth();
  const bool may_publish = role_ == Role::publish;
  switch (kind) {
    case FrameKind::publish_begin:
    case FrameKind::bucket:
    case FrameKind::publish_end:
    case FrameKind::goodbye:
      if (!may_publish) {
        return refuse(::fsdpx::detail::str("a ", to_string(kind), " frame on a connection authenticated to fetch only"),
                      &ServerStats::protocol_errors);
      }
      break;
    default: break;
  }
  switch (kind) {
    case FrameKind::publish_begin: return begin_publish();
    case FrameKind::bucket: return on_bucket();
    case FrameKind::publish_end: return end_publish();
    case FrameKind::fetch: {
      if (in_.version < no_version) {
        return refuse(::fsdpx::detail::str("a fetch for versions newer than ", in_.version, " (versions are >= 0)"),
                      &ServerStats::protocol_errors);
      }
      if (in_.length < sizeof(FetchBase)) {
        return refuse(::fsdpx::detail::str("a fetch of ", in_.length, " bytes (protocol ", protocol_version,
                                           " starts it with the reader's base: 8 bytes)"),
                      &ServerStats::protocol_errors);
      }
      have_ = in_.version;
      std::memcpy(&have_base_, small_.data(), sizeof(FetchBase));
      have_run_ = small_text().substr(sizeof(FetchBase));
      // A wait is capped by idle_timeout: a reader that crashed while waiting frees its slot then.
      const auto cap = static_cast<uint64_t>(std::max<int64_t>(0, core_->options.idle_timeout.count()));
      deadline_ = dist::deadline_after(std::chrono::milliseconds(std::min(in_.aux, cap)));
      return check_fetch();
    }
    case FrameKind::goodbye: said_goodbye_ = true; return read_header();
    default:
      return refuse(::fsdpx::detail::str("an unexpected ", to_string(kind), " frame"), &ServerStats::protocol_errors);
  }
}

inline void Session::on_auth() {
  if (role_) return refuse("a second handshake", &ServerStats::protocol_errors);
  if (in_.aux != static_cast<uint64_t>(Role::publish) && in_.aux != static_cast<uint64_t>(Role::fetch)) {
    return refuse(::fsdpx::detail::str("a handshake for unknown role ", in_.aux), &ServerStats::failed_auth);
  }
  if (in_.length != 2 * nonce_bytes) {
    return refuse(::fsdpx::detail::str("a handshake of ", in_.length, " bytes (", 2 * nonce_bytes, " expected)"),
                  &ServerStats::failed_auth);
  }
  const Role role = Role(in_.aux);
  const Secret& secret = core_->secret(role);
  Nonce client_nonce;
  std::copy_n(small_.begin(), nonce_bytes, client_nonce.begin());
  Mac proof{};
  if (!secret.empty()) {
    const Mac expected = handshake_mac(secret.value, client_label, role, server_nonce_, client_nonce);
    if (!same_mac(expected, small_.data() + nonce_bytes)) {
      return refuse(::fsdpx::detail::str("authentication failed: the connection did not prove it holds the ",
                                         to_string(role), " secret"),
                    &ServerStats::failed_auth);
    }
    proof = handshake_mac(secret.value, server_label, role, client_nonce, server_nonce_);
  }
  role_ = role;
  leave_handshake_pool();
  ++watch_generation_;  // the handshake's deadline no longer applies
  send(make_frame(FrameKind::welcome, no_version, static_cast<uint64_t>(role), proof.data(), proof.size()),
       std::string(reinterpret_cast<const char*>(proof.data()), proof.size()));
}

inline void Session::begin_publish() {
  if (pending_) return refuse("a publish inside a publish", &ServerStats::protocol_errors);
  const auto& o = core_->options;
  Pending p;
  p.version = in_.version;
  p.count = in_.aux;
  p.run = run_label(small_text());  // readers see the label, never the identity
  {
    // Said now, so the publisher learns it at its end frame without the server keeping its buckets;
    // checked again at the commit (another publisher may commit meanwhile).
    std::lock_guard lock(core_->runs_mutex);
    p.rejected = core_->admission(p.run, p.version);
  }
  // Every bucket holds at least a header; a count no version could fill is refused at once.
  if (p.count == 0 || p.count > static_cast<uint64_t>(o.max_version_bytes / bucket_prefix_bytes)) {
    return refuse(::fsdpx::detail::str("a publish of ", p.count, " buckets"), &ServerStats::protocol_errors);
  }
  is_publisher_ = true;
  said_goodbye_ = false;
  publish_run_ = p.run;
  if (publishes_served_run()) core_->publisher_lost.clear();
  stage(std::move(p));
  read_header();
}

/// Each publishing connection stages its own version: publishers never cancel one another, and a
/// publish's fate (committed, or refused with the reason) is told at its end frame.
inline void Session::stage(Pending p) {
  pending_ = std::move(p);
  core_->staging.push_back(this);
}

inline void Session::unstage() {
  if (!pending_) return;
  core_->staged_bytes -= pending_->staged_bytes;
  std::erase(core_->staging, this);
  pending_.reset();
}

/// The publish will not commit, for `why` (told at its end frame); what it held is freed now.
inline void Session::drop_staged(const std::string& why) {
  Pending& p = *pending_;
  if (p.rejected.empty()) p.rejected = why;
  p.buckets.clear();
  p.coverage = VersionCoverage();
  p.held_bytes = 0;
  core_->staged_bytes -= p.staged_bytes;
  p.staged_bytes = 0;
}

/// Whether this connection publishes the run being served (or would be the first): its loss is the
/// trainer's, which readers waiting for a newer version must hear of. Another publisher's is not.
inline bool Session::publishes_served_run() const {
  std::lock_guard lock(core_->runs_mutex);
  return core_->current_run.empty() || core_->current_run == publish_run_;
}

/// A bucket of the publish: checked (its place in the version, its header, and that its chunks cover
/// elements no other chunk did) and kept; or, once the publish is rejected, counted and dropped.
inline void Session::on_bucket() {
  if (!pending_) return refuse("a bucket outside a publish", &ServerStats::protocol_errors);
  Pending& p = *pending_;
  p.bytes += static_cast<int64_t>(in_.length);
  const uint64_t index = p.received++;
  if (p.rejected.empty()) {
    try {
      const BucketLayout b = check_bucket(payload_, p.version, index, p.count, "publisher " + peer_);
      const int64_t limit = core_->options.max_version_bytes;
      for (const BucketEntry& e : b.entries) {
        if (std::string problem = p.coverage.add(e, b.index); !problem.empty()) {
          p.rejected = ::fsdpx::detail::str("version ", p.version, " is not whole: ", problem);
          break;
        }
        // Many tiny tensors, or scattered chunks, cost bookkeeping beyond their bytes: counted too.
        if (p.coverage.bookkeeping_bytes() > limit - p.bytes) {
          p.rejected = ::fsdpx::detail::str("version ", p.version, " takes more than max_version_bytes (", limit,
                                            ") with the bookkeeping of its ", b.entries.size(), "-entry buckets");
          break;
        }
        p.rejected = bookkeeping_problem(p.coverage.bookkeeping_bytes(), p.bytes, version_bookkeeping_floor,
                                         ::fsdpx::detail::str("version ", p.version));
        if (!p.rejected.empty()) break;
      }
    } catch (const SyncError& e) {
      p.rejected = std::string(unprefixed(e.what()));
    }
  }
  if (!p.rejected.empty()) {
    drop_staged(p.rejected);  // it will not commit: nothing more is held for it
  } else {
    p.held_bytes += static_cast<int64_t>(payload_.nbytes());
    p.buckets.push_back(std::move(payload_));
    const int64_t staged = p.held_bytes + p.coverage.bookkeeping_bytes();
    core_->staged_bytes += staged - p.staged_bytes;
    p.staged_bytes = staged;
    p.last_progress = std::chrono::steady_clock::now();
    make_staging_room();
  }
  payload_ = at::Tensor();
  read_header();
}

/// Keeps all unfinished publishes within max_version_bytes together (this one alone fits: see
/// allowed_payload) by dropping the others that progressed least recently: a publisher that stalled
/// never holds an active one back, and two honest publishers whose versions fit side by side never
/// meet this.
inline void Session::make_staging_room() {
  const int64_t limit = core_->options.max_version_bytes;
  while (core_->staged_bytes > limit) {
    Session* stalest = nullptr;
    for (Session* s : core_->staging) {
      if (s != this && s->pending_->staged_bytes > 0 &&
          (stalest == nullptr || s->pending_->last_progress < stalest->pending_->last_progress)) {
        stalest = s;
      }
    }
    if (stalest == nullptr) return;
    const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                            stalest->pending_->last_progress);
    stalest->drop_staged(::fsdpx::detail::str(
        "version ", stalest->pending_->version, " was dropped before its end to make room for version ",
        pending_->version, " from another publisher (", peer_, "): the server stages at most max_version_bytes (",
        limit, ") of unfinished publishes together, and this one's last bucket came ", idle.count(),
        " ms before; publish it again"));
  }
}

inline void Session::end_publish() {
  if (!pending_ || in_.version != pending_->version)
    return refuse("an end frame outside its publish", &ServerStats::protocol_errors);
  Pending p = std::move(*pending_);
  unstage();
  if (p.rejected.empty() && p.received != p.count) {
    p.rejected = ::fsdpx::detail::str("version ", p.version, " ended after ", p.received, " of ", p.count, " buckets");
  }
  if (p.rejected.empty()) {
    if (std::string missing = p.coverage.missing(); !missing.empty()) {
      p.rejected = ::fsdpx::detail::str("version ", p.version, " is not whole: ", missing);
    }
  }
  uint64_t refusal = 0;
  if (p.rejected.empty()) {
    try {
      // The version's tensors (a copy of its chunks) go to the store: a full version replaces the held
      // one, a delta is applied to it; every CRC-32C is checked. The buckets as they came are served.
      TensorCollector collector(at::kCPU, core_->options.max_version_bytes, /*huge_pages=*/false);  // a peer's
      for (const at::Tensor& bucket : p.buckets) {
        const BucketLayout b = decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), "publisher " + peer_);
        for (const auto& e : b.entries) collector.accept(e, entry_view(bucket, e));
      }
      std::vector<NamedTensor> tensors = collector.finish();
      const std::string where = "publisher " + peer_;
      const Manifest manifest = split_manifest(tensors, where).first;
      FSDPX_CHECK_AS(SyncError, manifest.version == p.version, "version ", p.version,
                     " carries the manifest of version ", manifest.version);
      p.rejected = core_->commit(p.run, p.version, [&] {
        if (manifest.is_delta() && !core_->store.holds(manifest.base_version, manifest.base_digest)) {
          refusal = refused_base;
          throw SyncError(::fsdpx::detail::str(
              "fsdpx: version ", p.version, " is a delta from version ", manifest.base_version, " (digest ",
              manifest.base_digest, "), which this server does not hold (it holds ",
              core_->store.empty() ? std::string("none") : ::fsdpx::detail::str("version ", core_->store.version()),
              "): send it full"));
        }
        // Frame headers are made anew: a reader gets the server's, never fields a publisher chose. Made
        // before the store changes, so that nothing after it can fail and leave store and slot apart.
        auto snapshot = encode_snapshot(p.version, p.run, std::move(p.buckets));
        auto served = std::make_shared<ServedVersion>();
        served->digest = manifest.digest;
        core_->store.accept(std::move(tensors), VersionStore::Apply::owned, where);
        if (manifest.is_delta()) {
          served->base_version = manifest.base_version;
          served->base_digest = manifest.base_digest;
          served->delta = std::move(snapshot);
        } else {
          served->full = std::move(snapshot);
        }
        return served;
      });
    } catch (const SyncError& e) {
      p.rejected = std::string(unprefixed(e.what()));
    }
    if (p.rejected.empty()) {
      last_published_ = p.version;
      core_->wake_waiters();
    }
  }
  if (!p.rejected.empty()) return send(make_frame(FrameKind::error, p.version, refusal), p.rejected);
  send(make_frame(FrameKind::ack, p.version));
}

inline void Session::check_fetch() {
  if (closed_ || closing_) return;
  std::unique_lock store_lock(core_->store_mutex);
  auto [version, latest] = core_->slot.latest();
  // Newer: a higher version, or any version of another run than the reader's (a new run took over,
  // maybe with lower versions: the reader gets a whole version of it).
  if (latest != nullptr && (version > have_ || (!have_run_.empty() && latest->run != have_run_))) {
    std::shared_ptr<const EncodedSnapshot> snapshot = core_->snapshot_for(*latest, version, have_, have_base_);
    store_lock.unlock();
    ++watch_generation_;
    arm(core_->options.io_timeout);
    std::array<asio::const_buffer, 2> begin{asio::buffer(&snapshot->begin, sizeof(FrameHeader)),
                                            asio::buffer(snapshot->run)};
    stream_.async_write(begin, [self = shared_from_this(), snapshot](const boost::system::error_code& ec, size_t) {
      if (ec) return self->on_closed(ec);
      self->guarded([&] { self->send_bucket(snapshot, 0); });
    });
    return;
  }
  store_lock.unlock();
  if (!core_->publisher_lost.empty()) {
    return send(make_frame(FrameKind::error, version),
                ::fsdpx::detail::str("no weight version newer than ", have_, " will come (latest: ", version,
                                     "): ", core_->publisher_lost));
  }
  if (std::chrono::steady_clock::now() >= deadline_) return send(make_frame(FrameKind::timeout, version));
  waiting_ = true;
  ++watch_generation_;  // the fetch's own deadline governs now
  if (!listed_) {
    listed_ = true;
    core_->add_waiter(weak_from_this());
  }
  fetch_timer_.expires_at(deadline_);
  fetch_timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
    self->waiting_ = false;
    self->guarded([&] { self->check_fetch(); });
  });
}

inline void Session::wake() {
  listed_ = false;
  if (waiting_) fetch_timer_.cancel();
}

/// One bucket at a time, each within io_timeout: a reader that stops reading is closed, and holds
/// the (immutable, shared) snapshot no longer than that.
inline void Session::send_bucket(std::shared_ptr<const EncodedSnapshot> s, size_t index) {
  if (closed_ || closing_) return;
  if (index == s->buckets.size()) return read_header();
  arm(core_->options.io_timeout);
  std::array<asio::const_buffer, 2> buffers{
      asio::buffer(&s->headers[index], sizeof(FrameHeader)),
      asio::buffer(s->buckets[index].const_data_ptr(), s->buckets[index].nbytes())};
  stream_.async_write(buffers, [self = shared_from_this(), s, index](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);  // the reader left mid-transfer: nothing else is affected
    self->guarded([&] { self->send_bucket(s, index + 1); });
  });
}

inline void Session::send(FrameHeader frame, std::string text, bool then_close) {
  if (closed_ || closing_) return;
  if (text.size() > max_error_bytes) text.resize(max_error_bytes);  // texts can quote what peers sent
  auto owned = std::make_shared<std::pair<FrameHeader, std::string>>(frame, std::move(text));
  if (!owned->second.empty()) {
    owned->first.length = owned->second.size();
    owned->first.checksum = frame_checksum(owned->second.data(), owned->second.size());
  }
  arm(core_->options.io_timeout);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(&owned->first, sizeof(FrameHeader)),
                                            asio::buffer(owned->second)};
  stream_.async_write(buffers,
                      [self = shared_from_this(), owned, then_close](const boost::system::error_code& ec, size_t) {
                        if (ec || then_close) return self->on_closed(ec ? ec : asio::error::connection_aborted);
                        self->guarded([&] { self->read_header(); });
                      });
}

/// Tells the peer why, then closes; counted under `counter`. Never throws.
inline void Session::refuse(const std::string& why, int64_t ServerStats::* counter) {
  if (closed_ || closing_) return;
  try {
    ++(core_->stats.*counter);
    if (is_publisher_ && !said_goodbye_ && role_ == Role::publish && publishes_served_run()) {
      core_->publisher_lost = "the trainer's connection (" + peer_ + ") sent " + why;
      core_->wake_waiters();
    }
    unstage();
    std::string text = "the synchronizer server refused the connection from " + peer_ + ": " + why;
    send(make_frame(FrameKind::error, no_version), std::move(text), /*then_close=*/true);
    closing_ = true;  // a read still in flight (a bucket the peer was still sending) is ignored when it ends
    fetch_timer_.cancel();
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_receive, ignored);
  } catch (...) {
    on_closed(asio::error::connection_aborted);
  }
}

inline void Session::on_closed(const boost::system::error_code& ec) {
  if (closed_) return;
  closed_ = true;
  ++watch_generation_;
  if (is_publisher_ && !said_goodbye_ && role_ == Role::publish && core_->publisher_lost.empty() &&
      publishes_served_run()) {
    // A trainer that vanishes (killed, crashed, network gone) will not publish again: readers waiting for
    // a newer version are told now instead of at their timeout.
    try {
      core_->publisher_lost =
          pending_ ? ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                          ") disconnected in the middle of version ", pending_->version, " (",
                                          pending_->received, " of ", pending_->count,
                                          " buckets received; the partial version was discarded): ", ec.message())
                   : ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                          ") disconnected without saying goodbye after version ", last_published_, ": ",
                                          ec.message());
      core_->wake_waiters();
    } catch (...) {
    }
  }
  unstage();
  boost::system::error_code ignored;
  watchdog_.cancel();
  fetch_timer_.cancel();
  stream_.socket().close(ignored);
}

}  // namespace detail

FSDPX_DECL SynchronizerServer::SynchronizerServer(ServerOptions options)
    : core_(std::make_unique<detail::ServerCore>()) {
  auto& core = *core_;
  core.options = std::move(options);
  const ServerOptions& o = core.options;
  FSDPX_CHECK_AS(SyncError,
                 o.max_bucket_bytes >= bucket_prefix_bytes && o.max_version_bytes >= o.max_bucket_bytes &&
                     o.max_connections >= 1 && o.max_handshakes >= 1 && o.max_handshakes_per_address >= 1,
                 "synchronizer server: inconsistent limits (max_bucket_bytes ", o.max_bucket_bytes,
                 ", max_version_bytes ", o.max_version_bytes, ", max_connections ", o.max_connections,
                 ", max_handshakes ", o.max_handshakes, ", max_handshakes_per_address ", o.max_handshakes_per_address,
                 ")");
  const std::string run_problem = detail::run_problem(o.run);
  FSDPX_CHECK_AS(SyncError, run_problem.empty(), "synchronizer server: ServerOptions::run is ", run_problem);
  FSDPX_CHECK_AS(SyncError, o.tls_certificate_file.empty() == o.tls_private_key_file.empty(),
                 "synchronizer server: TLS needs both tls_certificate_file and tls_private_key_file");
  if (!o.tls_certificate_file.empty())
    core.tls.emplace(detail::server_tls_context(o.tls_certificate_file, o.tls_private_key_file));
  core.publish_secret = resolve_secret(Role::publish, o.publish_secret, o.secret);
  core.fetch_secret = resolve_secret(Role::fetch, o.fetch_secret, o.secret);
  boost::system::error_code ec;
  const auto address = detail::asio::ip::make_address(o.host, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: '", o.host, "' is not an IP address: ", ec.message());
  if (!address.is_loopback() && !o.allow_unauthenticated) {
    for (const Role r : {Role::publish, Role::fetch}) {
      FSDPX_CHECK_AS(SyncError, !core.secret(r).empty(), "synchronizer server: refusing to listen on ", o.host,
                     " without a ", to_string(r), " secret: anyone who reaches the port could ",
                     r == Role::publish ? "publish weights into every rollout" : "read the model's weights",
                     ". Set ServerOptions::secret (or ", r == Role::publish ? "publish_secret" : "fetch_secret",
                     ", or the environment variable FSDPX_SYNC_SECRET), listen on 127.0.0.1, or set "
                     "allow_unauthenticated on a network you trust");
    }
  }
  const detail::tcp::endpoint endpoint(address, o.port);
  core.acceptor.open(endpoint.protocol(), ec);
  if (!ec) core.acceptor.set_option(detail::tcp::acceptor::reuse_address(true), ec);
  if (!ec) core.acceptor.bind(endpoint, ec);
  if (!ec) core.acceptor.listen(detail::asio::socket_base::max_listen_connections, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: cannot listen on ", o.host, ":", o.port, ": ", ec.message());
  port_ = core.acceptor.local_endpoint().port();
  core.accept();
  thread_ = std::thread([&core] {
    // Handlers contain their own exceptions; this is the last line, so the loop never ends early.
    while (true) {
      try {
        core.io.run();
        return;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fsdpx: synchronizer server: a handler failed (%s); serving on\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "fsdpx: synchronizer server: a handler failed; serving on\n");
      }
    }
  });
}

FSDPX_DECL SynchronizerServer::~SynchronizerServer() { stop(); }
FSDPX_DECL const std::string& SynchronizerServer::host() const { return core_ ? core_->options.host : stopped_host_; }
FSDPX_DECL int64_t SynchronizerServer::latest_version() const { return core_ ? core_->slot.version() : no_version; }

FSDPX_DECL ServerStats SynchronizerServer::stats() const {
  if (!core_) return last_stats_;
  std::promise<ServerStats> taken;
  auto future = taken.get_future();
  detail::asio::post(core_->io, [&] {
    ServerStats s = core_->stats;
    s.served_full = core_->served_full;
    s.served_delta = core_->served_delta;
    taken.set_value(s);
  });
  ServerStats s = future.get();
  s.runs_taken_over = core_->runs_taken_over;
  return s;
}

FSDPX_DECL void SynchronizerServer::publish(int64_t version, const std::vector<NamedTensor>& tensors) {
  FSDPX_CHECK_AS(SyncError, core_ != nullptr, "cannot publish version ", version, ": the server was stopped");
  FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
  FSDPX_CHECK_AS(SyncError, !tensors.empty(), "cannot publish version ", version, ": it has no tensors");
  detail::check_unique_names(tensors, version);
  const std::string run = detail::run_label(core_->options.run.empty() ? detail::process_run() : core_->options.run);
  auto& core = *core_;
  const std::string refused = core.commit(run, version, [&] {
    // Cut against the version held: readers that hold it get the delta; the full version is built from
    // the store when a reader needs it (or now, when there is no delta).
    EncodedVersion cut = core.store.cut(version, tensors, core.options.delta);
    auto served = std::make_shared<detail::ServedVersion>();
    served->digest = cut.manifest.digest;
    auto snapshot =
        detail::encode_snapshot(version, run, pack_buckets(cut.tensors, core.options.bucket_bytes, version));
    if (cut.manifest.is_delta()) {
      served->base_version = cut.manifest.base_version;
      served->base_digest = cut.manifest.base_digest;
      served->delta = std::move(snapshot);
    } else {
      served->full = std::move(snapshot);
    }
    core.store.commit(std::move(cut));
    return served;
  });
  FSDPX_CHECK_AS(SyncError, refused.empty(), "cannot publish version ", version, ": ", refused);
  detail::asio::post(core_->io, [core = core_.get()] {
    core->publisher_lost.clear();
    core->wake_waiters();
  });
}

FSDPX_DECL void SynchronizerServer::stop() {
  if (!thread_.joinable()) return;
  last_stats_ = stats();
  stopped_host_ = core_->options.host;
  detail::asio::post(core_->io, [core = core_.get()] {
    boost::system::error_code ignored;
    core->acceptor.close(ignored);
    core->accept_pause.cancel();
    core->io.stop();
  });
  thread_.join();
  core_.reset();  // closes every connection
}

}  // namespace fsdpx::sync
