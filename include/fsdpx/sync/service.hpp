// The synchronizer as a small TCP service (Boost.Asio): the trainer publishes versions to it, rollout
// processes fetch a version newer than theirs. Same guarantees as the in-process Synchronizer:
// versions only increase, a version becomes visible only once complete, a reader gets a whole version
// or an error.
//
//   fsdpx::sync::SynchronizerServer server({.host = "0.0.0.0", .port = 5710});   // anywhere; port 0 = pick one
//   // trainer rank 0 (or server.publish(...) when the server lives in the trainer process):
//   fsdpx::sync::SynchronizerClient trainer("10.0.0.1", 5710);
//   trainer.publish(step, fsdpx::sync::gather_full_state_dict(model, true, {.dtype = at::kBFloat16}));
//   // a rollout process:
//   fsdpx::sync::SynchronizerClient rollout("10.0.0.1", 5710);
//   have = rollout.fetch_newer_into(*model, have, std::chrono::seconds(60));
//
// Frames (little-endian): a 40-byte header {u32 magic 'FXSF', u16 kind, u16 flags, i64 version,
// u64 payload length, u64 xxHash64 of the payload, u64 aux} and the payload. A version travels as
// weight buckets (fsdpx/sync/bucket.hpp), one per frame, between a begin and (for publishes) an end
// frame. Every wait has a deadline. A server that dies, a trainer that dies mid-publish (readers are
// told at once, not at their timeout), a corrupt frame and a timeout all end in fsdpx::SyncError.
#pragma once

#if !defined(FSDPX_WITH_BOOST)
#error "fsdpx/sync/service.hpp (the TCP synchronizer service) needs Boost.Asio (Boost >= 1.74): configure fsdpx where Boost is installed, so that FSDPX_WITH_BOOST is set. The broadcast (fsdpx/sync/broadcast.hpp) and the in-process Synchronizer do not need Boost."
#endif

#include <boost/asio.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/bucket.hpp>
#include <fsdpx/sync/synchronizer.hpp>

namespace fsdpx::sync {
namespace detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// ---- xxHash64 (Yann Collet's algorithm): fast enough to check every byte of a model ----------------

inline uint64_t xxh_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline constexpr uint64_t xxh_p1 = 11400714785074694791ULL, xxh_p2 = 14029467366897019727ULL,
                          xxh_p3 = 1609587929392839161ULL, xxh_p4 = 9650029242287828579ULL,
                          xxh_p5 = 2870177450012600261ULL;
inline uint64_t xxh_round(uint64_t acc, uint64_t input) { return xxh_rotl(acc + input * xxh_p2, 31) * xxh_p1; }
inline uint64_t xxh_merge(uint64_t acc, uint64_t v) { return (acc ^ xxh_round(0, v)) * xxh_p1 + xxh_p4; }
inline uint64_t xxh_read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0) {
  const auto* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + xxh_p1 + xxh_p2, v2 = seed + xxh_p2, v3 = seed, v4 = seed - xxh_p1;
    for (const uint8_t* limit = end - 32; p <= limit; p += 32) {
      v1 = xxh_round(v1, xxh_read64(p));
      v2 = xxh_round(v2, xxh_read64(p + 8));
      v3 = xxh_round(v3, xxh_read64(p + 16));
      v4 = xxh_round(v4, xxh_read64(p + 24));
    }
    h = xxh_rotl(v1, 1) + xxh_rotl(v2, 7) + xxh_rotl(v3, 12) + xxh_rotl(v4, 18);
    h = xxh_merge(xxh_merge(xxh_merge(xxh_merge(h, v1), v2), v3), v4);
  } else {
    h = seed + xxh_p5;
  }
  h += static_cast<uint64_t>(len);
  for (; p + 8 <= end; p += 8) h = xxh_rotl(h ^ xxh_round(0, xxh_read64(p)), 27) * xxh_p1 + xxh_p4;
  if (p + 4 <= end) {
    uint32_t k;
    std::memcpy(&k, p, 4);
    h = xxh_rotl(h ^ (static_cast<uint64_t>(k) * xxh_p1), 23) * xxh_p2 + xxh_p3;
    p += 4;
  }
  for (; p < end; ++p) h = xxh_rotl(h ^ (*p * xxh_p5), 11) * xxh_p1;
  h ^= h >> 33;
  h *= xxh_p2;
  h ^= h >> 29;
  h *= xxh_p3;
  h ^= h >> 32;
  return h;
}

// ---- frames ---------------------------------------------------------------------------------------

enum class FrameKind : uint16_t {
  publish_begin = 1,   // version; aux = bucket count
  bucket = 2,          // aux = bucket index; payload = one weight bucket
  publish_end = 3,     // version
  ack = 4,             // version committed
  fetch = 5,           // version = the reader's; aux = how long the server may wait, ms
  snapshot_begin = 6,  // version; aux = bucket count; bucket frames follow
  timeout = 7,         // version = the server's latest
  error = 8,           // payload = message
  goodbye = 9,         // a publisher leaves on purpose
};

inline const char* to_string(FrameKind k) {
  switch (k) {
    case FrameKind::publish_begin: return "publish_begin";
    case FrameKind::bucket: return "bucket";
    case FrameKind::publish_end: return "publish_end";
    case FrameKind::ack: return "ack";
    case FrameKind::fetch: return "fetch";
    case FrameKind::snapshot_begin: return "snapshot_begin";
    case FrameKind::timeout: return "timeout";
    case FrameKind::error: return "error";
    case FrameKind::goodbye: return "goodbye";
  }
  return "unknown";
}

inline constexpr uint32_t frame_magic = 0x46535846;  // "FXSF"
inline constexpr uint64_t max_frame_bytes = uint64_t{1} << 38;

struct FrameHeader {
  uint32_t magic = frame_magic;
  uint16_t kind = 0;
  uint16_t flags = 0;
  int64_t version = no_version;
  uint64_t length = 0;
  uint64_t checksum = 0;
  uint64_t aux = 0;
};
static_assert(sizeof(FrameHeader) == 40 && std::is_trivially_copyable_v<FrameHeader>);

inline FrameHeader make_frame(FrameKind kind, int64_t version, uint64_t aux = 0, const void* payload = nullptr,
                              size_t length = 0) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.version = version;
  h.aux = aux;
  h.length = length;
  h.checksum = xxh64(payload, length);
  return h;
}

/// A version ready to serve: its buckets and their frame headers (checksums computed once).
struct EncodedSnapshot {
  int64_t version = no_version;
  FrameHeader begin;
  std::vector<FrameHeader> headers;
  std::vector<at::Tensor> buckets;  // uint8, CPU
};

inline std::shared_ptr<const EncodedSnapshot> encode_snapshot(int64_t version, std::vector<at::Tensor> buckets,
                                                              std::vector<FrameHeader> headers = {}) {
  auto s = std::make_shared<EncodedSnapshot>();
  s->version = version;
  s->begin = make_frame(FrameKind::snapshot_begin, version, buckets.size());
  if (headers.empty()) {
    for (size_t i = 0; i < buckets.size(); ++i) {
      headers.push_back(make_frame(FrameKind::bucket, version, i, buckets[i].const_data_ptr(), buckets[i].nbytes()));
    }
  }
  s->headers = std::move(headers);
  s->buckets = std::move(buckets);
  return s;
}

/// Checks that `bucket` is bucket `index` of `count` of `version`; returns its layout.
inline BucketLayout check_bucket(const at::Tensor& bucket, int64_t version, uint64_t index, uint64_t count,
                                 std::string_view where) {
  BucketLayout b = decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where);
  FSDPX_CHECK_AS(SyncError, b.version == version && b.index == index && b.count == count &&
                                b.total_bytes == bucket.numel(),
                 "weight bucket out of order from ", where, ": expected bucket ", index, " of ", count, " of version ",
                 version, " (", bucket.numel(), " bytes), got bucket ", b.index, " of ", b.count, " of version ",
                 b.version, " (", b.total_bytes, " bytes)");
  return b;
}

// ---- the server's state and its connections ------------------------------------------------------

struct ServerCore;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ServerCore* core, tcp::socket socket);
  void start() { read_header(); }
  void wake();

 private:
  struct Pending {
    int64_t version = no_version;
    uint64_t count = 0;
    std::vector<at::Tensor> buckets;
    std::vector<FrameHeader> headers;
    std::string rejected;  // why the publish will not commit (told at its end frame)
  };

  void read_header();
  void on_header(const boost::system::error_code& ec);
  void on_payload(const boost::system::error_code& ec);
  void handle();
  void check_fetch();
  void send_frames(std::vector<FrameHeader> frames, std::string text = {});
  void send_snapshot(std::shared_ptr<const EncodedSnapshot> snapshot);
  void protocol_error(const std::string& why);
  void on_closed(const boost::system::error_code& ec);

  ServerCore* core_;
  tcp::socket socket_;
  std::string peer_;
  FrameHeader in_;
  at::Tensor payload_;
  std::optional<Pending> pending_;
  bool closed_ = false;
  bool is_publisher_ = false;
  bool said_goodbye_ = false;
  int64_t last_published_ = no_version;
  // fetch
  int64_t have_ = no_version;
  std::chrono::steady_clock::time_point deadline_;
  asio::steady_timer timer_;
  bool waiting_ = false;
};

struct ServerCore {
  asio::io_context io;
  tcp::acceptor acceptor{io};
  VersionedSlot<EncodedSnapshot> slot;
  // Touched on the io thread only.
  std::string publisher_lost;  // why readers should stop waiting; cleared by the next publish
  std::vector<std::weak_ptr<Session>> waiters;
  std::atomic<int64_t> connections{0};

  void wake_waiters() {
    auto list = std::move(waiters);
    waiters.clear();
    for (auto& w : list) {
      if (auto s = w.lock()) s->wake();
    }
  }
  void accept() {
    acceptor.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) {
        ++connections;
        boost::system::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        socket.set_option(asio::socket_base::keep_alive(true), ignored);
        std::make_shared<Session>(this, std::move(socket))->start();
      }
      accept();
    });
  }
};

inline Session::Session(ServerCore* core, tcp::socket socket)
    : core_(core), socket_(std::move(socket)), timer_(core->io) {
  boost::system::error_code ec;
  const auto ep = socket_.remote_endpoint(ec);
  peer_ = ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
}

inline void Session::read_header() {
  asio::async_read(socket_, asio::buffer(&in_, sizeof(in_)),
                   [self = shared_from_this()](const boost::system::error_code& ec, size_t) { self->on_header(ec); });
}

inline void Session::on_header(const boost::system::error_code& ec) {
  if (ec) return on_closed(ec);
  if (in_.magic != frame_magic) return protocol_error("a frame without the synchronizer's magic number");
  if (in_.length > max_frame_bytes) return protocol_error(::fsdpx::detail::str("a frame of ", in_.length, " bytes"));
  if (in_.length == 0) {
    payload_ = at::Tensor();
    return on_payload({});
  }
  payload_ = at::empty({static_cast<int64_t>(in_.length)}, at::kByte);
  asio::async_read(socket_, asio::buffer(payload_.data_ptr(), in_.length),
                   [self = shared_from_this()](const boost::system::error_code& e, size_t) { self->on_payload(e); });
}

inline void Session::on_payload(const boost::system::error_code& ec) {
  if (ec) return on_closed(ec);
  const uint64_t sum = payload_.defined() ? xxh64(payload_.const_data_ptr(), in_.length) : xxh64(nullptr, 0);
  if (sum != in_.checksum) {
    return protocol_error(::fsdpx::detail::str("a ", to_string(FrameKind(in_.kind)), " frame whose checksum does not "
                                               "match its payload (corrupted in transit)"));
  }
  handle();
}

inline void Session::handle() {
  const std::string where = "publisher " + peer_;
  switch (FrameKind(in_.kind)) {
    case FrameKind::publish_begin: {
      is_publisher_ = true;
      said_goodbye_ = false;
      core_->publisher_lost.clear();
      pending_ = Pending{in_.version, in_.aux, {}, {}, {}};
      if (const int64_t latest = core_->slot.version(); in_.version <= latest) {
        pending_->rejected = ::fsdpx::detail::str("version ", in_.version, " is not newer than the latest published "
                                                  "version, ", latest, " (versions never go backwards)");
      }
      return read_header();
    }
    case FrameKind::bucket: {
      if (!pending_) return protocol_error("a bucket outside a publish");
      try {
        check_bucket(payload_, pending_->version, pending_->buckets.size(), pending_->count, where);
      } catch (const SyncError& e) {
        return protocol_error(e.what());
      }
      pending_->buckets.push_back(std::move(payload_));
      pending_->headers.push_back(in_);
      return read_header();
    }
    case FrameKind::publish_end: {
      if (!pending_ || in_.version != pending_->version) return protocol_error("an end frame outside its publish");
      Pending p = std::move(*pending_);
      pending_.reset();
      if (p.rejected.empty() && p.buckets.size() != p.count) {
        p.rejected = ::fsdpx::detail::str("version ", p.version, " ended after ", p.buckets.size(), " of ", p.count,
                                          " buckets");
      }
      if (p.rejected.empty()) {
        try {
          core_->slot.publish(p.version, encode_snapshot(p.version, std::move(p.buckets), std::move(p.headers)));
          last_published_ = p.version;
          core_->wake_waiters();
        } catch (const SyncError& e) {
          p.rejected = e.what();
        }
      }
      if (!p.rejected.empty()) return send_frames({make_frame(FrameKind::error, p.version)}, p.rejected);
      return send_frames({make_frame(FrameKind::ack, p.version)});
    }
    case FrameKind::fetch:
      have_ = in_.version;
      deadline_ = dist::deadline_after(std::chrono::milliseconds(in_.aux));
      return check_fetch();
    case FrameKind::goodbye: said_goodbye_ = true; return read_header();
    default:
      return protocol_error(::fsdpx::detail::str("an unexpected frame of kind ", in_.kind));
  }
}

inline void Session::check_fetch() {
  if (closed_) return;
  auto [version, snapshot] = core_->slot.latest();
  if (version > have_) return send_snapshot(std::move(snapshot));
  if (!core_->publisher_lost.empty()) {
    return send_frames({make_frame(FrameKind::error, version)},
                       ::fsdpx::detail::str("no weight version newer than ", have_, " will come (latest: ", version,
                                            "): ", core_->publisher_lost));
  }
  if (std::chrono::steady_clock::now() >= deadline_) return send_frames({make_frame(FrameKind::timeout, version)});
  waiting_ = true;
  core_->waiters.push_back(weak_from_this());
  timer_.expires_at(deadline_);
  timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
    self->waiting_ = false;
    self->check_fetch();
  });
}

inline void Session::wake() {
  if (waiting_) timer_.cancel();
}

inline void Session::send_frames(std::vector<FrameHeader> frames, std::string text) {
  auto owned = std::make_shared<std::pair<std::vector<FrameHeader>, std::string>>(std::move(frames), std::move(text));
  auto& [headers, body] = *owned;
  if (!body.empty()) {
    headers.back().length = body.size();
    headers.back().checksum = xxh64(body.data(), body.size());
  }
  std::vector<asio::const_buffer> buffers;
  for (const auto& h : headers) buffers.push_back(asio::buffer(&h, sizeof(h)));
  if (!body.empty()) buffers.push_back(asio::buffer(body));
  asio::async_write(socket_, buffers, [self = shared_from_this(), owned](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);
    self->read_header();
  });
}

inline void Session::send_snapshot(std::shared_ptr<const EncodedSnapshot> s) {
  std::vector<asio::const_buffer> buffers;
  buffers.push_back(asio::buffer(&s->begin, sizeof(FrameHeader)));
  for (size_t i = 0; i < s->buckets.size(); ++i) {
    buffers.push_back(asio::buffer(&s->headers[i], sizeof(FrameHeader)));
    buffers.push_back(asio::buffer(s->buckets[i].const_data_ptr(), s->buckets[i].nbytes()));
  }
  // The snapshot is immutable and held until the write ends: a newer publish cannot tear it.
  asio::async_write(socket_, buffers, [self = shared_from_this(), s](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);  // the reader left mid-transfer: nothing else is affected
    self->read_header();
  });
}

inline void Session::protocol_error(const std::string& why) {
  auto frame = make_frame(FrameKind::error, no_version);
  const std::string text = "the synchronizer server refused the connection from " + peer_ + ": " + why;
  if (is_publisher_ && !said_goodbye_) {
    core_->publisher_lost = "the trainer's connection (" + peer_ + ") sent " + why;
    core_->wake_waiters();
  }
  pending_.reset();
  auto owned = std::make_shared<std::pair<FrameHeader, std::string>>(frame, text);
  owned->first.length = text.size();
  owned->first.checksum = xxh64(text.data(), text.size());
  std::array<asio::const_buffer, 2> buffers{asio::buffer(&owned->first, sizeof(FrameHeader)), asio::buffer(owned->second)};
  asio::async_write(socket_, buffers, [self = shared_from_this(), owned](const boost::system::error_code&, size_t) {
    boost::system::error_code ignored;
    self->socket_.close(ignored);
  });
}

inline void Session::on_closed(const boost::system::error_code& ec) {
  if (closed_) return;
  closed_ = true;
  if (is_publisher_ && !said_goodbye_) {
    // A trainer that vanishes (killed, crashed, network gone) will not publish again: readers waiting for
    // a newer version are told now instead of at their timeout.
    core_->publisher_lost =
        pending_ ? ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                        ") disconnected in the middle of version ", pending_->version, " (",
                                        pending_->buckets.size(), " of ", pending_->count,
                                        " buckets received; the partial version was discarded): ", ec.message())
                 : ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                        ") disconnected without saying goodbye after version ", last_published_, ": ",
                                        ec.message());
    core_->wake_waiters();
  }
  pending_.reset();
  boost::system::error_code ignored;
  timer_.cancel();
  socket_.close(ignored);
}

inline std::string describe(const boost::system::error_code& ec) {
  if (ec == asio::error::eof) return "the server closed the connection (it exited, crashed or was stopped)";
  if (ec == asio::error::connection_reset || ec == asio::error::broken_pipe) {
    return "the connection was reset (the server exited or crashed)";
  }
  return ec.message();
}

}  // namespace detail

// ---- server ---------------------------------------------------------------------------------------

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: the system picks one; see port()
  int64_t bucket_bytes = int64_t{16} << 20;  // for versions published in-process
};

/// Serves versions to rollout processes; receives them from a trainer (SynchronizerClient::publish) or
/// from this process (publish()). One I/O thread; snapshots are served from memory as written.
class SynchronizerServer {
 public:
  explicit SynchronizerServer(ServerOptions options = {}) : options_(std::move(options)) {
    auto& core = *core_;
    boost::system::error_code ec;
    const auto address = detail::asio::ip::make_address(options_.host, ec);
    FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: '", options_.host, "' is not an IP address: ", ec.message());
    const detail::tcp::endpoint endpoint(address, options_.port);
    core.acceptor.open(endpoint.protocol(), ec);
    if (!ec) core.acceptor.set_option(detail::tcp::acceptor::reuse_address(true), ec);
    if (!ec) core.acceptor.bind(endpoint, ec);
    if (!ec) core.acceptor.listen(detail::asio::socket_base::max_listen_connections, ec);
    FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: cannot listen on ", options_.host, ":", options_.port, ": ",
                   ec.message());
    port_ = core.acceptor.local_endpoint().port();
    core.accept();
    thread_ = std::thread([&core] { core.io.run(); });
  }
  SynchronizerServer(const SynchronizerServer&) = delete;
  SynchronizerServer& operator=(const SynchronizerServer&) = delete;
  ~SynchronizerServer() { stop(); }

  uint16_t port() const { return port_; }
  const std::string& host() const { return options_.host; }
  int64_t latest_version() const { return core_ ? core_->slot.version() : no_version; }
  /// Connections accepted so far.
  int64_t connections() const { return core_ ? core_->connections.load() : 0; }

  /// Publishes from this process (a trainer hosting the server). The tensors are packed (copied) now.
  void publish(int64_t version, const std::vector<NamedTensor>& tensors) {
    FSDPX_CHECK_AS(SyncError, core_ != nullptr, "cannot publish version ", version, ": the server was stopped");
    FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
    auto snapshot = detail::encode_snapshot(version, pack_buckets(tensors, options_.bucket_bytes, version));
    core_->slot.publish(version, std::move(snapshot));
    detail::asio::post(core_->io, [core = core_.get()] {
      core->publisher_lost.clear();
      core->wake_waiters();
    });
  }

  /// Stops serving: connections close (clients see a SyncError). Idempotent.
  void stop() {
    if (!thread_.joinable()) return;
    detail::asio::post(core_->io, [core = core_.get()] {
      boost::system::error_code ignored;
      core->acceptor.close(ignored);
      core->io.stop();
    });
    thread_.join();
    core_.reset();  // closes every connection
  }

 private:
  ServerOptions options_;
  std::unique_ptr<detail::ServerCore> core_ = std::make_unique<detail::ServerCore>();
  uint16_t port_ = 0;
  std::thread thread_;
};

// ---- client ---------------------------------------------------------------------------------------

struct ClientOptions {
  /// How long to keep trying to connect (the server may start after the client).
  std::chrono::milliseconds connect_timeout{10000};
  /// Deadline for sending or receiving one frame (one bucket).
  std::chrono::milliseconds io_timeout{60000};
  /// Bucket capacity for publish().
  int64_t bucket_bytes = int64_t{16} << 20;
};

/// One connection to a SynchronizerServer, for publishing (the trainer) or fetching (a rollout). Not
/// thread-safe: one client per thread.
class SynchronizerClient {
 public:
  SynchronizerClient(std::string host, uint16_t port, ClientOptions options = {})
      : options_(options), where_(host + ":" + std::to_string(port)) {
    boost::system::error_code ec;
    const auto address = detail::asio::ip::make_address(host, ec);
    FSDPX_CHECK_AS(SyncError, !ec, "synchronizer client: '", host, "' is not an IP address: ", ec.message());
    const detail::tcp::endpoint endpoint(address, port);
    const auto deadline = dist::deadline_after(options_.connect_timeout);
    std::string last = "no attempt";
    while (true) {
      std::optional<boost::system::error_code> result;
      socket_.async_connect(endpoint, [&](const boost::system::error_code& e) { result = e; });
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      io_.restart();
      io_.run_for(std::max(left, std::chrono::milliseconds(1)));
      if (result && !*result) break;
      if (!result) {
        boost::system::error_code ignored;
        socket_.close(ignored);
        io_.restart();
        io_.run();
        last = "timed out";
      } else {
        last = result->message();
        boost::system::error_code ignored;
        socket_.close(ignored);
      }
      FSDPX_CHECK_AS(SyncError, std::chrono::steady_clock::now() < deadline, "could not connect to the synchronizer at ",
                     where_, " within ", options_.connect_timeout.count(), " ms: ", last,
                     " (is the server running, and is the address right?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    socket_.set_option(detail::tcp::no_delay(true));
    socket_.set_option(detail::asio::socket_base::keep_alive(true));
  }
  SynchronizerClient(const SynchronizerClient&) = delete;
  SynchronizerClient& operator=(const SynchronizerClient&) = delete;
  ~SynchronizerClient() {
    try {
      close();
    } catch (...) {
    }
  }

  /// Publishes `tensors` as `version`; returns once the server committed it (readers can see it).
  /// Bucket by bucket, so the trainer holds one bucket beyond the tensors.
  void publish(int64_t version, const std::vector<NamedTensor>& tensors) {
    FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
    std::vector<TensorSpec> specs;
    for (const auto& t : tensors) specs.push_back({t.name, t.tensor.sizes().vec(), t.tensor.scalar_type()});
    const auto plan = plan_buckets(specs, options_.bucket_bytes, version);
    const std::string what = ::fsdpx::detail::str("publishing version ", version);
    write_frame(detail::make_frame(detail::FrameKind::publish_begin, version, plan.size()), nullptr, what);
    at::Tensor bucket;
    size_t next = 0;
    for (const BucketLayout& b : plan) {
      if (!bucket.defined() || bucket.numel() < b.total_bytes) bucket = at::empty({b.total_bytes}, at::kByte);
      const at::Tensor view = bucket.narrow(0, 0, b.total_bytes);
      write_header(view, b);
      for (const auto& e : b.entries) {
        while (tensors[next].name != e.name) ++next;  // the plan follows the tensors' order
        pack_entry(view, e, tensors[next].tensor.to(at::kCPU));
      }
      write_frame(detail::make_frame(detail::FrameKind::bucket, version, b.index, view.const_data_ptr(), b.total_bytes),
                  view.const_data_ptr(), what);
    }
    write_frame(detail::make_frame(detail::FrameKind::publish_end, version), nullptr, what);
    const auto [reply, text] = read_frame(options_.io_timeout, what);
    FSDPX_CHECK_AS(SyncError, reply.kind != static_cast<uint16_t>(detail::FrameKind::error), "the synchronizer at ",
                   where_, " refused version ", version, ": ", text);
    FSDPX_CHECK_AS(SyncError, reply.kind == static_cast<uint16_t>(detail::FrameKind::ack) && reply.version == version,
                   "the synchronizer at ", where_, " answered a publish with a ", detail::to_string(detail::FrameKind(reply.kind)),
                   " frame");
    published_ = true;
  }

  /// The newest version once it is newer than `have` (no_version: any), waiting up to `wait` for one.
  /// All of one version or a SyncError: on a timeout, when the trainer disconnected, when the server
  /// is gone, on a corrupt frame.
  WeightSnapshot fetch_newer(int64_t have, std::chrono::milliseconds wait) {
    const std::string what = ::fsdpx::detail::str("fetching a version newer than ", have);
    write_frame(detail::make_frame(detail::FrameKind::fetch, have, static_cast<uint64_t>(wait.count())), nullptr, what);
    const auto [begin, text] = read_frame(wait + options_.io_timeout, what);
    switch (detail::FrameKind(begin.kind)) {
      case detail::FrameKind::snapshot_begin: break;
      case detail::FrameKind::timeout:
        throw SyncError(::fsdpx::detail::str("fsdpx: no weight version newer than ", have, " was published within ",
                                             wait.count(), " ms (the synchronizer at ", where_, " has version ",
                                             begin.version, "); the trainer may be slow, stopped or dead"));
      case detail::FrameKind::error:
        throw SyncError(::fsdpx::detail::str("fsdpx: the synchronizer at ", where_, " answered: ", text));
      default:
        fail(::fsdpx::detail::str("an unexpected ", detail::to_string(detail::FrameKind(begin.kind)), " frame"), what);
    }
    FSDPX_CHECK_AS(SyncError, begin.version > have, "the synchronizer at ", where_, " sent version ", begin.version,
                   " for a request newer than ", have);
    TensorCollector collector;
    for (uint64_t k = 0; k < begin.aux; ++k) {
      const detail::FrameHeader frame = read_frame(options_.io_timeout, what, /*keep_payload=*/true).first;
      if (frame.kind != static_cast<uint16_t>(detail::FrameKind::bucket)) fail("a bucket frame was expected", what);
      const BucketLayout b = detail::check_bucket(payload_, begin.version, k, begin.aux, "synchronizer " + where_);
      for (const auto& e : b.entries) collector.accept(e, entry_view(payload_, e));
    }
    payload_ = at::Tensor();
    return {begin.version, collector.finish()};
  }

  /// fetch_newer, then loads the whole version into `module` by name; returns the version. The module is
  /// untouched when the fetch fails (the version is staged first).
  int64_t fetch_newer_into(torch::nn::Module& module, int64_t have, std::chrono::milliseconds wait) {
    const WeightSnapshot s = fetch_newer(have, wait);
    load_into(module, s.tensors);
    return s.version;
  }

  /// Leaves: a publisher says goodbye first, so readers are not told that the trainer was lost.
  void close() {
    if (!socket_.is_open()) return;
    if (published_) write_frame(detail::make_frame(detail::FrameKind::goodbye, no_version), nullptr, "saying goodbye");
    boost::system::error_code ignored;
    socket_.shutdown(detail::tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  [[noreturn]] void fail(const std::string& why, const std::string& what) {
    boost::system::error_code ignored;
    socket_.close(ignored);
    throw SyncError(::fsdpx::detail::str("fsdpx: ", what, " from the synchronizer at ", where_, ": ", why));
  }

  /// Runs one asynchronous operation to completion or its deadline; a missed deadline closes the socket.
  template <class Start>
  void run(Start&& start, std::chrono::milliseconds timeout, const std::string& what) {
    FSDPX_CHECK_AS(SyncError, socket_.is_open(), what, ": the connection to the synchronizer at ", where_,
                   " is closed after an earlier error");
    std::optional<boost::system::error_code> result;
    start([&](const boost::system::error_code& ec, size_t) { result = ec; });
    io_.restart();
    io_.run_for(timeout);
    if (!result) {
      boost::system::error_code ignored;
      socket_.close(ignored);
      io_.restart();
      io_.run();
      throw SyncError(::fsdpx::detail::str("fsdpx: ", what, ": the synchronizer at ", where_, " did not answer within ",
                                           timeout.count(), " ms (the server or the trainer behind it is stalled or "
                                           "unreachable)"));
    }
    if (*result) fail(detail::describe(*result), what);
  }

  void write_frame(const detail::FrameHeader& h, const void* payload, const std::string& what) {
    std::array<detail::asio::const_buffer, 2> buffers{detail::asio::buffer(&h, sizeof(h)),
                                                     detail::asio::buffer(payload, payload ? h.length : 0)};
    run([&](auto handler) { detail::asio::async_write(socket_, buffers, handler); }, options_.io_timeout, what);
  }

  /// Reads one frame; an error frame's text comes back as the string. A bucket payload stays in payload_.
  std::pair<detail::FrameHeader, std::string> read_frame(std::chrono::milliseconds timeout, const std::string& what,
                                                         bool keep_payload = false) {
    detail::FrameHeader h;
    run([&](auto handler) { detail::asio::async_read(socket_, detail::asio::buffer(&h, sizeof(h)), handler); }, timeout,
        what);
    if (h.magic != detail::frame_magic) fail("a frame without the synchronizer's magic number", what);
    if (h.length > detail::max_frame_bytes) fail(::fsdpx::detail::str("a frame of ", h.length, " bytes"), what);
    at::Tensor payload = at::empty({static_cast<int64_t>(h.length)}, at::kByte);
    if (h.length > 0) {
      run([&](auto handler) {
            detail::asio::async_read(socket_, detail::asio::buffer(payload.data_ptr(), h.length), handler);
          },
          options_.io_timeout, what);
    }
    if (detail::xxh64(h.length ? payload.const_data_ptr() : nullptr, h.length) != h.checksum) {
      fail("a frame whose checksum does not match its payload (corrupted in transit)", what);
    }
    std::string text;
    if (h.kind == static_cast<uint16_t>(detail::FrameKind::error)) {
      text.assign(static_cast<const char*>(payload.const_data_ptr()), h.length);
    }
    if (keep_payload) payload_ = std::move(payload);
    return {h, text};
  }

  ClientOptions options_;
  std::string where_;
  detail::asio::io_context io_;
  detail::tcp::socket socket_{io_};
  at::Tensor payload_;
  bool published_ = false;
};

}  // namespace fsdpx::sync
